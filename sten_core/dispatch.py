"""Operator and sparsifier dispatch (paper §3, "Operator implementations").

Resolution order for a call, cached per key so a repeated call costs a dict
look-up:

1. an implementation registered for exactly these input layouts and outputs;
2. one found through the ``sten_resolve_op`` hook (generic implementations);
3. a lossless conversion of the inputs to layouts that have an implementation;
4. the dense fallback: densify, run the original op, sparsify the outputs, with
   one ``DispatchWarning`` per key (or a ``DispatchError`` under
   ``set_dispatch_failure("raise")``).

The same chain serves backward and sparsifiers.

Example:
    >>> import torch, sten_core as sten
    >>> add = sten.sparsified_op(torch.add, out_fmt=(sten.KeepAll(), torch.Tensor,
    ...     sten.ScalarFractionSparsifier(0.5), sten.CsrTensor))
    >>> type(add(torch.ones(2, 2), torch.eye(2)).wrapped_tensor).__name__
    'CsrTensor'
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import deque
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.autograd.function import once_differentiable

from . import plugins
from .registry import Entry, OpKey, registry, trim
from .signatures import bind, op_name
from .sparsifiers import KeepAll, SameFormatSparsifier
from .spec import DENSE, OutputSpec, coerce_specs
from .tensor import (DENSE_TYPES, PLAIN_TYPES, WRAPPER_TYPES, SparseTensorWrapper, densify,
                     densify_tree, detached, map_tensors, rebuild_seq, write_back)
from .layouts import builds_from_dense, to_dense_tensor


class DispatchError(RuntimeError):
    """No implementation was found and dense fallbacks are disabled."""


class DispatchWarning(UserWarning):
    """A dense fallback ran because no sparse implementation is registered."""


_failure_mode = "warn"


def set_dispatch_failure(mode: str) -> None:
    """``"warn"``: run the dense fallback with one warning per key;
    ``"raise"``: raise ``DispatchError`` instead."""
    global _failure_mode
    if mode not in ("warn", "raise"):
        raise ValueError(f"mode must be 'warn' or 'raise', got {mode!r}")
    _failure_mode = mode


def get_dispatch_failure() -> str:
    return _failure_mode


# -- plans ------------------------------------------------------------------------

class Plan:
    """How a key is executed: ``kind`` is ``impl``, ``native``, ``convert``,
    ``generic`` or ``fallback``."""

    __slots__ = ("kind", "entry", "conversions", "key", "fixes_inline", "nargs", "direct")

    def __init__(self, kind: str, key: OpKey, entry: Entry | None = None, conversions: tuple = ()):
        self.kind = kind
        self.key = key
        self.entry = entry
        self.conversions = conversions
        # implementations produce tmp_format themselves; the rest need the inline sparsifier applied
        self.fixes_inline = kind in ("impl", "convert", "generic")
        self.nargs = max(entry.nargs, len(key.inp)) if entry is not None else 0
        self.direct = kind in ("impl", "generic")  # runs the implementation on the inputs as they are

    def __repr__(self) -> str:
        return f"Plan({self.kind}, {self.key.describe()})"


_cache: dict[OpKey, Any] = {}  # operator keys → Plan; sparsifier keys → (kind, impl)
_warned: set[OpKey] = set()
_path_cache: dict[tuple[type, type], tuple | None] = {}
_sparsifier_plans: dict[tuple, tuple] = {}  # (sparsifier class, layout, out format) → (kind, impl)
observers: list[Callable[[dict], None]] = []
_DENSE_TYPES, _WRAPPER_TYPES = DENSE_TYPES, WRAPPER_TYPES
_NoTorchFunction = torch._C.DisableTorchFunctionSubclass


def _clear_cache() -> None:
    _cache.clear()
    _fast.clear()
    _path_cache.clear()
    _sparsifier_plans.clear()


registry.on_change(_clear_cache)


def layout_of(value: Any) -> Any:
    """The layout class of a call argument: a layout class, ``torch.Tensor`` or ``None``."""
    t = type(value)
    if t in WRAPPER_TYPES:
        return type(value.wrapped_tensor)
    if t in DENSE_TYPES:
        return torch.Tensor
    if t in PLAIN_TYPES:
        return None
    if isinstance(value, SparseTensorWrapper):
        return type(value.wrapped_tensor)
    if isinstance(value, torch.Tensor):
        return torch.Tensor
    return None


def _fix_text(key: OpKey) -> str:
    def one(i: Any) -> str:
        if isinstance(i, tuple):  # the layouts of a list argument's items
            return "[" + ", ".join(one(x) for x in i) + "]"
        return "None" if i is None else ("torch.Tensor" if i is torch.Tensor else i.__name__)

    def pat(items: Iterable) -> str:
        parts = [one(i) for i in items]
        return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"

    def pairs(items: Iterable) -> str:
        return "[" + ", ".join("None" if p is None else f"({p[0].__name__}, {pat([p[1]])[1:-1].rstrip(',')})" for p in items) + "]"

    if key.direction == "fwd":
        out = key.out if key.out is not None else ((KeepAll, torch.Tensor),)
        return f"@sten.register_fwd_op_impl(operator={op_name(key.op)}, inp={pat(key.inp)}, out={pairs(out)})"
    if key.direction == "bwd":
        return (
            f"@sten.register_bwd_op_impl(operator={op_name(key.op)}, grad_out={pat(key.grad_out)}, "
            f"grad_inp={pairs(key.out)}, inp={pat(key.inp)})"
        )
    return (
        f"@sten.register_sparsifier_implementation(sparsifier={key.op.__name__}, "
        f"inp={pat(key.inp)[1:-2]}, out={pat([key.out])[1:-2]})"
    )


def _missing(key: OpKey, detail: str | None = None) -> None:
    """Warn once per key, or raise, about a dense fallback (``detail``: why, when known)."""
    if key.direction == "sparsifier":
        what = "Sparsifier implementation is not registered"
        then = "Fallback to dense keep all implementation."
    else:
        what = f"Sparse operator implementation is not registered ({key.direction})"
        then = "Fallback to dense implementation."
    message = f"{what}. {key.describe()}. {then} To add one: {_fix_text(key)}"
    if detail:
        what = "No implementation applies to these inputs"
        message = f"{what}: {detail}. {key.describe()}. {then} To add one: {_fix_text(key)}"
    if key.direction == "fwd" and any(isinstance(i, tuple) for i in key.inp):
        message = (f"{what}: wrappers inside a list argument. {key.describe()}. {then} "
                   "Implementations are registered for tensor arguments only: pass the tensors "
                   "densely or call a sparse operator that takes them one by one.")
    _fail(message, key, then)


def lossy_fallback(key: OpKey, kept: int, chosen: int) -> None:
    """A sparsifier's output was pruned again by its layout's ``from_dense``:
    a fallback (warned once per key, raised in raise mode)."""
    out = key.out.__name__
    producers = [k.op.__name__ for k in registry.impls if k.direction == "sparsifier" and k.out is key.out]
    hint = f" Sparsifiers registered to produce it: {', '.join(sorted(set(producers)))}." if producers else ""
    message = (f"Lossy sparsifier output: {key.describe()}: {out}.from_dense kept {kept} of the {chosen} values "
               f"that {key.op.__name__} chose (the layout cannot store its pattern), so the result was pruned "
               f"again.{hint} Use a sparsifier that produces {out} directly, or register one: {_fix_text(key)}")
    _fail(message, ("lossy", key))


@contextlib.contextmanager
def quiet_fallbacks() -> Iterator[None]:
    """Silence ``DispatchWarning`` inside the block without using up the
    once-per-key warnings: fallbacks first met inside still warn after it.

    Example:
        >>> import sten_core as sten
        >>> with sten.dispatch.quiet_fallbacks():
        ...     pass
    """
    given = set(_warned)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DispatchWarning)
        try:
            yield
        finally:
            _warned.intersection_update(given)


def _fail(message: str, key: Any, then: str = "") -> None:
    """Raise ``message`` as a ``DispatchError`` in raise mode; else warn once per ``key``."""
    if _failure_mode == "raise":
        raise DispatchError(message.replace(then + " ", "") if then else message)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, DispatchWarning, stacklevel=5)


# -- conversions ------------------------------------------------------------------

def conversion_path(src: type, dst: type) -> tuple | None:
    """The shortest chain of registered lossless conversions from ``src`` to ``dst``."""
    if src is dst:
        return ()
    found = _path_cache.get((src, dst), False)
    if found is not False:
        return found
    edges: dict[type, list[tuple[type, Callable]]] = {}
    for (a, b), fn in registry.conversions.items():
        edges.setdefault(a, []).append((b, fn))
    queue, seen, result = deque([(src, ())]), {src}, None
    while queue:
        node, path = queue.popleft()
        for nxt, fn in edges.get(node, []):
            if nxt in seen:
                continue
            if nxt is dst:
                result = path + (fn,)
                queue.clear()
                break
            seen.add(nxt)
            queue.append((nxt, path + (fn,)))
    _path_cache[(src, dst)] = result
    return result


def convert(value: Any, target: type) -> Any:
    """Convert a wrapper (or dense tensor) to the layout ``target``, losslessly.

    Uses registered conversions, then the ``sten_convert`` hook, then a round
    trip through dense. Returns a dense tensor for ``torch.Tensor``.
    """
    plugins.ensure_loaded()
    if not observers:
        return _convert(value, target)
    source = layout_of(value)
    started = time.perf_counter()
    result = _convert(value, target)
    if source is not target:
        _notify("convert", OpKey("convert", None, (source,), target), "convert", time.perf_counter() - started)
    return result


def _convert(value: Any, target: type) -> Any:
    if target is torch.Tensor:
        return densify(value)
    if isinstance(value, SparseTensorWrapper):
        layout = value.wrapped_tensor
        if type(layout) is target:
            return value
        path = conversion_path(type(layout), target)
        if path is not None:  # a step may refuse this tensor (shape, dtype, device): callers decide
            for fn in path:
                layout = fn(layout)
            return SparseTensorWrapper(layout)
        hooked = plugins.get_plugin_manager().hook.sten_convert(tensor=layout, target=target)
        if hooked is not None:
            return SparseTensorWrapper(hooked)
        value = to_dense_tensor(layout)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"cannot convert {type(value).__name__} to {target.__name__}")
    if not builds_from_dense(target):
        raise DispatchError(
            f"{target.__name__} has no from_dense, so a dense tensor cannot be converted to it. Register a "
            f"sparsifier implementation that produces it: @sten.register_sparsifier_implementation("
            f"sparsifier=..., inp=torch.Tensor, out={target.__name__})")
    return SparseTensorWrapper(target.from_dense(value.detach()))


def same_format_layout(target: SparseTensorWrapper, dense: torch.Tensor) -> Any:
    """A layout of ``target``'s type holding ``dense`` at ``target``'s positions,
    made by the ``SameFormatSparsifier`` implementation for that layout (an
    in-place update of a layout without the stored-values protocol)."""
    layout_cls = type(target.wrapped_tensor)
    result = _sparsify(SameFormatSparsifier(target), dense, layout_cls)
    if not isinstance(result, SparseTensorWrapper) or type(result.wrapped_tensor) is not layout_cls:
        raise DispatchError(
            f"an in-place update of a {layout_cls.__name__} needs a SameFormatSparsifier implementation "
            f"producing it: @sten.register_sparsifier_implementation(sparsifier=sten.SameFormatSparsifier, "
            f"inp=torch.Tensor, out={layout_cls.__name__}); the tensor is unchanged")
    return result.wrapped_tensor


def wrap(value: Any) -> Any:
    """Wrap a bare layout object; tensors, wrappers and ``None`` pass through."""
    if type(value) in DENSE_TYPES or type(value) in WRAPPER_TYPES or value is None or isinstance(value, torch.Tensor) or isinstance(value, (int, float, bool)):
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(wrap(v) for v in value)
    if hasattr(value, "to_dense"):
        return SparseTensorWrapper(value)
    return value


# -- sparsifiers --------------------------------------------------------------------

def _resolve_sparsifier(key: OpKey) -> tuple[str, Callable]:
    """``(plan kind, impl)`` for a sparsifier key, by the same chain as operators."""
    sp_cls, (inp,), out = key.op, key.inp, key.out
    entry = registry.impls.get(key)
    if entry is not None:
        return "impl", _call_sparsifier_entry(entry)
    hooked = plugins.get_plugin_manager().hook.sten_resolve_op(key=key)
    if isinstance(hooked, Entry):
        return "generic", _call_sparsifier_entry(hooked)
    if hooked is not None:
        return "generic", lambda sp, t, grad_fmt=None: wrap(hooked(sp, t, grad_fmt))
    if sp_cls is KeepAll:
        if inp is out:
            return "identity", lambda sp, t, grad_fmt=None: t
        return "convert", lambda sp, t, grad_fmt=None: convert(t, out)
    dense_key = OpKey("sparsifier", sp_cls, (torch.Tensor,), out)
    if inp is not torch.Tensor and dense_key in registry.impls:
        impl = _call_sparsifier_entry(registry.impls[dense_key])
        return "convert", lambda sp, t, grad_fmt=None: impl(sp, densify(t), grad_fmt)
    for (k, entry) in list(registry.impls.items()):
        if k.direction == "sparsifier" and k.op is sp_cls and k.inp[0] in (inp, torch.Tensor):
            path = conversion_path(k.out, out) if k.out is not torch.Tensor else None
            if path is not None:
                impl = _call_sparsifier_entry(entry)
                return "convert", lambda sp, t, grad_fmt=None, impl=impl: convert(impl(sp, densify(t), grad_fmt), out)

    buildable = out is torch.Tensor or builds_from_dense(out)

    def fallback(sp: Any, t: Any, grad_fmt: Any = None) -> Any:
        _missing(key)
        # keep all values: in ``out`` when it can be built from a dense tensor, else dense
        return convert(densify(t), out) if buildable else densify(t)

    return "fallback", fallback


def _call_sparsifier_entry(entry: Entry) -> Callable:
    fn = entry.fn
    if entry.arity >= 3:
        return lambda sp, t, grad_fmt=None: wrap(fn(sp, t, grad_fmt))
    return lambda sp, t, grad_fmt=None: wrap(fn(sp, t))


def sparsify(sparsifier: Any, tensor: Any, out_format: type, grad_fmt: Any = None) -> Any:
    """Apply ``sparsifier`` to ``tensor``, producing layout ``out_format``.

    >>> import torch, sten_core as sten
    >>> w = sten.sparsify(sten.ScalarFractionSparsifier(0.75), torch.randn(4, 4), sten.CooTensor)
    >>> w.wrapped_tensor.nnz
    4
    """
    if sparsifier is None or isinstance(sparsifier, (type, str, bytes, int, float, complex, torch.Tensor)):
        raise TypeError(f"sparsifier must be a sparsifier instance (e.g. sten.KeepAll()), got {sparsifier!r}")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor or sparse wrapper, got {type(tensor).__name__}")
    if not isinstance(out_format, type):
        raise TypeError(f"out_format must be a layout class, got {out_format!r}")
    plugins.ensure_loaded()
    return _sparsify(sparsifier, tensor, out_format, grad_fmt)


def _sparsify(sparsifier: Any, tensor: torch.Tensor, out_format: type, grad_fmt: Any = None,
              layout: Any = None) -> Any:
    """``sparsify`` without argument checks (output specs were checked when made);
    ``layout``: the tensor's, when the caller knows it."""
    if layout is None:
        layout = layout_of(tensor)
    resolved = _sparsifier_plans.get((type(sparsifier), layout, out_format))
    if resolved is None:
        resolved = _sparsifier_plan(type(sparsifier), layout, out_format)
    kind, impl = resolved
    if observers:
        started = time.perf_counter()
        result = impl(sparsifier, tensor, grad_fmt)
        _notify("sparsifier", OpKey("sparsifier", type(sparsifier), (layout,), out_format), kind,
                time.perf_counter() - started)
    else:
        result = impl(sparsifier, tensor, grad_fmt)
    if grad_fmt is not None and isinstance(result, SparseTensorWrapper):
        result.grad_fmt = grad_fmt
    return result


