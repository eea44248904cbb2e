"""Which implementation the plugin's operators ran, and the rule for dense fallbacks.

``last[op]`` holds ``{"path": ..., "why": ...}`` for the latest call of each
operator (``"linear24"``, ``"grad_input24"``, ``"linear_bsr"``, ``"grad_input_bsr"``,
``"grad_weight_bsr"``, ``"grad_weight24"``), so tests and benchmarks can assert
which path ran. CPU tensors compute densely by design (path ``"dense"``, no
warning). A CUDA tensor that cannot use the sparse kernel (no Triton, a block
shape the kernel does not take, no cuSPARSELt/CUTLASS) is a dense *fallback*:
it warns once per reason with ``plugin_api.DispatchWarning``, or raises
``plugin_api.DispatchError`` under ``plugin_api.set_dispatch_failure("raise")``,
like the core's own fallbacks.

Example:
    >>> record("linear_bsr", "triton")
    >>> last["linear_bsr"]["path"]
    'triton'
"""

from __future__ import annotations

import warnings

import torch

last: dict[str, dict[str, str]] = {}
_warned: set[tuple[str, str]] = set()


def record(op: str, path: str, why: str = "") -> None:
    """Note the path ``op`` took."""
    last[op] = {"path": path, "why": why}


def dense(op: str, tensor: torch.Tensor, why: str) -> None:
    """Record a dense computation of ``op``; on CUDA it is a fallback (warn or raise)."""
    from sten_core import plugin_api

    record(op, "dense", why)
    if tensor.device.type != "cuda":   # documented (CPU: dense); `sten explain` shows it under the call
        plugin_api.note(lambda: f"sten_cuda24 {op}: dense torch product ({why})")
        return
    from sten_core.plugin_api import DispatchError, DispatchWarning

    text = f"sten_cuda24 {op}: the sparse kernel cannot run ({why}); computing densely"
    if plugin_api.get_dispatch_failure() == "raise":
        raise DispatchError(text + " is refused under set_dispatch_failure('raise')")
    if (op, why) not in _warned:
        _warned.add((op, why))
        warnings.warn(text, DispatchWarning, stacklevel=3)
