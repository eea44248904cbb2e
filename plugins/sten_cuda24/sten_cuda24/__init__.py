"""STen plugin ``cuda24``: 2:4 semi-structured and block-sparse layouts for CUDA.

- ``Sparse24Tensor`` (2:4 along the contraction dim; cuSPARSELt / CUTLASS
  matmul on the GPU) and ``Sparse24Sparsifier`` (one-pass pruning kernels);
- ``BlockSparseTensor`` (BSR, Triton kernels for ``F.linear`` and its backward).

Everything imports and the layouts work without a GPU; the plugin then reports
itself unavailable with the reason (``sten plugins``).

Example:
    >>> import torch
    >>> from sten_cuda24 import sparsify_24
    >>> sparsify_24(torch.tensor([[1., -4., 2., 3.]])).to_dense().tolist()
    [[0.0, -4.0, 0.0, 3.0]]
"""

from __future__ import annotations

__version__ = "0.1.0"

from .blocksparse import BlockSparseTensor
from .sparse24 import Sparse24Tensor
from .sparsifiers import Sparse24Sparsifier, sparsify_24

__all__ = ["BlockSparseTensor", "Sparse24Sparsifier", "Sparse24Tensor", "sparsify_24", "__version__"]