def _sparsifier_plan(sp_cls: type, layout: Any, out_format: type) -> tuple[str, Callable]:
    """Resolve (and cache, under its ``OpKey`` and a plain tuple) a sparsifier key."""
    key = OpKey("sparsifier", sp_cls, (layout,), out_format)
    resolved = _cache.get(key)
    if resolved is None:
        resolved = _cache[key] = _resolve_sparsifier(key)
    _sparsifier_plans[(sp_cls, layout, out_format)] = resolved
    return resolved


def apply_spec(value: Any, spec: OutputSpec, inline_done: bool = False) -> Any:
    """Run an output through its spec: inline sparsifier to ``tmp_format``
    (unless already done), then the external one to ``out_format``."""
    t = type(value)
    if t not in DENSE_TYPES and t not in WRAPPER_TYPES and not isinstance(value, torch.Tensor):
        return value
    layout = None
    if not inline_done:
        value = _sparsify(spec.inline_sparsifier, value, spec.tmp_format)
    elif layout_of(value) is not spec.tmp_format:
        value = convert(value, spec.tmp_format)
    else:
        layout = spec.tmp_format
    return _sparsify(spec.external_sparsifier, value, spec.out_format, None, layout)


# -- forward resolution ---------------------------------------------------------

_DENSE_OUT = ((KeepAll, torch.Tensor),)
_KEEP_ALL = KeepAll()
_inplace_ops: dict[Any, bool] = {}


