"""The paper's appendix A.2 MLP and A.3 walk-through with the scipy layouts in
place of the hand-written CSC class: values and gradients equal dense."""

import warnings

import pytest
import torch

import sten_core as sten
from sten_scipy import ScipyCscTensor, ScipyCsrTensor

from conftest import LAYOUTS

TOL = {"rtol": 1e-4, "atol": 1e-5}


class SparseLinear(torch.nn.Module):
    """Appendix A.2's SparseLinear with ``layout`` for ``sten.CscTensor``."""

    def __init__(self, input_features, output_features, weight_sparsity, layout, dense_grad=False):
        super().__init__()
        self.weight_sparsity = weight_sparsity
        dense_weight = sten.random_mask_sparsify(torch.randn(output_features, input_features), frac=weight_sparsity)
        self.weight = sten.SparseParameterWrapper(layout.from_dense(dense_weight))
        self.weight.grad_fmt = None if dense_grad else (
            sten.KeepAll(), torch.Tensor, sten.RandomFractionSparsifier(self.weight_sparsity), layout)
        self.bias = torch.nn.Parameter(torch.rand(output_features))
        self.bias.grad_fmt = (sten.KeepAll(), torch.Tensor, sten.KeepAll(), torch.Tensor)

    def forward(self, input):
        sparse_op = sten.sparsified_op(
            orig_op=torch.nn.functional.linear,
            out_fmt=tuple([(sten.KeepAll(), torch.Tensor, sten.KeepAll(), torch.Tensor)]),
            grad_out_fmt=tuple([(sten.KeepAll(), torch.Tensor, sten.KeepAll(), torch.Tensor)]),
        )
        return sparse_op(input, self.weight, self.bias)


def mlp(sizes, make):
    layers = torch.nn.Sequential()
    for idx, (i, o) in enumerate(zip(sizes[:-1], sizes[1:])):
        if idx != 0:
            layers.append(torch.nn.ReLU())
        layers.append(make(i, o))
    return layers


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dense_grad", [True, False])
def test_a2_sparse_mlp_equals_dense(layout, dense_grad):
    torch.manual_seed(0)
    sizes = [50, 40, 30, 20, 30, 10]
    sparse = mlp(sizes, lambda i, o: SparseLinear(i, o, 0.8, layout, dense_grad))
    dense = mlp(sizes, torch.nn.Linear)
    with torch.no_grad():
        for s, d in zip(sparse, dense):
            if isinstance(s, SparseLinear):
                d.weight.copy_(s.weight.to_dense())
                d.bias.copy_(s.bias)
    x = torch.randn(15, 50, requires_grad=True)
    xd = x.detach().clone().requires_grad_(True)
    torch.manual_seed(1)
    out = sparse(x)
    ref = dense(xd)
    torch.testing.assert_close(out, ref, **TOL)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(x.grad, xd.grad, **TOL)
    for s, d in zip(sparse, dense):
        if not isinstance(s, SparseLinear):
            continue
        torch.testing.assert_close(s.bias.grad, d.bias.grad, **TOL)
        if dense_grad:
            torch.testing.assert_close(s.weight.grad, d.weight.grad, **TOL)
        else:  # the paper's grad_fmt: dense gradient, 0.8 random-dropped, stored in the layout
            assert isinstance(s.weight.grad.wrapped_tensor, layout)
            kept = s.weight.grad.to_dense() != 0
            assert 0.08 < kept.sum() / (d.weight.grad != 0).sum() < 0.35  # about 0.2 of the nonzero gradient kept
            torch.testing.assert_close(s.weight.grad.to_dense(), d.weight.grad * kept, **TOL)


class MyRandomFractionSparsifier:
    def __init__(self, fraction):
        self.fraction = fraction


@pytest.fixture
def fresh_registry():
    before = dict(sten.registry.impls)
    sten.dispatch.reset_warnings()
    sten.set_dispatch_failure("warn")
    yield
    sten.registry.impls.clear()
    sten.registry.impls.update(before)
    sten.dispatch.clear_caches()


def _messages(record):
    return [str(w.message) for w in record if issubclass(w.category, sten.DispatchWarning)]


