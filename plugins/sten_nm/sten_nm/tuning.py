"""Per-machine choice of the exact n:m product: the sparse kernel or "decompress the weight
into a scratch buffer + dense GEMM", timed once per (op, shape, pattern, batch bucket,
dtype, threads, ISA) and cached on disk, like FFTW's wisdom. The paper format's forward
(op ``cg_fwd``) chooses its kernel's loop order the same way (``"stream"`` or ``"tiled"``).

* ``STEN_NM_TUNE=0`` turns tuning off (always the sparse kernel);
* ``STEN_NM_TUNE_CACHE`` names the cache file (default
  ``~/.cache/sten_nm/tuning-<cpu>.json``, one file per CPU model: a home directory
  shared by different machines never hands one CPU's timings to another); the file records
  the kernel build and torch version it was timed with (:func:`build`) and is ignored when
  either changed, so a rebuilt kernel or another torch is timed afresh;
* :func:`choices` returns what was chosen (also ``python -m sten_nm.tuning``);
* :func:`status` says, for one key, what tuning chose, would choose or why it is off;
  the products say it to ``sten explain`` through ``plugin_api.note`` (:func:`pick`).

Example:
    >>> from sten_nm import tuning
    >>> tuning.key("fwd", 3072, 768, 2, 4, True, 1000, "float32", 2, "avx2")
    'fwd R=3072 C=768 2:4 a_is_w=1 B~1024 float32 threads=2 avx2'
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import sys
import time
from typing import Callable, Optional

from sten_core.plugin_api import cpu_model, note, observing

KERNEL, DENSE = "kernel", "dense"
_memory: dict[str, dict] = {}
_loaded_from: Optional[str] = None


def enabled() -> bool:
    """Tuning is on unless ``STEN_NM_TUNE`` is ``0`` (or ``off`` / ``false``), and never while
    torch.compile or export traces (fake tensors cannot be timed: the kernels are taken)."""
    if os.environ.get("STEN_NM_TUNE", "1").strip().lower() in ("0", "off", "false", "no"):
        return False
    return not _tracing()


def _tracing() -> bool:
    """torch.compile traces, or fake tensors are active (dynamo's tracing context or a
    ``FakeTensorMode`` on the dispatch stack): the checks of ``torch._guards.detect_fake_mode``
    without its input scan, a quarter of its cost on every tuned call."""
    import torch

    if torch.compiler.is_compiling():
        return True
    ctx = torch._guards.TracingContext.try_get()
    if ctx is not None and ctx.fake_mode is not None:
        return True
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


@functools.lru_cache(maxsize=None)
def build() -> str:
    """What the cached timings were measured with: the kernel library's digest and torch's
    version. A cache file written by another build is ignored (its choices may be stale:
    a faster kernel variant, another dense GEMM). Example: ``"kernel 1a2b3c4d5e6f, torch 2.13.0+cpu"``."""
    import torch

    from . import _kernel

    return f"kernel {_kernel.build_id()}, torch {torch.__version__}"


def cache_path() -> str:
    """The cache file: ``STEN_NM_TUNE_CACHE``, else one per CPU model under ``~/.cache/sten_nm``."""
    named = os.environ.get("STEN_NM_TUNE_CACHE")
    if named:
        return named
    return _default_path(os.environ.get("HOME"), cpu_model())


@functools.lru_cache(maxsize=8)
def _default_path(home: Optional[str], model: str) -> str:
    """``~/.cache/sten_nm/tuning-<slug>-<digest>.json`` for a home directory and CPU model
    (computed once per pair: every tuned call asks)."""
    slug = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")[:40]
    name = f"tuning-{slug}-{hashlib.sha1(model.encode()).hexdigest()[:8]}.json"
    return os.path.join(os.path.expanduser("~"), ".cache", "sten_nm", name)


def batch_bucket(B: int) -> int:
    """Batch rows rounded up to a power of two (one timing per bucket)."""
    return 1 << max(0, (max(1, B) - 1).bit_length())


def key(op: str, R: int, C: int, n: int, m: int, a_is_w: bool, B: int, dtype: str, threads: int, isa: str) -> str:
    return (f"{op} R={R} C={C} {n}:{m} a_is_w={int(a_is_w)} B~{batch_bucket(B)} {dtype} "
            f"threads={threads} {isa}")


def _load() -> dict[str, dict]:
    global _loaded_from
    path = cache_path()
    if _loaded_from != path:
        _memory.clear()
        try:
            with open(path) as f:
                data = json.load(f)
            if isinstance(data, dict) and data.get("build") == build() and isinstance(data.get("choices"), dict):
                _memory.update({k: v for k, v in data["choices"].items()
                                if isinstance(v, dict) and isinstance(v.get("choice"), str)})
        except (OSError, ValueError):
            pass
        _loaded_from = path
    return _memory


def _save() -> None:
    path = cache_path()
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"build": build(), "choices": _memory}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: the choice still holds for this process


def _best_time(fn: Callable[[], object], reps: int) -> float:
    """The fastest of ``reps`` calls: on a loaded machine a call's time only grows (a thread
    descheduled mid-call), so the minimum is the least disturbed estimate."""
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


MIN_ROUNDS = 3
MAX_ROUNDS = 8
CLEAR_MARGIN = 1.05


def _clear(best_times: dict[str, float]) -> bool:
    """Whether the fastest candidate leads the next by ``CLEAR_MARGIN`` (else a close call,
    decided by load noise more than by the kernels: time further rounds). Example:
    ``_clear({"a": 1.0, "b": 1.2})`` is True, ``_clear({"a": 1.0, "b": 1.02})`` False."""
    ts = sorted(best_times.values())
    return len(ts) < 2 or ts[1] >= CLEAR_MARGIN * ts[0]


def choose(k: str, candidates: dict[str, Callable[[], object]], reps: int = 3) -> str:
    """The cached choice for ``k`` (when it names one of ``candidates``: a hand-edited file or
    another version's names are re-tuned), else time the candidates (interleaved) and cache
    the fastest."""
    table = _load()
    if k in table and table[k]["choice"] in candidates:
        return table[k]["choice"]
    times: dict[str, list[float]] = {name: [] for name in candidates}
    rounds = 0
    while True:
        for name, fn in candidates.items():
            times[name].append(_best_time(fn, reps))
        rounds += 1
        med = {name: min(ts) for name, ts in times.items()}
        if rounds >= MAX_ROUNDS or (rounds >= MIN_ROUNDS and _clear(med)):
            break
    best = min(med, key=med.get)
    table[k] = {"choice": best, "ms": {name: round(t * 1e3, 3) for name, t in med.items()}}
    _save()
    return best


def off_reason() -> Optional[str]:
    """Why tuning is off here (``None`` when it is on)."""
    if os.environ.get("STEN_NM_TUNE", "1").strip().lower() in ("0", "off", "false", "no"):
        return f"tuning off via STEN_NM_TUNE={os.environ.get('STEN_NM_TUNE')}"
    if _tracing():
        return "tuning off while torch.compile/export traces"
    return None


def _times(entry: dict) -> str:
    return ", ".join(f"{name} {ms} ms" for name, ms in sorted(entry.get("ms", {}).items()))


def status(k: str) -> str:
    """What tuning says for key ``k``: the cached choice with its timings, ``not tuned yet``
    (the next call times the candidates), or why tuning is off.

    >>> import os
    >>> os.environ["STEN_NM_TUNE"] = "0"
    >>> status("fwd R=8 C=8 2:4 a_is_w=1 B~1 float32 threads=1 avx2")
    'tuning off via STEN_NM_TUNE=0: kernel'
    >>> del os.environ["STEN_NM_TUNE"]
    """
    why = off_reason()
    if why is not None:
        return f"{why}: {KERNEL}"
    entry = _load().get(k)
    if entry is None:
        return "not tuned yet"
    return f"{entry['choice']} (cached; {_times(entry)})"


def pick(k: str, candidates: dict[str, Callable[[], object]], empty: bool = False,
         default: Optional[str] = KERNEL, reps: int = 3) -> Optional[str]:
    """The candidate to run for key ``k`` (``default`` when tuning is off or the call is
    ``empty``), told to ``sten explain`` with the key and how it was chosen."""
    if empty or off_reason() is not None:
        if observing():
            note(f"sten_nm {k}: " + (f"empty batch: {default}" if empty else status(k)))
        return default
    table = _load()
    was_cached = table.get(k, {}).get("choice") in candidates
    choice = choose(k, candidates, reps=reps)
    if observing():
        entry = table.get(k, {})
        how = "cached" if was_cached else "tuned on this call"
        note(f"sten_nm {k}: {choice} ({how}; {_times(entry)})")
    return choice


def choices() -> dict[str, dict]:
    """Every cached choice: ``{key: {"choice": "kernel" | "dense" | "stream" | "tiled", "ms": {...}}}``."""
    return dict(_load())


def forget() -> None:
    """Drop the cached choices (memory and file)."""
    global _loaded_from
    _memory.clear()
    _loaded_from = cache_path()
    try:
        os.remove(cache_path())
    except OSError:
        pass


if __name__ == "__main__":  # python -m sten_nm.tuning: show the choices
    json.dump({"enabled": enabled(), "cache": cache_path(), "build": build(), "choices": choices()}, sys.stdout, indent=1)
    print()
