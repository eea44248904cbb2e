"""``@`` under torch.compile keeps its operands in order with a sparse wrapper on either side.

Dynamo (torch 2.13) traced ``W @ x`` with a wrapper ``W`` as ``x @ W``: silently
wrong for square operands (``sten_core/dispatch/dynamo_matmul.py``)."""

import pytest
import torch

import sten_core as sten
from sten_core.testing import compile_whole

LAYOUTS = [sten.DenseTensor, sten.CsrTensor, sten.CscTensor, sten.CooTensor]
PRODUCTS = {
    "W @ x": (lambda w, x: w @ x, lambda w, x: w @ x),
    "x @ W": (lambda w, x: x @ w, lambda w, x: x @ w),
    "W @ vector": (lambda w, x: w @ x[:, 0], lambda w, x: w @ x[:, 0]),
    "W @ x + x @ W": (lambda w, x: w @ x + x @ w, lambda w, x: w @ x + x @ w),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("product", PRODUCTS)
def test_matmul_operator_order_under_compile(layout, product):
    torch.manual_seed(0)
    dense = torch.randn(8, 8) * (torch.rand(8, 8) > 0.5)
    x = torch.randn(8, 8)
    wrapper = sten.SparseTensorWrapper(layout.from_dense(dense))
    traced, reference = PRODUCTS[product]
    torch._dynamo.reset()
    got = torch.compile(lambda x: traced(wrapper, x))(x)
    torch.testing.assert_close(got, reference(dense, x))  # square, not symmetric: a swap shows


def test_reverse_matmul_entry_is_added_when_dynamo_loads():
    import operator

    from torch._dynamo.variables import builtin

    builtin.populate_builtin_to_tensor_fn_map()
    assert builtin.BUILTIN_TO_TENSOR_RFN_MAP[operator.matmul] is torch.Tensor.__rmatmul__


WEIGHT_FIRST = {
    "W @ x": lambda w, x: w @ x,
    "torch.matmul(W, x)": lambda w, x: torch.matmul(w, x),
    "torch.mm(W, x)": lambda w, x: torch.mm(w, x),
    "W @ vector": lambda w, x: w @ x[:, 0],
    "W @ batch": lambda w, x: w @ torch.stack([x, 2 * x]),
}


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CscTensor])
@pytest.mark.parametrize("product", WEIGHT_FIRST)
def test_weight_first_products_run_the_layouts_kernel_without_breaks(layout, product):
    """``W @ x`` with the wrapper first runs the layout's compiled F.linear transposed
    (sten_core.dispatch.compiled_products): no graph break, the custom operator in the graph,
    eager's values and the dense product's."""
    torch.manual_seed(1)
    dense = torch.randn(6, 8) * (torch.rand(6, 8) > 0.5)
    wrapper = sten.SparseTensorWrapper(layout.from_dense(dense))
    x = torch.randn(8, 5)
    f = WEIGHT_FIRST[product]
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    got = compile_whole(lambda x: f(wrapper, x), x, backend=backend)
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    kernels = {torch.ops.sten_core.csr_mm, torch.ops.sten_core.csr_t_mm}  # CSC: the CSR of W.t()
    assert any(getattr(t, "overloadpacket", t) in kernels for t in targets), targets
    torch.testing.assert_close(got, f(wrapper, x))
    torch.testing.assert_close(got, f(dense, x), rtol=1e-5, atol=1e-5)
    assert got.is_contiguous()


def test_weight_first_products_check_their_operands():
    wrapper = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.randn(6, 8)))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="mm: the second operand must be a tensor of 2 dimensions"):
        torch.compile(lambda x: torch.mm(wrapper, x), fullgraph=True)(torch.randn(2, 8, 3))


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.DenseTensor])
@pytest.mark.parametrize("keeps_layout", [True, False], ids=["grad in layout", "dense grad"])
@pytest.mark.parametrize("product", WEIGHT_FIRST)
def test_weight_first_products_train_compiled(layout, keeps_layout, product):
    """A trainable weight used as ``W @ x`` trains compiled: CSR (traceable) through
    ``sten_core::wrapper_linear`` on x^T, its gradient in the graph in its grad_fmt (it raised
    ``UnsupportedTrainingOp`` with a grad_fmt that keeps the layout); DenseTensor (an eager-class
    wrapper) through the eager dispatcher at a graph break (Dynamo crashed tracing into it:
    ``IndexError`` in its ``pgo`` on the scipy conversion's ``.numpy()``). Compiled, eager and dense
    gradients agree."""
    torch.manual_seed(2)
    dense = torch.randn(6, 8) * (torch.rand(6, 8) > 0.5)
    x0 = torch.randn(8, 5)
    f = WEIGHT_FIRST[product]
    fmt = (sten.KeepAll(), layout, sten.KeepAll(), layout) if keeps_layout else None
    runs = {}
    for mode in ("dense", "eager", "compiled"):
        w = dense.clone().requires_grad_() if mode == "dense" else sten.SparseParameterWrapper(
            sten.SparseTensorWrapper(layout.from_dense(dense), requires_grad=True, grad_fmt=fmt))
        x = x0.clone().requires_grad_()
        if mode == "compiled" and layout is sten.CsrTensor:
            y = compile_whole(lambda x: f(w, x), x)
        elif mode == "compiled":
            torch._dynamo.reset()
            y = torch.compile(lambda x: f(w, x))(x)
        else:
            y = f(w, x)
        y.square().sum().backward()
        gw = w.grad if isinstance(w.grad, torch.Tensor) and not isinstance(w.grad, sten.SparseTensorWrapper) \
            else w.grad.to_dense()
        runs[mode] = (y, x.grad, gw * (dense != 0) if keeps_layout else gw)
        if mode != "dense" and keeps_layout:
            assert type(w.grad.wrapped_tensor) is layout, (mode, type(w.grad))
    for mode in ("eager", "compiled"):
        for got, want in zip(runs[mode], runs["dense"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
