"""Operators: forward and backward against the dense reference (rtol 1e-4, fp32)."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_nm import ColumnGroupedNMTensor, GroupedNMTensor, NMTensor, nm_linear, nm_matmul

from conftest import PATTERNS, requires_kernel

pytestmark = requires_kernel

SPARSE_GRAD = (sten.KeepAll(), NMTensor, sten.KeepAll(), NMTensor)


def _close(a, b, rtol=1e-4):
    scale = max(1.0, float(b.detach().abs().max())) if b.numel() else 1.0
    assert a.shape == b.shape, (a.shape, b.shape)
    torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * scale)


def _wrapper(t: NMTensor, sparse_grad: bool) -> torch.Tensor:
    return sten.SparseParameterWrapper(
        sten.SparseTensorWrapper(t, requires_grad=True, grad_fmt=SPARSE_GRAD if sparse_grad else None)
    )


@pytest.mark.parametrize("n,m", PATTERNS)
@pytest.mark.parametrize("B", [1, 7, 100, 1024])
def test_linear_fwd_bwd(isa, n, m, B):
    N, K = 19, 37 + m  # odd K and M
    w = torch.randn(N, K)
    t = NMTensor.from_dense(w, n, m)
    for dim in (1, 0):
        t = NMTensor.from_dense(w, n, m, dim=dim)
        wd = t.to_dense()
        x = torch.randn(B, K, requires_grad=True)
        bias = torch.randn(N, requires_grad=True)
        W = _wrapper(t, sparse_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no dense fallback
            y = F.linear(x, W, bias)
            gy = torch.randn_like(y)
            y.backward(gy)
        xr, wr, br = x.detach().requires_grad_(), wd.clone().requires_grad_(), bias.detach().requires_grad_()
        yr = F.linear(xr, wr, br)
        yr.backward(gy)
        _close(y, yr)
        _close(x.grad, xr.grad)
        _close(bias.grad, br.grad)
        g = W.grad
        assert isinstance(g.wrapped_tensor, NMTensor) and g.wrapped_tensor.same_pattern(t)
        _close(g.wrapped_tensor.to_dense(), wr.grad * t.mask())


@pytest.mark.parametrize("n,m", [(2, 4), (1, 10)])
def test_linear_dense_weight_grad_no_bias(n, m):
    w = torch.randn(12, 30)
    t = NMTensor.from_dense(w, n, m)
    W = _wrapper(t, sparse_grad=False)
    x = torch.randn(3, 5, 30, requires_grad=True)  # any batch shape
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = F.linear(x, W)
        y.square().sum().backward()
    wr = t.to_dense().requires_grad_()
    xr = x.detach().requires_grad_()
    F.linear(xr, wr).square().sum().backward()
    _close(x.grad, xr.grad)
    assert isinstance(W.grad, torch.Tensor) and not hasattr(W.grad, "wrapped_tensor")
    _close(W.grad, wr.grad)


@pytest.mark.parametrize("op", [torch.mm, torch.matmul])
@pytest.mark.parametrize("dim", [0, 1])
def test_mm_matmul(op, dim):
    s = torch.randn(45, 23)  # [K, N]
    t = NMTensor.from_dense(s, 2, 8, dim=dim)
    S = _wrapper(t, sparse_grad=True)
    x = torch.randn(33, 45, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = op(x, S)
        gy = torch.randn_like(y)
        y.backward(gy)
    xr, sr = x.detach().requires_grad_(), t.to_dense().requires_grad_()
    yr = op(xr, sr)
    yr.backward(gy)
    _close(y, yr)
    _close(x.grad, xr.grad)
    _close(S.grad.wrapped_tensor.to_dense(), sr.grad * t.mask())


def test_matmul_batched_and_non_contiguous():
    t = NMTensor.from_dense(torch.randn(40, 24), 1, 4, dim=0)
    x = torch.randn(4, 24, 3, 40).transpose(1, 3)[:, :, 1]  # [4, 40, 24]... non-contiguous
    x = x.transpose(1, 2)  # [4, 24, 40] with strides
    assert not x.is_contiguous()
    _close(nm_matmul(x, t), x @ t.to_dense())
    w = NMTensor.from_dense(torch.randn(24, 40), 2, 4)
    _close(nm_linear(x, w), F.linear(x, w.to_dense()))
    xs = torch.randn(40, 6).t()  # column-major 2-D input
    _close(nm_linear(xs, w), F.linear(xs, w.to_dense()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_other_dtypes(dtype):
    w = torch.randn(16, 40).to(dtype)
    t = NMTensor.from_dense(w, 2, 4)
    x = torch.randn(9, 40).to(dtype)
    y = nm_linear(x, t)
    assert y.dtype == dtype
    ref = F.linear(x.double(), t.to_dense().double())
    tol = 1e-10 if dtype == torch.float64 else 2e-2
    _close(y.double(), ref, rtol=tol)


def test_bad_inputs():
    t = NMTensor.from_dense(torch.randn(8, 16), 2, 4)
    with pytest.raises(ValueError, match="input has shape"):
        nm_linear(torch.randn(3, 15), t)
    with pytest.raises(TypeError, match="input must be a floating-point"):
        nm_linear(torch.ones(3, 16, dtype=torch.int64), t)
    with pytest.raises(ValueError, match="bias"):
        nm_linear(torch.randn(3, 16), t, torch.randn(7))
    with pytest.raises(TypeError, match="weight must be an NMTensor"):
        nm_linear(torch.randn(3, 16), torch.randn(8, 16))
    W = sten.SparseTensorWrapper(t)
    with pytest.raises(ValueError, match="input has shape"):
        F.linear(torch.randn(3, 15), W)


def test_empty_and_tiny():
    t = NMTensor.from_dense(torch.randn(5, 3), 1, 4)
    _close(nm_linear(torch.randn(0, 3), t), torch.zeros(0, 5))
    x = torch.randn(2, 3)
    _close(nm_linear(x, t), F.linear(x, t.to_dense()))


def test_threads_agree():
    t = NMTensor.from_dense(torch.randn(300, 200), 2, 4)
    x = torch.randn(130, 200)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1 = nm_linear(x, t)
        torch.set_num_threads(2)
        y2 = nm_linear(x, t)
    finally:
        torch.set_num_threads(old)
    _close(y1, y2)


@pytest.mark.parametrize("n,m", [(1, 2), (2, 4), (1, 10), (3, 32)])
def test_scatter_kernels_agree(isa, n, m):
    from sten_nm import _kernel

    t = NMTensor.from_dense(torch.randn(45, 77), n, m)
    y = torch.randn(130, 45)
    b = torch.randn(77)
    ref = y @ t.to_dense() + b
    _close(_kernel.scatter(t.mat(), y, b), ref)
    _close(_kernel.tgather(t.mat(), y, b), ref)


SPELLINGS = {
    "x @ W": lambda x, w: x @ w,
    "x.mm(W)": lambda x, w: x.mm(w),
    "x.matmul(W)": lambda x, w: x.matmul(w),
    "torch.matmul": lambda x, w: torch.matmul(x, w),
}


@pytest.mark.parametrize("spelling", list(SPELLINGS))
@pytest.mark.parametrize("amp", [None, torch.bfloat16])
def test_method_and_operator_spellings_run_the_nm_product(spelling, amp):
    """x @ W, x.mm(W), x.matmul(W) with an n:m operand run sten_nm's own product, as
    torch.matmul does: registered for torch.mm / torch.matmul only, they were converted to
    scipy's CSR on every call (which ignores autocast: float32 where dense gives bf16)."""
    torch.manual_seed(0)
    S = NMTensor.from_dense(torch.randn(16, 12), 2, 4, dim=0)
    w = sten.SparseTensorWrapper(S, requires_grad=True)
    x = torch.randn(5, 16, requires_grad=True)
    seen = []
    with sten.dispatch.observed(lambda e: seen.append((e["kind"], e.get("plan")))), \
            torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
        y = SPELLINGS[spelling](x, w)
        ref = SPELLINGS[spelling](x.detach(), S.to_dense())
    assert seen and all(kind == "op" and str(plan) == "impl" for kind, plan in seen), seen
    assert y.dtype == ref.dtype
    tol = dict(rtol=2e-2, atol=5e-2) if amp else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, ref, **tol)
    y.float().square().sum().backward()
    xd = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
        (xd @ S.to_dense()).float().square().sum().backward()
    torch.testing.assert_close(x.grad, xd.grad, **tol)


