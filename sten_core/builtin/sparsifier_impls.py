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

from ..layouts import supports_values
from ..registry import Entry, OpKey
from ..sparsifiers import BUILTIN_SPARSIFIERS, KeepAll, SameFormatSparsifier
from ..tensor import SparseTensorWrapper, densify


def masked_dense(sparsifier: Any, tensor: torch.Tensor) -> torch.Tensor:
    dense = densify(tensor)
    return dense * sparsifier.mask(dense).to(dense.device)


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
        return dense * (ref_layout != 0)
    if supports_values(ref_layout) and hasattr(ref_layout, "gather"):
        values = ref_layout.gather(dense).to(ref_layout.values().dtype)
        return SparseTensorWrapper(ref_layout.with_values(values), False, grad_fmt)
    return SparseTensorWrapper(type(ref_layout).from_dense(dense * sparsifier.mask(dense)), False, grad_fmt)


def resolve(key: OpKey) -> Any:
    """Generic sparsifier implementations for any layout with ``from_dense``."""
    if key.direction != "sparsifier":
        return None
    if key.op is SameFormatSparsifier:
        out = key.out

        def same_format_into(sp: Any, tensor: torch.Tensor, grad_fmt: Any = None) -> Any:
            result = same_format(sp, tensor, grad_fmt)
            produced = type(result.wrapped_tensor) if isinstance(result, SparseTensorWrapper) else torch.Tensor
            if produced is out:
                return result
            from ..dispatch import convert

            return convert(result, out)

        return Entry(same_format_into, 1)
    if key.op is KeepAll or not callable(getattr(key.op, "mask", None)):
        return None
    if key.out is not torch.Tensor and not callable(getattr(key.out, "from_dense", None)):
        return None
    fn = into(key.out)
    return lambda sp, t, grad_fmt=None: fn(sp, t, grad_fmt)


def register(registry: Any, layouts: tuple) -> None:
    for sparsifier in BUILTIN_SPARSIFIERS:
        if sparsifier in (KeepAll, SameFormatSparsifier):
            continue
        for layout in (torch.Tensor,) + tuple(layouts):
            registry.register_sparsifier_implementation(sparsifier, torch.Tensor, layout, into(layout))
