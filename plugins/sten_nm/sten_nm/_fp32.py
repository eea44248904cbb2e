"""Float32 copies of stored values for the kernels, cached on the layout object until the
values change (in place: ``_version``; replaced: ``data_ptr``), so bf16 / fp16 weights, and
fp32 weights rounded for CPU autocast, are converted once, not on every call.

Example:
    >>> import torch
    >>> class Holder: pass
    >>> h, v = Holder(), torch.ones(3, dtype=torch.bfloat16)
    >>> fp32_values(h, v) is fp32_values(h, v)
    True
"""

from __future__ import annotations

from typing import Any, Optional

import torch


def fp32_values(owner: Any, values: torch.Tensor, round_to: Optional[torch.dtype] = None) -> torch.Tensor:
    """``values`` as float32 (rounded through ``round_to`` first when given); ``values`` itself
    when it already is float32 and nothing is rounded."""
    if round_to is None or round_to == values.dtype:
        round_to = None
        if values.dtype == torch.float32:
            return values
    key = (values.data_ptr(), values._version, values.dtype, tuple(values.shape), round_to)
    cached = getattr(owner, "_fp32_cache", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    out = (values.to(round_to) if round_to is not None else values).float().contiguous()
    owner._fp32_cache = (key, out)
    return out


def kernel_values(owner: Any, values: torch.Tensor, round_to: Optional[torch.dtype] = None) -> torch.Tensor:
    """The values for a kernel that reads float32 or bfloat16 (widened in the kernel, fp32
    accumulation): bf16 values (or values rounded to bf16) stay bf16, contiguous, half the
    bytes of a float32 copy; anything else goes through :func:`fp32_values`.

    >>> import torch
    >>> class Holder: pass
    >>> kernel_values(Holder(), torch.ones(3), torch.bfloat16).dtype
    torch.bfloat16
    """
    target = round_to if round_to is not None else values.dtype
    if target != torch.bfloat16:
        return fp32_values(owner, values, round_to)
    if values.dtype == torch.bfloat16 and values.is_contiguous():
        return values
    key = (values.data_ptr(), values._version, values.dtype, tuple(values.shape), "bf16")
    cached = getattr(owner, "_bf16_cache", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    out = values.to(torch.bfloat16).contiguous()
    owner._bf16_cache = (key, out)
    return out
