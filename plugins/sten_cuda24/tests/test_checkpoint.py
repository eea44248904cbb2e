"""Checkpoints of the CPU-side layouts: ``torch.save(model.state_dict())`` then the
default ``torch.load`` (``weights_only=True``), into a fresh sparse model and a dense one."""

import pytest
import torch

import sten_core as sten
from sten_core.testing import check_checkpoint
from sten_cuda24 import BlockSparseTensor, Sparse24Tensor, sparsify_24


def test_sparse24_checkpoint():
    check_checkpoint(Sparse24Tensor, sparsifier=sten.PerBlockFractionSparsifier(2, 4),
                     dtypes=(torch.float32, torch.float16, torch.bfloat16))


def test_sparse24_transposable_checkpoint():
    check_checkpoint(Sparse24Tensor, shapes=((16, 32), (24, 36)), make=lambda d: sparsify_24(d, transposable=True))


def test_block_sparse_checkpoint():
    check_checkpoint(BlockSparseTensor, shapes=((16, 32), (7, 9)), sparsifier=sten.BlockwiseFractionSparsifier(0.5, (4, 4)),
                     dtypes=(torch.float32, torch.float16), make=lambda d: BlockSparseTensor.from_dense(d, block_shape=(4, 4)))


@pytest.mark.parametrize("part, damage, message", [
    (0, lambda crow: crow.flip(0), "crow must rise from 0"),
    (1, lambda col: col + 100, "col must be block columns in"),
    (1, lambda col: col - 100, "col must be block columns in"),
])
def test_block_sparse_damaged_indices_fail_on_load(part, damage, message):
    dense = torch.randn(16, 32) * (torch.rand(4, 8).repeat_interleave(4, 0).repeat_interleave(4, 1) > 0.5)
    parts = list(BlockSparseTensor.from_dense(dense, block_shape=(4, 4)).state_tensors())
    assert BlockSparseTensor.from_state_tensors(tuple(parts), (16, 32)).to_dense().equal(dense)
    parts[part] = damage(parts[part])
    with pytest.raises(ValueError, match=message):
        BlockSparseTensor.from_state_tensors(tuple(parts), (16, 32))


@pytest.mark.parametrize("transposable", [False, True])
def test_sparse24_damaged_metadata_fails_on_load(transposable):
    """Zeroed metadata (code 0 names position 0 twice) loaded without a word; ``to_dense`` then kept 16
    of the 32 stored values while ``nnz`` said 32."""
    torch.manual_seed(0)
    layout = sparsify_24(torch.randn(8, 32), transposable=transposable)
    parts = list(layout.state_tensors())
    assert Sparse24Tensor.from_state_tensors(tuple(parts), (8, 32)).to_dense().equal(layout.to_dense())
    damaged = 1 if not transposable else 2
    parts[damaged] = torch.zeros_like(parts[damaged])
    with pytest.raises(ValueError, match=r"(meta|meta_t): group 0 of row 0 names positions 0 and 0"):
        Sparse24Tensor.from_state_tensors(tuple(parts), (8, 32))


def test_a_24_checkpoint_into_a_block_model_keeps_blocks_or_says_why():
    """The registered 2:4 -> block conversion uses 64x64 blocks: loading a 2:4 checkpoint into a model of
    4x4 blocks made the weight one padded block, dense, with no word."""
    torch.manual_seed(0)
    saved = torch.nn.Linear(16, 8, bias=False)
    saved.weight = sten.SparseParameterWrapper(sparsify_24(saved.weight.detach()))
    model = torch.nn.Linear(16, 8, bias=False)
    model.weight = sten.SparseParameterWrapper(BlockSparseTensor.from_dense(
        model.weight.detach() * (torch.rand(2, 4) > 0.5).repeat_interleave(4, 0).repeat_interleave(4, 1), (4, 4)))
    with pytest.raises(RuntimeError, match=r"BlockSparseTensor.*cannot hold the new value exactly"):
        model.load_state_dict(saved.state_dict())
    full = torch.nn.Linear(16, 8, bias=False)   # a model storing every position takes it (stores no more)
    full.weight = sten.SparseParameterWrapper(BlockSparseTensor.from_dense(torch.ones(8, 16), (4, 4)))
    full.load_state_dict(saved.state_dict())
    assert torch.equal(full.weight.to_dense(), saved.weight.to_dense()) and full.weight.wrapped_tensor.nnz <= 128
