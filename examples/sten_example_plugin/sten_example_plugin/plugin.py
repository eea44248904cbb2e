"""The plugin module: the entry point ``example = "sten_example_plugin.plugin"``
names it, and sten_core calls its hooks when plugins are first needed.

Example:
    >>> import sten_core
    >>> from sten_example_plugin import plugin
    >>> sten_core.plugins.register_plugin(plugin, name="example")  # without installing
    True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import sten_core as sten

from .bitmask import BitmaskTensor
from .linear import linear_bwd, linear_fwd
from .sparsifier import RowTopKSparsifier, row_topk_to_bitmask

T = torch.Tensor
KEEP = (sten.KeepAll, T)  # (inline sparsifier class, tmp_format) of a dense output


@sten.hookimpl
def sten_register(registry: Any) -> None:
    """Register the layout, its conversions, the sparsifier and F.linear."""
    registry.register_layout(BitmaskTensor)
    registry.register_conversion(BitmaskTensor, sten.CooTensor, lambda b: sten.CooTensor.from_dense(b.to_dense()))
    registry.register_conversion(sten.CooTensor, BitmaskTensor, lambda c: BitmaskTensor.from_dense(c.to_dense()))
    registry.register_sparsifier_implementation(RowTopKSparsifier, T, BitmaskTensor, row_topk_to_bitmask)
    for inp in ((T, BitmaskTensor, T), (T, BitmaskTensor)):  # with and without bias
        n = len(inp)
        registry.register_fwd_op_impl(F.linear, inp, [KEEP], linear_fwd)
        # dense weight gradient (the default) ...
        registry.register_bwd_op_impl(F.linear, (T,), (KEEP, KEEP, KEEP)[:n], inp, linear_bwd(False))
        # ... or one at the kept positions, when the weight's grad_fmt asks for BitmaskTensor
        registry.register_bwd_op_impl(F.linear, (T,), (KEEP, (sten.KeepAll, BitmaskTensor), KEEP)[:n], inp,
                                      linear_bwd(True))


@sten.hookimpl
def sten_plugin_info() -> dict:
    """Name, version and availability (this plugin needs nothing beyond torch)."""
    from . import __version__

    return {"name": "example", "version": __version__, "available": True, "reason": None}
