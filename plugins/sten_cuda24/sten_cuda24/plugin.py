"""The ``cuda24`` STen plugin: registers the layouts, sparsifiers, operators
and conversions, and reports whether the GPU paths can run here.

Without a GPU it still imports and registers everything (the layouts and the
CPU paths work) and reports ``available: False`` with the reason.

Example:
    >>> from sten_cuda24 import plugin
    >>> plugin.sten_plugin_info()["name"]
    'cuda24'
"""

from __future__ import annotations

from typing import Any

import sten_core
import torch

from . import __version__, _compat, conversions, ops, sparsifiers
from .blocksparse import BlockSparseTensor
from .sparse24 import Sparse24Tensor


@sten_core.hookimpl
def sten_register(registry: Any) -> None:
    registry.register_layout(Sparse24Tensor)
    registry.register_layout(BlockSparseTensor)
    T = torch.Tensor
    registry.register_sparsifier_implementation(sparsifiers.Sparse24Sparsifier, T, Sparse24Tensor, sparsifiers.sparse24_impl)
    registry.register_sparsifier_implementation(sten_core.PerBlockFractionSparsifier, T, Sparse24Tensor, sparsifiers.per_block_impl)
    registry.register_sparsifier_implementation(sten_core.BlockwiseFractionSparsifier, T, BlockSparseTensor, sparsifiers.blockwise_impl)
    ops.register(registry)
    for src, dst, fn in conversions.conversions():
        registry.register_conversion(src, dst, fn)


@sten_core.hookimpl
def sten_plugin_info() -> dict:
    ok, reason = _compat.availability()
    return {"name": "cuda24", "version": __version__, "available": ok, "reason": reason}