def _is_inplace(op: Any, kwargs: dict) -> bool:
    """Whether a call writes into its first argument (``add_``, ``__iadd__``) or ``out=``."""
    if kwargs and kwargs.get("out") is not None:
        return True
    try:
        return _inplace_ops[op]
    except (KeyError, TypeError):
        name = getattr(op, "__name__", "")
        result = (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")
        try:
            _inplace_ops[op] = result
        except TypeError:
            pass
        return result


def _resolve(key: OpKey) -> Plan:
    entry = registry.impls.get(key)
    if entry is not None:
        return Plan("impl", key, entry)
    if key.out is None:  # an implicit call: a registered dense-output implementation comes first
        entry = registry.impls.get(key._replace(out=_DENSE_OUT))
        if entry is not None:
            return Plan("impl", key._replace(out=_DENSE_OUT), entry)
    hooked = plugins.get_plugin_manager().hook.sten_resolve_op(key=key)
    if hooked is not None:
        entry = hooked if isinstance(hooked, Entry) else Entry(hooked, len(key.inp))
        return Plan("generic", key, entry)
    if key.direction == "bwd":
        return Plan("fallback", key)
    if key.out is None:  # the caller let the implementation choose: dense otherwise
        return _resolve(key._replace(out=_DENSE_OUT))
    if all(layout in (torch.Tensor, None) for layout in key.inp):
        return Plan("native", key)
    best = None
    for cand_key, entry in registry.fwd_candidates(key.op, key.out):
        if len(cand_key.inp) != len(key.inp):
            continue
        steps, ok = [], True
        for have, want in zip(key.inp, cand_key.inp):
            if have is want:
                steps.append(None)
            elif have is None or want is None or want is torch.Tensor:
                ok = False
                break
            else:
                path = conversion_path(have, want)
                if path is None:
                    ok = False
                    break
                steps.append(want)
        if ok and (best is None or sum(s is not None for s in steps) < sum(s is not None for s in best[2])):
            best = (cand_key, entry, tuple(steps))
    if best is not None:
        return Plan("convert", best[0], best[1], best[2])
    return Plan("fallback", key)


def _plan_for(key: OpKey) -> Plan:
    plan = _cache.get(key)
    if plan is None:
        plan = _cache[key] = _resolve(key)
    return plan


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


_KEEP_ALL_LIST = [_KEEP_ALL]


def _run_impl(plan: Plan, ctx: OpContext, specs: CallSpecs | None) -> Any:
    """Call a plan's implementation on ``ctx.inputs`` (``plan.nargs`` of them);
    bare layout objects in its output are wrapped."""
    raw = plan.entry.fn(ctx, ctx.inputs, _KEEP_ALL_LIST if specs is None else specs.sparsifiers)
    return raw if type(raw) in _DENSE_TYPES else wrap(raw)


def _finish(raw: Any, specs: CallSpecs | None, inplace: bool, inline_done: bool) -> Any:
    """Run the outputs through their specs (in-place calls return their target as is)."""
    if specs is None or inplace:
        return raw
    out_specs = specs.out
    if not isinstance(raw, tuple):
        return apply_spec(raw, out_specs[0] if out_specs else DENSE, inline_done)
    out_specs = out_specs + (DENSE,) * (len(raw) - len(out_specs))
    return tuple(apply_spec(v, s, inline_done) for v, s in zip(raw, out_specs))


def _detach_all(values: list, positions: Any) -> list:
    """``values`` with the tensors at ``positions`` detached (see ``detached``)."""
    values = list(values)
    with _NoTorchFunction():
        for i in positions:
            values[i] = detached(values[i])
    return values


_refusals: dict[OpKey, str] = {}  # the last refusal per convert plan, for the fallback's message
_REFUSALS = (ValueError, TypeError, RuntimeError, NotImplementedError)
"""What a conversion raises to say it does not apply (shape, dtype, device, rank)."""


def _converted_inputs(bound: list, positions: list[int], plan: Plan, detach: bool) -> list | None:
    """A convert plan's inputs (detached when ``detach``), or ``None`` if a
    conversion refuses them: one plugin's layouts never break another's calls."""
    inputs = _detach_all(bound, positions) if detach else list(bound)
    try:
        return [convert(v, c) if c is not None else v for v, c in zip(inputs, plan.conversions)] \
            + inputs[len(plan.conversions):]
    except _REFUSALS as error:
        if isinstance(error, (DispatchError, torch.OutOfMemoryError)):
            raise
        steps = ", ".join(f"{layout_of(v).__name__} -> {c.__name__}" for v, c in zip(inputs, plan.conversions)
                          if c is not None)
        _refusals[plan.key] = f"the conversion {steps} refused these inputs ({type(error).__name__}: {error})"
        return None


def _is_tensor(value: Any) -> bool:
    t = type(value)
    return t in _DENSE_TYPES or t in _WRAPPER_TYPES or (t not in PLAIN_TYPES and isinstance(value, torch.Tensor))


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
                 "n_unique", "slot_of", "grad_specs", "converted", "where", "held")

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
        started = time.perf_counter() if observers else 0.0
        if plan.kind in ("impl", "generic", "convert"):
            if self.converted is not None:
                inputs = self.converted
            else:
                inputs = _detach_all(self.bound, self.positions) if detach else list(self.bound)
            nargs = plan.nargs
            inputs = inputs[:nargs] + [None] * (nargs - len(inputs))
            self.ctx = OpContext(op, inputs, (self.args, self.kwargs))
            raw = _run_impl(plan, self.ctx, self.specs)
            if detach:
                raw = _own_outputs(raw, inputs)
        else:  # an in-place call without an implementation, outside autograd
            if plan.kind == "fallback":
                _missing(plan.key)
            args, kwargs = densify_tree((self.args, self.kwargs))
            raw = op(*args, **kwargs)
            if isinstance(self.bound[0], SparseTensorWrapper):
                raw = write_back(self.bound[0], args[0])
        if observers:
            _notify("op", self.key, plan.kind, time.perf_counter() - started)
        return _finish(raw, self.specs, self.specs is not None and _is_inplace(op, self.kwargs), plan.fixes_inline)

    def stash(self, fctx: Any, out: Any) -> None:
        """Hand what backward needs to autograd (``save_for_backward``) and drop
        the node's own references to the call's tensors (``out``: the forward's outputs)."""
        self.grad_specs = [_grad_spec(v) if _is_tensor(v) else None for v in self.bound]
        twins = {}
        ctx = self.ctx
        if ctx is not None and self.plan.kind != "convert":
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
            if type(t) in _WRAPPER_TYPES and id(t) not in outputs:
                with _NoTorchFunction():
                    held.append((t, t._version))
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
        specs = (self.specs.grad if self.specs is not None else None) or ()
        specs = specs + (DENSE,) * (len(grads) - len(specs))
        grad_outputs = [apply_spec(g, s) for g, s in zip(grads, specs)]
        grad_specs = self.grad_specs
        pairs = trim(tuple(None if s is None else (type(s.inline_sparsifier), s.tmp_format) for s in grad_specs))
        inp = self.plan.key.inp if self.plan.kind == "convert" else self.key.inp  # what the forward ran on
        key = OpKey("bwd", self.op, inp, pairs, tuple(layout_of(g) for g in grad_outputs))
        plan = _plan_for(key)
        started = time.perf_counter() if observers else 0.0
        slot_of = self.slot_of
        if plan.kind == "fallback":
            _missing(key)
            by_slot = self._dense_backward(grad_outputs, needs)
            if observers:
                _notify("op", key, plan.kind, time.perf_counter() - started)
            out = []
            for k, g in enumerate(by_slot):
                pos = next(p for p, s in slot_of.items() if s == k)
                out.append(None if g is None else apply_spec(g, grad_specs[pos]))
            return tuple(out)
        ctx = self.ctx or OpContext(self.op, _detach_all(self.bound, self.positions))
        ctx.needs_input_grad = tuple(i in slot_of and needs[slot_of[i]] for i in range(len(self.bound)))
        sparsifiers = [None if s is None else s.inline_sparsifier for s in grad_specs]
        raw = plan.entry.fn(ctx, tuple(grad_outputs), sparsifiers)
        raw = (raw,) if not isinstance(raw, (tuple, list)) else tuple(raw)
        raw = tuple(wrap(g) for g in raw)
        if observers:
            _notify("op", key, plan.kind, time.perf_counter() - started)
        per_slot: list[list] = [[] for _ in range(self.n_unique)]
        spec_of: list = [None] * self.n_unique
        for pos in self.positions:
            k = slot_of[pos]
            spec_of[k] = grad_specs[pos]
            g = raw[pos] if pos < len(raw) else None
            if g is not None and needs[k]:
                per_slot[k].append(g)
        out = []
        for k, gs in enumerate(per_slot):
            if not gs:
                out.append(None)
            elif len(gs) == 1:
                out.append(apply_spec(gs[0], spec_of[k], inline_done=True))
            else:  # the same tensor at several positions: its gradients add up
                total = densify(gs[0])
                for g in gs[1:]:
                    total = total + densify(g)
                out.append(apply_spec(total, spec_of[k]))
        return tuple(out)

    def _dense_backward(self, grad_outputs: list, needs: tuple) -> list:
        """Gradients per distinct input by re-running the op densely under autograd."""
        leaves: dict[int, torch.Tensor] = {}
        for k, value in enumerate(self.unique_values):
            dense = densify(value).detach()
            if needs[k] and (dense.is_floating_point() or dense.is_complex()):
                dense.requires_grad_(True)
            leaves[id(value)] = dense

        def swap(tensor: torch.Tensor) -> torch.Tensor:
            return leaves.get(id(tensor)) if id(tensor) in leaves else densify(tensor)

        with torch.enable_grad():
            out = self.op(*map_tensors(swap, self.args), **map_tensors(swap, self.kwargs))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        pairs = [(o, densify(g)) for o, g in zip(outs, grad_outputs)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        inputs = [leaves[id(v)] for v in self.unique_values]
        wanted = [t for t in inputs if t.requires_grad]
        grads = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True) \
            if pairs and wanted else []
        by_id = {id(t): g for t, g in zip(wanted, grads)}
        return [by_id.get(id(t)) for t in inputs]

    @property
    def unique_values(self) -> list:
        """The distinct tensor arguments as they are now (restored in backward)."""
        first = {}
        for p in self.positions:
            first.setdefault(self.slot_of[p], p)
        return [self.bound[first[k]] for k in range(self.n_unique)]


