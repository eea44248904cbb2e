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
from sten_core.model.replacing import same_values
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
        try:
            obj = layout_from_mask(layout, values, keep, sparsifier.layout_params())
        except ValueError as error:   # (nm_compress: more than n of some group of m)
            raise cannot_store(layout, sparsifier, f": {error}") from error
        if not same_values(to_dense_tensor(obj), values):   # (NaN weights equal: kept as they are)
            raise cannot_store(layout, sparsifier)
        return SparseTensorWrapper(obj, False, grad_fmt)

    return impl


def cannot_store(layout: type, sparsifier: Any, detail: str = "") -> ValueError:
    """The ``ValueError`` of a layout that cannot store the mask ``sparsifier`` chose as it is."""
    pattern = getattr(sparsifier, "n", None) is not None or getattr(sparsifier, "m", None) is not None
    hint = "" if pattern else (" An n:m layout stores n:m masks only: to prune into one, ask for its pattern "
                               "(pattern=(n, m), e.g. (2, 4)) instead of a sparsity.")
    return ValueError(f"{layout.__name__} cannot store the mask that {type(sparsifier).__name__} chose (its "
                      f"from_dense changes the kept values or positions){detail}; pick a layout that stores any mask "
                      f"of this pattern (e.g. CsrTensor, or NMTensor for n:m).{hint}")


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
