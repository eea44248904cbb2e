"""Optimizer state follows its weight's pattern.

Inside a ``torch.optim`` step, a sparse weight's state (``exp_avg``, ``square_avg``, made by
``zeros_like(w)``) keeps its own pattern and is read at the weight's stored positions
(``optimizer_steps``). When the weight's pattern or layout changes between steps (``w.data =
new``, ``w.set_(...)``, ``load_state_dict`` of a checkpoint with another pattern, a regrowth),
state made before no longer fits it: Adam's regrown weights never moved (their ``exp_avg`` was
unstored, so 0), RMSprop's were divided by ``eps`` (~1e18), and SGD's started with the momentum
its dense buffer had gathered off the pattern. A global step pre-hook (registered when the first
sparse weight is made: a parameter, or a wrapper that requires grad) compares each sparse weight's
layout with the one it had at the last step (O(1) while they share their index tensors) and,
where the pattern changed, moves sparse state onto the weight's pattern and layout (its values
kept where both store) and keeps dense state of the weight's shape where the old and new
patterns both store. Every other position starts at the optimizer's initial state
(``fresh_state``: 0 for moments, Adagrad's ``initial_accumulator_value``, Rprop's ``lr``), as
the masked dense twin has there; a position pruned and regrown later restarts, as RigL's
regrown connections do. State grown beyond the weight's pattern by gradients of other
patterns keeps its growth.

Example:
    >>> import torch, sten_core as sten
    >>> w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.tensor([[1., 0.], [0., 1.]])))
    >>> opt = torch.optim.Adam([w], lr=0.1)
    >>> w.grad = torch.ones(2, 2); opt.step()
    >>> w.data = sten.sparsify(sten.KeepAll(), torch.ones(2, 2), sten.CsrTensor)   # every position regrown
    >>> opt.step()
    >>> opt.state[w]["exp_avg"].wrapped_tensor.nnz
    4
"""

from __future__ import annotations

import operator
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from sten_core.dispatch.fresh_state import fresh_state
from sten_core.dispatch.writes import layout_at, stored_mask_of
from sten_core.model.layouts import supports_values
from sten_core.model.masks import stored_mask
from sten_core.model.tensor import SparseTensorWrapper, densify

_registered = False


def follow_weight_patterns() -> None:
    """Register the step pre-hook that moves optimizer state onto its weight's pattern (once;
    torch is left as it is until a sparse weight is made)."""
    global _registered
    if not _registered:
        register_optimizer_step_pre_hook(_state_follows_weights)
        _registered = True


class _Seen:
    """A weight as one optimizer last stepped it: its layout (the values are the weight's own,
    updated in place; after a pattern change the old layout is held until that optimizer's
    next step, or until it is gone) and the state wrappers it had (new ones: state loaded).
    The weight itself is held, as its optimizer holds it: a weak reference to it would make
    ``load_state_dict`` with ``swap_tensors`` refuse it."""

    __slots__ = ("weight", "layout", "states")

    def __init__(self, weight: SparseTensorWrapper):
        self.weight = weight
        self.layout: Any = None
        self.states: tuple = ()


_seen: "weakref.WeakKeyDictionary[torch.optim.Optimizer, dict[int, _Seen]]" = weakref.WeakKeyDictionary()
"""Per optimizer (a wrapping optimizer, Lookahead's or ZeRO's, and the one it wraps each step the
weight), per weight ``id``: the weights of its last step only."""


def _state_follows_weights(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if torch.compiler.is_compiling():   # (a compiled step traces its hooks: eager state only)
        return
    seen, now = _seen.get(optimizer, {}), {}
    with torch.no_grad():
        for group in optimizer.param_groups:
            for weight in group["params"]:
                if isinstance(weight, SparseTensorWrapper) and supports_values(weight.wrapped_tensor):
                    now[id(weight)] = _follow(optimizer, weight, seen.get(id(weight)))
    _seen[optimizer] = now


def _follow(optimizer: torch.optim.Optimizer, weight: SparseTensorWrapper, entry: _Seen | None) -> _Seen:
    """``weight``'s state onto its pattern where that changed since this optimizer's last step,
    or where the state is not what it was then (loaded), or was not seen before."""
    if entry is None or entry.weight is not weight:
        entry = _Seen(weight)
    layout, last = weight.wrapped_tensor, entry.layout
    state = optimizer.state.get(weight) or {}
    states = tuple(v for v in state.values() if isinstance(v, SparseTensorWrapper))
    unchanged = last is not None and (last is layout or (type(last) is type(layout) and layout.same_pattern(last)))
    # state made by this optimizer's last step is on the weight's pattern; other new state was loaded
    made_here = not entry.states or (len(states) == len(entry.states) and all(map(operator.is_, states, entry.states)))
    entry.layout, entry.states = layout, states
    if (unchanged and made_here) or not state:
        return entry
    fresh, new, old = None, stored_mask(weight), None
    if last is not None and not unchanged:
        old = stored_mask_of(last).to(new.device)
    for name, value in list(state.items()):
        if not isinstance(value, torch.Tensor) or value.shape != weight.shape or not value.is_floating_point():
            continue   # (the step counter, scalars, factored state)
        if isinstance(value, SparseTensorWrapper):
            added = _onto_pattern(value, weight, new, None if old is None else old & ~new)
        elif old is not None:   # dense state (SGD's momentum of the dense gradient): junk off the old pattern
            added = ~(new & old)
        else:
            continue
        if added is None or not bool(added.any()):
            continue
        if fresh is None:
            fresh = fresh_state(optimizer, weight)
        start, added = fresh.get(name, 0.0), added.to(value.device)
        start = start.to(value.device) if torch.is_tensor(start) else start
        if not isinstance(value, SparseTensorWrapper):
            value.masked_fill_(added, start)
        elif bool(start != 0):
            value.copy_(densify(value).masked_fill(added, start))
    return entry


def _onto_pattern(state: SparseTensorWrapper, weight: SparseTensorWrapper, wanted: torch.Tensor,
                  dropped: torch.Tensor | None) -> torch.Tensor | None:
    """``state`` (of ``weight``'s shape) made to store every position ``weight`` stores
    (``wanted``), in ``weight``'s layout class, less the positions ``weight`` has just dropped:
    where that class can store what remains of its own pattern too, those positions stay (state
    grown by gradients of other patterns keeps its growth), else it takes ``weight``'s pattern.
    The mask of the positions it gained (``None`` where it already stores them all)."""
    mine, theirs = state.wrapped_tensor, weight.wrapped_tensor
    if mine is theirs or getattr(mine, "fills_unstored", False):
        return None
    if type(mine) is type(theirs) and theirs.same_pattern(mine):   # (O(1) while they share indices)
        return None
    had = stored_mask(state).to(theirs.device)
    added = wanted & ~had
    if not bool(added.any()):
        return None
    dense = densify(state).to(theirs.device)
    kept = had & ~wanted if dropped is None else had & ~wanted & ~dropped
    grown = layout_at(type(theirs), dense, kept | wanted) if bool(kept.any()) else None
    if grown is None:
        grown = theirs.with_values(theirs.gather(dense).to(state.dtype))
    state.wrapped_tensor = grown
    return added
