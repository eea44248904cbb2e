"""The positions a weight stores, as a boolean mask (schedules, distributed checks,
the derivative of a gradient put in a sparse format under ``create_graph``), and a
tensor kept at a mask's positions only.

Example:
    >>> import torch, sten_core as sten
    >>> w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(2)))
    >>> stored_mask(w).tolist()
    [[True, False], [False, True]]
"""

from __future__ import annotations

from typing import Any

import torch

from sten_core.model.layouts import supports_values, to_dense_tensor
from sten_core.model.tensor import SparseTensorWrapper


def stored_mask(value: Any) -> torch.Tensor:
    """Boolean mask of the positions a wrapper (or dense tensor) stores."""
    if not isinstance(value, SparseTensorWrapper):
        return torch.ones(value.shape, dtype=torch.bool, device=value.device)
    layout = value.wrapped_tensor
    mask_fn = getattr(layout, "mask", None)
    if callable(mask_fn):
        return mask_fn().to(torch.bool)
    if supports_values(layout):
        ones = layout.with_values(torch.ones_like(layout.values()))
        return to_dense_tensor(ones) != 0
    return to_dense_tensor(layout) != 0


def masked(dense: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``dense`` where ``mask`` is set, 0 elsewhere: a dropped NaN or inf is 0, where
    ``dense * mask`` would leave NaN (``inf * 0``, ``nan * 0``).

    >>> masked(torch.tensor([float("inf"), 2.0]), torch.tensor([False, True]))
    tensor([0., 2.])
    """
    zero = torch.zeros((), dtype=dense.dtype, device=dense.device)  # (the int 0 made a bool tensor int64)
    return dense.where(mask.to(device=dense.device, dtype=torch.bool), zero)
