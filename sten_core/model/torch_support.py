"""The torch versions on which sparse wrappers become traceable tensor subclasses.

A traceable wrapper (``__tensor_flatten__``) is what lets ``torch.compile`` train sparse
weights without graph breaks. It leans on AOTAutograd's handling of subclass inputs and their
gradients, which changed between torch releases: the compiled-training tests pass on torch
2.13 (CI) and several failed on torch 2.11 ("Cannot access data pointer" for the 2:4 layouts,
``PendingUnbackedSymbolNotFound`` for block-sparse ones). Below ``TRACEABLE_MIN_TORCH`` every
wrapper keeps the eager class: ``torch.compile`` then breaks the graph at sparse calls and runs
them eagerly (eager's results), instead of failing inside the compiler. Frozen weights still
compile whole through their layouts' custom operators either way.

``STEN_TRACEABLE_WRAPPERS=1`` turns traceable wrappers on for any torch (to try a version not
tested yet), ``=0`` off.

Example:
    >>> traceable_wrappers_supported("2.13.0+cpu", {}), traceable_wrappers_supported("2.11.0+cu130", {})
    (True, False)
    >>> traceable_wrappers_supported("2.11.0", {"STEN_TRACEABLE_WRAPPERS": "1"})
    True
"""

from __future__ import annotations

import os
from typing import Mapping

import torch
from torch.torch_version import TorchVersion

TRACEABLE_MIN_TORCH = "2.13"
"""The oldest torch release the compiled-training tests have passed on."""


def traceable_wrappers_supported(version: str = torch.__version__, env: Mapping[str, str] = os.environ) -> bool:
    """Whether wrappers may be traceable subclasses on torch ``version`` (``STEN_TRACEABLE_WRAPPERS``
    in ``env`` overrides: ``1`` on, ``0`` off)."""
    forced = env.get("STEN_TRACEABLE_WRAPPERS", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        raise ValueError(f"STEN_TRACEABLE_WRAPPERS must be 0 or 1, got {forced!r}")
    return TorchVersion(version.split("+")[0]) >= TRACEABLE_MIN_TORCH


TRACEABLE_WRAPPERS = traceable_wrappers_supported()
"""Decided once at import; ``wrapper_class`` reads it (tests patch it)."""
