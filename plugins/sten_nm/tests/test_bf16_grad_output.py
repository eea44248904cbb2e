"""bf16 grad_output (and x) read by the backward kernels of the n:m layouts (``*_mixed`` in
``csrc/nm_bf16_bwd.h``): widened while the drivers pack or regroup them, so no float32 copy is
made in torch. Widening is exact, so every result has the same bits as the float32 kernel on
the widened operands; also checked against the dense product (values and gradients), on
every ISA, for odd sizes, B = 0 / K = 0 and strided / offset views, and end to end through
autograd with bf16 gradients (bf16 model, CPU autocast)."""

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_nm import ColumnGroupedNMTensor, GroupedNMTensor, NMTensor, _bf16x, _kernel

from conftest import requires_kernel

pytestmark = requires_kernel

SHAPES = [(5, 3), (37, 45), (70, 131), (8, 0), (0, 12)]
PATTERNS = [(1, 2), (2, 4), (1, 10), (3, 32)]


def _exact_desc(t):
    R, C = t._rc()
    return _kernel.mat(t._values.contiguous(), t.indices, R, C, t.n, t.m)


def _grouped_desc(g):
    N, K = g.shape
    return _kernel.grouped(g._vals.contiguous(), g.indices, g.perm, N, K, g.n, g.m)


def _operands(B, N, K, y16, x16):
    gy, x = torch.randn(B, N), torch.randn(B, K)
    return (gy.bfloat16() if y16 else gy), (x.bfloat16() if x16 else x)


