"""Where a warning should point: the user's line, not a frame inside STen; and
whether a call comes from a library that cannot take sparse wrappers.

A sparse call passes through the dispatcher, PyTorch's ``__torch_function__``
machinery and often a plugin before it warns; a fixed ``stacklevel`` points at
one of those frames. ``user_stacklevel`` counts them instead.
"""
from __future__ import annotations

import sys

_LIBRARY_PREFIXES = ("sten_", "torch", "pluggy", "functools", "contextlib")


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning point at the first caller outside
    STen, its plugins and PyTorch: the user's line that made the sparse call.

    Example:
        >>> user_stacklevel() >= 1
        True
    """
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not name.startswith(_LIBRARY_PREFIXES):
            return level
        frame, level = frame.f_back, level + 1
    return 1


FSDP_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")
"""FSDP (``FullyShardedDataParallel``, ``fully_shard``): it shards parameters with dense
operators (``chunk``, ``flatten``, ``p.data = view``), which would turn a sparse wrapper into
its dense copy."""


def called_from(prefixes: tuple[str, ...], depth: int = 40) -> bool:
    """Whether a frame of a module whose name starts with one of ``prefixes`` is among the
    ``depth`` callers of the caller.

    Example:
        >>> called_from(("torch.distributed.fsdp",))
        False
    """
    frame = sys._getframe(1)
    while frame is not None and depth > 0:
        if frame.f_globals.get("__name__", "").startswith(prefixes):
            return True
        frame, depth = frame.f_back, depth - 1
    return False