def _grad_spec(value: torch.Tensor) -> OutputSpec:
    fmt = getattr(value, "grad_fmt", None)
    return DENSE if fmt is None else OutputSpec.coerce(fmt, "grad_fmt")


def _notify(kind: str, key: OpKey, plan: str, seconds: float) -> None:
    """Tell the observers about one call: ``kind`` is ``op``, ``sparsifier`` or
    ``convert``; ``plan`` how it ran (``impl``, ``generic``, ``convert``,
    ``native``, ``identity`` or ``fallback``)."""
    event = {"kind": kind, "key": key, "plan": plan, "seconds": seconds}
    for observer in observers:
        observer(event)


class _DispatchFunction(torch.autograd.Function):
    """The autograd node of a call that runs an implementation."""

    @staticmethod
    def forward(fctx: Any, call: _Call, *tensors: torch.Tensor) -> Any:
        fctx.call = call
        out = call.forward()
        if isinstance(out, tuple):
            fctx.mark_non_differentiable(*[o for o in out if isinstance(o, torch.Tensor) and not o.is_floating_point()])
        call.stash(fctx, out)
        return out

    @staticmethod
    @once_differentiable  # implementations see detached inputs: no double backward (raises, not wrong)
    def backward(fctx: Any, *grads: Any) -> Any:
        call = fctx.call
        templates = call.unstash(call.saved(fctx.saved_tensors))  # raises if an input changed in place since
        try:
            return (None, *call.backward(grads, fctx.needs_input_grad[1:]))
        finally:
            call.restash(templates)


