"""The paper format's backward C kernels (``nm_colgrouped_grad_input_f32``,
``nm_colgrouped_grad_values_f32``) against dense, on every ISA this CPU runs, and the
layout's autograd (eager and the compiled path's custom operators) against dense autograd."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_nm import ColumnGroupedNMTensor

from conftest import requires_kernel

pytestmark = requires_kernel

CG_PATTERNS = [(1, 2), (2, 4), (1, 4), (3, 4), (3, 8), (1, 10), (2, 5), (5, 8)]
SPARSE_GRAD = (sten.KeepAll(), ColumnGroupedNMTensor, sten.KeepAll(), ColumnGroupedNMTensor)


@pytest.mark.parametrize("n,m", CG_PATTERNS)
@pytest.mark.parametrize("B", [1, 5, 17, 70, 200])
def test_kernels_every_isa_against_dense(isa, n, m, B):
    from sten_nm import _kernel

    for N, K, g in ((19, 37, None), (40, 200, 2), (3, 11, 1)):
        t = ColumnGroupedNMTensor.from_dense(torch.randn(N, K), n, m, g)
        d = t.to_dense()
        x, gy = torch.randn(B, K), torch.randn(B, N)
        for threads in (1, 3):
            gx = _kernel.colgrouped_grad_input(t.desc(), gy, nthreads=threads)
            torch.testing.assert_close(gx, gy @ d, rtol=1e-4, atol=1e-4)
            gv = _kernel.colgrouped_grad_values(t.desc(), gy, x, nthreads=threads)
            assert gv.shape == t.values().shape
            torch.testing.assert_close(gv, t.gather(gy.t() @ x), rtol=1e-4, atol=1e-4)


def test_kernels_strided_odd_offset_operands_and_block_sizes(isa, monkeypatch):
    """Operands that are views at odd float offsets with row strides > K (unaligned),
    bf16 values, and the smallest blocks (one vector per chunk and per x block)."""
    from sten_nm import _kernel

    t = ColumnGroupedNMTensor.from_dense(torch.randn(21, 45), 2, 4)
    d = t.to_dense()
    xb, gb = torch.randn(33, 51), torch.randn(33, 26)
    x, gy = xb[1:, 3:48], gb[1:, 1:22]
    assert x.data_ptr() % 64 and gy.stride(0) > 21
    v = t.values()
    flat = torch.empty(v.numel() + 1)
    flat[1:] = v.flatten()
    t_odd = t.with_values(flat[1:].view_as(v))
    for env in ({}, {"STEN_NM_CGBWD_BYTES": "1", "STEN_NM_CGBWD_XBYTES": "1"}):
        for k, val in env.items():
            monkeypatch.setenv(k, val)
        for w in (t, t_odd):
            torch.testing.assert_close(_kernel.colgrouped_grad_input(w.desc(), gy), gy @ d, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(_kernel.colgrouped_grad_values(w.desc(), gy, x), t.gather(gy.t() @ x),
                                       rtol=1e-4, atol=1e-4)
    tb = ColumnGroupedNMTensor.from_dense(d.bfloat16(), 2, 4)
    desc = tb.desc()
    assert desc.vtype == 1   # bf16 values, widened in the kernel
    torch.testing.assert_close(_kernel.colgrouped_grad_input(desc, gy), gy @ tb.to_dense().float(),
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(_kernel.colgrouped_grad_values(desc, gy, x), tb.gather(gy.t() @ x).float(),
                               rtol=1e-4, atol=1e-4)


def test_kernels_empty_sizes():
    from sten_nm import _kernel

    for N, K, B in ((0, 8, 3), (8, 0, 3), (8, 12, 0), (0, 0, 0)):
        t = ColumnGroupedNMTensor.from_dense(torch.randn(N, K), 2, 4)
        gy, x = torch.randn(B, N), torch.randn(B, K)
        assert torch.equal(_kernel.colgrouped_grad_input(t.desc(), gy), torch.zeros(B, K))
        assert torch.equal(_kernel.colgrouped_grad_values(t.desc(), gy, x), torch.zeros_like(t.values()))


def test_kernel_rejects_columns_out_of_range():
    from sten_nm import _kernel

    t = ColumnGroupedNMTensor.from_dense(torch.randn(8, 16), 2, 4)
    bad = t.columns.clone()
    bad.view(-1)[3] = 10_000
    desc = _kernel.colgrouped(t.values().contiguous(), bad, t.desc().__dict__["_keep"][2], 8, 16, 2, 4)
    with pytest.raises(RuntimeError, match="rejected"):
        _kernel.colgrouped_grad_input(desc, torch.randn(2, 8))
    with pytest.raises(RuntimeError, match="rejected"):
        _kernel.colgrouped_grad_values(desc, torch.randn(2, 8), torch.randn(2, 16))


@pytest.mark.parametrize("xshape", [(37,), (6, 37), (2, 3, 37), (0, 37), (2, 0, 37)])
@pytest.mark.parametrize("sparse_grad", [True, False])
def test_autograd_against_dense_any_batch_shape(xshape, sparse_grad):
    t = ColumnGroupedNMTensor.from_dense(torch.randn(19, 37), 2, 4)
    W = sten.SparseParameterWrapper(t, grad_fmt=SPARSE_GRAD if sparse_grad else None)
    x = torch.randn(*xshape, requires_grad=True)
    b = torch.randn(19, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # our implementation, no dense fallback
        y = F.linear(x, W, b)
        gy = torch.randn_like(y)
        y.backward(gy)
    xr, wr, br = x.detach().requires_grad_(), t.to_dense().requires_grad_(), b.detach().requires_grad_()
    F.linear(xr, wr, br).backward(gy)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(b.grad, br.grad, rtol=1e-4, atol=1e-4)
    if sparse_grad:
        torch.testing.assert_close(W.grad.wrapped_tensor.to_dense(), wr.grad * t.mask(), rtol=1e-4, atol=1e-4)
    else:
        torch.testing.assert_close(W.grad, wr.grad, rtol=1e-4, atol=1e-4)


def test_backward_runs_the_layout_kernels(monkeypatch):
    """The eager backward and the compiled path's grad custom operators call the new kernels."""
    from sten_nm import _kernel, compiled

    calls = []
    for name in ("colgrouped_grad_input", "colgrouped_grad_values"):
        real = getattr(_kernel, name)
        monkeypatch.setattr(_kernel, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    t = ColumnGroupedNMTensor.from_dense(torch.randn(12, 20), 1, 4)
    W = sten.SparseParameterWrapper(t, grad_fmt=SPARSE_GRAD)
    x = torch.randn(5, 20, requires_grad=True)
    F.linear(x, W).sum().backward()
    assert calls == ["colgrouped_grad_input", "colgrouped_grad_values"]
    calls.clear()
    tensors, consts = compiled.members(t)
    gy = torch.randn(5, 12)
    gx = torch.ops.sten_nm.column_grouped_linear_grad_input(gy, x.detach(), tensors, consts)
    gv = torch.ops.sten_nm.column_grouped_linear_grad_values(gy, x.detach(), tensors, consts)
    assert calls == ["colgrouped_grad_input", "colgrouped_grad_values"]
    torch.testing.assert_close(gx, gy @ t.to_dense(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gv.reshape(t.values().shape), t.gather(gy.t() @ x.detach()), rtol=1e-4, atol=1e-4)
