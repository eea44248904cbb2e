"""bf16 weights in exact n:m's forward (``nm_gather_bf16w``): stored bf16, widened per block
of rows in the kernel, fp32 accumulation; against dense on every ISA, odd sizes, views at
odd offsets, and through F.linear / CPU autocast (bf16 result as dense), with no float32
copy of the weight made."""

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_nm import NMTensor, _kernel, nm_linear

from conftest import requires_kernel

pytestmark = requires_kernel


def _bf16_mat(t: NMTensor):
    R, C = t._rc()
    return _kernel.mat(t.values(), t.indices, R, C, t.n, t.m)


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (3, 6), (2, 8), (1, 10), (3, 32)])
@pytest.mark.parametrize("B", [1, 7, 64, 130])
def test_bf16_gather_every_isa(isa, n, m, B):
    for N, K in ((19, 37), (70, 200), (33, 5)):   # more than one block of 32 rows; K < m
        t = NMTensor.from_dense(torch.randn(N, K).bfloat16(), n, m)
        assert t.values().dtype == torch.bfloat16
        x, b = torch.randn(B, K), torch.randn(N)
        ref = F.linear(x, t.to_dense().float(), b)   # fp32 product of the exact bf16 values
        torch.testing.assert_close(_kernel.gather_bf16w(_bf16_mat(t), x, b), ref, rtol=1e-5, atol=1e-4)
        for threads in (1, 3):
            torch.testing.assert_close(_kernel.gather_bf16w(_bf16_mat(t), x, nthreads=threads),
                                       F.linear(x, t.to_dense().float()), rtol=1e-5, atol=1e-4)


def test_bf16_gather_views_at_odd_offsets_and_empty(isa):
    t = NMTensor.from_dense(torch.randn(45, 61).bfloat16(), 2, 4)
    v = t.values()
    flat = torch.empty(v.numel() + 1, dtype=torch.bfloat16)
    flat[1:] = v.flatten()
    t_odd = t.with_values(flat[1:].view_as(v))
    assert t_odd.values().data_ptr() % 4 == 2
    xb = torch.randn(10, 64)
    x = xb[1:, 2:63]                               # a view: odd offset, row stride 64
    ref = F.linear(x, t.to_dense().float())
    torch.testing.assert_close(_kernel.gather_bf16w(_bf16_mat(t_odd), x), ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(nm_linear(x, t_odd), ref, rtol=1e-5, atol=1e-4)
    for N, K, B in ((0, 8, 3), (8, 0, 3), (8, 12, 0)):
        e = NMTensor.from_dense(torch.randn(N, K).bfloat16(), 2, 4)
        b = torch.randn(N)
        y = _kernel.gather_bf16w(_bf16_mat(e), torch.randn(B, K), b)
        assert torch.equal(y, b.expand(B, N))


def test_bf16_gather_rejects_float_values():
    t = NMTensor.from_dense(torch.randn(8, 16), 2, 4)
    with pytest.raises(ValueError, match="bfloat16"):
        _kernel.gather_bf16w(t.mat(), torch.randn(2, 16))


def test_bf16_weight_through_f_linear_no_fp32_copy():
    """fp32 input, bf16 weight: fp32 result (as dense); bf16 input: bf16 result; the forward
    keeps no float32 copy of the weight."""
    t = NMTensor.from_dense(torch.randn(48, 64).bfloat16(), 2, 4)
    x = torch.randn(5, 64)
    y = F.linear(x, sten.SparseTensorWrapper(t))
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, x @ t.to_dense().float().t(), rtol=1e-5, atol=1e-4)
    yb = nm_linear(x.bfloat16(), t)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), x.bfloat16().float() @ t.to_dense().float().t(), rtol=1e-2, atol=1e-2)
    assert getattr(t, "_fp32_cache", None) is None


def test_autocast_gives_bf16_like_dense_and_reads_a_bf16_copy():
    w = torch.randn(40, 72)
    t = NMTensor.from_dense(w, 1, 4)
    x = torch.randn(6, 72)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = F.linear(x, sten.SparseTensorWrapper(t))
        yd = F.linear(x, t.to_dense())
    assert y.dtype == yd.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), yd.float(), rtol=2e-2, atol=2e-2)
    assert t._bf16_cache[1].dtype == torch.bfloat16 and getattr(t, "_fp32_cache", None) is None


def test_bf16_values_in_place_update_seen():
    t = NMTensor.from_dense(torch.randn(16, 32).bfloat16(), 1, 4)
    x = torch.randn(3, 32)
    nm_linear(x, t)
    t.values().mul_(2)
    torch.testing.assert_close(nm_linear(x, t), x @ t.to_dense().float().t(), rtol=1e-5, atol=1e-4)


