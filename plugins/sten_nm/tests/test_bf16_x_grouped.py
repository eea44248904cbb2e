"""bf16 activations read by the 16-row ``GroupedNMTensor`` forward (``nm_grouped_gather_bf16x``
with float32 values, ``nm_grouped_gather_bf16wx`` with bf16 values): x is widened while the
kernel packs its 6-row micro-panels, no float32 copy in torch. Widening is exact, so the result
has the same bits as the previous path (``x.float()`` then the float32-x kernel); also checked
against the dense product of the same bf16 operands, under autocast, on every ISA, both
schedules (threads split the batch or the row groups), odd sizes and strided / offset views."""

import pytest
import torch
import torch.nn.functional as F

from sten_nm import GroupedNMTensor, _bf16x, _kernel
from sten_nm.ops import grouped_linear

from conftest import requires_kernel

pytestmark = requires_kernel


def _desc(g):
    N, K = g.shape
    return _kernel.grouped(g._vals.contiguous(), g.indices, g.perm, N, K, g.n, g.m)


def _old_path(xb, g, bias=None, nthreads=None):
    """The kernel on x widened by torch (the path before x was read as bf16)."""
    if g._vals.dtype == torch.bfloat16:
        return _kernel.grouped_gather_bf16w(_desc(g), xb.float(), bias, nthreads)
    return _kernel.grouped_gather(g.desc(), xb.float(), bias, nthreads)


@pytest.mark.parametrize("in_registers", [False, True])
@pytest.mark.parametrize("vdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,m", [(1, 2), (2, 4), (3, 7), (1, 10), (3, 32)])
@pytest.mark.parametrize("B", [0, 1, 5, 6, 13, 40, 131])
@pytest.mark.parametrize("nthreads", [1, 2])
def test_kernel_same_bits_as_widened_x(isa, monkeypatch, in_registers, vdtype, n, m, B, nthreads):
    if in_registers:   # bf16 values widened in registers (AVX-512's default) on every ISA
        monkeypatch.setenv("STEN_NM_BF16_IN_REGISTERS", "1")
    for N, K in ((5, 3), (37, 45), (70, 131)):
        g = GroupedNMTensor.from_dense(torch.randn(N, K).to(vdtype), n, m)
        xb = torch.randn(B, K).bfloat16()
        bias = torch.randn(N)
        y = _bf16x.grouped_gather_bf16x(_desc(g), xb, bias, nthreads)
        assert y.dtype == torch.float32 and y.shape == (B, N)
        assert torch.equal(y, _old_path(xb, g, bias, nthreads))
        ref = F.linear(xb.double(), g.to_dense().double(), bias.double()).float()
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_long_chunks(isa, monkeypatch):
    """Chunks of kept slots wider than one 64-column packing unit, and several chunks."""
    g = GroupedNMTensor.from_dense(torch.randn(40, 700), 2, 4)
    xb = torch.randn(19, 700).bfloat16()
    for kc in ("64", "96", "512"):
        monkeypatch.setenv("STEN_NM_GROUPED_KC", kc)
        for nth in (1, 2):
            assert torch.equal(_bf16x.grouped_gather_bf16x(_desc(g), xb, None, nth), _old_path(xb, g, None, nth))


@pytest.mark.parametrize("vdtype", [torch.float32, torch.bfloat16])
def test_strided_and_odd_offset_views(isa, vdtype):
    N, K = 29, 67
    g = GroupedNMTensor.from_dense(torch.randn(N, K).to(vdtype), 2, 4)
    big = torch.randn(41, K + 9).bfloat16()
    views = [big[:, 1:K + 1],                 # odd 2-byte offset, row stride K + 9
             big[3:40:2, 5:K + 5],            # every other row
             torch.randn(K, 23).bfloat16().t()]  # column stride != 1: copied
    for xv in views:
        assert torch.equal(_bf16x.grouped_gather_bf16x(_desc(g), xv), _old_path(xv.contiguous(), g))
        y = grouped_linear(xv, g)
        assert torch.equal(y.float(), grouped_linear(xv.float(), g).to(y.dtype).float())


