"""The paper's appendix A.3 walk-through, step by step, with ``import sten_core as sten``."""

import warnings

import pytest
import scipy.sparse
import torch

import sten_core as sten


class MyRandomFractionSparsifier:
    def __init__(self, fraction):
        self.fraction = fraction


class MyCscTensor:
    def __init__(self, data):
        self.data = data

    @staticmethod
    def from_dense(tensor):
        return MyCscTensor(scipy.sparse.csc_matrix(tensor))

    def to_dense(self):
        return torch.from_numpy(self.data.todense())


@pytest.fixture
def fresh_registry():
    """Undo the registrations this test makes."""
    sten.plugins.ensure_loaded()
    before = dict(sten.registry.impls)
    sten.dispatch.reset_warnings()
    yield
    sten.registry.impls.clear()
    sten.registry.impls.update(before)
    sten.dispatch.clear_caches()
    sten.set_dispatch_failure("warn")


def messages(record):
    return [str(w.message) for w in record if issubclass(w.category, sten.DispatchWarning)]


def test_a3_walkthrough(fresh_registry):
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

    # 1. nothing registered: the sparsifier and mm fall back, each reported once
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        d = torch.mm(sparse_add(a, b), c)
    text = messages(record)
    assert len(text) == 2
    assert "Sparsifier implementation is not registered" in text[0] and "MyRandomFractionSparsifier" in text[0]
    assert "register_sparsifier_implementation" in text[0]
    assert "(fwd)" in text[1] and "torch.mm" in text[1] and "MyCscTensor" in text[1]
    assert "register_fwd_op_impl(operator=torch.mm, inp=(MyCscTensor, torch.Tensor)" in text[1]

    # 2. the paper's all-dense registration of add is allowed and used
    calls = []

    @sten.register_fwd_op_impl(operator=torch.add, inp=(torch.Tensor, torch.Tensor, None, None),
                               out=tuple([(sten.KeepAll, torch.Tensor)]))
    def sparse_add_fwd_impl(ctx, inputs, output_sparsifiers):
        input, other, alpha, out = inputs
        calls.append("add")
        return torch.add(input, other, alpha=alpha, out=out)

    @sten.register_sparsifier_implementation(sparsifer=MyRandomFractionSparsifier, inp=torch.Tensor, out=MyCscTensor)
    def my_sparsifier(sparsifier, tensor):
        return sten.SparseTensorWrapper(MyCscTensor.from_dense(sten.random_mask_sparsify(tensor, frac=sparsifier.fraction)))

    @sten.register_fwd_op_impl(operator=torch.mm, inp=(MyCscTensor, torch.Tensor), out=tuple([(sten.KeepAll, torch.Tensor)]))
    def torch_mm_fwd_impl(ctx, inputs, output_sparsifiers):
        input1, input2 = inputs
        ctx.save_for_backward(input1, input2)
        return torch.from_numpy(input1.wrapped_tensor.data @ input2.numpy())

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        s = sparse_add(a, b)
        d = torch.mm(s, c)
    assert messages(record) == [] and calls == ["add"]
    dense_s = s.wrapped_tensor.to_dense()
    torch.testing.assert_close(d, dense_s @ c.detach(), rtol=1e-4, atol=1e-5)

    # 3. backward: mm's backward is missing and reported as the paper shows
    sten.set_dispatch_failure("raise")
    with pytest.raises(sten.DispatchError, match=r"\(bwd\).*torch\.mm.*MyCscTensor"):
        torch.mm(sparse_add(a, b), c).backward(grad_d)

    @sten.register_bwd_op_impl(operator=torch.mm, grad_out=(torch.Tensor,),
                               grad_inp=((sten.KeepAll, torch.Tensor), (sten.KeepAll, torch.Tensor)),
                               inp=(MyCscTensor, torch.Tensor))
    def torch_mm_bwd_impl(ctx, grad_outputs, input_sparsifiers):
        input1, input2 = ctx.saved_tensors
        [grad_output] = grad_outputs
        grad_input1 = torch.mm(grad_output, input2.T)
        grad_input2 = torch.from_numpy(input1.wrapped_tensor.data.transpose() @ grad_output)
        return grad_input1, grad_input2

    with pytest.raises(sten.DispatchError, match=r"\(bwd\).*torch\.add.*grad_out=\(MyCscTensor,\)"):
        torch.mm(sparse_add(a, b), c).backward(grad_d)

    @sten.register_bwd_op_impl(operator=torch.add, grad_out=(MyCscTensor,),
                               grad_inp=((sten.KeepAll, torch.Tensor), (sten.KeepAll, torch.Tensor), None, None, None),
                               inp=(torch.Tensor, torch.Tensor, None, None))
    def torch_add_bwd_impl(ctx, grad_outputs, input_sparsifiers):
        [grad_output] = grad_outputs
        dense_output = grad_output.wrapped_tensor.to_dense()
        return dense_output, dense_output, None, None

    # 4. all registered: values and gradients equal the dense computation with the same masks
    for t in (a, b, c):
        t.grad = None
    torch.manual_seed(1)
    s = sparse_add(a, b)
    d = torch.mm(s, c)
    d.backward(grad_d)
    mask = s.wrapped_tensor.to_dense() != 0
    torch.testing.assert_close(s.wrapped_tensor.to_dense(), ((a + b) * mask).detach())
    torch.testing.assert_close(d, s.wrapped_tensor.to_dense() @ c.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(c.grad, s.wrapped_tensor.to_dense().T @ grad_d, rtol=1e-4, atol=1e-5)
    # the gradient reaching add went through the 0.5 random sparsifier into MyCscTensor
    grad_s = grad_d @ c.detach().T
    kept = a.grad != 0
    assert 0.3 < kept.float().mean() < 0.7
    torch.testing.assert_close(a.grad, grad_s * kept, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(b.grad, a.grad)


def test_section3_register_form(fresh_registry):
    """The §3 form: inp=(CsrTensor, CooTensor, None, None) with a RandomFraction → COO output."""

    @sten.register_fwd_op_impl(operator=torch.add, inp=(sten.CsrTensor, sten.CooTensor, None, None),
                               out=[(sten.RandomFractionSparsifier, sten.CooTensor)])
    def sparse_add_fwd_impl(ctx, inputs, output_sparsifiers):
        input, other, alpha, out = inputs
        [out_sp] = output_sparsifiers
        dense = input.wrapped_tensor.to_dense() + alpha * other.wrapped_tensor.to_dense()
        return sten.SparseTensorWrapper(sten.CooTensor.from_dense(sten.random_mask_sparsify(dense, out_sp.fraction)))

    x = torch.randn(6, 5)
    y = torch.randn(6, 5)
    xs = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(x))
    ys = sten.SparseTensorWrapper(sten.CooTensor.from_dense(y))
    op = sten.sparsified_op(torch.add, out_fmt=((sten.RandomFractionSparsifier(0.0), sten.CooTensor, sten.KeepAll(), sten.CooTensor),))
    with warnings.catch_warnings():
        warnings.simplefilter("error", sten.DispatchWarning)
        z = op(xs, ys)
    assert isinstance(z.wrapped_tensor, sten.CooTensor)
    torch.testing.assert_close(z.to_dense(), x + y)
