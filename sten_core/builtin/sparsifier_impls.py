"""Sparsifier implementations of the built-in sparsifiers.

Every sparsifier with a dense ``mask`` gets an implementation dense → dense
(masked) and dense → each built-in layout; the ``sten_resolve_op`` hook extends
that to any layout with ``from_dense``. ``SameFormatSparsifier`` reads the
reference's stored positions directly when its layout supports it.

Example:
    >>> import torch, sten_core as sten
    >>> sten.sparsify(sten.ScalarThresholdSparsifier(1.5), torch.tensor([1., 2.]), torch.Tensor)
    tensor([0., 2.])
"""

from __future__ import annotations

from typing import Any

import torch

from sten_core.dispatch import convert, lossy_fallback
from sten_core.model.layouts import Layout, builds_from_dense, supports_values
from sten_core.model.masks import masked
from sten_core.model.registry import Entry, OpKey
from sten_core.model.sparsifiers import BUILTIN_SPARSIFIERS, KeepAll, SameFormatSparsifier, Sparsifier
from sten_core.model.tensor import SparseTensorWrapper, densify


def masked_dense(sparsifier: Any, tensor: torch.Tensor) -> torch.Tensor:
    dense = densify(tensor)
    return masked(dense, sparsifier.mask(dense))


def into(layout: type):
    """An implementation dense → ``layout`` for sparsifiers with a ``mask``."""

    def impl(sparsifier: Any, tensor: torch.Tensor, grad_fmt: Any = None) -> Any:
        masked = masked_dense(sparsifier, tensor)
        if layout is torch.Tensor:
            return masked
        return SparseTensorWrapper(layout.from_dense(masked), False, grad_fmt)

    return impl


def same_format(sparsifier: SameFormatSparsifier, tensor: torch.Tensor, grad_fmt: Any = None) -> Any:
    """Keep the reference's positions, in the reference's layout."""
    ref = sparsifier.ref
    ref_layout = ref.wrapped_tensor if isinstance(ref, SparseTensorWrapper) else ref
    dense = densify(tensor)
    if isinstance(ref_layout, torch.Tensor):
        return masked(dense, ref_layout != 0)
    if supports_values(ref_layout):
        values = ref_layout.gather(dense).to(ref_layout.values().dtype)
        return SparseTensorWrapper(ref_layout.with_values(values), False, grad_fmt)
    return SparseTensorWrapper(type(ref_layout).from_dense(masked(dense, sparsifier.mask(dense))), False, grad_fmt)


def resolve(key: OpKey) -> Any:
    """Generic sparsifier implementations for any layout with ``from_dense``."""
    if key.direction != "sparsifier":
        return None
    if key.op is SameFormatSparsifier:
        out = key.out
        if out is not torch.Tensor and not builds_from_dense(out) and not _has_values(out):
            return None  # nothing generic can build it: a fallback (warned) or a registered implementation

        def same_format_into(sp: Any, tensor: torch.Tensor, grad_fmt: Any = None) -> Any:
            result = same_format(sp, tensor, grad_fmt)
            produced = type(result.wrapped_tensor) if isinstance(result, SparseTensorWrapper) else torch.Tensor
            if produced is out:
                return result
            return convert(result, out)

        return Entry(same_format_into, 1)
    if key.op is KeepAll or not _has_mask(key.op):
        return None
    if key.out is not torch.Tensor and not builds_from_dense(key.out):
        return None
    fn = into(key.out)
    if key.out is torch.Tensor:
        return lambda sp, t, grad_fmt=None: fn(sp, t, grad_fmt)
    return lambda sp, t, grad_fmt=None: _lossless(fn(sp, t, grad_fmt), sp, t, key)


def _has_values(layout_cls: type) -> bool:
    """Whether a layout class has the stored-values protocol (``with_values``)."""
    return callable(getattr(layout_cls, "with_values", None)) and layout_cls.with_values is not Layout.with_values


def _has_mask(sparsifier_cls: type) -> bool:
    """Whether a sparsifier class overrides ``Sparsifier.mask`` (a dense keep-mask)."""
    mask = getattr(sparsifier_cls, "mask", None)
    return callable(mask) and mask is not Sparsifier.mask


def _lossless(result: Any, sparsifier: Any, tensor: torch.Tensor, key: OpKey) -> Any:
    """``result`` if its layout kept every value the sparsifier chose; else a
    lossy fallback (the layout's ``from_dense`` pruned again): warned, or raised."""
    kept = int(torch.count_nonzero(result.to_dense()))
    chosen = int(torch.count_nonzero(masked_dense(sparsifier, tensor)))
    if kept != chosen:
        lossy_fallback(key, kept, chosen)
    return result


def register(registry: Any, layouts: tuple) -> None:
    for sparsifier in BUILTIN_SPARSIFIERS:
        if sparsifier in (KeepAll, SameFormatSparsifier):
            continue
        for layout in (torch.Tensor,) + tuple(layouts):
            registry.register_sparsifier_implementation(sparsifier, torch.Tensor, layout, into(layout))
