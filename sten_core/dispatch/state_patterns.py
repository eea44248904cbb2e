"""Optimizer state follows its weight's pattern.

Inside a ``torch.optim`` step, a sparse weight's state (``exp_avg``, ``square_avg``, made by
``zeros_like(w)``) keeps its own pattern and is read at the weight's stored positions
(``optimizer_steps``). When the weight's pattern changes between steps (``w.data = new``,
``w.set_(...)``, ``load_state_dict`` of a checkpoint with another pattern, a regrowth), state
made before no longer covers it: Adam's regrown weights never moved (their ``exp_avg`` stayed
unstored, so 0) and RMSprop's were divided by ``eps`` (~1e18). A global step pre-hook,
registered the first time a sparse parameter is made, a weight's state is made or loaded or a
wrapper's contents are replaced, moves each such state onto the
weight's pattern before the step: its values where both store, zero at the new positions (as
the masked dense twin has there, whose masked gradients kept it at zero), and positions the
weight no longer stores are dropped (a position pruned and regrown later restarts at zero, as
RigL's regrown connections do). The check is one ``same_pattern`` per state tensor, O(1) while
the two share their index tensors (state made by ``zeros_like(w)`` does).

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

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from sten_core.dispatch.fresh_state import fresh_state

from sten_core.model.layouts import supports_values
from sten_core.model.masks import stored_mask
from sten_core.model.tensor import SparseTensorWrapper, densify, services

_registered = False


def follow_weight_patterns() -> None:
    """Register the step pre-hook that moves optimizer state onto its weight's pattern (once;
    torch is left as it is until a sparse weight's state is made or loaded)."""
    global _registered
    if not _registered:
        register_optimizer_step_pre_hook(_state_follows_weights)
        _registered = True


_seen: dict[int, tuple[weakref.ref, Any]] = {}
"""Each weight's layout at the last step, by ``id`` (its values are the weight's own, updated in
place: no copy is kept), to tell a changed pattern from an unchanged one in O(1)."""


def _state_follows_weights(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if torch.compiler.is_compiling():   # (a compiled step traces its hooks: eager state only)
        return
    with torch.no_grad():
        for group in optimizer.param_groups:
            for weight in group["params"]:
                if isinstance(weight, SparseTensorWrapper):
                    _follow(optimizer, weight)


def _follow(optimizer: torch.optim.Optimizer, weight: SparseTensorWrapper) -> None:
    """``weight``'s state onto its pattern where that changed since the last step (or where it
    was not seen before: state made or loaded before the hook)."""
    layout, entry = weight.wrapped_tensor, _seen.get(id(weight))
    last = entry[1] if entry is not None and entry[0]() is weight else None
    key = id(weight)
    _seen[key] = (weakref.ref(weight, lambda _, key=key: _seen.pop(key, None)), layout)
    if last is not None and (last is layout or (type(last) is type(layout) and supports_values(layout)
                                                and layout.same_pattern(last))):
        return
    state = optimizer.state.get(weight)
    if not state:
        return
    fresh, new = None, stored_mask(weight)
    for name, value in list(state.items()):
        if not isinstance(value, torch.Tensor) or value.shape != weight.shape or not value.is_floating_point():
            continue   # (the step counter, scalars, factored state)
        if isinstance(value, SparseTensorWrapper):
            added = follow_pattern(value, weight)
        elif last is not None:   # dense state (SGD's momentum of the dense gradient): junk off the old pattern
            added = ~(new & stored_mask(SparseTensorWrapper(last)).to(new.device))
        else:
            continue
        if added is None or not bool(added.any()):
            continue
        if fresh is None:
            fresh = fresh_state(optimizer, weight)
        start = fresh.get(name, 0.0)
        if isinstance(value, SparseTensorWrapper):
            if bool(start != 0):
                value.copy_(densify(value).masked_fill(added.to(value.device), start))
        else:
            value.masked_fill_(added.to(value.device), start)


def follow_pattern(state: Any, weight: SparseTensorWrapper) -> torch.Tensor | None:
    """``state`` (a wrapper of ``weight``'s shape) moved onto ``weight``'s pattern, in its layout,
    where ``weight`` stores positions ``state`` does not; the mask of those positions (``None``
    where it is left as it is: state that holds more, grown by gradients of other patterns,
    keeps it)."""
    if not isinstance(state, SparseTensorWrapper) or state.shape != weight.shape:
        return None
    mine, theirs = state.wrapped_tensor, weight.wrapped_tensor
    if mine is theirs or not supports_values(theirs) or getattr(mine, "fills_unstored", False):
        return None
    if type(mine) is type(theirs) and theirs.same_pattern(mine):   # (O(1) while they share indices)
        return None
    added = stored_mask(weight) & ~stored_mask(state).to(theirs.device)
    if not bool(added.any()):
        return None
    values = theirs.gather(densify(state).to(theirs.device))
    state.wrapped_tensor = theirs.with_values(values.to(state.dtype))
    return added


services.install(watch_optimizer_state=follow_weight_patterns)
