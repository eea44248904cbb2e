"""Gradients put in a sparse format without losing their graph: under
``create_graph=True`` (a gradient penalty, a Hessian-vector product) a gradient
stored in its ``grad_fmt`` stays differentiable. The format keeps the values at the
positions it stores, so its derivative is the incoming gradient at those positions.

Example:
    >>> import torch, sten_core as sten
    >>> from sten_core.dispatch.sparsifier_dispatch import apply_sparsifier
    >>> g = torch.tensor([[3.0, 0.0], [0.0, 4.0]], requires_grad=True)
    >>> with torch.enable_grad():
    ...     csr = keeping_graph(lambda t: apply_sparsifier(sten.KeepAll(), t, sten.CsrTensor), g, sten.CsrTensor)
    >>> csr.requires_grad
    True
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from sten_core.model.masks import stored_mask
from sten_core.model.tensor import DENSE_TYPES, densify


class _Formatted(torch.autograd.Function):
    """``to_format(grad)`` as an autograd node: backward passes the incoming gradient
    at the positions ``kept(result)`` names (the format is a projection onto them), or
    everywhere where it names none."""

    @staticmethod
    def forward(fctx: Any, grad: torch.Tensor, to_format: Callable, kept: Callable) -> Any:
        out = to_format(grad)
        mask = kept(out)
        fctx.all_kept = mask is None
        fctx.save_for_backward(*(() if mask is None else (mask.to(grad.device),)))
        return out

    @staticmethod
    def backward(fctx: Any, incoming: Any) -> Any:
        dense = densify(incoming)
        return (dense if fctx.all_kept else dense * fctx.saved_tensors[0]), None, None


def every_position(out: Any) -> None:
    """``kept`` for a format that keeps every value (``KeepAll``): a stored zero is still the
    gradient's value there, so the derivative is the incoming gradient everywhere."""
    return None


def keeping_graph(to_format: Callable[[torch.Tensor], Any], grad: Any, out_format: type,
                  kept: Callable[[Any], torch.Tensor | None] = stored_mask) -> Any:
    """``to_format(grad)``, a layout of class ``out_format``; where ``grad`` has a graph
    (``create_graph=True``) and ``out_format`` is sparse, one that keeps it: differentiating
    through that gradient reaches what ``grad`` was computed from, at the positions
    ``kept(result)`` gives (by default those the format stores; ``every_position`` where the
    format drops only zeros)."""
    if (out_format not in DENSE_TYPES and type(grad) in DENSE_TYPES and grad.requires_grad
            and torch.is_grad_enabled() and not torch._C._are_functorch_transforms_active()):
        return _Formatted.apply(grad, to_format, kept)
    return to_format(grad)
