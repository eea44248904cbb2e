"""torch.compile of weight products other than ``F.linear`` (issue #15's remaining gaps).

- A frozen weight as the *second* operand (``x @ W``, ``torch.matmul(x, W)``, ``torch.mm(x, W)``)
  and the method calls ``W.matmul(x)`` / ``W.mm(x)`` compile whole.
- A trainable weight whose gradient is dense (default ``grad_fmt=None`` or the explicit dense
  format) trains compiled through ``torch.mm(x, W.t())``, ``x @ W.t()``, ``torch.matmul(x, W.t())``,
  ``torch.addmm(b, x, W.t())``: its differentiable dense view (``sten_core::wrapper_dense``), the
  plain dense gradient eager gives.
The bodies are the testing kit's (``check_compile_weight_products``,
``check_compile_training_products``); the n:m and scipy layouts run them in their plugins' suites.
"""

import warnings

import pytest
import torch

import sten_core as sten
from sten_core.dispatch.compiled import UnsupportedTrainingOp
from sten_core.testing import (check_compile_training_products, check_compile_weight_products, compile_whole,
                               compiled_training_grads)

LAYOUTS = [sten.CsrTensor, sten.CscTensor]
DENSE_GRAD = (sten.KeepAll(), torch.Tensor, sten.KeepAll(), torch.Tensor)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_frozen_weight_products_and_method_calls_compile_whole(layout):
    report = check_compile_weight_products(layout)
    assert set(report) == {"x @ W", "torch.matmul(x, W)", "torch.mm(x, W)", "W.matmul(x.t())", "W.mm(x.t())",
                           "x @ W.t()", "torch.mm(x, W.transpose(0, 1))"}
    assert set(report.values()) == {0}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_training_through_other_products_with_the_default_grad_fmt(layout):
    report = check_compile_training_products(layout)
    assert len(report) == 5 and set(report.values()) == {0}


def test_training_through_other_products_with_the_explicit_dense_grad_fmt():
    report = check_compile_training_products(sten.CsrTensor, grad_fmt=DENSE_GRAD,
                                             products=["torch.addmm(b, x, W.t())", "x @ W.t() + b"])
    assert set(report.values()) == {0}


class _MmModel(torch.nn.Module):
    def __init__(self, lin):
        super().__init__()
        self.lin = lin

    def forward(self, x):
        return torch.mm(x, self.lin.weight.t()) + self.lin.bias


def test_sparsity_builder_weight_trains_through_mm_compiled_like_eager_and_dense():
    """The issue's case: ``SparsityBuilder.set_weight(..., KeepAll(), out_format=CsrTensor)``; eager
    ``torch.mm(x, W.t())`` gives W.grad a plain dense tensor equal to the dense model's, and the
    compiled step (no break, fullgraph) gives the same."""
    torch.manual_seed(3)
    dense = torch.nn.Sequential(torch.nn.Linear(16, 6))
    sb = sten.SparsityBuilder(dense)
    sb.set_weight("0.weight", sten.KeepAll(), out_format=sten.CsrTensor)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sparse = sb.get_sparse_model()
    model = _MmModel(sparse[0])
    x = torch.randn(4, 16, requires_grad=True)
    run = compiled_training_grads(model, x)
    assert run["graph_breaks"] == 0, run["reasons"]
    assert type(run["eager"][0]) is torch.Tensor and type(run["compiled"][0]) is torch.Tensor
    reference = _MmModel(torch.nn.Linear(16, 6))
    with torch.no_grad():
        reference.lin.weight.copy_(sparse[0].weight.to_dense())
        reference.lin.bias.copy_(sparse[0].bias)
    xd = x.detach().clone().requires_grad_(True)
    reference(xd).square().sum().backward()
    want = [reference.lin.weight.grad, reference.lin.bias.grad, xd.grad]
    for eager, compiled, dense_grad in zip(run["eager"], run["compiled"], want):
        torch.testing.assert_close(eager, dense_grad)
        torch.testing.assert_close(compiled, eager)


def test_in_place_operators_on_a_trainable_weight_still_raise():
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.randn(6, 8)))

    def f(x):
        w.mul_(2)
        return x @ w.t()

    with pytest.raises(Exception, match="in-place mul_ .*change the weight outside the compiled function"):
        torch.compile(f, fullgraph=True)(torch.randn(3, 8))


def test_the_dense_of_a_traceable_layout_is_one_custom_operator():
    """``sten_core::members_to_dense``: the layout's own to_dense() from its members (opcheck:
    fake implementation, schema, no aliasing)."""
    from sten_core.dispatch.dense_view import layout_name, traced_dense
    from sten_core.model.tensor import TRACEABLE_LAYOUTS

    layout = sten.CsrTensor.from_dense(torch.randn(5, 7) * (torch.rand(5, 7) > 0.5))
    torch.testing.assert_close(traced_dense(layout), layout.to_dense())
    tensors, consts = TRACEABLE_LAYOUTS[sten.CsrTensor][0](layout)
    torch.library.opcheck(torch.ops.sten_core.members_to_dense.default,
                          (list(tensors), list(consts), layout_name(sten.CsrTensor)),
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(ValueError, match="is not a registered traceable layout"):
        torch.ops.sten_core.members_to_dense(list(tensors), list(consts), "nowhere.Layout")


def test_keep_layout_grad_fmt_still_says_to_write_f_linear():
    keep = (sten.KeepAll(), sten.CsrTensor, sten.KeepAll(), sten.CsrTensor)
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.randn(6, 8)), grad_fmt=keep)
    with pytest.raises(Exception, match=r"Tensor.t on a trainable CsrTensor weight whose grad_fmt keeps its layout"):
        torch.compile(lambda x: x @ w.t(), fullgraph=True)(torch.randn(3, 8))
    assert isinstance(UnsupportedTrainingOp("m"), TypeError)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("product", ["x @ W", "torch.mm(x, W)", "vector @ W", "batch @ W"])
def test_x_at_a_frozen_csr_or_csc_weight_runs_the_transposed_kernel(layout, product):
    """CSR/CSC ``x @ W``: one ``sten_core::csr_t_mm`` / ``csr_mm`` node on the members (no dense
    matrix), eager's values and x's gradient, the dense product's."""
    torch.manual_seed(2)
    dense = torch.randn(6, 8) * (torch.rand(6, 8) > 0.5)
    w = sten.SparseTensorWrapper(layout.from_dense(dense))
    f = {"x @ W": lambda w, x: x @ w, "torch.mm(x, W)": lambda w, x: torch.mm(x, w),
         "vector @ W": lambda w, x: x[0] @ w, "batch @ W": lambda w, x: torch.stack([x, 2 * x]) @ w}[product]
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    x = torch.randn(5, 6, requires_grad=True)
    got = compile_whole(lambda x: f(w, x), x, backend=backend)
    targets = {getattr(n.target, "overloadpacket", n.target) for g in graphs for n in g.graph.nodes
               if n.op == "call_function"}
    kernel = torch.ops.sten_core.csr_t_mm if layout is sten.CsrTensor else torch.ops.sten_core.csr_mm
    assert kernel in targets and torch.ops.sten_core.members_to_dense not in targets, targets
    got.square().sum().backward()
    gx = x.grad.clone()
    x.grad = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = f(w, x)
    want.square().sum().backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(gx, x.grad)
    xd = x.detach().clone().requires_grad_(True)
    ref = f(dense, xd)
    ref.square().sum().backward()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, xd.grad, rtol=1e-5, atol=1e-5)
    assert got.is_contiguous()
