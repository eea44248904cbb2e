"""Where a call enters dispatch: ``dispatch_call`` (wrappers' ``__torch_function__``
and sparse operators), with its fast path for call shapes seen before, and
``sparsified_op`` (the paper's sparse operators).

Example:
    >>> import torch, sten_core as sten
    >>> add = sten.sparsified_op(torch.add, out_fmt=(sten.KeepAll(), torch.Tensor,
    ...     sten.ScalarFractionSparsifier(0.5), sten.CsrTensor))
    >>> type(add(torch.ones(2, 2), torch.eye(2)).wrapped_tensor).__name__
    'CsrTensor'
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from sten_core.dispatch.autograd import (any_requires_grad, batched_under_transform, functorch_active,
                                         outside_transform, record)
from sten_core.dispatch.call import (_KEEP_ALL_LIST, CallSpecs, OpContext, _Call, checks_results, finish_outputs,
                                    impl_result)
from sten_core.dispatch.conversions import converted_inputs, refusals
from sten_core.dispatch.dense_path import composite, inplace_with_grad
from sten_core.dispatch.errors import Unsupported, declined, report_missing, traced
from sten_core.dispatch.observers import active
from sten_core.dispatch.plan import (COLLECTIVES, NOT_DIFFERENTIABLE, Plan, PlanKind, is_inplace, plan_for,
                                    remember)
from sten_core.model.registry import OpKey, registry
from sten_core.model.signatures import bind, given_past
from sten_core.model.spec import coerce_specs
from sten_core.model.tensor import DENSE_TYPES, PLAIN_TYPES, WRAPPER_TYPES, SparseTensorWrapper, layout_of
from sten_core.plugins import manager as plugins


def _scan(bound: list) -> tuple[tuple, list[int], bool]:
    """Input layouts (trimmed), tensor positions, and whether any needs grad.

    A list or tuple argument holding wrappers (``torch.cat([w, w])``) has the
    tuple of its items' layouts as its layout; no implementation matches such
    a key, so the call takes the dense path with a warning."""
    layouts: list = []
    positions: list[int] = []
    wrappers = False
    needs_grad = False
    for i, v in enumerate(bound):
        t = type(v)
        if t in PLAIN_TYPES:
            layouts.append(None)
        elif t in WRAPPER_TYPES or (t not in DENSE_TYPES and isinstance(v, SparseTensorWrapper)):
            positions.append(i)
            layouts.append(type(v.wrapped_tensor))
            wrappers = True
        elif t in DENSE_TYPES or isinstance(v, torch.Tensor):
            positions.append(i)
            layouts.append(torch.Tensor)
            needs_grad = needs_grad or v.requires_grad
        elif (t is list or t is tuple) and any(isinstance(item, SparseTensorWrapper) for item in v):
            layouts.append(tuple(layout_of(item) for item in v))
            wrappers = True
            needs_grad = needs_grad or any_requires_grad(*[x for x in v if isinstance(x, torch.Tensor)])
        else:
            layouts.append(None)
    if wrappers and not needs_grad:
        needs_grad = any_requires_grad(*[bound[i] for i in positions])
    while layouts and layouts[-1] is None:
        layouts.pop()
    return tuple(layouts), positions, needs_grad




class _Fast:
    """A positional call shape already resolved to a plan that runs its
    implementation on the inputs as they are (``impl`` or ``generic``), with
    the general path's per-call work (binding, scanning, key, plan look-up)
    done once. Keyed in ``_fast`` by ``(op, output pairs or None, argument
    kinds)``, where a wrapper's kind is its layout class; cleared with the
    plan cache on every registration."""

    __slots__ = ("plan", "fn", "key", "nargs", "pad", "fill", "positions", "inplace", "checks")

    def __init__(self, plan: Plan, key: OpKey, op: Any, args: tuple, bound: list, positions: list[int]):
        n, nargs = len(args), len(bound) if plan.all_args else plan.nargs
        padded = list(bound) + [None] * max(0, nargs - len(bound))
        self.plan, self.fn, self.key, self.nargs = plan, plan.entry.fn, key, nargs
        self.pad = tuple(padded[n:nargs])  # defaults completing the implementation's inputs
        self.fill = tuple(bound[n:])  # defaults completing the bound arguments
        self.positions = tuple(positions)
        self.inplace = is_inplace(op, {})
        self.checks = checks_results(plan, op)

    def record(self, op: Any, args: tuple, kwargs: dict, specs: CallSpecs | None) -> Any:
        """The call as an autograd node."""
        call = _Call(op, args, kwargs, [*args, *self.fill], self.positions, self.key, self.plan, specs)
        return record(call)


_fast: dict[tuple, _Fast] = {}
_forward_ad = torch.autograd.forward_ad
_jit_tracing = torch._C._is_tracing
_PROXY, _FAKE = torch._C._TorchDispatchModeKey.PROXY, torch._C._TorchDispatchModeKey.FAKE


def _is_tracing() -> bool:
    """``torch.jit.trace``, or ``make_fx`` tracing real tensors (``torch.func.linearize`` does): both
    record torch operators only. (torch.compile and torch.export trace fake tensors: their proxy
    mode comes with a fake mode, and the layouts' compiled implementations are custom operators.)"""
    if _jit_tracing():
        return True
    get = torch._C._get_dispatch_mode
    return get(_PROXY) is not None and get(_FAKE) is None


_plugins_ready = [False]  # every plugin loaded: re-checked after each registry change (reset, unload)


def _registry_changed() -> None:
    _fast.clear()
    _plugins_ready[0] = False


registry.on_change(_registry_changed)


def _remember_fast(fast_key: tuple, plan: Plan, key: OpKey, op: Any, args: tuple, bound: list,
                   positions: list[int]) -> None:
    """Cache a positional call's plan by its argument kinds, when the kinds determine its key."""
    n = len(args)
    if (plan.all_args or n <= plan.nargs) and all(p < n for p in positions) and all(
            type(a) in WRAPPER_TYPES or type(a) in DENSE_TYPES or type(a) in PLAIN_TYPES for a in args):
        _fast[fast_key] = _Fast(plan, key, op, args, bound, positions)


def _fast_key(op: Any, pairs: tuple | None, args: tuple) -> tuple:
    """``(op, pairs, kind per argument)``; a wrapper's kind is its layout class."""
    key = [op, pairs]
    for a in args:
        t = type(a)
        key.append(type(a.wrapped_tensor) if t in WRAPPER_TYPES else t)
    return tuple(key)


def dispatch_call(op: Any, args: tuple, kwargs: dict, specs: CallSpecs | None = None) -> Any:
    """Dispatch one call of ``op`` with output specs ``specs`` (``None``: the
    implementation chooses). Positional calls whose argument kinds were
    resolved before to a direct plan skip the general path, unless observers
    are registered."""
    if not _plugins_ready[0]:
        plugins.ensure_loaded()
        _plugins_ready[0] = plugins.loaded()
    if _is_tracing():
        raise traced(op)
    if kwargs or active():
        return _dispatch_general(op, args, kwargs, specs, None)
    pairs = None if specs is None else specs.pairs
    if len(args) == 2:  # the common binary call, unrolled (this is the hot path)
        a, b = args
        ta, tb = type(a), type(b)
        fast_key = (op, pairs, type(a.wrapped_tensor) if ta in WRAPPER_TYPES else ta,
                    type(b.wrapped_tensor) if tb in WRAPPER_TYPES else tb)
    else:
        fast_key = _fast_key(op, pairs, args)
    hit = _fast.get(fast_key)
    if hit is not None:
        if not any_requires_grad(*args):  # nothing to track: _Call.forward less the scan and checks
            if functorch_active() or _forward_ad._current_level >= 0:  # vmap's batched inputs, dual tensors
                return _dispatch_general(op, args, kwargs, specs, None)
            inputs = [*args[:hit.nargs], *hit.pad]
            ctx = OpContext(op, inputs, (args, kwargs))
            try:
                out = hit.fn(ctx, inputs, _KEEP_ALL_LIST if specs is None else specs.sparsifiers)
            except Unsupported as error:
                return _dense_instead(op, args, kwargs, specs, hit.key, hit.fn, error)
            if type(out) not in DENSE_TYPES or hit.checks:
                out = impl_result(hit.plan, ctx, out, hit.checks)
            return out if specs is None else finish_outputs(out, specs, hit.inplace, True)
        if not hit.inplace and torch.is_grad_enabled() and op not in NOT_DIFFERENTIABLE:
            try:
                return hit.record(op, args, kwargs, specs)
            except Unsupported as error:
                return _dense_instead(op, args, kwargs, specs, hit.key, hit.fn, error)
    return _dispatch_general(op, args, kwargs, specs, fast_key)


def _dispatch_general(op: Any, args: tuple, kwargs: dict, specs: CallSpecs | None, fast_key: tuple | None) -> Any:
    """Bind, scan, key, plan; remember the plan under ``fast_key`` when it is direct."""
    bound = bind(op, args, kwargs)
    inp, positions, needs_grad = _scan(bound)
    key = OpKey("fwd", op, inp, None if specs is None else specs.pairs)
    plan = plan_for(key)
    if plan.entry is not None and not plan.all_args and len(bound) > plan.nargs:
        unseen = given_past(op, bound, plan.nargs, kwargs)
        if unseen:  # the implementation would run without them: the dense path, saying why
            return _dense_instead(op, args, kwargs, specs, key, plan.entry.fn, Unsupported(
                f"this call gives {', '.join(unseen)}, and the implementation receives the {plan.nargs} "
                f"argument{'s' if plan.nargs != 1 else ''} its pattern lists; list the argument in inp "
                "(None for a non-tensor) or end inp with ... to receive every argument"))
    if fast_key is not None and plan.direct:
        _remember_fast(fast_key, plan, key, op, args, bound, positions)
    grad = needs_grad and torch.is_grad_enabled() and op not in NOT_DIFFERENTIABLE
    if is_inplace(op, kwargs):
        collective = op in COLLECTIVES   # (writes its tensors outside autograd, as for a dense parameter:
        # dist.broadcast(p, 0) on a sparse one raised "a leaf Variable that requires grad ... in-place")
        if grad and getattr(op, "__module__", None) != "torch.nn.init" and not collective:  # (nn.init: no_grad inside)
            return inplace_with_grad(op, args, kwargs, bound, key, plan)
        try:
            with torch.no_grad() if collective else outside_transform(args, kwargs, op):
                return _Call(op, args, kwargs, bound, positions, key, plan, specs).forward(detach=needs_grad)
        except Unsupported as error:
            return _dense_instead(op, args, kwargs, specs, key, plan.entry.fn, error)
    if not grad and (functorch_active() or _forward_ad._current_level >= 0):
        dense = batched_under_transform(_Call(op, args, kwargs, bound, positions, key, plan, specs))
        if dense is not None:
            return dense
        with outside_transform(args, kwargs, op):   # nothing of a transform's: outside it
            return _run_planned(op, args, kwargs, bound, positions, key, plan, specs, grad, needs_grad)
    return _run_planned(op, args, kwargs, bound, positions, key, plan, specs, grad, needs_grad)


def _converted(key: OpKey, plan: Plan, bound: list, positions: list, needs_grad: bool) -> tuple[Plan, list | None]:
    """A convert plan's inputs converted, or the dense path's plan where a conversion refused them (with
    its warning, once per key). A plan reached through the ``sten_convert`` hook comes with the other
    implementations the hook might reach: on the key's first call the hook is asked for each in turn, and
    the first it serves (or the dense path, where it serves none) is the key's plan from then on."""
    if not plan.alternatives:
        converted = converted_inputs(bound, positions, plan, detach=needs_grad)
        if converted is None:  # a conversion refused these inputs: the dense path, with its warning
            report_missing(key, refusals.get(plan.key))  # (once per key: the fallback's own call is then silent)
            plan = Plan(PlanKind.FALLBACK, key)
        return plan, converted
    for candidate in (plan,) + plan.alternatives:
        converted = converted_inputs(bound, positions, candidate, detach=needs_grad)
        if converted is not None:
            settled = Plan(PlanKind.CONVERT, candidate.key, candidate.entry, candidate.conversions)
            return remember(key, settled), converted
    tried = ", ".join("(" + ", ".join(getattr(c, "__name__", "None") for c in p.key.inp) + ")"
                      for p in (plan,) + plan.alternatives)
    refusals[key] = f"the sten_convert hook turned these inputs into none of the layouts with an implementation: " \
                    f"{tried}"
    report_missing(key, refusals[key])
    return remember(key, Plan(PlanKind.FALLBACK, key)), None


def _run_planned(op: Any, args: tuple, kwargs: dict, bound: list, positions: list, key: OpKey, plan: Plan,
                 specs: CallSpecs | None, grad: bool, needs_grad: bool) -> Any:
    """A call that is not in place by its plan: converted inputs, the dense path, or the
    implementation (recorded for autograd when ``grad``)."""
    converted = None
    if plan.kind is PlanKind.CONVERT:
        plan, converted = _converted(key, plan, bound, positions, needs_grad)
    if not plan.direct and plan.kind is not PlanKind.CONVERT:
        return composite(op, args, kwargs, key, plan, specs, grad)
    call = _Call(op, args, kwargs, bound, positions, key, plan, specs)
    call.converted = converted
    try:
        if grad:
            return record(call)
        return call.forward(detach=needs_grad)
    except Unsupported as error:
        return _dense_instead(op, args, kwargs, specs, key, plan.entry.fn, error)


def _dense_instead(op: Any, args: tuple, kwargs: dict, specs: CallSpecs | None, key: OpKey, impl: Any,
                   error: Unsupported) -> Any:
    """The dense path for a call whose implementation declined it (``Unsupported``); an
    in-place call (reached outside autograd only) is written back into its target, as one
    without an implementation is."""
    declined(key, impl, error)  # (warned once per key: the fallback's own report is then silent)
    if is_inplace(op, kwargs):
        fallback = Plan(PlanKind.FALLBACK, key)
        return _Call(op, args, kwargs, list(args), (), key, fallback, specs).forward(detach=False)
    grad = torch.is_grad_enabled() and any_requires_grad(*args, *kwargs.values())
    return composite(op, args, kwargs, key, Plan(PlanKind.FALLBACK, key), specs, grad)


def call_op(op: Any, args: tuple, kwargs: dict, out_specs: tuple | None = None,
            grad_out_specs: tuple | None = None) -> Any:
    """Dispatch one call of ``op`` (the entry point of wrappers and sparse ops);
    ``out_specs`` / ``grad_out_specs`` are tuples of ``OutputSpec``."""
    return dispatch_call(op, args, kwargs, None if out_specs is None else CallSpecs(out_specs, grad_out_specs))


def sparsified_op(orig_op: Callable, out_fmt: Any, grad_out_fmt: Any = None) -> Callable:
    """A sparse operator: ``orig_op`` whose outputs (and gradients of its
    outputs) are sparsified by the given output specs.

    Args:
        orig_op: any torch callable, e.g. ``torch.add``.
        out_fmt: one ``(inline_sparsifier, tmp_format, external_sparsifier,
            out_format)`` per output (a single 4-tuple is accepted).
        grad_out_fmt: the same for the gradients flowing into the outputs.
    """
    if not callable(orig_op):
        raise TypeError(f"orig_op must be callable, got {orig_op!r}")
    out_specs = coerce_specs(out_fmt, "out_fmt")
    if out_specs is None:
        raise ValueError("out_fmt is required: one 4-tuple per output")
    grad_specs = coerce_specs(grad_out_fmt, "grad_out_fmt")

    specs = CallSpecs(out_specs, grad_specs)

    def sparse_op(*args: Any, **kwargs: Any) -> Any:
        return dispatch_call(orig_op, args, kwargs, specs)

    sparse_op.__name__ = f"sparse_{getattr(orig_op, '__name__', 'op')}"
    sparse_op.__wrapped__ = orig_op  # type: ignore[attr-defined]
    return sparse_op
