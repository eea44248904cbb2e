"""Padding slots of the n:m layouts: stored slots past the logical shape (the last group of
``m`` when the grouped size is not a multiple of ``m``, the row blocks and chunks the paper
format rounds up to). Their values must stay 0: the kernels multiply them by the zero-padded
operand, and an element-wise update on stored values (``W.div_(D)``: ``D`` gathered as 0
there, 0/0 = NaN; Adagrad's and RMSprop's steps) left NaN that ``to_dense()`` crops but
``F.linear`` returned (NaN * 0 = NaN).

Example:
    >>> import torch
    >>> from sten_nm import NMTensor
    >>> w = NMTensor.from_dense(torch.ones(1, 5), 2, 4)   # the second group: column 4 and padding
    >>> w.columns().tolist()
    [[0, 1, 4, 5]]
    >>> v = w.values().clone().fill_(float("nan"))
    >>> w.with_values(v).values().isnan().tolist()        # the slot at column 5 is 0 again
    [[True, True, True, False]]
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

_MASKS = WeakIdKeyDictionary()
"""pattern tensor -> (its version, the padding mask of the values or None when it has none)"""


def padding_mask(layout: Any, pattern: torch.Tensor, values: torch.Tensor) -> Optional[torch.Tensor]:
    """True at ``layout``'s padding slots (shaped like ``values``), ``None`` when it has none;
    found once per pattern tensor as the slots where ``gather`` of an all-ones tensor is 0."""
    hit = _MASKS.get(pattern)
    if hit is None or hit[0] != pattern._version:
        ones = torch.ones(layout.shape, dtype=values.dtype, device=values.device)
        pad = layout.gather(ones).reshape(values.shape) == 0
        hit = (pattern._version, pad if bool(pad.any()) else None)
        _MASKS[pattern] = hit
    return hit[1]


def zero_padding(layout: Any, pattern: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` with 0 in ``layout``'s padding slots (in place, unless autograd tracks
    ``values``); ``layout`` and ``values`` share the pattern tensor ``pattern``."""
    if values.device.type == "meta" or values.numel() == 0:
        return values
    pad = padding_mask(layout, pattern, values)
    if pad is None:
        return values
    if values.requires_grad:
        return values.masked_fill(pad, 0)
    return values.masked_fill_(pad, 0)
