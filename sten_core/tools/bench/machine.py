"""The machine a benchmark ran on, for its table: CPU model and load.

Example:
    >>> isinstance(cpu_model(), str) and isinstance(load_average(), str)
    True
"""

from __future__ import annotations

import os
import platform


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, or ``"n/a"``."""
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"
