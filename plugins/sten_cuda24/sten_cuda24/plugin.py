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

from sten_core import plugin_api
import torch

from . import __version__, _compat, compiled, conversions, ops, sparsifiers
from .blocksparse import BlockSparseTensor
from .sparse24 import Sparse24Tensor


@plugin_api.hookimpl
def sten_register(registry: Any) -> None:
    registry.register_layout(Sparse24Tensor)
    registry.register_layout(BlockSparseTensor)
    T = torch.Tensor
    registry.register_sparsifier_implementation(sparsifiers.Sparse24Sparsifier, T, Sparse24Tensor, sparsifiers.sparse24_impl)
    registry.register_sparsifier_implementation(plugin_api.PerBlockFractionSparsifier, T, Sparse24Tensor, sparsifiers.per_block_impl)
    registry.register_sparsifier_implementation(plugin_api.BlockwiseFractionSparsifier, T, BlockSparseTensor, sparsifiers.blockwise_impl)
    ops.register(registry)
    compiled.register(registry)      # torch.compile: the kernels as custom operators
    compiled.register_traceable()    # compiled training of 2:4 and block-sparse weights
    for src, dst, fn in conversions.conversions():
        registry.register_conversion(src, dst, fn)


@plugin_api.hookimpl
def sten_bench_layouts(register: Any) -> None:
    """``sten bench`` lines: 2:4 semi-structured (at 50 % only) and 64x64 blocks."""
    register(plugin_api.BenchLayout("2:4", "2:4 (sten_cuda24)", "Sparse24Tensor",
                                    lambda s: plugin_api.PerBlockFractionSparsifier(2, 4), devices=("cuda",),
                                    sparsities=(0.5,), aliases=("24", "sparse24"), pattern=lambda s: "2:4"))
    register(plugin_api.BenchLayout("block", "block 64x64 (sten_cuda24)", "BlockSparseTensor",
                                    lambda s: plugin_api.BlockwiseFractionSparsifier(s, (64, 64)), devices=("cuda",),
                                    pattern=lambda s: "64x64"))


@plugin_api.hookimpl
def sten_plugin_info() -> dict:
    ok, reason = _compat.availability()
    return {"name": "cuda24", "version": __version__, "available": ok, "reason": reason}
