"""The positions a weight stores, as a boolean mask (schedules, distributed checks,
the derivative of a gradient put in a sparse format under ``create_graph``).

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
