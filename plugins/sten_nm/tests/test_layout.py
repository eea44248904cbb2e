"""NMTensor: round trip, mask semantics, memory, stored-values protocol, errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sten_nm import NMSparsifier, NMTensor

from conftest import PATTERNS


def _reference_mask(w: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Kept positions (magnitude, ties to the lower index) along dim 1."""
    R, C = w.shape
    mask = torch.zeros_like(w, dtype=torch.bool)
    for c0 in range(0, C, m):
        blk = w[:, c0:c0 + m].abs().double()
        k = min(n, blk.shape[1])
        # stable: larger magnitude first, then lower index
        key = blk * 4 - torch.arange(blk.shape[1], dtype=torch.float64) * 1e-9
        idx = key.topk(k, dim=1).indices
        mask[:, c0:c0 + m].scatter_(1, idx, True)
    return mask


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(0, 40), cols=st.integers(0, 70), nm=st.sampled_from(PATTERNS),
    dim=st.sampled_from([0, 1]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
)
def test_round_trip(rows, cols, nm, dim, dtype):
    n, m = nm
    w = torch.randn(rows, cols).to(dtype)
    t = NMTensor.from_dense(w, n, m, dim=dim)
    d = t.to_dense()
    assert d.shape == w.shape and d.dtype == dtype and t.shape == w.shape and t.dtype == dtype
    ref_mask = _reference_mask(w.float() if dim == 1 else w.float().t(), n, m)
    ref_mask = ref_mask if dim == 1 else ref_mask.t()
    assert torch.equal(d, torch.where(ref_mask, w, torch.zeros_like(w)))
    assert torch.equal(t.mask(), ref_mask)
    assert t.nnz == int(ref_mask.sum())
    # a second round trip is lossless
    t2 = NMTensor.from_dense(d, n, m, dim=dim)
    assert torch.equal(t2.to_dense(), d)


@pytest.mark.parametrize("n,m", PATTERNS)
def test_group_semantics(n, m):
    w = torch.randn(9, 4 * m + 3)
    d = NMTensor.from_dense(w, n, m).to_dense()
    for c0 in range(0, w.shape[1], m):
        blk = d[:, c0:c0 + m]
        assert int((blk != 0).sum(1).max()) <= n
    dd = NMTensor.from_dense(w, n, m, dim=0).to_dense()
    for r0 in range(0, w.shape[0], m):
        assert int((dd[r0:r0 + m] != 0).sum(0).max()) <= n


@pytest.mark.parametrize("n,m", [(1, 2), (2, 4), (1, 4), (2, 8), (1, 8), (1, 10), (2, 16)])
def test_memory_bound(n, m):
    rows, cols = 96, 960
    t = NMTensor.from_dense(torch.randn(rows, cols), n, m)
    dense = rows * cols * 4
    assert t.nbytes <= 1.15 * n / m * dense + 64 * rows


def test_mask_argument_and_ties():
    w = torch.ones(2, 8)
    t = NMTensor.from_dense(w, 2, 4)
    assert t.to_dense().tolist() == [[1, 1, 0, 0, 1, 1, 0, 0]] * 2
    mask = torch.zeros(2, 8, dtype=torch.bool)
    mask[:, 3] = True
    t = NMTensor.from_dense(w, 2, 4, mask=mask)
    assert t.to_dense().tolist() == [[0, 0, 0, 1, 0, 0, 0, 0]] * 2
    with pytest.raises(ValueError, match="more than n"):
        NMTensor.from_dense(w, 1, 4, mask=torch.ones(2, 8, dtype=torch.bool))


def test_nan_counts_as_largest():
    w = torch.tensor([[1.0, float("nan"), 3.0, 2.0]])
    d = NMTensor.from_dense(w, 1, 4).to_dense()
    assert torch.isnan(d[0, 1]) and int((d != 0).sum()) == 1


def test_stored_values_protocol():
    w = torch.randn(6, 13)
    t = NMTensor.from_dense(w, 2, 4)
    v = t.values()
    assert v.shape == (6, 4 * 2)
    t2 = t.with_values(v * 2)
    assert t2.same_pattern(t) and torch.equal(t2.to_dense(), t.to_dense() * 2)
    assert torch.equal(t.gather(w), v)
    assert not t.same_pattern(NMTensor.from_dense(torch.randn(6, 13), 2, 4))
    other = torch.randn(6, 13)
    assert torch.equal(t.with_values(t.gather(other)).to_dense(), torch.where(t.mask(), other, torch.zeros(())))


def test_sparsifier_mask():
    w = torch.randn(4, 12)
    sp = NMSparsifier(1, 4)
    assert torch.equal(sp.mask(w), NMTensor.from_dense(w, 1, 4).mask())
    assert sp == NMSparsifier(1, 4) and hash(sp) == hash(NMSparsifier(1, 4))


@pytest.mark.parametrize("kwargs,exc,word", [
    (dict(n=4, m=4), ValueError, "n must be < m"),
    (dict(n=5, m=4), ValueError, "n must be < m"),
    (dict(n=1, m=33), ValueError, "m must be <= 32"),
    (dict(n=0, m=4), ValueError, "n must be >= 1"),
    (dict(n=1.0, m=4), TypeError, "n must be an int"),
    (dict(n=1, m=4, dim=2), ValueError, "dim"),
])
def test_bad_pattern(kwargs, exc, word):
    with pytest.raises(exc, match=word):
        NMTensor.from_dense(torch.randn(4, 8), **kwargs)
    if "dim" not in kwargs:
        with pytest.raises(exc, match=word):
            NMSparsifier(kwargs["n"], kwargs["m"])


def test_bad_tensor():
    with pytest.raises(ValueError, match="tensor must be 2-D"):
        NMTensor.from_dense(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="tensor must be 2-D"):
        NMTensor.from_dense(torch.randn(8))
    with pytest.raises(TypeError, match="tensor must be a floating-point"):
        NMTensor.from_dense(torch.ones(4, 8, dtype=torch.int32))
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor"):
        NMTensor.from_dense([[1.0, 2.0]])