def test_bf16_training_step_against_dense():
    """The backward of a bf16 weight (through the float32 kernels, a cached float32 copy)."""
    t = NMTensor.from_dense(torch.randn(24, 40).bfloat16(), 2, 4)
    fmt = (sten.KeepAll(), NMTensor, sten.KeepAll(), NMTensor)
    W = sten.SparseParameterWrapper(t, grad_fmt=fmt)
    x = torch.randn(7, 40, requires_grad=True)
    y = F.linear(x, W)
    gy = torch.randn_like(y)
    y.backward(gy)
    xr, wr = x.detach().double().requires_grad_(), t.to_dense().double().requires_grad_()
    F.linear(xr, wr).backward(gy.double())
    torch.testing.assert_close(y.double(), F.linear(xr, wr).detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(W.grad.wrapped_tensor.to_dense().double(), wr.grad * t.mask(), rtol=3e-2, atol=3e-2)


def test_to_bf16_same_bits_as_torch_every_isa(isa):
    x = torch.randn(1000, 37) * torch.logspace(-44, 38, 37)   # denormals to near overflow
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.4e38, -3.4e38, 1e-45,
                            1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -9])   # ties to even
    for t in (x, special, torch.empty(0), x[:, 1:]):
        y = _kernel.to_bf16(t, nthreads=3)
        ref = t.to(torch.bfloat16)
        assert y.shape == t.shape and y.dtype == torch.bfloat16
        nan = ref.isnan()   # torch's NaN bits depend on its path (0x7fc0 or 0xffff): any NaN
        assert torch.equal(y.isnan(), nan)
        assert torch.equal(y[~nan].view(torch.int16), ref[~nan].view(torch.int16))


# -- GroupedNMTensor (16 rows share a pattern) ------------------------------------------
def _grouped_bf16_desc(g):
    N, K = g.shape
    return _kernel.grouped(g._vals, g.indices, g.perm, N, K, g.n, g.m)


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (3, 6), (1, 10), (3, 32)])
@pytest.mark.parametrize("B", [1, 7, 13, 64, 130])   # 13: 3 micro-panels (the kernel pairs them)
@pytest.mark.parametrize("in_registers", [False, True])
def test_grouped_bf16_gather_every_isa(isa, n, m, B, in_registers, monkeypatch):
    """Both bf16 kernels on every ISA: widening in registers (AVX-512's default, forced by
    STEN_NM_BF16_IN_REGISTERS elsewhere) and per group into a buffer (AVX2's, portable's)."""
    from sten_nm import GroupedNMTensor

    if in_registers:
        monkeypatch.setenv("STEN_NM_BF16_IN_REGISTERS", "1")

    for N, K, kc in ((19, 37, None), (70, 200, None), (40, 130, "8")):   # kc: several chunks of slots
        if kc:
            monkeypatch.setenv("STEN_NM_GROUPED_KC", kc)
        g = GroupedNMTensor.from_dense(torch.randn(N, K).bfloat16(), n, m)
        assert g._vals.dtype == torch.bfloat16
        x, b = torch.randn(B, K), torch.randn(N)
        ref = F.linear(x, g.to_dense().float(), b)
        for threads in (1, 2, 3):
            torch.testing.assert_close(_kernel.grouped_gather_bf16w(_grouped_bf16_desc(g), x, b, nthreads=threads),
                                       ref, rtol=1e-5, atol=1e-4)
        monkeypatch.delenv("STEN_NM_GROUPED_KC", raising=False)


def test_grouped_bf16_through_f_linear_autocast_and_odd_offsets():
    from sten_nm import GroupedNMTensor, grouped_linear

    g = GroupedNMTensor.from_dense(torch.randn(48, 64).bfloat16(), 2, 4)
    xb = torch.randn(9, 70)
    x = xb[1:, 3:67]
    y = F.linear(x, sten.SparseTensorWrapper(g))
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, x @ g.to_dense().float().t(), rtol=1e-5, atol=1e-4)
    assert getattr(g, "_fp32_cache", None) is None      # read as bf16 in the kernel
    v = g._vals
    flat = torch.empty(v.numel() + 1, dtype=torch.bfloat16)
    flat[1:] = v.flatten()
    g_odd = g.with_values(flat[1:].view_as(v))
    torch.testing.assert_close(grouped_linear(x, g_odd), x @ g.to_dense().float().t(), rtol=1e-5, atol=1e-4)
    w32 = GroupedNMTensor.from_dense(torch.randn(40, 72), 1, 4)
    xa = torch.randn(6, 72)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ya = F.linear(xa, sten.SparseTensorWrapper(w32))
        yd = F.linear(xa, w32.to_dense())
    assert ya.dtype == yd.dtype == torch.bfloat16
    torch.testing.assert_close(ya.float(), yd.float(), rtol=2e-2, atol=2e-2)
    assert getattr(w32, "_fp32_cache", None) is None


def test_grouped_bf16_rejects_float_values():
    from sten_nm import GroupedNMTensor

    g = GroupedNMTensor.from_dense(torch.randn(8, 16), 2, 4)
    with pytest.raises(ValueError, match="bfloat16"):
        _kernel.grouped_gather_bf16w(g.desc(), torch.randn(2, 16))
