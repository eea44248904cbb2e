"""The ``pruning`` plugin of sten-core: how calibrated sparsifiers produce a layout.

A ``CalibratedSparsifier`` (Wanda, SparseGPT) may change the kept values and
carries its pattern (``n``, ``m``), so the generic mask-times-dense path does not
fit it. This plugin's ``sten_resolve_op`` gives every sparsifier key of such a
sparsifier an implementation into ``torch.Tensor`` or any layout with
``from_dense``: ``values, mask = sparsifier.prune(dense)``, then
``layout_from_mask(layout, values, mask, sparsifier.layout_params())``
(exactly the mask, kept zeros included, where the layout can store that). A
layout that re-prunes on its own and does not store the mask raises.

It is one of sten-core's built-in plugins (``sten_core.plugins.BUILTIN_PLUGINS``),
loaded through the same hooks as any installed plugin.

Example:
    >>> from sten_core.training.pruning import plugin
    >>> plugin.sten_plugin_info()["name"]
    'pruning'
"""

from __future__ import annotations

from typing import Any

import torch

from sten_core.model.layouts import to_dense_tensor
from sten_core.plugins.hookspecs import hookimpl
from sten_core.training.schedule import layout_from_mask
from sten_core.version import __version__
from sten_core.model.tensor import SparseTensorWrapper
from sten_core.training.pruning.base import CalibratedSparsifier


NAME = "pruning"


def into(layout: type):
    """The implementation dense (or any layout) → ``layout`` of a calibrated sparsifier."""

    def impl(sparsifier: CalibratedSparsifier, tensor: Any, grad_fmt: Any = None) -> Any:
        values, keep = sparsifier.prune(tensor)
        if layout is torch.Tensor:
            return values
        obj = layout_from_mask(layout, values, keep, sparsifier.layout_params())
        stored = to_dense_tensor(obj)
        if stored.shape != values.shape or not torch.equal(stored.to(values.dtype), values):
            raise ValueError(
                f"{layout.__name__} cannot store the mask that {type(sparsifier).__name__} chose "
                f"(its from_dense changes the kept values or positions); pick a layout that stores any "
                f"mask of this pattern (e.g. CsrTensor, or NMTensor for n:m)"
            )
        return SparseTensorWrapper(obj, False, grad_fmt)

    return impl


@hookimpl
def sten_resolve_op(key: Any) -> Any:
    if key.direction != "sparsifier":
        return None
    if not (isinstance(key.op, type) and issubclass(key.op, CalibratedSparsifier)):
        return None
    if key.out is not torch.Tensor and not callable(getattr(key.out, "from_dense", None)):
        return None
    return into(key.out)


@hookimpl
def sten_plugin_info() -> dict:
    return {"name": NAME, "version": __version__, "available": True, "reason": None}
