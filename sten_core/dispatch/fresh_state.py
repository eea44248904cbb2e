"""The state an optimizer gives a new parameter, per element-wise entry (``fresh_state``): what a
position new to a sparse weight's pattern starts with (``SparsityScheduler`` regrowth,
``state_patterns`` when a weight's pattern changes between steps).

Example:
    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(2, 2))
    >>> fresh_state(torch.optim.Adagrad([w], initial_accumulator_value=0.3), w)["sum"].item()
    0.30000001192092896
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch


def fresh_state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, torch.Tensor]:
    """The value every position of a new parameter like ``param`` starts with, per
    element-wise state entry of ``optimizer`` (``{}`` when that cannot be found).

    Found from the optimizer itself: a copy of its class, with the hyperparameters of
    ``param``'s group, takes one step with a zero gradient on a one-element zero
    parameter (for torch's optimizers the state then is the initial one: Rprop's
    ``step_size`` is ``lr``, Adagrad's ``sum`` is ``initial_accumulator_value``,
    Adam's moments are 0). Scalar state (the ``step`` counter) is not included. The probe's step
    is a real one: global optimizer step hooks see it too.

    >>> w = torch.nn.Parameter(torch.ones(2, 2))
    >>> fresh_state(torch.optim.Rprop([w], lr=0.5), w)["step_size"].item()
    0.5
    """
    group = next((g for g in optimizer.param_groups if any(p is param for p in g["params"])), None)
    if group is None:
        return {}
    dummy = torch.nn.Parameter(torch.zeros((1,) * param.dim(), dtype=param.dtype, device=param.device))
    try:
        probe = type(optimizer)([dummy], **_init_kwargs(type(optimizer), optimizer.defaults))
        probe.param_groups[0].update({k: v for k, v in group.items() if k != "params"})
        dummy.grad = torch.zeros_like(dummy)
        probe.step()
    except Exception as err:  # an optimizer that cannot be rebuilt this way: zero state, said once
        _warn_once(type(optimizer), f"STen: cannot find the initial state of {type(optimizer).__name__} "
                                    f"({type(err).__name__}: {err}); positions new to a sparse weight's pattern "
                                    "(regrown) start with zero state")
        return {}
    return {k: v.detach().reshape(()) for k, v in probe.state[dummy].items()
            if isinstance(v, torch.Tensor) and v.shape == dummy.shape}


def _init_kwargs(cls: type, defaults: dict) -> dict:
    """The entries of an optimizer's ``defaults`` that its constructor takes (AdamW's
    ``defaults`` hold ``decoupled_weight_decay``, which its constructor fixes)."""
    try:
        accepted = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return dict(defaults)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in accepted}


_warned: set = set()


def _warn_once(key: Any, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)