class _Densify(torch.autograd.Function):
    """A wrapper as a dense tensor, differentiably: its gradient comes back in
    the wrapper's ``grad_fmt``."""

    @staticmethod
    def forward(fctx: Any, wrapper: SparseTensorWrapper) -> torch.Tensor:
        fctx.spec = _grad_spec(wrapper)
        return to_dense_tensor(wrapper.wrapped_tensor).detach()

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> Any:
        return apply_spec(grad, fctx.spec)


class _Sparsify(torch.autograd.Function):
    """An output run through its spec, differentiably: the gradient flowing
    into it is sparsified by ``grad_spec``, then made dense for the dense op."""

    @staticmethod
    def forward(fctx: Any, dense: torch.Tensor, spec: OutputSpec, grad_spec: OutputSpec) -> Any:
        fctx.grad_spec = grad_spec
        out = apply_spec(dense, spec)
        return out.view_as(out) if out is dense else out

    @staticmethod
    def backward(fctx: Any, grad: Any) -> Any:
        if fctx.grad_spec is not DENSE:
            grad = apply_spec(grad, fctx.grad_spec)
        return densify(grad), None, None


def dense_with_grad(wrapper: SparseTensorWrapper) -> torch.Tensor:
    """``wrapper`` as a dense tensor whose gradient flows back to it (in its ``grad_fmt``)."""
    return _apply(_Densify, wrapper)


