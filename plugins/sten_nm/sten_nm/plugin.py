"""The ``nm`` STen plugin (entry point ``[project.entry-points.sten] nm = "sten_nm.plugin"``).

Registers the ``NMTensor`` layout, its sparsifiers, conversions and the
``F.linear`` / ``torch.mm`` / ``torch.matmul`` implementations.

Example:
    >>> from sten_nm import plugin
    >>> plugin.sten_plugin_info()["name"]
    'nm'
"""

from __future__ import annotations

from typing import Any

import torch

from sten_core import plugin_api

from . import __version__, _kernel, addmm, column_grouped_ops, compiled, ops
from .column_grouped import ColumnGroupedNMTensor
from .grouped_tensor import GroupedNMTensor
from .nm_tensor import NMTensor
from .sparsifier import (ColumnGroupedNMSparsifier, GroupedNMSparsifier, NMSparsifier, column_grouped_sparsify,
                         grouped_sparsify, nm_sparsify, per_block_sparsify)


def _column_grouped_to_nm(t: ColumnGroupedNMTensor) -> NMTensor:
    """Lossless: every column keeps n of each block of m rows, as ``NMTensor(dim=0)``."""
    return t.to_nm()


def _conversions() -> list:
    from sten_core.plugin_api import CooTensor, CscTensor, CsrTensor, DenseTensor

    out = [(src, cls, (lambda c: (lambda t: c.from_dense(t.to_dense())))(cls))
           for src in (NMTensor, GroupedNMTensor, ColumnGroupedNMTensor)
           for cls in (DenseTensor, CooTensor, CsrTensor, CscTensor)]
    out.append((GroupedNMTensor, NMTensor, lambda t: t.to_nm()))  # lossless: same values
    out.append((ColumnGroupedNMTensor, NMTensor, _column_grouped_to_nm))
    return out


@plugin_api.hookimpl
def sten_register(registry: Any) -> None:
    registry.register_layout(NMTensor)
    registry.register_layout(GroupedNMTensor)
    registry.register_layout(ColumnGroupedNMTensor)
    registry.register_sparsifier_implementation(GroupedNMSparsifier, torch.Tensor, GroupedNMTensor, grouped_sparsify)
    registry.register_sparsifier_implementation(ColumnGroupedNMSparsifier, torch.Tensor, ColumnGroupedNMTensor,
                                                column_grouped_sparsify)
    for sp, impl in ((NMSparsifier, nm_sparsify), (plugin_api.PerBlockFractionSparsifier, per_block_sparsify)):
        registry.register_sparsifier_implementation(sp, torch.Tensor, NMTensor, impl)
    for src, dst, fn in _conversions():
        registry.register_conversion(src, dst, fn)
    column_grouped_ops.register(registry)  # pure torch: with or without the C kernels
    if _kernel.available()[0]:  # else the products take STen's dense fallback (DispatchWarning)
        ops.register(registry)
        ops.register_grouped(registry)
        addmm.register(registry)
    compiled.register(registry, kernels=_kernel.available()[0])  # torch.compile: custom operators
    compiled.register_traceable(kernels=_kernel.available()[0])   # compiled training of n:m weights


@plugin_api.hookimpl
def sten_bench_layouts(register: Any) -> None:
    """``sten bench`` lines: exact n:m, the 16-row grouped n:m and the paper's
    grouped n:m, each at the n:m closest to the asked sparsity."""
    nm = plugin_api.nm_for_sparsity
    cpu = ("cpu",)
    register(plugin_api.BenchLayout("nm", "n:m (sten_nm)", "NMTensor", lambda s: plugin_api.PerBlockFractionSparsifier(*nm(s)),
                                    devices=cpu, aliases=("n:m",), pattern=plugin_api.nm_label))
    register(plugin_api.BenchLayout("grouped_nm", "grouped n:m, 16 rows (sten_nm)", "GroupedNMTensor",
                                    lambda s: GroupedNMSparsifier(*nm(s)), devices=cpu, aliases=("grouped",),
                                    pattern=plugin_api.nm_label))
    register(plugin_api.BenchLayout("paper_nm", "paper grouped n:m (sten_nm)", "ColumnGroupedNMTensor",
                                    lambda s: ColumnGroupedNMSparsifier(*nm(s)), devices=cpu,
                                    aliases=("column_grouped",), pattern=plugin_api.nm_label))


@plugin_api.hookimpl
def sten_plugin_info() -> dict:
    ok, reason = _kernel.available()
    return {"name": "nm", "version": __version__, "available": ok, "reason": reason}
