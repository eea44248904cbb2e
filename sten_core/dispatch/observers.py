"""Observers of dispatch: callables told about each call (``sten.explain``
records with one). Observers are per thread or task (a context variable), so an
``explain()`` in one thread records only that thread's calls.

Example:
    >>> import torch, sten_core as sten
    >>> events = []
    >>> with sten.dispatch.observed(events.append):
    ...     _ = sten.sparsify(sten.KeepAll(), torch.ones(2), sten.DenseTensor)
    >>> [event["kind"] for event in events]     # KeepAll into DenseTensor is a conversion
    ['convert', 'sparsifier']
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator

from sten_core.model.registry import OpKey

Observer = Callable[[dict], None]
_observers: contextvars.ContextVar[tuple] = contextvars.ContextVar("sten_dispatch_observers", default=())
active = _observers.get
"""``active()``: the observers in force here (a tuple; empty: dispatch skips timing)."""


@contextlib.contextmanager
def observed(observer: Observer) -> Iterator[None]:
    """Tell ``observer`` about every dispatched call in this thread or task inside the block."""
    token = _observers.set(_observers.get() + (observer,))
    try:
        yield
    finally:
        _observers.reset(token)


def add_observer(observer: Observer) -> None:
    """Tell ``observer`` about every dispatched call in this thread or task from
    now on, until ``remove_observer`` (``observed`` is the block form)."""
    _observers.set(_observers.get() + (observer,))


def remove_observer(observer: Observer) -> None:
    """Stop telling ``observer`` (added here by ``add_observer``)."""
    current = list(_observers.get())
    current.remove(observer)
    _observers.set(tuple(current))


def notify(kind: str, key: OpKey, plan: str, seconds: float) -> None:
    """Tell the observers about one call: ``kind`` is ``op``, ``sparsifier`` or
    ``convert``; ``plan`` how it ran (a ``PlanKind`` value, or ``identity`` /
    ``convert`` for sparsifiers)."""
    event = {"kind": kind, "key": key, "plan": str(plan), "seconds": seconds}
    for observer in _observers.get():
        observer(event)