@pytest.mark.parametrize("own_impls", [False, True], ids=["plugin-impls", "paper-impls"])
def test_a3_walkthrough(fresh_registry, own_impls):
    """A.3 with ``ScipyCscTensor`` for ``MyCscTensor``. With ``own_impls`` the
    paper's own registrations (which use ``.data`` as a scipy array) replace
    the plugin's; without, the plugin's mm forward/backward run."""
    MyCscTensor = ScipyCscTensor
    torch.manual_seed(0)
    a = torch.randn(10, 20, requires_grad=True)
    b = torch.randn(10, 20, requires_grad=True)
    c = torch.randn(20, 30, requires_grad=True)
    grad_d = torch.randn(10, 30)
    sparse_add = sten.sparsified_op(
        orig_op=torch.add,
        out_fmt=((sten.KeepAll(), torch.Tensor, MyRandomFractionSparsifier(0.5), MyCscTensor),),
        grad_out_fmt=((sten.KeepAll(), torch.Tensor, MyRandomFractionSparsifier(0.5), MyCscTensor),),
    )
    # 1. only the user's sparsifier is unknown: one fallback warning, torch.mm runs sparse
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        torch.mm(sparse_add(a, b), c)
    text = _messages(record)
    assert len(text) == 1 and "MyRandomFractionSparsifier" in text[0] and "ScipyCscTensor" in text[0]

    @sten.register_sparsifier_implementation(sparsifer=MyRandomFractionSparsifier, inp=torch.Tensor, out=MyCscTensor)
    def my_sparsifier(sparsifier, tensor):
        return sten.SparseTensorWrapper(MyCscTensor.from_dense(sten.random_mask_sparsify(tensor, frac=sparsifier.fraction)))

    if own_impls:
        @sten.register_fwd_op_impl(operator=torch.mm, inp=(MyCscTensor, torch.Tensor), out=tuple([(sten.KeepAll, torch.Tensor)]))
        def torch_mm_fwd_impl(ctx, inputs, output_sparsifiers):
            input1, input2 = inputs
            ctx.save_for_backward(input1, input2)
            return torch.from_numpy(input1.wrapped_tensor.data @ input2.numpy())

        @sten.register_bwd_op_impl(operator=torch.mm, grad_out=(torch.Tensor,),
                                   grad_inp=((sten.KeepAll, torch.Tensor), (sten.KeepAll, torch.Tensor)),
                                   inp=(MyCscTensor, torch.Tensor))
        def torch_mm_bwd_impl(ctx, grad_outputs, input_sparsifiers):
            input1, input2 = ctx.saved_tensors
            [grad_output] = grad_outputs
            grad_input1 = torch.mm(grad_output, input2.T)
            grad_input2 = torch.from_numpy(input1.wrapped_tensor.data.transpose() @ grad_output.numpy())
            return grad_input1, grad_input2

    # 2. the gradient of add arrives as ScipyCscTensor: the paper's registration handles it
    @sten.register_bwd_op_impl(operator=torch.add, grad_out=(MyCscTensor,),
                               grad_inp=((sten.KeepAll, torch.Tensor), (sten.KeepAll, torch.Tensor), None, None, None),
                               inp=(torch.Tensor, torch.Tensor, None, None))
    def torch_add_bwd_impl(ctx, grad_outputs, input_sparsifiers):
        [grad_output] = grad_outputs
        dense_output = grad_output.wrapped_tensor.to_dense()
        return dense_output, dense_output, None, None

    sten.set_dispatch_failure("raise")
    torch.manual_seed(1)
    s = sparse_add(a, b)
    assert isinstance(s.wrapped_tensor, ScipyCscTensor)
    d = torch.mm(s, c)
    d.backward(grad_d)
    s_dense = s.wrapped_tensor.to_dense()
    mask = s_dense != 0
    torch.testing.assert_close(s_dense, ((a + b) * mask).detach(), **TOL)
    torch.testing.assert_close(d, s_dense @ c.detach(), **TOL)
    torch.testing.assert_close(c.grad, s_dense.T @ grad_d, **TOL)
    grad_s = grad_d @ c.detach().T
    kept = a.grad != 0
    assert 0.3 < kept.float().mean() < 0.7
    torch.testing.assert_close(a.grad, grad_s * kept, **TOL)
    torch.testing.assert_close(b.grad, a.grad)