def _differentiable_dense(tree: Any, grad: bool) -> Any:
    """``densify_tree``, keeping the autograd graph of wrappers that require grad."""

    def dense(tensor: torch.Tensor) -> torch.Tensor:
        if grad and isinstance(tensor, SparseTensorWrapper) and tensor.requires_grad:
            return _apply(_Densify, tensor)
        return densify(tensor)

    return map_tensors(dense, tree)


def _composite(op: Any, args: tuple, kwargs: dict, key: OpKey, plan: Plan, specs: CallSpecs | None,
               grad: bool) -> Any:
    """The dense path (``fallback`` and ``native`` plans): wrappers become dense
    tensors through differentiable nodes, the original op runs under ordinary
    autograd, and outputs go through their specs differentiably. Autograd
    itself then handles repeated arguments, tensors in lists, views and
    multiple outputs exactly as for dense tensors."""
    if plan.kind == "fallback":
        _missing(plan.key)
    started = time.perf_counter() if observers else 0.0
    dense_args, dense_kwargs = _differentiable_dense((args, kwargs), grad)
    out = op(*dense_args, **dense_kwargs)
    if observers:
        _notify("op", key, plan.kind, time.perf_counter() - started)
    if specs is None:
        return out
    grad_specs = specs.grad or ()

    def finish(value: Any, i: int) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        spec = specs.out[i] if i < len(specs.out) else DENSE
        grad_spec = grad_specs[i] if i < len(grad_specs) else DENSE
        if spec == DENSE and grad_spec == DENSE:
            return value
        if grad and value.requires_grad:
            return _apply(_Sparsify, value, spec, grad_spec)
        return apply_spec(value, spec)

    if isinstance(out, (tuple, list)):
        return rebuild_seq(out, [finish(v, i) for i, v in enumerate(out)])
    return finish(out, 0)


