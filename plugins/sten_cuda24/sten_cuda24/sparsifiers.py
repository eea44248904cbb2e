"""Sparsifiers into the plugin's layouts, with the fast kernels on CUDA.

- ``Sparse24Sparsifier(transposable=False)``: 2:4 magnitude pruning along the
  last dim (two largest |x| of every 4, ties to the lower index).
  ``transposable=True`` picks a mask that is 2:4 along both dims (4x4-tile
  greedy) and records the transposed pair, so the backward pass can use the
  sparse kernel for the input gradient.
- ``PerBlockFractionSparsifier(n, 4)`` with ``n <= 2`` → ``Sparse24Tensor``.
- ``BlockwiseFractionSparsifier(fraction, (bh, bw))`` → ``BlockSparseTensor``.

Kernels: CUDA tensors use the Triton kernel (row masks; falls back to the nvcc
library) or the nvcc/ctypes library (transposable masks); CPU tensors use the
same algorithm in torch ops.

Example:
    >>> import torch
    >>> s = sparsify_24(torch.tensor([[1., -4., 2., 3.]]))
    >>> s.to_dense()
    tensor([[ 0., -4.,  0.,  3.]])
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from sten_core.plugin_api import check_tensor, wrap_layout

from . import _compat, encoding
from .blocksparse import BlockSparseTensor
from .sparse24 import Sparse24Tensor

from sten_core.plugin_api import BLOCKING, Sparsifier, block_keep_mask, nm_keep_mask


class Sparse24Sparsifier(Sparsifier):
    """2:4 magnitude pruning along the last dim (``transposable``: along both dims)."""

    kind: ClassVar[str] = BLOCKING

    def __init__(self, transposable: bool = False) -> None:
        if not isinstance(transposable, bool):
            raise TypeError(f"transposable must be a bool, got {type(transposable).__name__}")
        self.transposable = transposable

    def mask(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.transposable:
            return encoding.transposable_mask(tensor)
        return encoding.row_mask(tensor)


def _gpu_kernel_ok(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" or (_compat.triton_runs_on(x) and _compat.has_triton())


def sparsify_24(dense: torch.Tensor, transposable: bool = False, activation: str | None = None) -> Sparse24Tensor:
    """Prune ``dense`` to 2:4 and compress it in one pass (the kernel on CUDA)."""
    check_tensor(dense, "dense", where="sparsify_24")
    encoding.check_dtype(dense.dtype)
    dense = dense.detach()
    if transposable:
        if dense.dim() != 2:
            raise ValueError(f"a transposable 2:4 mask needs a 2-D tensor, got {dense.dim()}-D")
        if activation is not None:
            raise ValueError("activation fusion is only offered for row-wise 2:4 (transposable=False)")
        if dense.device.type == "cuda" and _compat.nvcc_path() is not None:
            from .cuda_lib import sparsify24_cuda

            packed, meta, _, meta_t, _ = sparsify24_cuda(dense, transposable=True)
            return Sparse24Tensor.from_pair(packed, meta, dense.shape, meta_t)
        return Sparse24Tensor.from_dense_masked(dense, encoding.transposable_mask(dense), transposable=True)
    if _gpu_kernel_ok(dense) and _compat.has_triton():
        from .triton_sparsify24 import sparsify24

        packed, meta, _ = sparsify24(dense, activation=activation)
        return Sparse24Tensor(packed, meta, dense.shape)
    if dense.device.type == "cuda" and dense.dim() == 2 and activation is None and _compat.nvcc_path() is not None:
        from .cuda_lib import sparsify24_cuda

        packed, meta, _, _, _ = sparsify24_cuda(dense)
        return Sparse24Tensor(packed, meta, dense.shape)
    from .triton_sparsify24 import reference_sparsify24

    return Sparse24Tensor.from_dense(reference_sparsify24(dense, activation))


def sparse24_impl(sparsifier: Sparse24Sparsifier, tensor: torch.Tensor, grad_fmt: Any = None) -> Any:
    """``Sparse24Sparsifier``: dense → ``Sparse24Tensor``."""
    return wrap_layout(sparsify_24(_dense(tensor), transposable=sparsifier.transposable), grad_fmt)


def per_block_impl(sparsifier: Any, tensor: torch.Tensor, grad_fmt: Any = None) -> Any:
    """``PerBlockFractionSparsifier(n, 4)`` with ``n <= 2``: dense → ``Sparse24Tensor``."""
    n, m = sparsifier.n, sparsifier.m
    if m != 4 or n > 2:
        raise ValueError(f"Sparse24Tensor stores n:m with m == 4 and n <= 2 (2:4 and sparser); got {n}:{m}")
    dense = _dense(tensor)
    if n == 2:
        return wrap_layout(sparsify_24(dense), grad_fmt)
    return wrap_layout(Sparse24Tensor.from_dense_masked(dense, nm_keep_mask(dense, n, m).to(torch.bool)), grad_fmt)


def blockwise_impl(sparsifier: Any, tensor: torch.Tensor, grad_fmt: Any = None) -> Any:
    """``BlockwiseFractionSparsifier(fraction, (bh, bw))``: dense → ``BlockSparseTensor``."""
    shape = tuple(sparsifier.block_shape)
    if len(shape) != 2:
        raise ValueError(f"BlockSparseTensor needs a 2-D block_shape (bh, bw), got {shape}")
    dense = _dense(tensor)
    if dense.dim() != 2:
        raise ValueError(f"BlockSparseTensor is 2-D; got a {dense.dim()}-D tensor")
    bh, bw = shape
    mask = block_keep_mask(dense, sparsifier.fraction, shape)
    block_mask = mask[::bh, ::bw]
    return wrap_layout(BlockSparseTensor.from_dense_block_mask(dense, block_mask, shape), grad_fmt)


def _dense(tensor: Any) -> torch.Tensor:
    layout = getattr(tensor, "wrapped_tensor", None)
    if layout is not None:
        return layout.to_dense()
    return tensor.detach()
