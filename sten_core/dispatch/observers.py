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


_note_listeners: contextvars.ContextVar[tuple] = contextvars.ContextVar("sten_note_listeners", default=())


def observing() -> bool:
    """Whether anyone listens to ``note`` here (a plugin may skip building its text)."""
    return bool(_note_listeners.get())


def note(text: "str | Callable[[], str]") -> None:
    """Say which variant an implementation picked inside the dispatched call that is
    running (e.g. the kernel chosen by tuning); ``explain`` shows it under that call's
    row. ``text`` may be a callable, called only when someone listens. Notes go to note
    listeners (``listening_to_notes``), not to the observers of dispatched calls.

    >>> heard = []
    >>> with listening_to_notes(heard.append):
    ...     note(lambda: "kernel: dense GEMM (tuned)")
    >>> heard
    ['kernel: dense GEMM (tuned)']
    """
    listeners = _note_listeners.get()
    if not listeners:
        return
    message = text() if callable(text) else str(text)
    for listener in listeners:
        listener(message)


def add_note_listener(listener: Callable[[str], None]) -> None:
    """Hear every ``note`` in this thread or task from now on (until ``remove_note_listener``)."""
    _note_listeners.set(_note_listeners.get() + (listener,))


def remove_note_listener(listener: Callable[[str], None]) -> None:
    current = list(_note_listeners.get())
    current.remove(listener)
    _note_listeners.set(tuple(current))


@contextlib.contextmanager
def listening_to_notes(listener: Callable[[str], None]) -> Iterator[None]:
    """Block form of ``add_note_listener``."""
    token = _note_listeners.set(_note_listeners.get() + (listener,))
    try:
        yield
    finally:
        _note_listeners.reset(token)


def notify(kind: str, key: OpKey, plan: str, seconds: float) -> None:
    """Tell the observers about one call: ``kind`` is ``op``, ``sparsifier`` or
    ``convert``; ``plan`` how it ran (a ``PlanKind`` value, or ``identity`` /
    ``convert`` for sparsifiers)."""
    event = {"kind": kind, "key": key, "plan": str(plan), "seconds": seconds}
    for observer in _observers.get():
        observer(event)
