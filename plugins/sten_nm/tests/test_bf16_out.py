"""The exact ``NMTensor`` and 16-row ``GroupedNMTensor`` forwards with a bf16 result rounded
by the kernel's threads (``nm_gather_bf16x_out16``: each unit of rows rounded while in cache;
``nm_grouped_gather_bf16x_out16``: each row as it is written; no float32 result in memory): the same bits as the float32 kernel result rounded by ``.to(torch.bfloat16)``, on every
ISA, float32 and bf16 values, with and without bias, odd sizes, B = 0, K = 0 and views."""

import pytest
import torch
import torch.nn.functional as F

from sten_nm import GroupedNMTensor, NMTensor, _bf16x, _kernel
from sten_nm.ops import grouped_linear

from conftest import requires_kernel

pytestmark = requires_kernel


def _desc(t):
    R, C = t._rc()
    return _kernel.mat(t._values.contiguous(), t.indices, R, C, t.n, t.m)


@pytest.mark.parametrize("vdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,m", [(1, 2), (2, 4), (1, 10), (3, 32)])
@pytest.mark.parametrize("B", [0, 1, 17, 130])
@pytest.mark.parametrize("nthreads", [1, 2])
def test_same_bits_as_rounding_the_float32_result(isa, vdtype, n, m, B, nthreads):
    for N, K in ((5, 3), (37, 45), (200, 131), (9, 0), (0, 7)):
        t = NMTensor.from_dense(torch.randn(N, K).to(vdtype), n, m)
        xb = torch.randn(B, K).bfloat16()
        for bias in (None, torch.randn(N)):
            y = _bf16x.gather_bf16x(_desc(t), xb, bias, nthreads, out_bf16=True)
            assert y.dtype == torch.bfloat16 and y.shape == (B, N)
            y32 = _bf16x.gather_bf16x(_desc(t), xb, bias, nthreads)
            assert torch.equal(y, y32.to(torch.bfloat16))
            ref = F.linear(xb.double(), t.to_dense().double(), None if bias is None else bias.double())
            torch.testing.assert_close(y.double(), ref.to(torch.bfloat16).double(), rtol=1e-2, atol=1e-2)


def test_views_and_specials(isa):
    t = NMTensor.from_dense(torch.randn(70, 67).bfloat16(), 2, 4)
    big = torch.randn(41, 80).bfloat16()
    for xv in (big[:, 1:68], big[3:40:2, 5:72]):
        y = _bf16x.gather_bf16x(_desc(t), xv, out_bf16=True)
        assert torch.equal(y, _bf16x.gather_bf16x(_desc(t), xv).to(torch.bfloat16))
    x = torch.randn(4, 67).bfloat16()
    x[0, 0], x[1, 1] = float("inf"), float("nan")
    y = _bf16x.gather_bf16x(_desc(t), x, out_bf16=True)
    y32 = _bf16x.gather_bf16x(_desc(t), x)
    assert torch.equal(y.isnan(), y32.isnan())
    ok = ~y32.isnan()
    assert torch.equal(y[ok], y32[ok].to(torch.bfloat16))


def _gdesc(g):
    N, K = g.shape
    return _kernel.grouped(g._vals.contiguous(), g.indices, g.perm, N, K, g.n, g.m)


@pytest.mark.parametrize("in_registers", [False, True])
@pytest.mark.parametrize("vdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,m", [(1, 2), (2, 4), (1, 10), (3, 32)])
@pytest.mark.parametrize("B", [0, 1, 17, 130])
@pytest.mark.parametrize("nthreads", [1, 2])
def test_grouped_same_bits_as_rounding(isa, monkeypatch, in_registers, vdtype, n, m, B, nthreads):
    """16-row GroupedNMTensor: rows rounded as the driver writes them (both schedules)."""
    if in_registers:
        monkeypatch.setenv("STEN_NM_BF16_IN_REGISTERS", "1")
    for N, K in ((5, 3), (37, 45), (70, 131), (9, 0), (0, 7)):
        g = GroupedNMTensor.from_dense(torch.randn(N, K).to(vdtype), n, m)
        xb = torch.randn(B, K).bfloat16()
        for bias in (None, torch.randn(N)):
            y = _bf16x.grouped_gather_bf16x(_gdesc(g), xb, bias, nthreads, out_bf16=True)
            assert y.dtype == torch.bfloat16 and y.shape == (B, N)
            assert torch.equal(y, _bf16x.grouped_gather_bf16x(_gdesc(g), xb, bias, nthreads).to(torch.bfloat16))
            ref = F.linear(xb.double(), g.to_dense().double(), None if bias is None else bias.double())
            torch.testing.assert_close(y.double(), ref.to(torch.bfloat16).double(), rtol=1e-2, atol=1e-2)


def test_grouped_linear_bf16_out_view():
    g = GroupedNMTensor.from_dense(torch.randn(40, 67).bfloat16(), 2, 4)
    xv = torch.randn(9, 80).bfloat16()[:, 1:68]
    y = grouped_linear(xv, g)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, _bf16x.grouped_gather_bf16x(_gdesc(g), xv).to(torch.bfloat16))
