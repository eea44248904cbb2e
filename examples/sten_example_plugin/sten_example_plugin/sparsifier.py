"""``RowTopKSparsifier``: keep the ``k`` largest magnitudes of every row.

A sparsifier is a small object with its parameters and its kind (paper
Table 1). What it does is an *implementation* registered for an input and
an output layout (see ``plugin.py``); ``mask`` additionally lets the core use
it for any layout that has ``from_dense``.

Example:
    >>> import torch
    >>> RowTopKSparsifier(1).mask(torch.tensor([[1., -3.], [2., 0.]])).tolist()
    [[False, True], [True, False]]
"""

from __future__ import annotations

import torch

from sten_core import plugin_api as sten

from .bitmask import BitmaskTensor


class RowTopKSparsifier(sten.Sparsifier):
    """Keeps the ``k`` values of largest magnitude along the last dimension."""

    kind = "blocking"  # decides per row: needs a whole row, not the whole tensor

    def __init__(self, k: int):
        if isinstance(k, bool) or not isinstance(k, int):
            raise TypeError(f"k must be an int, got {type(k).__name__}")
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.k = k

    def mask(self, tensor: torch.Tensor) -> torch.Tensor:
        """Boolean keep-mask of a dense tensor (at least 1-D)."""
        if tensor.dim() == 0:
            raise ValueError("RowTopKSparsifier needs a tensor with at least 1 dimension")
        k = min(self.k, tensor.shape[-1])
        keep = torch.zeros(tensor.shape, dtype=torch.bool, device=tensor.device)
        top = tensor.detach().abs().topk(k, dim=-1).indices
        return keep.scatter_(-1, top, True)


def row_topk_to_bitmask(sparsifier: RowTopKSparsifier, tensor: torch.Tensor, grad_fmt=None) -> sten.SparseTensorWrapper:
    """The implementation dense → ``BitmaskTensor``: build the layout from the mask directly."""
    dense = tensor.detach()
    layout = BitmaskTensor.from_mask(dense, sparsifier.mask(dense))
    return sten.SparseTensorWrapper(layout, grad_fmt=grad_fmt)
