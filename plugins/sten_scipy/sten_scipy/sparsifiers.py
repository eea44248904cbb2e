"""Sparsifier implementations into the scipy layouts.

Every built-in sparsifier of the core goes dense → ``ScipyCsrTensor`` /
``ScipyCscTensor`` in one step: its keep-mask selects the stored values
directly (``compress``), with no masked dense copy. ``SameFormatSparsifier``
reads the reference's positions (``gather``) when the reference is a scipy
layout. Zeros are never stored, as for the core's own layouts.

Example:
    >>> import torch, sten_core as sten
    >>> from sten_scipy import ScipyCscTensor
    >>> w = sten.sparsify(sten.PerBlockFractionSparsifier(2, 4), torch.randn(3, 8), ScipyCscTensor)
    >>> w.wrapped_tensor.nnz
    12
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from sten_core import plugin_api as sten
from sten_core.plugin_api import SparseTensorWrapper

from ._checks import check_dense
from .compressed import ScipyCompressed, compress
from .layouts import SCIPY_LAYOUTS


def _dense_input(tensor: Any, layout: type) -> torch.Tensor:
    if isinstance(tensor, SparseTensorWrapper):
        tensor = tensor.to_dense()
    return check_dense(tensor, f"sparsify into {layout.__name__}")


def into(layout: type) -> Callable:
    """``impl(sparsifier, tensor, grad_fmt)``: dense → ``layout`` through the sparsifier's mask."""

    def impl(sparsifier: Any, tensor: torch.Tensor, grad_fmt: Any = None) -> SparseTensorWrapper:
        dense = _dense_input(tensor, layout)
        keep = None if type(sparsifier) is sten.KeepAll else sparsifier.mask(dense)
        obj = layout.from_parts(*compress(dense, keep, layout._major), tuple(dense.shape))
        return SparseTensorWrapper(obj, False, grad_fmt)

    impl.__name__ = f"sparsify_into_{layout.__name__}"
    return impl


def same_format(layout: type) -> Callable:
    """``SameFormatSparsifier(ref)`` into ``layout``: the reference's positions."""
    fallback = into(layout)

    def impl(sparsifier: Any, tensor: torch.Tensor, grad_fmt: Any = None) -> SparseTensorWrapper:
        ref = getattr(sparsifier.ref, "wrapped_tensor", sparsifier.ref)
        if isinstance(ref, ScipyCompressed):
            dense = _dense_input(tensor, layout)
            if tuple(dense.shape) != tuple(ref.shape):
                raise ValueError(f"SameFormatSparsifier: tensor shape {tuple(dense.shape)} does not match "
                                 f"the reference's shape {tuple(ref.shape)}")
            if isinstance(ref, layout):
                obj = ref.with_values(ref.gather(dense.to(ref.dtype)).clone())
            else:  # same positions, the other compression: convert the gathered result
                from .conversions import csc_to_csr, csr_to_csc

                gathered = ref.with_values(ref.gather(dense.to(ref.dtype)).clone())
                obj = csr_to_csc(gathered) if layout._major == 1 else csc_to_csr(gathered)
            return SparseTensorWrapper(obj, False, grad_fmt)
        return fallback(sparsifier, tensor, grad_fmt)

    return impl


def register(registry: Any) -> None:
    for layout in SCIPY_LAYOUTS:
        for sparsifier in sten.BUILTIN_SPARSIFIERS:
            impl = same_format(layout) if sparsifier is sten.SameFormatSparsifier else into(layout)
            registry.register_sparsifier_implementation(sparsifier, torch.Tensor, layout, impl)