def test_no_float32_copy_of_x(monkeypatch):
    """F.linear with bf16 x goes through grouped_gather_bf16x, never widening x in torch first."""
    import sten_nm._bf16x as bx

    calls = []
    real = bx.grouped_gather_bf16x
    monkeypatch.setattr(bx, "grouped_gather_bf16x", lambda *a, **k: calls.append(a[1].dtype) or real(*a, **k))
    rowmajor = _kernel._rowmajor

    def no_widen(t):
        if t.dtype == torch.bfloat16:
            raise AssertionError("bf16 x widened in torch")
        return rowmajor(t)

    monkeypatch.setattr(_kernel, "_rowmajor", no_widen)
    for vdtype in (torch.float32, torch.bfloat16):
        g = GroupedNMTensor.from_dense(torch.randn(32, 16).to(vdtype), 2, 4)
        grouped_linear(torch.randn(5, 16).bfloat16(), g)
    assert calls == [torch.bfloat16, torch.bfloat16]


@pytest.mark.parametrize("vdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(45,), (0, 45), (1, 45), (2, 3, 45), (4, 0, 45)])
def test_linear_shapes_and_dtypes(isa, vdtype, shape):
    g = GroupedNMTensor.from_dense(torch.randn(19, 45).to(vdtype), 1, 4)
    x = torch.randn(shape).bfloat16()
    bias = torch.randn(19).to(vdtype)
    y = grouped_linear(x, g, bias)
    want_dtype = torch.promote_types(torch.bfloat16, vdtype)
    assert y.dtype == want_dtype and y.shape == (*shape[:-1], 19)
    old = _old_path(x.reshape(-1, 45), g, bias.float()).to(want_dtype).reshape(y.shape)
    assert torch.equal(y, old)
    ref = F.linear(x.double(), g.to_dense().double(), bias.double())
    torch.testing.assert_close(y.double(), ref.to(want_dtype).double(), rtol=1e-2, atol=1e-2)


def test_empty_contraction():
    g = GroupedNMTensor.from_dense(torch.randn(8, 0), 2, 4)
    y = _bf16x.grouped_gather_bf16x(_desc(g), torch.randn(3, 0).bfloat16(), torch.ones(8))
    assert torch.equal(y, torch.ones(3, 8))


@pytest.mark.parametrize("vdtype", [torch.float32, torch.bfloat16])
def test_autocast(isa, vdtype):
    """Under CPU autocast an fp32 x is rounded to bf16 and read by the kernel as bf16; the result
    is bf16 as dense gives, the same bits as widening the rounded x first."""
    g = GroupedNMTensor.from_dense(torch.randn(33, 70).to(vdtype), 2, 4)
    x = torch.randn(3, 11, 70)
    bias = torch.randn(33)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = grouped_linear(x, g, bias)
        dense = F.linear(x, g.to_dense().to(vdtype), bias)
    assert y.dtype == dense.dtype == torch.bfloat16
    N, K = g.shape
    v16 = g._vals.to(torch.bfloat16).contiguous()
    old = _kernel.grouped_gather_bf16w(_kernel.grouped(v16, g.indices, g.perm, N, K, g.n, g.m),
                                       x.reshape(-1, 70).bfloat16().float(), bias.bfloat16().float())
    assert torch.equal(y, _kernel.to_bf16(old).reshape(3, 11, 33))
    torch.testing.assert_close(y.float(), dense.float(), rtol=2e-2, atol=2e-2)


def test_bad_input_named():
    g = GroupedNMTensor.from_dense(torch.randn(16, 16), 2, 4)
    with pytest.raises(ValueError, match="bfloat16"):
        _bf16x.grouped_gather_bf16x(g.desc(), torch.randn(3, 16))
    with pytest.raises(ValueError, match="16 columns"):
        _bf16x.grouped_gather_bf16x(g.desc(), torch.randn(3, 15).bfloat16())