@pytest.mark.parametrize("vdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,m", PATTERNS)
@pytest.mark.parametrize("B", [0, 1, 17, 70])
def test_exact(isa, vdtype, n, m, B):
    for N, K in SHAPES:
        t = NMTensor.from_dense(torch.randn(N, K).to(vdtype), n, m)
        d, f = _exact_desc(t), t.fp32().mat()
        D = t.to_dense().double()
        for y16, x16 in ((1, 0), (0, 1), (1, 1), (0, 0)):
            gy, x = _operands(B, N, K, y16, x16)
            gx = _bf16x.tgather_mixed(d, gy)
            assert torch.equal(gx, _kernel.tgather(f, gy.float()))
            torch.testing.assert_close(gx, (gy.double() @ D).float(), rtol=1e-5, atol=1e-5)
            gv = _bf16x.sddmm_mixed(d, gy, x)
            assert torch.equal(gv, _kernel.sddmm(f, gy.float(), x.float()))
            full = gy.double().t() @ x.double()
            torch.testing.assert_close(t.with_values(gv).to_dense().double(), full * t.mask(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,m", PATTERNS)
@pytest.mark.parametrize("B", [0, 1, 17, 70])
def test_grouped(isa, vdtype, n, m, B):
    for N, K in SHAPES:
        g = GroupedNMTensor.from_dense(torch.randn(N, K).to(vdtype), n, m)
        d, f = _grouped_desc(g), g.desc()
        D = g.to_dense().double()
        for y16, x16 in ((1, 0), (0, 1), (1, 1), (0, 0)):
            gy, x = _operands(B, N, K, y16, x16)
            gx = _bf16x.grouped_tgather_mixed(d, gy)
            assert torch.equal(gx, _kernel.grouped_tgather(f, gy.float()))
            torch.testing.assert_close(gx, (gy.double() @ D).float(), rtol=1e-5, atol=1e-5)
            gv = _bf16x.grouped_sddmm_mixed(d, gy, x)
            assert torch.equal(gv, _kernel.grouped_sddmm(f, gy.float(), x.float()))
            full = gy.double().t() @ x.double()
            got = g.with_values(gv.to(g.dtype) if vdtype == torch.float32 else gv).to_dense().double()
            torch.testing.assert_close(got, full * (D != 0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,m", [(1, 2), (2, 4), (1, 4)])
@pytest.mark.parametrize("B", [0, 1, 17, 70])
def test_column_grouped(isa, vdtype, n, m, B):
    for N, K in ((8, 24), (16, 45), (40, 130)):
        t = ColumnGroupedNMTensor.from_dense(torch.randn(N, K).to(vdtype), n, m)
        d = t.desc()
        D = t.to_dense().double()
        for y16, x16 in ((1, 0), (0, 1), (1, 1), (0, 0)):
            gy, x = _operands(B, N, K, y16, x16)
            gx = _bf16x.colgrouped_grad_input_mixed(d, gy)
            assert torch.equal(gx, _kernel.colgrouped_grad_input(d, gy.float()))
            torch.testing.assert_close(gx, (gy.double() @ D).float(), rtol=1e-5, atol=1e-5)
            gv = _bf16x.colgrouped_grad_values_mixed(d, gy, x)
            assert torch.equal(gv, _kernel.colgrouped_grad_values(d, gy.float(), x.float()))
            full = gy.double().t() @ x.double()
            got = t.with_values(gv.to(t.dtype)).to_dense().double()
            torch.testing.assert_close(got, full * (D != 0), rtol=2e-2 if vdtype == torch.bfloat16 else 1e-5,
                                       atol=2e-2 if vdtype == torch.bfloat16 else 1e-5)


def _views(width):
    """bf16 [*, width] operands: odd 2-byte offset with a row stride, every other row, and a
    column-strided view (copied before the kernel)."""
    big = torch.randn(41, width + 9).bfloat16()
    return [big[:, 1:width + 1], big[3:40:2, 5:width + 5], torch.randn(width, 41).bfloat16().t()]


def test_odd_offset_and_strided_views(isa):
    N, K = 32, 67
    f = NMTensor.from_dense(torch.randn(N, K), 2, 4).fp32().mat()
    g = GroupedNMTensor.from_dense(torch.randn(N, K), 2, 4).desc()
    c = ColumnGroupedNMTensor.from_dense(torch.randn(N, K), 2, 4).desc()
    for gy, x in zip(_views(N), _views(K)):
        B = min(gy.shape[0], x.shape[0])
        gy, x = gy[:B], x[:B]
        gyf, xf = gy.float(), x.float()
        assert torch.equal(_bf16x.tgather_mixed(f, gy), _kernel.tgather(f, gyf))
        assert torch.equal(_bf16x.sddmm_mixed(f, gy, x), _kernel.sddmm(f, gyf, xf))
        assert torch.equal(_bf16x.grouped_tgather_mixed(g, gy), _kernel.grouped_tgather(g, gyf))
        assert torch.equal(_bf16x.grouped_sddmm_mixed(g, gy, x), _kernel.grouped_sddmm(g, gyf, xf))
        assert torch.equal(_bf16x.colgrouped_grad_input_mixed(c, gy), _kernel.colgrouped_grad_input(c, gyf))
        assert torch.equal(_bf16x.colgrouped_grad_values_mixed(c, gy, x), _kernel.colgrouped_grad_values(c, gyf, xf))


@pytest.mark.parametrize("layout", ["exact", "grouped", "column_grouped"])
@pytest.mark.parametrize("mode", ["bf16_model", "autocast"])
def test_autograd_bf16_grad_output(monkeypatch, layout, mode):
    """A bf16 backward (bf16 model, or fp32 model under CPU autocast: grad_output is bf16) runs
    the kernels on bf16 gy without widening it in torch, and matches dense."""
    make = {"exact": lambda w: NMTensor.from_dense(w, 2, 4),
            "grouped": lambda w: GroupedNMTensor.from_dense(w, 2, 4),
            "column_grouped": lambda w: ColumnGroupedNMTensor.from_dense(w, 2, 4)}[layout]
    vdtype = torch.bfloat16 if mode == "bf16_model" else torch.float32
    t = make(torch.randn(48, 64).to(vdtype))
    x = torch.randn(3, 7, 64).to(vdtype).requires_grad_()
    W = sten.SparseParameterWrapper(t)
    xr = x.detach().clone().requires_grad_()
    wr = t.to_dense().detach().clone().requires_grad_()
    seen = []
    rowmajor = _kernel._rowmajor

    def no_widen(u):
        seen.append(u.dtype)
        return rowmajor(u)

    monkeypatch.setattr(_kernel, "_rowmajor", no_widen)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
        y = F.linear(x, W)
        yr = F.linear(xr, wr)
    gy = torch.randn(y.shape).to(y.dtype)
    y.backward(gy)
    yr.backward(gy)
    assert torch.bfloat16 not in seen   # gy, x: no bf16 operand widened in torch for a kernel
    assert y.dtype == yr.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad.float(), xr.grad.float(), rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(W.grad.float(), wr.grad.float(), rtol=3e-2, atol=3e-2)
