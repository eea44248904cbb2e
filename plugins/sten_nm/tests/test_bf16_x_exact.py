"""bf16 activations read by the exact ``NMTensor`` forward (``nm_gather_bf16x`` with float32
values, ``nm_gather_bf16wx`` with bf16 values): x is widened while the kernel packs its panel,
no float32 copy in torch. Widening is exact, so the result has the same bits as the previous
path (``x.float()`` then the float32-x kernel); also checked against the dense product of the
same bf16 operands, under autocast, on every ISA, for odd sizes and strided / offset views."""

import pytest
import torch
import torch.nn.functional as F

from sten_nm import NMTensor, _bf16x, _kernel, nm_linear

from conftest import requires_kernel

pytestmark = requires_kernel


def _old_path(xb, t, bias=None):
    """The kernel on x widened by torch (the path before x was read as bf16)."""
    R, C = t._rc()
    if t._values.dtype == torch.bfloat16:
        return _kernel.gather_bf16w(_kernel.mat(t._values.contiguous(), t.indices, R, C, t.n, t.m), xb.float(), bias)
    return _kernel.gather(t.mat(), xb.float(), bias)


def _desc(t):
    R, C = t._rc()
    return _kernel.mat(t._values.contiguous(), t.indices, R, C, t.n, t.m)


@pytest.mark.parametrize("vdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,m", [(1, 2), (2, 4), (3, 7), (1, 10), (3, 32)])
@pytest.mark.parametrize("B", [0, 1, 3, 17, 33, 130])
def test_kernel_same_bits_as_widened_x(isa, vdtype, n, m, B):
    for N, K in ((5, 3), (37, 45), (70, 131)):
        t = NMTensor.from_dense(torch.randn(N, K).to(vdtype), n, m)
        xb = torch.randn(B, K).bfloat16()
        bias = torch.randn(N)
        y = _bf16x.gather_bf16x(_desc(t), xb, bias)
        assert y.dtype == torch.float32 and y.shape == (B, N)
        assert torch.equal(y, _old_path(xb, t, bias))
        ref = F.linear(xb.double(), t.to_dense().double(), bias.double()).float()
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vdtype", [torch.float32, torch.bfloat16])
def test_strided_and_odd_offset_views(isa, vdtype):
    N, K = 29, 67
    t = NMTensor.from_dense(torch.randn(N, K).to(vdtype), 2, 4)
    big = torch.randn(141, K + 9).bfloat16()   # whole batch chunks too (packed widened in registers)
    views = [big[:, 1:K + 1],                 # odd 2-byte offset, row stride K + 9
             big[3:140:2, 5:K + 5],           # every other row
             torch.randn(K, 23).bfloat16().t()]  # column stride != 1: copied
    for xv in views:
        assert torch.equal(_bf16x.gather_bf16x(_desc(t), xv), _old_path(xv.contiguous(), t))
        y = nm_linear(xv, t)
        assert torch.equal(y.float(), nm_linear(xv.float(), t).to(y.dtype).float())


def test_no_float32_copy_of_x(monkeypatch):
    """F.linear with bf16 x goes through gather_bf16x, never widening x in torch first."""
    import sten_nm._bf16x as bx

    calls = []
    real = bx.gather_bf16x
    monkeypatch.setattr(bx, "gather_bf16x", lambda *a, **k: calls.append(a[1].dtype) or real(*a, **k))

    rowmajor = _kernel._rowmajor

    def no_widen(t):
        if t.dtype == torch.bfloat16:
            raise AssertionError("bf16 x widened in torch")
        return rowmajor(t)

    monkeypatch.setattr(_kernel, "_rowmajor", no_widen)
    for vdtype in (torch.float32, torch.bfloat16):
        t = NMTensor.from_dense(torch.randn(12, 16).to(vdtype), 2, 4)
        nm_linear(torch.randn(5, 16).bfloat16(), t)
    assert calls == [torch.bfloat16, torch.bfloat16]


@pytest.mark.parametrize("vdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(45,), (0, 45), (1, 45), (2, 3, 45), (4, 0, 45)])
def test_linear_shapes_and_dtypes(isa, vdtype, shape):
    t = NMTensor.from_dense(torch.randn(19, 45).to(vdtype), 1, 4)
    x = torch.randn(shape).bfloat16()
    bias = torch.randn(19).to(vdtype)
    y = nm_linear(x, t, bias)
    want_dtype = torch.promote_types(torch.bfloat16, vdtype)
    assert y.dtype == want_dtype and y.shape == (*shape[:-1], 19)
    # the previous path: x widened by torch, result rounded to the same dtype (same bits)
    old = _old_path(x.reshape(-1, 45), t, bias.float()).to(want_dtype).reshape(y.shape)
    assert torch.equal(y, old)
    ref = F.linear(x.double(), t.to_dense().double(), bias.double())
    torch.testing.assert_close(y.double(), ref.to(want_dtype).double(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("vdtype", [torch.float32, torch.bfloat16])
def test_autocast(isa, vdtype):
    """Under CPU autocast an fp32 x is rounded to bf16 and read by the kernel as bf16; the result
    is bf16 as dense gives, the same bits as widening the rounded x first."""
    w = torch.randn(33, 70).to(vdtype)
    t = NMTensor.from_dense(w, 2, 4)
    x = torch.randn(3, 11, 70)
    bias = torch.randn(33)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = nm_linear(x, t, bias)
        dense = F.linear(x, t.to_dense().to(vdtype), bias)
    assert y.dtype == dense.dtype == torch.bfloat16
    R, C = t._rc()
    v16 = t._values.to(torch.bfloat16).contiguous()
    old = _kernel.gather_bf16w(_kernel.mat(v16, t.indices, R, C, t.n, t.m), x.reshape(-1, 70).bfloat16().float(),
                               bias.bfloat16().float())
    assert torch.equal(y, _kernel.to_bf16(old).reshape(3, 11, 33))
    torch.testing.assert_close(y.float(), dense.float(), rtol=2e-2, atol=2e-2)


def test_bad_input_named():
    t = NMTensor.from_dense(torch.randn(8, 16), 2, 4)
    with pytest.raises(ValueError, match="bfloat16"):
        _bf16x.gather_bf16x(t.mat(), torch.randn(3, 16))
    with pytest.raises(ValueError, match="16 columns"):
        _bf16x.gather_bf16x(t.mat(), torch.randn(3, 15).bfloat16())
