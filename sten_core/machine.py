"""The machine code runs on, for benchmark tables and per-machine caches: CPU model and load.

Example:
    >>> isinstance(cpu_model(), str) and isinstance(load_average(), str)
    True
"""

from __future__ import annotations

import functools
import os
import platform


@functools.lru_cache(maxsize=None)
def cpu_model() -> str:
    """The CPU's model name with its family/model numbers (``/proc/cpuinfo`` on Linux: a
    virtual machine may name only "AMD EPYC" for Zen 1 to Zen 5), else the platform's
    processor string. Read once per process (per-call caches ask for it)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                name, _, value = line.partition(":")
                name = name.strip()
                if not name:  # the first processor's block ends here
                    break
                fields.setdefault(name, value.strip())
    except OSError:
        pass
    if "model name" in fields:
        return f"{fields['model name']} (family {fields.get('cpu family', '?')} model {fields.get('model', '?')})"
    return platform.processor() or platform.machine() or "unknown CPU"


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, or ``"n/a"``."""
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"
