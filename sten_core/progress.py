"""Whether to draw a progress bar: by default only when the output is a terminal.

A bar redraws itself with ``\\r``; in a CI log or a file that is noise, so the
default (``enabled=None``) asks the stream, and ``True``/``False`` force it on or off.

Example:
    >>> import io
    >>> show_progress(None, io.StringIO())   # a file or a pipe: no bar
    False
    >>> show_progress(True, io.StringIO())   # asked for explicitly
    True
"""

from __future__ import annotations

import sys
from typing import TextIO


def is_terminal(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default: ``sys.stderr``, looked up at call time) is an open terminal."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if not callable(isatty):
        return False
    try:
        return bool(isatty())
    except (ValueError, OSError):  # a closed or detached stream
        return False


def show_progress(enabled: bool | None = None, stream: TextIO | None = None) -> bool:
    """``enabled`` when it is a bool; for ``None``, whether ``stream`` (default stderr) is a terminal."""
    if enabled is None:
        return is_terminal(stream)
    if not isinstance(enabled, bool):
        raise TypeError(f"progress must be True, False or None (only on a terminal), got {enabled!r}")
    return enabled
