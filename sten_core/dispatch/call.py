"""One dispatched call that runs an implementation: its context (``OpContext``),
output specs (``CallSpecs``), forward, what it keeps for backward, and backward.

Example:
    >>> import torch, sten_core as sten
    >>> w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(2)), requires_grad=True)
    >>> torch.mm(w, torch.ones(2, 1)).sum().backward()   # one _Call, recorded as one autograd node
    >>> w.grad.shape
    torch.Size([2, 2])
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any

import torch

from sten_core.dispatch.conversions import wrap
from sten_core.dispatch.errors import Unsupported, declined, report_missing
from sten_core.dispatch.observers import active, notify
from sten_core.dispatch.plan import Plan, PlanKind, is_inplace, plan_for
from sten_core.dispatch.result_check import check_result, checks, is_torch_op
from sten_core.dispatch.sparsifier_dispatch import apply_grad_spec, apply_spec, is_grads_batched
from sten_core.dispatch.writes import into_target, run_dense_in_place
from sten_core.model.registry import OpKey, registry, trim
from sten_core.model.signatures import op_name
from sten_core.model.sparsifiers import KeepAll
from sten_core.model.spec import DENSE, OutputSpec
from sten_core.model.tensor import (DENSE_TYPES, PLAIN_TYPES, WRAPPER_TYPES, SparseTensorWrapper, _bump_version,
                                    densify, detach_at, detached, layout_of, map_tensors, services)

_NoTorchFunction = torch._C.DisableTorchFunctionSubclass


class OpContext:
    """The ``ctx`` that implementations receive (shared by forward and backward):
    ``op``, ``inputs`` (bound arguments), ``call_args`` (``(args, kwargs)``),
    ``save_for_backward(*tensors)`` / ``saved_tensors`` and, in backward,
    ``needs_input_grad``."""

    __slots__ = ("op", "inputs", "call_args", "__dict__")  # __dict__: implementations may stash state
    saved_tensors: tuple = ()
    needs_input_grad: tuple = ()

    def __init__(self, op: Any, inputs: list, call_args: tuple = ((), {})):
        self.op = op
        self.inputs = inputs
        self.call_args = call_args

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tensors


class CallSpecs:
    """The output specs of a call, with what dispatch derives from them once:
    ``pairs`` (the key's ``(inline sparsifier class, tmp_format)`` per output)
    and ``sparsifiers`` (the inline sparsifiers implementations receive)."""

    __slots__ = ("out", "grad", "pairs", "sparsifiers")

    def __init__(self, out: tuple, grad: tuple | None = None):
        self.out, self.grad = out, grad
        self.pairs = tuple((type(s.inline_sparsifier), s.tmp_format) for s in out)
        self.sparsifiers = [s.inline_sparsifier for s in out]


_KEEP_ALL_LIST = [KeepAll()]


def run_impl(plan: Plan, ctx: OpContext, specs: CallSpecs | None) -> Any:
    """Call a plan's implementation on ``ctx.inputs`` (``plan.nargs`` of them, or all);
    bare layout objects in its output are wrapped."""
    raw = plan.entry.fn(ctx, ctx.inputs, _KEEP_ALL_LIST if specs is None else specs.sparsifiers)
    return impl_result(plan, ctx, raw, checks_results(plan, ctx.op))


def impl_result(plan: Plan, ctx: OpContext, raw: Any, check: bool) -> Any:
    """An implementation's result ``raw``, bare layout objects wrapped, refused where it can only be a
    mistake (``_check_result``) and, where ``check``, where its shapes or dtypes are not the operator's."""
    if type(raw) not in DENSE_TYPES:
        if raw is None or _foreign_array(raw) or (type(raw) in _NOT_TENSORS and returns_tensors(ctx.op)):
            _check_result(plan, ctx, raw)
        raw = wrap(raw)
    if check and not is_inplace(ctx.op, ctx.call_args[1]):
        check_result(plan.entry.fn, plan.key, ctx.op, ctx.call_args, raw)
    return raw


def checks_results(plan: Plan, op: Any) -> bool:
    """Whether ``plan``'s implementation has its results for ``op`` checked against torch's
    (``result_check``): a registered one of user code or of a plugin outside this repository, for one of
    torch's out-of-place operators that returns tensors (known once per plan)."""
    if plan.checks is None:
        plan.checks = plan.kind is not PlanKind.GENERIC and _checkable(op) and checks(plan.key)
    return plan.checks


@functools.lru_cache(maxsize=None)
def _checkable(op: Any) -> bool:
    return is_torch_op(op) and returns_tensors(op) and not is_inplace(op, {}) and op not in _ARRAY_RESULT_OPS


_NOT_TENSORS = frozenset({int, float, bool, complex, str, list})
"""Results an implementation of an operator that returns tensors only gives by mistake."""


@functools.lru_cache(maxsize=None)
def returns_tensors(op: Any) -> bool:
    """Whether every aten schema of ``op`` (``F.linear``: ``aten::linear``) returns tensors only
    (one or a tuple); ``False`` where one returns something else (``Tensor.dim``, ``torch.split``'s
    list) or there is no such schema (nothing known).

    Example:
        >>> returns_tensors(torch.nn.functional.linear), returns_tensors(torch.Tensor.dim)
        (True, False)
    """
    if isinstance(op, torch._ops.OpOverload):
        schemas = [op._schema]
    else:
        name = getattr(op, "__name__", "")
        schemas = torch._C._jit_get_schemas_for_operator(f"aten::{name}") if name.isidentifier() else []
    return bool(schemas) and all(s.returns and all(str(r.type) == "Tensor" for r in s.returns) for s in schemas)


_ARRAY_RESULT_OPS = frozenset({torch.Tensor.numpy, torch.Tensor.__array__})
"""Operators whose implementations may return a numpy array."""


def _foreign_array(value: Any) -> bool:
    """Whether ``value`` is a numpy array or a scipy sparse matrix (not a numpy scalar)."""
    module = type(value).__module__.split(".")[0]
    return module in ("numpy", "scipy") and hasattr(value, "shape") and (
        type(value).__name__ == "ndarray" or callable(getattr(value, "tocsr", None)))


def _check_result(plan: Plan, ctx: OpContext, raw: Any) -> None:
    """Refuse what an implementation of an out-of-place operator can only have returned by mistake:
    ``None`` (a forgotten ``return``), a numpy / scipy array (a layout's storage not wrapped), or a
    number or list from an operator that returns tensors (``F.linear`` returning ``[y]``); each
    reached the user as the operator's result and failed far from its cause."""
    if raw is None and is_inplace(ctx.op, ctx.call_args[1]):
        return
    if raw is not None and ctx.op in _ARRAY_RESULT_OPS:
        return
    got = "None" if raw is None else f"a value of type {type(raw).__name__}" if type(raw) in _NOT_TENSORS else \
        f"a {type(raw).__module__.split('.')[0]}.{type(raw).__name__}"
    raise TypeError(
        f"the implementation {op_name(plan.entry.fn)} of {plan.key.describe()} returned {got}: an implementation "
        "returns the operator's result (a torch.Tensor, a layout object, which STen wraps, or a tuple of them)")


def finish_outputs(raw: Any, specs: CallSpecs | None, inplace: bool, inline_done: bool) -> Any:
    """Run the outputs through their specs (in-place calls return their target as is)."""
    if specs is None or inplace:
        return raw
    out_specs = specs.out
    if not isinstance(raw, tuple):
        return apply_spec(raw, out_specs[0] if out_specs else DENSE, inline_done)
    out_specs = out_specs + (DENSE,) * (len(raw) - len(out_specs))
    return tuple(apply_spec(v, s, inline_done) for v, s in zip(raw, out_specs))


def is_tensor(value: Any) -> bool:
    """Whether ``value`` is a tensor (a wrapper or a dense one), cheapest test first."""
    t = type(value)
    return t in DENSE_TYPES or t in WRAPPER_TYPES or (t not in PLAIN_TYPES and isinstance(value, torch.Tensor))


class _Slot:
    """A tensor taken out of a stashed tree: ``saved[index]`` (or its
    detached twin when ``twin``)."""

    __slots__ = ("index", "twin")

    def __init__(self, index: int, twin: bool = False):
        self.index, self.twin = index, twin


class _Stash:
    """Tensors that a recorded call keeps for backward, held by autograd
    (``save_for_backward``: version-checked, freed after backward) instead of
    by the node: trees (lists, tuples, dicts) are kept with ``_Slot``s."""

    def __init__(self, originals: list, twins: dict[int, int]):
        self.tensors: list = list(originals)
        self.index = {id(t): i for i, t in enumerate(originals)}
        self.twins = twins  # id(detached twin) -> index of its original

    def take(self, tree: Any) -> Any:
        """``tree`` with each tensor replaced by its ``_Slot``."""
        return map_tensors(self._slot, tree)

    def _slot(self, tensor: torch.Tensor) -> "_Slot":
        i = self.twins.get(id(tensor))
        if i is not None:
            return _Slot(i, twin=True)
        i = self.index.get(id(tensor))
        if i is None:
            i = self.index[id(tensor)] = len(self.tensors)
            self.tensors.append(tensor)
        return _Slot(i)


def _restore(tree: Any, saved: tuple) -> Any:
    """Inverse of ``_Stash.take`` given autograd's saved tensors."""

    def fill(slot: _Slot) -> Any:
        value = saved[slot.index]
        if slot.twin:
            with _NoTorchFunction():
                return detached(value)
        return value

    return map_tensors(fill, tree, leaf=_Slot)


class _Call:
    """One operator call whose plan runs an implementation (``impl``,
    ``generic`` or ``convert``): its arguments, specs and plan, forward and
    backward. A tensor passed at several positions is one input of the
    autograd node (``unique``); its gradients from all positions are summed."""

    __slots__ = ("op", "args", "kwargs", "bound", "positions", "key", "plan", "specs", "ctx", "unique",
                 "n_unique", "slot_of", "grad_specs", "converted", "where", "held", "amp")

    def __init__(self, op: Any, args: tuple, kwargs: dict, bound: list, positions: Any, key: OpKey,
                 plan: Plan, specs: CallSpecs | None):
        self.op, self.args, self.kwargs, self.bound, self.positions = op, args, kwargs, bound, positions
        self.key, self.plan, self.specs = key, plan, specs
        self.ctx: OpContext | None = None
        self.converted: list | None = None  # a convert plan's inputs, converted before the call

    def dedupe(self) -> list:
        """The distinct tensors among the call's tensor arguments, in order."""
        unique: list = []
        slot_of: dict[int, int] = {}
        seen: dict[int, int] = {}
        for p in self.positions:
            v = self.bound[p]
            k = seen.get(id(v))
            if k is None:
                k = seen[id(v)] = len(unique)
                unique.append(v)
            slot_of[p] = k
        self.unique, self.n_unique, self.slot_of = unique, len(unique), slot_of
        return unique

    # forward
    def forward(self, detach: bool = True) -> Any:
        """Run the implementation (or, for an in-place call without one, the
        dense op written back into its target)."""
        plan, op = self.plan, self.op
        started = time.perf_counter() if active() else 0.0
        if plan.kind in (PlanKind.IMPL, PlanKind.GENERIC, PlanKind.CONVERT):
            if self.converted is not None:
                inputs = self.converted
            else:
                inputs = detach_at(self.bound, self.positions) if detach else list(self.bound)
            if not plan.all_args:
                nargs = plan.nargs
                inputs = inputs[:nargs] + [None] * (nargs - len(inputs))
            self.ctx = OpContext(op, inputs, (self.args, self.kwargs))
            raw = run_impl(plan, self.ctx, self.specs)
            if detach:
                inplace = is_inplace(op, self.kwargs)
                raw = own_outputs(raw, inputs, self.bound if inplace else None)
                if inplace and isinstance(self.bound[0], SparseTensorWrapper):
                    _bump_version(self.bound[0])  # it may have written the target's twin, whose counter is its own
            raw = into_target(raw, self.kwargs, self.bound)
        else:  # an in-place call without an implementation, outside autograd
            if plan.kind is PlanKind.FALLBACK:
                report_missing(plan.key)
            raw = run_dense_in_place(op, self.args, self.kwargs)
        if active():
            notify("op", self.key, plan.kind, time.perf_counter() - started)
        return finish_outputs(raw, self.specs, self.specs is not None and is_inplace(op, self.kwargs), plan.fixes_inline)

    def stash(self, fctx: Any, out: Any) -> None:
        """Hand what backward needs to autograd (``save_for_backward``) and drop
        the node's own references to the call's tensors (``out``: the forward's outputs)."""
        self.grad_specs = [grad_spec(v) if is_tensor(v) else None for v in self.bound]
        self.amp = autocast_state(self.unique)  # the dense backward re-runs the op under it
        twins = {}
        ctx = self.ctx
        if ctx is not None and self.plan.kind is not PlanKind.CONVERT:
            for p in self.positions:
                if p < len(ctx.inputs) and ctx.inputs[p] is not self.bound[p]:
                    twins[id(ctx.inputs[p])] = self.slot_of[p]
        stash = _Stash(self.unique, twins)
        args, kwargs = self.args, self.kwargs
        self.args, self.kwargs = stash.take(args), stash.take(kwargs)
        self.bound = stash.take(self.bound)
        if ctx is not None:
            ctx.inputs = stash.take(ctx.inputs)
            call_args = ctx.call_args
            ctx.call_args = (self.args, self.kwargs) if call_args[0] is args and call_args[1] is kwargs \
                else stash.take(call_args)
            ctx.saved_tensors = stash.take(tuple(ctx.saved_tensors)) if ctx.saved_tensors else ()
        # plain tensors (activations) go to autograd: freed after backward, version-checked, seen
        # by saved-tensor hooks; wrappers (weights, mostly) stay with the node, version-checked here
        # (hooks such as save_on_cpu would turn them into dense copies); outputs always go to autograd
        outputs = {id(o) for o in (out if isinstance(out, tuple) else (out,))}
        self.where, saved, held = [], [], []
        for t in stash.tensors:
            if type(t) in WRAPPER_TYPES and id(t) not in outputs:
                with _NoTorchFunction():   # an inference tensor (made under inference_mode) has no counter
                    held.append((t, None if t.is_inference() else t._version))
                self.where.append((True, len(held) - 1))
            else:
                saved.append(t)
                self.where.append((False, len(saved) - 1))
        self.held = held
        fctx.save_for_backward(*saved)
        self.unique = None
        self.converted = None

    def saved(self, from_autograd: tuple) -> tuple:
        """The stashed tensors in stash order: autograd's, and the held wrappers
        (raising, as autograd does, if one was changed in place since)."""
        out = []
        for is_held, j in self.where:
            if not is_held:
                out.append(from_autograd[j])
                continue
            wrapper, version = self.held[j]
            if version is None:
                out.append(wrapper)
                continue
            with _NoTorchFunction():
                now = wrapper._version
            if now != version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: [{type(wrapper).__name__} of {type(wrapper.wrapped_tensor).__name__}, "
                    f"shape {tuple(wrapper.shape)}] is at version {now}; expected version {version} instead.")
            out.append(wrapper)
        return tuple(out)

    def unstash(self, saved: tuple) -> tuple:
        """The stashed trees filled from autograd's saved tensors; returns the
        templates to put back after backward."""
        ctx = self.ctx
        templates = (self.args, self.kwargs, self.bound,
                     None if ctx is None else (ctx.inputs, ctx.call_args, ctx.saved_tensors))
        self.args, self.kwargs = _restore(self.args, saved), _restore(self.kwargs, saved)
        self.bound = _restore(self.bound, saved)
        if ctx is not None:
            ctx.inputs = _restore(ctx.inputs, saved)
            ctx.call_args = _restore(ctx.call_args, saved)
            ctx.saved_tensors = _restore(ctx.saved_tensors, saved)
        return templates

    def restash(self, templates: tuple) -> None:
        self.args, self.kwargs, self.bound, inner = templates
        if inner is not None:
            self.ctx.inputs, self.ctx.call_args, self.ctx.saved_tensors = inner

    # backward
    def backward(self, grads: tuple, needs: tuple) -> tuple:
        """Gradients for the node's (distinct) inputs."""
        grad_outputs = self._grad_outputs(grads)
        grad_specs = self.grad_specs
        pairs = trim(tuple(None if s is None else (type(s.inline_sparsifier), s.tmp_format) for s in grad_specs))
        inp = self.plan.key.inp if self.plan.kind is PlanKind.CONVERT else self.key.inp  # what the forward ran on
        key = OpKey("bwd", self.op, inp, pairs, tuple(layout_of(g) for g in grad_outputs))
        plan = plan_for(key)
        started = time.perf_counter() if active() else 0.0
        slot_of = self.slot_of
        foreign = _foreign_backward(self.plan, plan)
        # is_grads_batched: a batch of gradients (vmap'ed), which the kernels do not take
        if plan.kind is PlanKind.FALLBACK or foreign or any(is_grads_batched(g) for g in grad_outputs):
            if plan.kind is PlanKind.FALLBACK or foreign:
                report_missing(key, foreign)
            by_slot = self._dense_backward(grad_outputs, needs)
            if active():
                notify("op", key, plan.kind, time.perf_counter() - started)
            return self._in_grad_formats(by_slot)
        ctx = self.ctx or OpContext(self.op, detach_at(self.bound, self.positions))
        ctx.needs_input_grad = tuple(i in slot_of and needs[slot_of[i]] for i in range(len(self.bound)))
        sparsifiers = [None if s is None else s.inline_sparsifier for s in grad_specs]
        try:
            raw = plan.entry.fn(ctx, tuple(grad_outputs), sparsifiers)
        except Unsupported as error:  # the dense op's gradients
            declined(key, plan.entry.fn, error)
            return self._in_grad_formats(self._dense_backward(grad_outputs, needs))
        raw = (raw,) if not isinstance(raw, (tuple, list)) else tuple(raw)
        missing = [pos for pos in self.positions if pos >= len(raw) and needs[slot_of[pos]]]
        if missing:  # a forgotten gradient (or return) would leave the input silently untrained
            raise TypeError(
                f"the backward implementation {op_name(plan.entry.fn)} of {key.describe()} returned {len(raw)} "
                f"gradient{'s' if len(raw) != 1 else ''}, but argument{'s' if len(missing) > 1 else ''} "
                f"{', '.join(map(str, missing))} of {op_name(self.op)} need{'s' if len(missing) == 1 else ''} one: "
                "return one gradient (or None) per argument, in the operator's signature order")
        raw = tuple(wrap(g) for g in raw)
        self._check_gradients(raw, needs, plan, key)
        if active():
            notify("op", key, plan.kind, time.perf_counter() - started)
        per_slot: list[list] = [[] for _ in range(self.n_unique)]
        spec_of: list = [None] * self.n_unique
        for pos in self.positions:
            k = slot_of[pos]
            spec_of[k] = grad_specs[pos]
            g = raw[pos] if pos < len(raw) else None
            if g is not None and needs[k]:
                per_slot[k].append(g)
        out = []
        values = self.unique_values
        for k, gs in enumerate(per_slot):
            if not gs:
                out.append(None)
            elif len(gs) == 1:
                out.append(self._formatted(gs[0], spec_of[k], values[k], inline_done=True))
            else:  # the same tensor at several positions: its gradients add up
                total = densify(gs[0])
                for g in gs[1:]:
                    total = total + densify(g)
                out.append(self._formatted(total, spec_of[k], values[k]))
        return tuple(out)

    def _check_gradients(self, raw: tuple, needs: tuple, plan: Plan, key: OpKey) -> None:
        """Refuse gradients that autograd would reject without naming the implementation ("returned
        an invalid gradient at index 1") or take silently: more gradients than the operator has
        arguments, or a gradient whose shape does not sum to its argument's (torch sums a
        broadcast gradient, as for a bias)."""
        what = f"the backward implementation {op_name(plan.entry.fn)} of {key.describe()}"
        if len(raw) > len(self.bound):
            raise TypeError(f"{what} returned {len(raw)} gradients, but {op_name(self.op)} was called with "
                            f"{len(self.bound)} argument(s): return one gradient (or None) per argument")
        for pos in self.positions:
            g = raw[pos] if pos < len(raw) else None
            value = self.bound[pos]
            if g is None or not needs[self.slot_of[pos]] or not isinstance(value, torch.Tensor) \
                    or g.shape == value.shape:
                continue
            try:
                fits = torch.broadcast_shapes(g.shape, value.shape) == g.shape
            except RuntimeError:
                fits = False
            if not fits:
                raise ValueError(f"{what} returned a gradient of shape {tuple(g.shape)} for argument {pos} of "
                                 f"{op_name(self.op)}, of shape {tuple(value.shape)}: a gradient has its "
                                 "argument's shape")

    @staticmethod
    def _formatted(grad: Any, spec: Any, value: Any, inline_done: bool = False) -> Any:
        """An implementation's gradient of ``value`` in its ``grad_fmt``; a wrapper's through
        ``apply_grad_spec`` (a dense gradient for a ``grad_fmt`` naming another layout is held at
        the wrapper's stored positions, as on the dense path; ``apply_spec`` stored every nonzero
        of it, pruned positions included)."""
        if spec is not None and isinstance(value, SparseTensorWrapper):
            return apply_grad_spec(grad, spec, value, inline_done=inline_done)
        return apply_spec(grad, spec, inline_done=inline_done)

    def differentiable_backward(self, grads: tuple, needs: tuple) -> tuple:
        """Gradients for the node's distinct inputs under ``create_graph=True`` (a gradient
        penalty, a Hessian): the op re-run densely on *differentiable* dense views of its inputs
        (a wrapper's through ``dense_with_grad``: its own gradients then reach it in its
        ``grad_fmt``), so the gradients returned have a graph of their own. The implementations
        compute first-order gradients on detached inputs; their results would be constants here,
        and second-order terms (through the weight, or the input's own) silently lost."""
        by_slot = self._dense_backward(self._grad_outputs(grads), needs, create_graph=True)
        return self._in_grad_formats(by_slot)

    def _grad_outputs(self, grads: tuple) -> list:
        """The incoming gradients through the outputs' gradient specs."""
        specs = (self.specs.grad if self.specs is not None else None) or ()
        specs = specs + (DENSE,) * (len(grads) - len(specs))
        return [apply_spec(g, s) for g, s in zip(grads, specs)]

    def _in_grad_formats(self, by_slot: list) -> tuple:
        """Dense gradients per distinct input, each wrapper's in its ``grad_fmt`` (under
        ``create_graph`` with a graph of its own: ``apply_grad_spec`` keeps it)."""
        out = []
        for k, p in enumerate(self._first_positions()):
            g, value = by_slot[k], self.bound[p]
            if g is not None and isinstance(value, SparseTensorWrapper):
                g = apply_grad_spec(g, self.grad_specs[p], value)
            out.append(g)
        return tuple(out)

    def _dense_backward(self, grad_outputs: list, needs: tuple, create_graph: bool = False) -> list:
        """Gradients per distinct input by re-running the op densely under autograd: on detached
        dense leaves, or under ``create_graph`` on differentiable dense views of the inputs (a
        wrapper's through ``dense_with_grad``, a dense tensor itself). The re-run of the op sees
        the forward's autocast state (as ``torch.utils.checkpoint``'s recomputation does): it
        computes in the dtypes the forward computed in, whatever autocast is in force when
        backward runs; the gradients are then taken in backward's own state, as dense torch's."""
        values = self.unique_values
        views: dict[int, torch.Tensor] = {}
        for k, value in enumerate(values):
            if create_graph:
                wrapper = isinstance(value, SparseTensorWrapper)
                dense = services.dense_with_grad(value) if wrapper and value.requires_grad else \
                    densify(value) if wrapper else value
            else:
                dense = densify(value).detach()
                if needs[k] and (dense.is_floating_point() or dense.is_complex()):
                    dense.requires_grad_(True)
            views[id(value)] = dense

        def swap(tensor: torch.Tensor) -> torch.Tensor:
            return views[id(tensor)] if id(tensor) in views else densify(tensor)

        with torch.enable_grad(), autocast_as(self.amp, list(views.values())):
            out = self.op(*map_tensors(swap, self.args), **map_tensors(swap, self.kwargs))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        pairs = [(o, densify(g)) for o, g in zip(outs, grad_outputs)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        inputs = [views[id(v)] for v in values]
        wanted = [k for k, t in enumerate(inputs) if needs[k] and t.requires_grad]
        found = torch.autograd.grad([o for o, _ in pairs], [inputs[k] for k in wanted], [g for _, g in pairs],
                                    allow_unused=True, create_graph=create_graph) if pairs and wanted else ()
        by_slot: list = [None] * len(inputs)
        for k, g in zip(wanted, found):
            by_slot[k] = g
        return by_slot

    def _first_positions(self) -> list:
        """The first argument position of each distinct tensor, by slot."""
        first: dict[int, int] = {}
        for p in self.positions:
            first.setdefault(self.slot_of[p], p)
        return [first[k] for k in range(self.n_unique)]

    @property
    def unique_values(self) -> list:
        """The distinct tensor arguments as they are now (restored in backward)."""
        return [self.bound[p] for p in self._first_positions()]


_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)
_autocast_available = getattr(torch.amp, "is_autocast_available", lambda device_type: device_type in ("cpu", "cuda"))


def _foreign_backward(forward: Plan, backward: Plan) -> str | None:
    """Why the registered ``backward`` cannot follow the ``forward`` that ran, or ``None``: its owner
    registered a forward of its own for this key, which another owner's forward overrides, so the
    context the backward reads was not made by the forward it was written for. (A backward whose owner
    registered no forward here, user code's custom gradient of a built-in forward, follows any.) Such a
    call takes the dense operator's gradients, with a warning.

    Example:
        >>> _foreign_backward(Plan(PlanKind.NATIVE, None), Plan(PlanKind.FALLBACK, None)) is None
        True
    """
    if backward.kind is not PlanKind.IMPL or forward.kind not in (PlanKind.IMPL, PlanKind.CONVERT):
        return None
    ran, owner = registry.owner_of("impls", forward.key), registry.owner_of("impls", backward.key)
    if ran == owner or owner not in registry.registered_by("impls", forward.key):
        return None
    return (f"its backward, {op_name(backward.entry.fn)} (of {owner!r}), belongs to {owner!r}'s forward, which "
            f"{ran!r} overrides: the forward that ran is {op_name(forward.entry.fn)} (of {ran!r}), whose context "
            "that backward cannot read")


def autocast_state(tensors: list) -> tuple | None:
    """The autocast settings in force for the CPU and the device types of ``tensors``:
    ``((device_type, dtype), ...)`` where autocast is on, with the cache setting; ``None``
    where it is on for none (the common case: one check)."""
    if not _any_autocast():
        return None
    with _NoTorchFunction():
        types = {"cpu", *(t.device.type for t in tensors)}
    on = tuple((d, torch.get_autocast_dtype(d)) for d in sorted(types)
               if _autocast_available(d) and torch.is_autocast_enabled(d))
    return (on, torch.is_autocast_cache_enabled()) if on else None


def autocast_as(state: tuple | None, tensors: list) -> contextlib.ExitStack:
    """A context in which autocast is as ``state`` (``autocast_state``'s) says for the CPU and
    the device types of ``tensors``: on where it was on, off elsewhere (a backward called
    inside an autocast region re-runs the op as its forward ran).

    Example:
        >>> import torch
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     state = autocast_state([])
        >>> with autocast_as(state, []):
        ...     torch.mm(torch.ones(1, 1), torch.ones(1, 1)).dtype
        torch.bfloat16
    """
    on = dict(state[0]) if state else {}
    cache = state[1] if state else True
    stack = contextlib.ExitStack()
    for device_type in sorted({"cpu", *on, *(t.device.type for t in tensors)}):
        if device_type in on:
            stack.enter_context(torch.autocast(device_type, dtype=on[device_type], cache_enabled=cache))
        elif _autocast_available(device_type) and torch.is_autocast_enabled(device_type):
            stack.enter_context(torch.autocast(device_type, enabled=False))
    return stack


def grad_spec(value: torch.Tensor) -> OutputSpec:
    fmt = getattr(value, "grad_fmt", None)
    return DENSE if fmt is None else OutputSpec.coerce(fmt, "grad_fmt")


def tensors_in(tree: Any) -> list:
    """The tensors in a tree of lists, tuples and dicts, in order."""
    found: list = []
    map_tensors(found.append, tree)
    return found


def own_outputs(out: Any, inputs: list, originals: list | None = None) -> Any:
    """Outputs that are an input as the implementation saw it (a wrapper's cached
    detached twin) become a new alias: autograd gives outputs a history, and
    the twin must stay private and without one. With ``originals`` (the call's
    own arguments: an in-place call, which returns its target), the argument itself."""
    if type(out) in DENSE_TYPES:
        return out

    def own(o: Any) -> Any:
        if isinstance(o, SparseTensorWrapper):
            for i, given in enumerate(inputs):
                if o is given:
                    if originals is not None and i < len(originals):
                        return originals[i]
                    return SparseTensorWrapper(o.wrapped_tensor, False, o.grad_fmt)
        return o

    return tuple(own(o) for o in out) if isinstance(out, tuple) else own(out)


# ``Function.apply`` without its Python wrapper (default-argument binding and a
