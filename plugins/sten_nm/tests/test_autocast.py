"""CPU autocast (bf16): the n:m products return what dense returns (dtype and values
within bf16 tolerance), forward and backward."""

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_nm import ColumnGroupedNMTensor, GroupedNMTensor, NMTensor

from conftest import requires_kernel

pytestmark = requires_kernel


def _pair(layout, dim, sparse_grad):
    w = torch.randn(24, 40)
    t = layout.from_dense(w, 2, 4) if layout is not NMTensor else layout.from_dense(w, 2, 4, dim=dim)
    fmt = (sten.KeepAll(), layout, sten.KeepAll(), layout) if sparse_grad else None
    return t, sten.SparseParameterWrapper(t, grad_fmt=fmt)


def _close(a, b):
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    scale = max(1.0, float(b.detach().abs().max()))
    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * scale)


@pytest.mark.parametrize("layout,dim", [(NMTensor, 1), (NMTensor, 0), (GroupedNMTensor, 1),
                                        (ColumnGroupedNMTensor, 1)])
@pytest.mark.parametrize("sparse_grad", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_under_bf16_autocast(layout, dim, sparse_grad, with_bias):
    t, W = _pair(layout, dim, sparse_grad)
    x = torch.randn(2, 9, 40, requires_grad=True)
    b = torch.randn(24, requires_grad=True) if with_bias else None
    xr, wr = x.detach().requires_grad_(), t.to_dense().requires_grad_()
    br = b.detach().requires_grad_() if with_bias else None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = F.linear(x, W, b)
        yr = F.linear(xr, wr, br)
    assert yr.dtype == torch.bfloat16
    _close(y, yr)
    gy = torch.randn_like(yr)
    y.backward(gy)
    yr.backward(gy)
    _close(x.grad, xr.grad)
    gw = W.grad.wrapped_tensor.to_dense() if sparse_grad else W.grad
    _close(gw, wr.grad * t.mask() if sparse_grad else wr.grad)
    if with_bias:
        _close(b.grad, br.grad)


@pytest.mark.parametrize("op", [torch.mm, torch.matmul])
@pytest.mark.parametrize("dim", [0, 1])
def test_mm_under_bf16_autocast(op, dim):
    t = NMTensor.from_dense(torch.randn(40, 24), 1, 4, dim=dim)
    S = sten.SparseTensorWrapper(t)
    x = torch.randn(7, 40)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, yr = op(x, S), op(x, t.to_dense())
    _close(y, yr)


def test_autocast_off_and_float64_unchanged():
    t = NMTensor.from_dense(torch.randn(8, 16), 2, 4)
    x = torch.randn(3, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert F.linear(x, sten.SparseTensorWrapper(t)).dtype == torch.float32
    td = NMTensor.from_dense(torch.randn(8, 16, dtype=torch.float64), 2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = F.linear(x.double(), sten.SparseTensorWrapper(td))
        assert y.dtype == F.linear(x.double(), td.to_dense()).dtype == torch.float64


@pytest.mark.parametrize("layout", [NMTensor, GroupedNMTensor, ColumnGroupedNMTensor])
def test_cached_fp32_weights_follow_in_place_updates(layout):
    """bf16 weights are widened once and cached: an in-place update (an optimizer step) or
    autocast rounding of updated fp32 weights must be seen by the next product."""
    from sten_nm import column_grouped_linear, grouped_linear, nm_linear

    f = {NMTensor: nm_linear, GroupedNMTensor: grouped_linear, ColumnGroupedNMTensor: column_grouped_linear}[layout]
    x = torch.randn(5, 40)
    for dtype in (torch.bfloat16, torch.float32):
        t = layout.from_dense(torch.randn(24, 40), 2, 4)
        t = t.with_values(t.values().to(dtype))
        xs = x.to(dtype)
        f(xs, t)
        t.values().mul_(2)                      # in place: same storage, new version
        _close(f(xs, t), F.linear(xs, t.to_dense()))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            f(x, t)
            t.values().add_(1)
            _close(f(x, t), F.linear(x, t.to_dense()))


@pytest.mark.parametrize("beta,alpha", [(1, 1), (0.5, 2)])
def test_addmm_under_bf16_autocast(beta, alpha):
    """``torch.addmm(bias, x, W)`` (GPT-2's ``Conv1D``) returned float32 under autocast: the float32
    bias promoted the bf16 product back; dense torch casts the bias too and returns bf16."""
    t = NMTensor.from_dense(torch.randn(12, 10), 2, 4, dim=0)
    W = sten.SparseParameterWrapper(sten.SparseTensorWrapper(t, requires_grad=True))
    Wr = torch.nn.Parameter(t.to_dense())
    x, b = torch.randn(5, 12, requires_grad=True), torch.randn(10, requires_grad=True)
    xr, br = x.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, yr = torch.addmm(b, x, W, beta=beta, alpha=alpha), torch.addmm(br, xr, Wr, beta=beta, alpha=alpha)
    assert y.dtype == yr.dtype == torch.bfloat16
    _close(y, yr)
    y.float().sum().backward()
    yr.float().sum().backward()
    _close(x.grad, xr.grad)
    _close(b.grad, br.grad)
