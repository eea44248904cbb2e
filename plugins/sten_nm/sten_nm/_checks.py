"""Argument checks shared by the layout, sparsifier and operators."""

from __future__ import annotations

from typing import Any

import torch

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def check_nm(n: Any, m: Any) -> tuple[int, int]:
    """Validate an n:m pattern: ints with ``1 <= n < m <= 32``."""
    for name, v in (("n", n), ("m", m)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if m > 32:
        raise ValueError(f"m must be <= 32, got m={m}")
    if m < 2:
        raise ValueError(f"m must be >= 2, got m={m}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got n={n}")
    if n >= m:
        raise ValueError(f"n must be < m (n:m keeps n of every m), got n={n}, m={m}")
    return n, m


def check_float_tensor(t: Any, name: str, ndim: int | None = None) -> torch.Tensor:
    """A floating-point CPU tensor (TypeError / ValueError naming ``name`` otherwise)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating-point tensor (float32, bfloat16, float16 or float64), got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU (sten_nm is a CPU plugin), got device {t.device}")
    return t


def check_dim(dim: Any) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or dim not in (0, 1, -1, -2):
        raise ValueError(f"dim must be 0 or 1 (the dimension the groups of m run along), got {dim!r}")
    return dim % 2
