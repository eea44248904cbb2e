"""Operator and sparsifier dispatch (paper §3, "Operator implementations").

Resolution order for a call, cached per key so a repeated call costs a dict
look-up:

1. an implementation registered for exactly these input layouts and outputs;
2. one found through the ``sten_resolve_op`` hook (generic implementations);
3. a lossless conversion of the inputs to layouts that have an implementation;
4. the dense fallback: densify, run the original op, sparsify the outputs, with
   one ``DispatchWarning`` per key (or a ``DispatchError`` in ``"raise"`` mode).

The same chain serves backward and sparsifiers. The modules, in the order a
call meets them: ``entry`` (the call and its fast path), ``plan`` (resolution),
``conversions``, ``sparsifier_dispatch``, ``call`` (a call with an implementation, forward and
backward), ``autograd`` (its node), ``dense_path`` (native and fallback calls),
``writes`` and ``optimizer_steps`` (what an in-place write does to a wrapper), ``errors``
(failure mode, warnings), ``observers`` (``explain``), ``compiled``
(``torch.compile``), ``eager_only`` (the dispatcher is never a compiled frame).

Example:
    >>> import torch, sten_core as sten
    >>> add = sten.sparsified_op(torch.add, out_fmt=(sten.KeepAll(), torch.Tensor,
    ...     sten.ScalarFractionSparsifier(0.5), sten.CsrTensor))
    >>> type(add(torch.ones(2, 2), torch.eye(2)).wrapped_tensor).__name__
    'CsrTensor'
"""

from sten_core.dispatch import compiled
from sten_core.dispatch.autograd import dense_with_grad
from sten_core.dispatch.call import CallSpecs, OpContext
from sten_core.dispatch.conversions import conversion_path, convert, wrap
from sten_core.dispatch.entry import call_op, dispatch_call, sparsified_op
from sten_core.dispatch.errors import (DispatchError, DispatchWarning, Unsupported, failure_mode, get_dispatch_failure,
                                       lossy_fallback, quiet_fallbacks, reset_warnings, set_dispatch_failure)
from sten_core.dispatch.observers import (add_note_listener, add_observer, listening_to_notes, note, observed,
                                          observing, remove_note_listener, remove_observer)
from sten_core.dispatch.plan import Plan, PlanKind, clear_caches, plan_for, plan_of
from sten_core.dispatch.sparsifier_dispatch import apply_spec, same_format_layout, sparsify
from sten_core.dispatch.state_patterns import follow_weight_patterns
from sten_core.dispatch.writes import accumulate, run_dense_in_place, sum_growing
from sten_core.model.tensor import layout_of, services

services.install(dispatch_call=dispatch_call, dense_with_grad=dense_with_grad,
                 same_format_layout=same_format_layout, convert=convert, accumulate=accumulate,
                 run_dense_in_place=run_dense_in_place, sum_growing=sum_growing,
                 watch_optimizer_state=follow_weight_patterns)

__all__ = [
    "add_note_listener", "add_observer", "clear_caches", "listening_to_notes", "note", "observing",
    "remove_note_listener", "remove_observer", "CallSpecs", "DispatchError", "DispatchWarning", "OpContext", "Plan", "PlanKind", "apply_spec", "call_op",
    "compiled", "conversion_path", "convert", "dense_with_grad", "dispatch_call", "failure_mode",
    "get_dispatch_failure", "layout_of", "lossy_fallback", "observed", "plan_for", "plan_of", "quiet_fallbacks",
    "reset_warnings", "same_format_layout", "set_dispatch_failure", "sparsified_op", "sparsify", "Unsupported", "wrap",
]