LEFT_SPELLINGS = {
    "W @ x": lambda w, x: w @ x,
    "W.mm(x)": lambda w, x: w.mm(x),
    "W.matmul(x)": lambda w, x: w.matmul(x),
    "torch.mm": lambda w, x: torch.mm(w, x),
    "torch.matmul": lambda w, x: torch.matmul(w, x),
}


LEFT_CASES = [(spelling, shape) for spelling in LEFT_SPELLINGS for shape in [(30,), (30, 7), (2, 3, 30, 5)]
              if len(shape) == 2 or "matmul" in spelling or "@" in spelling]  # torch.mm: 2-D only


LEFT_LAYOUTS = {
    "NMTensor": lambda w: NMTensor.from_dense(w, 2, 4),
    "NMTensor dim=0": lambda w: NMTensor.from_dense(w, 2, 4, dim=0),
    "GroupedNMTensor": lambda w: GroupedNMTensor.from_dense(w, 2, 4),
    "ColumnGroupedNMTensor": lambda w: ColumnGroupedNMTensor.from_dense(w, 2, 4),
}


@pytest.mark.parametrize("spelling,x_shape", LEFT_CASES)
@pytest.mark.parametrize("layout", LEFT_LAYOUTS)
@pytest.mark.parametrize("sparse_grad", [True, False])
def test_nm_operand_first_runs_the_nm_product(spelling, x_shape, layout, sparse_grad):
    """``W @ x`` (and ``mm`` / ``matmul``) with the n:m operand first runs the layout's own
    ``F.linear`` (``F.linear(x^T, W)^T``, the core's rule for any layout with one) with the values
    and gradients of dense torch, the weight gradient in W's own layout when its grad_fmt asks:
    it was converted to scipy's CSR on every call (the grouped layouts until the core's rule)."""
    torch.manual_seed(0)
    t = LEFT_LAYOUTS[layout](torch.randn(12, 30))
    fmt = (sten.KeepAll(), type(t), sten.KeepAll(), type(t)) if sparse_grad else None
    W = sten.SparseParameterWrapper(sten.SparseTensorWrapper(t, requires_grad=True, grad_fmt=fmt))
    x = torch.randn(*x_shape, requires_grad=True)
    seen = []
    with warnings.catch_warnings(), sten.dispatch.observed(lambda e: seen.append((e["kind"], str(e.get("plan"))))):
        warnings.simplefilter("error")  # no conversion, no dense fallback
        y = LEFT_SPELLINGS[spelling](W, x)
        gy = torch.randn_like(y)
        y.backward(gy)
    ops = [plan for kind, plan in seen if kind == "op"]
    assert ops == ["generic", "generic"], seen   # forward and backward through F.linear, no conversion
    xr, wr = x.detach().requires_grad_(), t.to_dense().requires_grad_()
    yr = LEFT_SPELLINGS[spelling](wr, xr)
    yr.backward(gy)
    assert y.is_contiguous()
    _close(y, yr)
    _close(x.grad, xr.grad)
    if sparse_grad:
        assert isinstance(W.grad.wrapped_tensor, type(t)) and W.grad.wrapped_tensor.same_pattern(t)
        _close(W.grad.wrapped_tensor.to_dense(), wr.grad * t.mask())
    else:
        _close(W.grad, wr.grad)


def test_nm_operand_first_rejects_mismatched_operands():
    W = sten.SparseTensorWrapper(NMTensor.from_dense(torch.randn(12, 30), 2, 4))
    with pytest.raises(ValueError, match="second-to-last dimension to be 30"):
        W @ torch.randn(29, 4)
    with pytest.raises(ValueError, match="length to be 30"):
        W @ torch.randn(29)
    with pytest.raises(ValueError, match="second operand must be 2-D"):
        torch.mm(W, torch.randn(30))


def test_addmm_with_an_empty_nm_operand_gives_the_bias_an_empty_gradient():
    """``torch.addmm(b, x, W)`` with ``W`` [8, 0] raised "cannot reshape tensor of 0 elements into
    shape [-1, 0]" in the bias gradient; dense torch gives an empty one."""
    import sten_core as sten

    W = sten.SparseTensorWrapper(NMTensor.from_dense(torch.randn(8, 0), n=2, m=4, dim=0))
    b = torch.randn(0, requires_grad=True)
    x = torch.randn(3, 8, requires_grad=True)
    y = torch.addmm(b, x, W)
    assert y.shape == (3, 0)
    y.sum().backward()
    assert b.grad.shape == (0,) and torch.equal(x.grad, torch.zeros(3, 8))
