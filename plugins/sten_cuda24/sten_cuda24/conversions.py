"""Conversions between the plugin's layouts, the core's layouts and ``sten_nm``.

All are lossless. A 2:4 weight moves between ``sten_nm.NMTensor`` (n=2, m=4,
groups along the columns; CPU) and ``Sparse24Tensor`` (GPU) with its mask
unchanged, kept zeros included (the mask is carried, not re-derived from the
nonzeros).

Example:
    >>> import torch
    >>> from sten_cuda24.sparse24 import Sparse24Tensor
    >>> s = Sparse24Tensor.from_dense(torch.tensor([[1., 0., 0., 2.]]))
    >>> to_block(s).to_dense().tolist()
    [[1.0, 0.0, 0.0, 2.0]]
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .blocksparse import BlockSparseTensor
from .sparse24 import Sparse24Tensor


def to_block(s: Sparse24Tensor) -> BlockSparseTensor:
    dense = s.to_dense()
    if dense.dim() != 2:
        raise ValueError(f"BlockSparseTensor is 2-D; this Sparse24Tensor has shape {tuple(s.shape)}")
    return BlockSparseTensor.from_dense(dense)


def nm_to_24(nm: Any) -> Sparse24Tensor:
    """``NMTensor`` (2:4 or sparser along columns) → ``Sparse24Tensor``, same mask."""
    if nm.m != 4 or nm.n > 2 or getattr(nm, "dim", 1) != 1:
        raise ValueError(
            f"only n:4 with n <= 2 along the columns (dim=1) converts to Sparse24Tensor; got "
            f"{nm.n}:{nm.m} along dim {getattr(nm, 'dim', 1)}"
        )
    return Sparse24Tensor.from_dense_masked(nm.to_dense(), nm.mask())


def s24_to_nm(s: Sparse24Tensor) -> Any:
    """``Sparse24Tensor`` → ``NMTensor(n, m=4)``, same mask: ``n`` is the most positions a group of 4
    keeps (a 1:4 weight becomes 1:4, not 2:4 with a trainable filler in every group)."""
    from sten_nm import NMTensor

    if len(s.shape) != 2:
        raise ValueError(f"NMTensor is 2-D; this Sparse24Tensor has shape {tuple(s.shape)}")
    mask = s.mask()
    groups = torch.nn.functional.pad(mask, (0, -mask.shape[1] % 4)).reshape(mask.shape[0], -1, 4)
    n = max(1, int(groups.sum(-1).max())) if groups.numel() else 2
    return NMTensor.from_dense(s.to_dense(), n=n, m=4, dim=1, mask=mask)


def conversions() -> list[tuple[type, type, Callable[[Any], Any]]]:
    """``(src, dst, fn)`` for the registry; ``sten_nm`` ones only if it imports."""
    from sten_core import plugin_api as sten

    out: list[tuple[type, type, Callable[[Any], Any]]] = [
        (Sparse24Tensor, BlockSparseTensor, to_block),
        (Sparse24Tensor, sten.DenseTensor, lambda s: sten.DenseTensor(s.to_dense())),
        (sten.DenseTensor, BlockSparseTensor, lambda d: BlockSparseTensor.from_dense(d.to_dense())),
        (BlockSparseTensor, sten.DenseTensor, lambda b: sten.DenseTensor(b.to_dense())),
        (BlockSparseTensor, sten.CsrTensor, lambda b: sten.CsrTensor.from_dense(b.to_dense())),
        (BlockSparseTensor, sten.CooTensor, lambda b: sten.CooTensor.from_dense(b.to_dense())),
        (Sparse24Tensor, sten.CooTensor, lambda s: sten.CooTensor.from_dense(s.to_dense())),
        (Sparse24Tensor, sten.CsrTensor, lambda s: sten.CsrTensor.from_dense(s.to_dense())),
    ]
    try:
        from sten_nm import NMTensor
    except Exception:
        return out
    out += [(NMTensor, Sparse24Tensor, nm_to_24), (Sparse24Tensor, NMTensor, s24_to_nm)]
    return out
