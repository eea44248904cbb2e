"""The plugin module: the entry point ``example = "sten_example_plugin.plugin"``
names it, and sten_core calls its hooks when plugins are first needed.

Example:
    >>> from sten_core import plugin_api
    >>> from sten_example_plugin import plugin
    >>> plugin_api.register_plugin(plugin, name="example")  # without installing
    True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from sten_core import plugin_api as sten

from .bitmask import BitmaskTensor
from .linear import linear_bwd, linear_fwd
from .sparsifier import RowTopKSparsifier, row_topk_to_bitmask

T = torch.Tensor


@sten.hookimpl
def sten_register(registry: Any) -> None:
    """Register the layout, its conversions, the sparsifier and F.linear."""
    registry.register_layout(BitmaskTensor)
    registry.register_conversion(BitmaskTensor, sten.CooTensor, lambda b: sten.CooTensor.from_dense(b.to_dense()))
    registry.register_conversion(sten.CooTensor, BitmaskTensor, lambda c: BitmaskTensor.from_dense(c.to_dense()))
    registry.register_sparsifier_implementation(RowTopKSparsifier, T, BitmaskTensor, row_topk_to_bitmask)
    # F.linear(x, BitmaskTensor weight[, bias]): the forward, the backward with a dense weight
    # gradient (the default) and one at the kept positions (when grad_fmt asks for BitmaskTensor)
    sten.register_weight_product(registry, F.linear, BitmaskTensor, linear_fwd, linear_bwd(False), linear_bwd(True))


@sten.hookimpl
def sten_plugin_info() -> dict:
    """Name, version and availability (this plugin needs nothing beyond torch)."""
    from . import __version__

    return {"name": "example", "version": __version__, "available": True, "reason": None}
