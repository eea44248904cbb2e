"""Timing in turns for the sten_nm benchmark scripts (imported from their folder).

    >>> from _timing import in_turns
    >>> len(in_turns([lambda: None, lambda: None], reps=3))
    2
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence


def in_turns(fns: Sequence[Callable[[], object]], reps: int,
             clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Median ms of each function over ``reps`` rounds, the functions timed in turns within a
    round (a change of machine load hits all alike), after one warm-up call each."""
    for fn in fns:
        fn()
    ts: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t = clock()
            fn()
            ts[i].append(clock() - t)
    return [statistics.median(t) * 1e3 for t in ts]