class _InPlace(torch.autograd.Function):
    """An in-place op on a wrapper under autograd: the dense op, written back at
    the wrapper's stored positions. Backward is the dense op's own, with the
    incoming gradient taken at those positions (the adjoint of the write-back)."""

    @staticmethod
    def forward(fctx: Any, call: tuple, target: SparseTensorWrapper, *others: torch.Tensor) -> Any:
        op, args, kwargs = call
        before = densify(target).clone()
        dense_args, dense_kwargs = densify_tree((args, kwargs))
        written = dense_args[0].clone()
        op(written, *dense_args[1:], **dense_kwargs)
        write_back(target, written)
        fctx.mark_dirty(target)
        fctx.call, fctx.others = call, others
        fctx.specs = [_grad_spec(target)] + [_grad_spec(o) for o in others]
        fctx.save_for_backward(before, SameFormatSparsifier(target).mask(written))
        return target

    @staticmethod
    @once_differentiable
    def backward(fctx: Any, grad: Any) -> Any:
        op, args, kwargs = fctx.call
        before, stored = fctx.saved_tensors
        target = args[0]
        leaves = {id(target): before.detach().requires_grad_(fctx.needs_input_grad[1])}
        for o, need in zip(fctx.others, fctx.needs_input_grad[2:]):
            dense = densify(o).detach()
            leaves[id(o)] = dense.requires_grad_(need and (dense.is_floating_point() or dense.is_complex()))

        def swap(tensor: torch.Tensor) -> torch.Tensor:
            return leaves[id(tensor)] if id(tensor) in leaves else densify(tensor)

        inputs = [leaves[id(target)], *[leaves[id(o)] for o in fctx.others]]
        wanted = [t for t in inputs if t.requires_grad]
        grads: dict[int, Any] = {}
        if wanted:
            with torch.enable_grad():
                dense_args, dense_kwargs = map_tensors(swap, (args, kwargs))
                result = dense_args[0].clone()
                op(result, *dense_args[1:], **dense_kwargs)
            found = torch.autograd.grad(result, wanted, densify(grad) * stored, allow_unused=True)
            grads = {id(t): g for t, g in zip(wanted, found)}
        out = [grads.get(id(t)) for t in inputs]
        return (None, *[None if g is None else apply_spec(g, spec) for g, spec in zip(out, fctx.specs)])


def _inplace_with_grad(op: Any, args: tuple, kwargs: dict, bound: list, key: OpKey, plan: Plan) -> Any:
    """An in-place call that autograd must record. A wrapper target: ``_InPlace``
    (on a leaf that requires grad it raises, as torch does). A dense target: the
    op runs on it under ordinary autograd, wrappers among the other arguments made
    dense differentiably (their gradients come back in their ``grad_fmt``)."""
    if kwargs.get("out") is not None:  # as torch
        raise RuntimeError(f"{op_name(op)}(): functions with out=... arguments don't support automatic "
                           "differentiation, but one of the arguments requires grad.")
    if plan.kind == "fallback":
        _missing(plan.key)
    started = time.perf_counter() if observers else 0.0
    target = bound[0]
    if isinstance(target, SparseTensorWrapper):
        if target.requires_grad and target.is_leaf:
            raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
        others, seen = [], {id(target)}
        for v in _tensors_in((args, kwargs)):
            if id(v) not in seen:
                seen.add(id(v))
                others.append(v)
        result = _apply(_InPlace, (op, args, kwargs), target, *others)
    else:
        dense_args, dense_kwargs = _differentiable_dense((args, kwargs), True)
        result = op(*dense_args, **dense_kwargs)
    if observers:
        _notify("op", key, plan.kind, time.perf_counter() - started)
    return result


def _tensors_in(tree: Any) -> list:
    """The tensors in a tree of lists, tuples and dicts, in order."""
    found: list = []
    map_tensors(found.append, tree)
    return found


def _own_outputs(out: Any, inputs: list) -> Any:
    """Outputs that are an input as the implementation saw it (a wrapper's cached
    detached twin) become a new alias: autograd gives outputs a history, and
    the twin must stay private and without one."""
    if type(out) in _DENSE_TYPES:
        return out

    def own(o: Any) -> Any:
        if isinstance(o, SparseTensorWrapper) and any(o is i for i in inputs):
            return SparseTensorWrapper(o.wrapped_tensor, False, o.grad_fmt)
        return o

    return tuple(own(o) for o in out) if isinstance(out, tuple) else own(out)


# ``Function.apply`` without its Python wrapper (default-argument binding and a
# functorch check, about half the cost of recording a node); used while no
# functorch transform is active, as ``Function.apply`` itself does.
_apply_function = super(torch.autograd.Function, _DispatchFunction).apply
_unwrap_if_dead = getattr(torch._C._functorch, "unwrap_if_dead", lambda tensor: tensor)


def _apply(function: type, *args: Any) -> Any:
    """``function.apply(*args)`` with wrappers among ``args`` (no ``__torch_function__``)."""
    if torch._C._are_functorch_transforms_active():
        with _NoTorchFunction():
            return function.apply(*args)
    return super(torch.autograd.Function, function).apply(*args)


def _record(call: _Call) -> Any:
    """Run ``call`` as one autograd node whose inputs are its distinct tensor arguments."""
    unique = call.dedupe()
    if torch._C._are_functorch_transforms_active():
        with _NoTorchFunction():
            return _DispatchFunction.apply(call, *unique)
    return _apply_function(call, *[v if type(v) in _WRAPPER_TYPES else _unwrap_if_dead(v) for v in unique])


def _any_requires_grad_py(*args: Any) -> bool:
    with _NoTorchFunction():
        return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


# whether any argument is a tensor that requires grad, read without entering
# __torch_function__ (torch's own C helper where it exists)
_any_requires_grad = getattr(torch._C, "_any_requires_grad", _any_requires_grad_py)


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
        elif t in _WRAPPER_TYPES or (t not in _DENSE_TYPES and isinstance(v, SparseTensorWrapper)):
            positions.append(i)
            layouts.append(type(v.wrapped_tensor))
            wrappers = True
        elif t in _DENSE_TYPES or isinstance(v, torch.Tensor):
            positions.append(i)
            layouts.append(torch.Tensor)
            needs_grad = needs_grad or v.requires_grad
        elif (t is list or t is tuple) and any(isinstance(item, SparseTensorWrapper) for item in v):
            layouts.append(tuple(layout_of(item) for item in v))
            wrappers = True
            needs_grad = needs_grad or _any_requires_grad(*[x for x in v if isinstance(x, torch.Tensor)])
        else:
            layouts.append(None)
    if wrappers and not needs_grad:
        needs_grad = _any_requires_grad(*[bound[i] for i in positions])
    while layouts and layouts[-1] is None:
        layouts.pop()
    return tuple(layouts), positions, needs_grad


