"""Optimizer state follows its weight's pattern.

Inside a ``torch.optim`` step, a sparse weight's state (``exp_avg``, ``square_avg``, made by
``zeros_like(w)``) keeps its own pattern and is read at the weight's stored positions
(``optimizer_steps``). When the weight's pattern changes between steps (``w.data = new``,
``w.set_(...)``, ``load_state_dict`` of a checkpoint with another pattern, a regrowth), state
made before no longer covers it: Adam's regrown weights never moved (their ``exp_avg`` stayed
unstored, so 0) and RMSprop's were divided by ``eps`` (~1e18). A global step pre-hook,
registered the first time a weight's state is made or loaded, moves each such state onto the
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

from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from sten_core.model.layouts import supports_values
from sten_core.model.tensor import SparseTensorWrapper, densify

_registered = False


def follow_weight_patterns() -> None:
    """Register the step pre-hook that moves optimizer state onto its weight's pattern (once;
    torch is left as it is until a sparse weight's state is made or loaded)."""
    global _registered
    if not _registered:
        register_optimizer_step_pre_hook(_state_follows_weights)
        _registered = True


def _state_follows_weights(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if torch.compiler.is_compiling():   # (a compiled step traces its hooks: eager state only)
        return
    with torch.no_grad():
        for group in optimizer.param_groups:
            for weight in group["params"]:
                if isinstance(weight, SparseTensorWrapper):
                    for value in optimizer.state.get(weight, {}).values():
                        follow_pattern(value, weight)


def follow_pattern(state: Any, weight: SparseTensorWrapper) -> None:
    """``state`` (a wrapper of ``weight``'s shape and layout class) moved onto ``weight``'s
    pattern where the two differ; anything else is left as it is."""
    if not isinstance(state, SparseTensorWrapper) or state.shape != weight.shape:
        return
    mine, theirs = state.wrapped_tensor, weight.wrapped_tensor
    if mine is theirs or type(mine) is not type(theirs) or not supports_values(theirs):
        return
    if theirs.same_pattern(mine):
        return
    values = theirs.gather(densify(state).to(theirs.device))
    state.wrapped_tensor = theirs.with_values(values.to(mine.values().dtype))
