"""Products with the sparse matrix first (``W @ x``, ``W.mm(x)``, ``torch.matmul(W, x)``).

A layout that registers ``F.linear`` runs them as ``F.linear(x^T, W)^T`` (the core's
``sten_core.builtin.weight_first`` rule), forward and backward: before, they were converted to
another plugin's layout on every call (an n:m or block-sparse weight to scipy's CSR) or fell
back to dense. The built-in CSR / COO / CSC layouts ran ``W @ x``, ``W.mm(x)`` and
``W.matmul(x)`` through sten_scipy's CSR whenever sten_scipy was installed: their products were
registered for ``torch.mm`` / ``torch.matmul`` only, not the method spellings.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_core.plugin_api import linear_inputs, needs_grad, register_weight_product
from fake_layouts import DenseCopyLayout

OWNER = "test-weight-first"
SPELLINGS = {
    "W @ x": lambda w, x: w @ x,
    "W.mm(x)": lambda w, x: w.mm(x),
    "W.matmul(x)": lambda w, x: w.matmul(x),
    "torch.mm": lambda w, x: torch.mm(w, x),
    "torch.matmul": lambda w, x: torch.matmul(w, x),
}
CASES = [(spelling, shape) for spelling in SPELLINGS for shape in [(6,), (6, 3), (2, 6, 4)]
         if len(shape) == 2 or "mm" not in spelling.replace("matmul", "")]  # mm: matrices only


class LinearOnly(DenseCopyLayout):
    """A third-party layout whose plugin registers ``F.linear`` and nothing else."""


@pytest.fixture
def linear_only():
    calls = []

    def fwd(ctx, inputs, outs):
        x, w, b = linear_inputs(inputs)
        calls.append("fwd")
        ctx.save_for_backward(x, w)
        return F.linear(x, w.wrapped_tensor.data, b)

    def bwd(sparse):
        def backward(ctx, grad_outputs, sparsifiers):
            calls.append("bwd")
            x, w = ctx.saved_tensors
            gy = grad_outputs[0]
            gx = gy @ w.wrapped_tensor.data if needs_grad(ctx, 0) else None
            gw = gy.reshape(-1, gy.shape[-1]).T @ x.reshape(-1, x.shape[-1]) if needs_grad(ctx, 1) else None
            if sparse and gw is not None:
                gw = sten.SparseTensorWrapper(LinearOnly(gw * (w.wrapped_tensor.data != 0)))
            return gx, gw
        return backward

    try:
        with sten.registry.owner(OWNER):
            sten.registry.register_layout(LinearOnly)
            register_weight_product(sten.registry, F.linear, LinearOnly, fwd, bwd(False), bwd(True))
        yield calls
    finally:
        sten.registry.remove_owner(OWNER)


def plans_of(fn):
    seen = []
    with warnings.catch_warnings(), sten.dispatch.observed(lambda e: seen.append((e["kind"], str(e.get("plan"))))):
        warnings.simplefilter("error")  # no conversion, no dense fallback
        out = fn()
    return out, [plan for kind, plan in seen if kind == "op"]


def masked(*shape):
    return torch.randn(*shape) * (torch.rand(*shape) > 0.4)


@pytest.mark.parametrize("spelling,x_shape", CASES)
@pytest.mark.parametrize("sparse_grad", [False, True], ids=["dense grad", "grad in layout"])
def test_a_layout_with_only_f_linear_runs_weight_first_products(linear_only, spelling, x_shape, sparse_grad):
    torch.manual_seed(0)
    dense = masked(5, 6)
    fmt = (sten.KeepAll(), LinearOnly, sten.KeepAll(), LinearOnly) if sparse_grad else None
    w = sten.SparseTensorWrapper(LinearOnly.from_dense(dense), requires_grad=True, grad_fmt=fmt)
    x = torch.randn(*x_shape, requires_grad=True)

    def run():
        y = SPELLINGS[spelling](w, x)
        y.backward(torch.ones_like(y) * torch.arange(y.numel()).reshape(y.shape))
        return y

    y, plans = plans_of(run)
    assert plans == ["generic", "generic"] and linear_only == ["fwd", "bwd"]
    wr, xr = dense.clone().requires_grad_(), x.detach().clone().requires_grad_()
    yr = SPELLINGS[spelling](wr, xr)
    yr.backward(torch.ones_like(yr) * torch.arange(yr.numel()).reshape(yr.shape))
    torch.testing.assert_close(y, yr)
    assert y.is_contiguous()
    torch.testing.assert_close(x.grad, xr.grad)
    if sparse_grad:
        assert isinstance(w.grad.wrapped_tensor, LinearOnly)
        torch.testing.assert_close(w.grad.to_dense(), wr.grad * (dense != 0))
    else:
        torch.testing.assert_close(w.grad, wr.grad)


def test_only_the_operands_that_need_it_get_a_gradient(linear_only):
    w = sten.SparseTensorWrapper(LinearOnly.from_dense(masked(5, 6)))
    x = torch.randn(6, 3, requires_grad=True)
    (w @ x).sum().backward()
    torch.testing.assert_close(x.grad, w.to_dense().T @ torch.ones(5, 3))
    w.requires_grad_(True)
    (w @ x.detach()).sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(5, 3) @ x.detach().T)


def test_mismatched_operands_are_named(linear_only):
    w = sten.SparseTensorWrapper(LinearOnly.from_dense(masked(5, 6)))
    with pytest.raises(ValueError, match="second-to-last dimension to be 6"):
        w @ torch.randn(5, 3)
    with pytest.raises(ValueError, match="length to be 6"):
        w @ torch.randn(5)
    with pytest.raises(ValueError, match="must be 2-D"):
        torch.mm(w, torch.randn(6))


BOTH_ORDERS = {
    "W @ x": lambda w, x: w @ x, "W.mm(x)": lambda w, x: w.mm(x), "W.matmul(x)": lambda w, x: w.matmul(x),
    "x @ W": lambda w, x: x @ w, "x.mm(W)": lambda w, x: x.mm(w), "x.matmul(W)": lambda w, x: x.matmul(w),
}


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CooTensor, sten.CscTensor])
@pytest.mark.parametrize("spelling", BOTH_ORDERS)
def test_builtin_layouts_run_their_own_product_in_every_spelling(layout, spelling):
    """With every plugin installed, a CSR weight's ``W @ x`` ran sten_scipy's product after a
    conversion to scipy's CSR on every call; it runs the core's own product now."""
    torch.manual_seed(1)
    dense = masked(5, 5)
    w = sten.SparseTensorWrapper(layout.from_dense(dense), requires_grad=True)
    x = torch.randn(5, 5, requires_grad=True)
    y, plans = plans_of(lambda: BOTH_ORDERS[spelling](w, x))
    assert plans == ["impl"]
    y.sum().backward()
    wr, xr = dense.clone().requires_grad_(), x.detach().clone().requires_grad_()
    yr = BOTH_ORDERS[spelling](wr, xr)
    yr.sum().backward()
    torch.testing.assert_close(y, yr)
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad, wr.grad)
