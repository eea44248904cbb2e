"""Where a warning should point: the user's line, not a frame inside STen.

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
