"""Sparse24Tensor and BlockSparseTensor on CPU: storage, values protocol, conversions."""

from __future__ import annotations

import pickle

import pytest
import torch

from sten_cuda24 import BlockSparseTensor, Sparse24Tensor, encoding, sparsify_24


def pruned(*shape: int, dtype=torch.float32) -> torch.Tensor:
    x = torch.randn(*shape).to(dtype)
    return x * encoding.row_mask(x)


@pytest.mark.parametrize("shape", [(8, 16), (5, 13), (2, 3, 20), (1, 4)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_sparse24_roundtrip(shape, dtype):
    x = pruned(*shape, dtype=dtype)
    s = Sparse24Tensor.from_dense(x)
    assert s.shape == x.shape and s.dtype == dtype and s.device == x.device
    assert torch.equal(s.to_dense(), x)
    assert s.mask()[x != 0].all()
    k = shape[-1]
    assert s.nnz == x.numel() // k * (2 * (k // 4) + min(2, k % 4))


def test_sparse24_values_protocol():
    x = pruned(8, 32)
    s = Sparse24Tensor.from_dense(x)
    v = s.values()
    s2 = s.with_values(v * 2)
    assert torch.equal(s2.to_dense(), 2 * x) and s2.same_pattern(s)
    dense = torch.randn(8, 32)
    assert torch.equal(s.with_values(s.gather(dense)).to_dense(), dense * s.mask())
    assert not s.same_pattern(Sparse24Tensor.from_dense(pruned(8, 32)))
    with pytest.raises(ValueError, match="values must have shape"):
        s.with_values(v[:, :2])


def test_sparse24_masked_keeps_zero_positions():
    x = torch.tensor([[0.0, 5.0, 0.0, 0.0] * 4])
    mask = torch.tensor([[True, True, False, False] * 4])
    s = Sparse24Tensor.from_dense_masked(x, mask)
    assert torch.equal(s.mask(), mask)   # the kept zero at column 0 stays kept
    assert torch.equal(s.to_dense(), x)


def test_sparse24_transposable_pair():
    s = sparsify_24(torch.randn(24, 36), transposable=True)
    assert s.transposable
    t = s.transposed()
    assert torch.equal(t.to_dense(), s.to_dense().t())
    assert torch.equal(t.transposed().to_dense(), s.to_dense())


def test_sparse24_errors():
    with pytest.raises(ValueError, match="not 2:4"):
        Sparse24Tensor.from_dense(torch.ones(4, 8))
    with pytest.raises(TypeError, match="float16, bfloat16, float32"):
        Sparse24Tensor.from_dense(torch.zeros(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="2-D"):
        Sparse24Tensor.from_dense(pruned(2, 4, 8), transposable=True)
    with pytest.raises(TypeError, match="torch.Tensor"):
        Sparse24Tensor.from_dense([[1.0]])
    rows_only = torch.zeros(3, 7)   # 2:4 along every row; column 5 holds 3 nonzeros (it said "row 5")
    rows_only[torch.arange(3), torch.arange(3)] = 1.0
    rows_only[:, 5] = 1.0
    with pytest.raises(ValueError, match=r"group of 4 at column 5, rows 0\.\.3 \(transposable=True needs 2:4 along "
                                         r"the columns too\) has 3 nonzeros"):
        Sparse24Tensor.from_dense(rows_only, transposable=True)


def test_sparse24_pickles():
    s = Sparse24Tensor.from_dense(pruned(4, 16))
    assert torch.equal(pickle.loads(pickle.dumps(s)).to_dense(), s.to_dense())
    t = sparsify_24(torch.randn(12, 16), transposable=True)
    t.transposed()                                       # fills the cache
    back = pickle.loads(pickle.dumps(t))
    assert back._cache == {} and torch.equal(back.mask(), t.mask()) and back.same_pattern(t)


@pytest.mark.parametrize("shape,block", [((64, 64), (16, 16)), ((40, 50), (16, 32)), ((7, 9), (4, 4))])
def test_block_roundtrip(shape, block):
    keep = torch.rand(-(-shape[0] // block[0]), -(-shape[1] // block[1])) < 0.5
    x = torch.randn(*shape)
    b = BlockSparseTensor.from_dense_block_mask(x, keep, block)
    expect = x * keep.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: shape[0], : shape[1]]
    assert torch.equal(b.to_dense(), expect)
    assert b.num_blocks == int(keep.sum()) and b.block_shape == block
    assert torch.equal(b.block_mask(), keep)
    assert torch.equal(b.transposed().to_dense(), expect.t())
    assert torch.equal(BlockSparseTensor.from_dense(expect, block).to_dense(), expect)
    dense = torch.randn(*shape)
    assert torch.equal(b.with_values(b.gather(dense)).to_dense(), dense * (expect != 0) + 0 * expect)
    assert b.same_pattern(b.with_values(b.values() + 1))


def test_block_errors():
    with pytest.raises(ValueError, match="2-D"):
        BlockSparseTensor.from_dense(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="block_shape"):
        BlockSparseTensor.from_dense(torch.zeros(4, 4), (0, 4))
    with pytest.raises(TypeError, match="supports"):
        BlockSparseTensor.from_dense(torch.zeros(4, 4, dtype=torch.int32))


def test_block_to_torch_bsr():
    b = BlockSparseTensor.from_dense(torch.block_diag(torch.ones(16, 16), torch.zeros(16, 16), torch.ones(16, 16)), 16)
    assert torch.equal(b.to_torch_bsr().to_dense(), b.to_dense())


def test_nm_conversion_keeps_mask():
    nm_mod = pytest.importorskip("sten_nm", reason="sten_nm is not installed")
    from sten_cuda24.conversions import nm_to_24, s24_to_nm

    w = torch.randn(6, 22)
    w[0, :4] = 0.0   # a kept zero must stay kept
    nm = nm_mod.NMTensor.from_dense(w, n=2, m=4)
    s = nm_to_24(nm)
    assert torch.equal(s.mask(), nm.mask()) and torch.equal(s.to_dense(), nm.to_dense())
    back = s24_to_nm(s)
    assert torch.equal(back.mask(), nm.mask()) and torch.equal(back.to_dense(), nm.to_dense())
    with pytest.raises(ValueError, match="n:4 with n <= 2"):
        nm_to_24(nm_mod.NMTensor.from_dense(w, n=2, m=8))


@pytest.mark.parametrize("keep, n", [(1, 1), (2, 2)])
def test_an_n_of_4_weight_converts_to_n_of_4_nm(keep, n):
    """A 1:4 ``Sparse24Tensor`` became a 2:4 ``NMTensor``: every group gained a stored filler, which
    training then filled in (nnz 32 -> 64)."""
    nm_mod = pytest.importorskip("sten_nm")
    import sten_core as sten
    from sten_cuda24.conversions import s24_to_nm

    torch.manual_seed(0)
    s = sten.sparsify(sten.PerBlockFractionSparsifier(keep, 4), torch.randn(8, 20), Sparse24Tensor).wrapped_tensor
    nm = s24_to_nm(s)
    assert isinstance(nm, nm_mod.NMTensor) and (nm.n, nm.m) == (n, 4)
    assert torch.equal(nm.mask(), s.mask()) and torch.equal(nm.to_dense(), s.to_dense()) and nm.nnz == s.nnz


def test_block_sparse_nnz_counts_positions_inside_the_shape():
    """A 10x12 weight in 8x8 blocks reported nnz 128 (its padded blocks), more than its 120 elements."""
    full = BlockSparseTensor.from_dense(torch.randn(10, 12), block_shape=(8, 8))
    assert full.nnz == 120 and full.num_blocks == 4
    corner = torch.zeros(10, 12)
    corner[9, 11] = 1.0
    assert BlockSparseTensor.from_dense(corner, block_shape=(8, 8)).nnz == 2 * 4
    assert BlockSparseTensor.from_dense(torch.ones(16, 16), block_shape=(8, 8)).nnz == 256
    assert full.to("meta").nnz == 4 * 64  # no index values to read: padded blocks
