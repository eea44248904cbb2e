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