# -- the fast path ------------------------------------------------------------------

class _Fast:
    """A positional call shape already resolved to a plan that runs its
    implementation on the inputs as they are (``impl`` or ``generic``), with
    the general path's per-call work (binding, scanning, key, plan look-up)
    done once. Keyed in ``_fast`` by ``(op, output pairs or None, argument
    kinds)``, where a wrapper's kind is its layout class; cleared with the
    plan cache on every registration."""

    __slots__ = ("plan", "fn", "key", "nargs", "pad", "fill", "positions", "inplace")

    def __init__(self, plan: Plan, key: OpKey, op: Any, args: tuple, bound: list, positions: list[int]):
        n, nargs = len(args), plan.nargs
        padded = list(bound) + [None] * max(0, nargs - len(bound))
        self.plan, self.fn, self.key, self.nargs = plan, plan.entry.fn, key, nargs
        self.pad = tuple(padded[n:nargs])  # defaults completing the implementation's inputs
        self.fill = tuple(bound[n:])  # defaults completing the bound arguments
        self.positions = tuple(positions)
        self.inplace = _is_inplace(op, {})

    def record(self, op: Any, args: tuple, kwargs: dict, specs: CallSpecs | None) -> Any:
        """The call as an autograd node."""
        call = _Call(op, args, kwargs, [*args, *self.fill], self.positions, self.key, self.plan, specs)
        return _record(call)


_fast: dict[tuple, _Fast] = {}


def _remember_fast(fast_key: tuple, plan: Plan, key: OpKey, op: Any, args: tuple, bound: list,
                   positions: list[int]) -> None:
    """Cache a positional call's plan by its argument kinds, when the kinds determine its key."""
    n = len(args)
    if all(p < n for p in positions) and all(
            type(a) in _WRAPPER_TYPES or type(a) in _DENSE_TYPES or type(a) in PLAIN_TYPES for a in args):
        _fast[fast_key] = _Fast(plan, key, op, args, bound, positions)


def _fast_key(op: Any, pairs: tuple | None, args: tuple) -> tuple:
    """``(op, pairs, kind per argument)``; a wrapper's kind is its layout class."""
    key = [op, pairs]
    for a in args:
        t = type(a)
        key.append(type(a.wrapped_tensor) if t in _WRAPPER_TYPES else t)
    return tuple(key)


def dispatch_call(op: Any, args: tuple, kwargs: dict, specs: CallSpecs | None = None) -> Any:
    """Dispatch one call of ``op`` with output specs ``specs`` (``None``: the
    implementation chooses). Positional calls whose argument kinds were
    resolved before to a direct plan skip the general path, unless observers
    are registered."""
    if not plugins._loaded:
        plugins.ensure_loaded()
    if kwargs or observers:
        return _dispatch_general(op, args, kwargs, specs, None)
    pairs = None if specs is None else specs.pairs
    if len(args) == 2:  # the common binary call, unrolled (this is the hot path)
        a, b = args
        ta, tb = type(a), type(b)
        fast_key = (op, pairs, type(a.wrapped_tensor) if ta in _WRAPPER_TYPES else ta,
                    type(b.wrapped_tensor) if tb in _WRAPPER_TYPES else tb)
    else:
        fast_key = _fast_key(op, pairs, args)
    hit = _fast.get(fast_key)
    if hit is not None:
        if not _any_requires_grad(*args):  # nothing to track: _Call.forward less the scan and checks
            inputs = [*args[:hit.nargs], *hit.pad]
            out = hit.fn(OpContext(op, inputs, (args, kwargs)), inputs,
                         _KEEP_ALL_LIST if specs is None else specs.sparsifiers)
            if type(out) not in _DENSE_TYPES:
                out = wrap(out)
            return out if specs is None else _finish(out, specs, hit.inplace, True)
        if not hit.inplace and torch.is_grad_enabled():
            return hit.record(op, args, kwargs, specs)
    return _dispatch_general(op, args, kwargs, specs, fast_key)


def _dispatch_general(op: Any, args: tuple, kwargs: dict, specs: CallSpecs | None, fast_key: tuple | None) -> Any:
    """Bind, scan, key, plan; remember the plan under ``fast_key`` when it is direct."""
    bound = bind(op, args, kwargs)
    inp, positions, needs_grad = _scan(bound)
    key = OpKey("fwd", op, inp, None if specs is None else specs.pairs)
    plan = _plan_for(key)
    if fast_key is not None and plan.direct:
        _remember_fast(fast_key, plan, key, op, args, bound, positions)
    grad = needs_grad and torch.is_grad_enabled()
    if _is_inplace(op, kwargs):
        if grad:
            return _inplace_with_grad(op, args, kwargs, bound, key, plan)
        return _Call(op, args, kwargs, bound, positions, key, plan, specs).forward(detach=needs_grad)
    converted = None
    if plan.kind == "convert":
        converted = _converted_inputs(bound, positions, plan, detach=needs_grad)
        if converted is None:  # a conversion refused these inputs: the dense path, with its warning
            _missing(key, _refusals.get(plan.key))  # (once per key: the fallback's own call is then silent)
            plan = Plan("fallback", key)
    if not plan.direct and plan.kind != "convert":
        return _composite(op, args, kwargs, key, plan, specs, grad)
    call = _Call(op, args, kwargs, bound, positions, key, plan, specs)
    call.converted = converted
    if grad:
        return _record(call)
    return call.forward(detach=needs_grad)


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
