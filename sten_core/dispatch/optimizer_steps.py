"""Whether the running code is a ``torch.optim`` optimizer's step.

An optimizer's state (``exp_avg``, a momentum buffer) made from a sparse parameter keeps
the parameter's pattern: the step reads it at the parameter's stored positions only, so its
updates with the dense gradient (the default ``grad_fmt``) are stored there, in O(nnz).
Anywhere else, an in-place write into a wrapper that is not a weight (a temporary, a
sparse intermediate: ResNet's ``out += identity``) gives dense torch's result
(``writes.writes_exactly``).

A step is found on the call stack: every optimizer's ``step`` runs inside the wrapper
``Optimizer.profile_hook_step`` puts around it (``Optimizer.__init__`` wraps each class's
``step`` once). The stack is what the thread is running now, so a step left by an exception
is gone with it, and a step compiled with ``torch.compile`` keeps the wrapper's frame around
the parts that run eagerly (torch's global step hooks, tried first, run traced there).

Example:
    >>> import torch
    >>> seen = []
    >>> class Probe(torch.optim.SGD):
    ...     @torch.no_grad()
    ...     def step(self, closure=None):
    ...         seen.append(in_optimizer_step())
    >>> Probe([torch.zeros(1, requires_grad=True)], lr=0.1).step()
    >>> seen, in_optimizer_step()
    ([True], False)
"""

from __future__ import annotations

import sys

import torch

_STEP_CODE = torch.optim.Optimizer.profile_hook_step(lambda *args, **kwargs: None).__code__
"""The code of the wrapper around every optimizer's ``step`` (one code object for all)."""
_STEP_WHERE = (_STEP_CODE.co_filename, _STEP_CODE.co_firstlineno, _STEP_CODE.co_name)


def in_optimizer_step() -> bool:
    """Whether this thread runs inside ``Optimizer.step`` (of any ``torch.optim`` optimizer,
    subclasses included), with autograd off (LBFGS's closure, which the step calls with
    autograd on, is a forward and backward pass, not a state update)."""
    if torch.is_grad_enabled():
        return False
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code is _STEP_CODE or (code.co_name == _STEP_WHERE[2] and code.co_firstlineno == _STEP_WHERE[1]
                                  and code.co_filename == _STEP_WHERE[0]):   # (a compiled frame's code: a copy)
            return True
        frame = frame.f_back
    return False
