"""The 2:4 metadata encoding against torch's own CUTLASS converters (CPU)."""

from __future__ import annotations

import itertools

import pytest
import torch
try:  # the GPU machine may lack hypothesis: the property test then runs fixed cases
    from hypothesis import given, settings, strategies as st
except ImportError:  # pragma: no cover
    given = None
from torch.sparse._semi_structured_conversions import (
    sparse_semi_structured_from_dense_cutlass as torch_from_dense,
    sparse_semi_structured_to_dense_cutlass as torch_to_dense,
)

from sten_cuda24 import encoding


def all_masks_tensor(dtype: torch.dtype, rows: int = 32) -> torch.Tensor:
    """Every group mask with <= 2 nonzeros (and some with more), tiled over a [rows, 64] tensor."""
    masks = [m for m in itertools.product([0, 1], repeat=4) if sum(m) <= 2]
    k = 64
    groups = torch.tensor([masks[i % len(masks)] for i in range(rows * k // 4)], dtype=torch.bool)
    values = torch.randn(rows * k // 4, 4).abs() + 0.5
    return (values * groups).reshape(rows, k).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_matches_torch_cutlass_encoder(dtype):
    x = all_masks_tensor(dtype, rows=64)
    packed, meta = torch_from_dense(x)
    ours_packed, ours_meta = encoding.to_cutlass(x)
    assert torch.equal(ours_packed, packed)
    assert torch.equal(ours_meta, meta)
    assert torch.equal(torch_to_dense(ours_packed, ours_meta), x)   # torch decodes ours
    assert torch.equal(encoding.from_cutlass(packed, meta), x)      # we decode torch's


def test_fp32_one_of_two_matches_torch():
    x = torch.randn(32, 64)
    keep = torch.zeros(32, 32, 2, dtype=torch.bool).scatter_(-1, torch.randint(0, 2, (32, 32, 1)), True)
    keep &= torch.rand(32, 32, 2) < 0.8
    x = x * keep.reshape(32, 64)
    packed, meta = torch_from_dense(x)
    ours = encoding.fp32_to_cutlass(x)
    assert torch.equal(ours[0], packed) and torch.equal(ours[1], meta)
    with pytest.raises(ValueError, match="1:2"):
        encoding.fp32_to_cutlass(torch.ones(32, 64))


def _roundtrip_cases(fn):
    if given is not None:
        return settings(max_examples=25, deadline=None)(given(rows=st.integers(1, 40), k=st.integers(1, 70), seed=st.integers(0, 2**16))(fn))
    cases = [(1, 1, 0), (1, 70, 1), (40, 1, 2), (40, 70, 3), (7, 13, 4), (32, 64, 5), (3, 17, 6), (16, 33, 7)]
    return pytest.mark.parametrize("rows,k,seed", cases)(fn)


@_roundtrip_cases
def test_compress_roundtrip_any_shape(rows, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    x = x * encoding.row_mask(x)
    values, meta = encoding.compress(x)
    kp = encoding.padded_k(k)
    assert values.shape == (rows, kp // 2) and meta.shape == (rows, kp // 16) and meta.dtype == torch.int16
    assert torch.equal(encoding.decompress(values, meta, k), x)
    assert encoding.keep_mask(meta, k)[x != 0].all()


def test_reorder_is_a_permutation():
    meta = torch.randint(-2**15, 2**15, (64, 6), dtype=torch.int16)
    assert torch.equal(encoding.cutlass_unreorder(encoding.cutlass_reorder(meta)), meta)
    offsets = encoding.cutlass_meta_offsets(64, 6)
    assert torch.equal(offsets.sort().values, torch.arange(64 * 6))
    with pytest.raises(ValueError, match="divisible by 32"):
        encoding.cutlass_meta_offsets(48, 6)


def test_not_24_is_refused_with_position():
    x = torch.zeros(2, 16)
    x[1, 4:7] = 1.0
    with pytest.raises(ValueError, match=r"row 1, columns 4\.\.7 has 3 nonzeros"):
        encoding.compress(x)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int8])
def test_odd_dtypes(dtype):
    with pytest.raises(TypeError, match="float16, bfloat16, float32"):
        encoding.compress(torch.zeros(4, 16, dtype=dtype))


def test_transposable_mask_is_24_both_ways():
    x = torch.randn(37, 29)
    m = encoding.transposable_mask(x)
    for mm in (m, m.t()):
        k = mm.shape[1]
        padded = torch.nn.functional.pad(mm, (0, (-k) % 4))
        assert (padded.reshape(mm.shape[0], -1, 4).sum(-1) <= 2).all()
    # greedy keeps the largest value of every full tile
    tile = x[:4, :4].abs()
    assert m[:4, :4].reshape(-1)[tile.reshape(-1).argmax()]


def test_row_mask_ties_lower_index():
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 2.0]])
    assert encoding.row_mask(x).tolist() == [[True, True, False, False, True, False, False, True]]
