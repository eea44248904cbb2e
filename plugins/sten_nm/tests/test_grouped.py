"""GroupedNMTensor: layout, kernel and STen integration against the dense reference."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_nm import GroupedNMSparsifier, GroupedNMTensor, NMTensor, grouped_linear

from conftest import PATTERNS, requires_kernel

pytestmark = requires_kernel


@pytest.mark.parametrize("n,m", PATTERNS)
@pytest.mark.parametrize("B", [1, 7, 100, 1024])
def test_grouped_forward(isa, n, m, B):
    w = torch.randn(37, 29 + m)
    for group in (True, False):
        t = GroupedNMTensor.from_dense(w, n, m, group=group)
        d = t.to_dense()
        # every row keeps at most n of every m, and rows of a group share the pattern
        for c0 in range(0, d.shape[1], m):
            assert int((d[:, c0:c0 + m] != 0).sum(1).max()) <= n
        x = torch.randn(B, w.shape[1])
        b = torch.randn(37)
        torch.testing.assert_close(grouped_linear(x, t, b), F.linear(x, d, b), rtol=1e-4, atol=1e-4)


def test_grouped_round_trip_and_protocol():
    w = torch.randn(40, 24)
    t = GroupedNMTensor.from_dense(w, 2, 8)
    assert torch.equal(t.to_nm().to_dense(), t.to_dense())
    v = t.values()
    t2 = t.with_values(v * 3)
    assert t2.same_pattern(t) and torch.equal(t2.to_dense(), 3 * t.to_dense())
    assert torch.equal(t.gather(t.to_dense()), v)
    assert 0 < t.kept_magnitude_ratio(w) <= 1.0 + 1e-6
    # rows sharing a group share their pattern
    mask = t.mask()
    perm = t.perm[:40].long()
    for q in range(2):
        rows = perm[q * 16:(q + 1) * 16]
        rows = rows[rows >= 0]
        assert (mask[rows] == mask[rows[0]]).all()


@pytest.mark.parametrize("sparse_grad", [True, False])
def test_grouped_linear_sten(sparse_grad):
    w = torch.randn(20, 36)
    sp = sten.sparsify(GroupedNMSparsifier(1, 4), w, GroupedNMTensor)
    t = sp.wrapped_tensor
    fmt = (sten.KeepAll(), GroupedNMTensor, sten.KeepAll(), GroupedNMTensor) if sparse_grad else None
    W = sten.SparseParameterWrapper(t, grad_fmt=fmt)
    x = torch.randn(3, 4, 36, requires_grad=True)
    b = torch.randn(20, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = F.linear(x, W, b)
        y.square().sum().backward()
    xr, wr, br = x.detach().requires_grad_(), t.to_dense().requires_grad_(), b.detach().requires_grad_()
    F.linear(xr, wr, br).square().sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(b.grad, br.grad, rtol=1e-4, atol=1e-4)
    if sparse_grad:
        g = W.grad.wrapped_tensor
        assert isinstance(g, GroupedNMTensor) and g.same_pattern(t)
        torch.testing.assert_close(g.to_dense(), wr.grad * t.mask(), rtol=1e-4, atol=1e-4)
    else:
        torch.testing.assert_close(W.grad, wr.grad, rtol=1e-4, atol=1e-4)


def test_grouped_conformance():
    testing = pytest.importorskip("sten_core.testing")
    sp = GroupedNMSparsifier(2, 4)
    testing.check_layout(GroupedNMTensor, sparsifier=sp, dtypes=(torch.float32,))
    testing.check_linear(GroupedNMTensor, sparsifier=sp)


def test_grouped_to_nm_conversion():
    t = GroupedNMTensor.from_dense(torch.randn(18, 20), 1, 2)
    out = sten.convert(sten.SparseTensorWrapper(t), NMTensor).wrapped_tensor
    assert isinstance(out, NMTensor) and torch.equal(out.to_dense(), t.to_dense())


def _random_grouped(N, K, n, m):
    """A grouped n:m tensor with a random row order (the kernels' general case)."""
    t = GroupedNMTensor.from_dense(torch.randn(N, K), n, m, group=False)
    perm = t.perm.clone()
    perm[:N] = perm[:N][torch.randperm(N)]
    return GroupedNMTensor(t.values(), t.indices, perm, t.shape, n, m)


@pytest.mark.parametrize("n,m", PATTERNS)
@pytest.mark.parametrize("blocked", [False, "chunks", True])
def test_grouped_kernels_blocking_and_threads(isa, n, m, blocked, monkeypatch):
    """Forward, weight and input gradients equal the dense reference whatever the chunking
    (slots per chunk, panels per block, batch rows per block) and thread count. ``"chunks"``:
    many slot chunks over blocks of several panels (AVX-512's two-panel pass adding to its
    accumulators from the second chunk on)."""
    from sten_nm import _kernel

    if blocked:  # force many chunks (and, unless "chunks", blocks) on small shapes
        monkeypatch.setenv("STEN_NM_GROUPED_KC", "3")
    if blocked is True:
        monkeypatch.setenv("STEN_NM_GROUPED_PANEL_BYTES", "1")
        monkeypatch.setenv("STEN_NM_GSDDMM_ROWS", "5")
        monkeypatch.setenv("STEN_NM_GTGATHER_ROWS", "1")
    t = _random_grouped(45, 7 * m + 3, n, m)
    d, desc = t.to_dense(), t.desc()
    for B in (1, 7, 13, 50):
        x, gy, b = torch.randn(B, d.shape[1]), torch.randn(B, 45), torch.randn(45)
        for threads in (1, 2, 3):
            y = _kernel.grouped_gather(desc, x, b, nthreads=threads)
            torch.testing.assert_close(y, F.linear(x, d, b), rtol=1e-4, atol=1e-4)
            g = _kernel.grouped_sddmm(desc, gy, x, nthreads=threads)
            torch.testing.assert_close(g, t.gather(gy.t() @ x), rtol=1e-4, atol=1e-4)
            gx = _kernel.grouped_tgather(desc, gy, nthreads=threads)
            torch.testing.assert_close(gx, gy @ d, rtol=1e-4, atol=1e-4)


def test_grouped_kernels_non_contiguous_inputs():
    from sten_nm import _kernel

    t = _random_grouped(33, 40, 2, 4)
    x = torch.randn(40, 20).t()          # [20, 40], column-major
    gy = torch.randn(33, 20).t()
    torch.testing.assert_close(_kernel.grouped_gather(t.desc(), x), F.linear(x, t.to_dense()), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(_kernel.grouped_sddmm(t.desc(), gy, x), t.gather(gy.t() @ x), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(_kernel.grouped_tgather(t.desc(), gy), gy @ t.to_dense(), rtol=1e-4, atol=1e-4)


def test_grouped_rejects_a_bad_row_order():
    t = GroupedNMTensor.from_dense(torch.randn(20, 8), 1, 4)
    perm = t.perm.clone()
    perm[1] = perm[0]                     # a row twice, another never
    with pytest.raises(ValueError, match="perm"):
        GroupedNMTensor(t.values(), t.indices, perm, t.shape, 1, 4)
