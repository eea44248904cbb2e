"""Argument checks shared by the layout, sparsifier and operators."""

from __future__ import annotations

from typing import Any

import torch

from sten_core import plugin_api

FLOAT_DTYPES = plugin_api.FLOAT_DTYPES


def check_nm(n: Any, m: Any) -> tuple[int, int]:
    """Validate an n:m pattern: ints with ``1 <= n < m <= 32``."""
    return plugin_api.check_nm(n, m, max_m=32)


def check_float_tensor(t: Any, name: str, ndim: int | None = None) -> torch.Tensor:
    """A floating-point CPU tensor (TypeError / ValueError naming ``name`` otherwise)."""
    plugin_api.check_tensor(t, name)
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating-point tensor (float32, bfloat16, float16 or float64), got {t.dtype}")
    plugin_api.check_tensor(t, name, ndim=ndim)
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU (sten_nm is a CPU plugin), got device {t.device}")
    return t


def check_dim(dim: Any) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or dim not in (0, 1, -1, -2):
        raise ValueError(f"dim must be 0 or 1 (the dimension the groups of m run along), got {dim!r}")
    return dim % 2
