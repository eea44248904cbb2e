"""Plans: how a call with given input layouts and output specs runs, resolved
once per ``OpKey`` and cached until the registry changes.

Example:
    >>> import torch, sten_core as sten
    >>> from sten_core.model.registry import OpKey
    >>> key = OpKey("fwd", torch.mm, (sten.CsrTensor, torch.Tensor), None)
    >>> str(sten.dispatch.plan_for(key).kind)
    'impl'
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from sten_core.plugins import manager as plugins
from sten_core.dispatch.conversions import conversion_path
from sten_core.model.registry import Entry, OpKey, registry
from sten_core.model.sparsifiers import KeepAll


class PlanKind(str, enum.Enum):
    """How a call runs (its value is the name ``explain`` and observers show)."""

    IMPL = "impl"  # an implementation registered for exactly these layouts
    GENERIC = "generic"  # one returned by a plugin's ``sten_resolve_op`` hook
    CONVERT = "convert"  # a registered one, after lossless conversions of the inputs
    NATIVE = "native"  # torch's own op: no wrapper among the inputs
    FALLBACK = "fallback"  # dense: inputs densified, outputs sparsified, with a warning
    IDENTITY = "identity"  # (sparsifiers only) nothing to do

    def __str__(self) -> str:
        return self.value


class Plan:
    """How a key is executed: its ``kind``, and the implementation ``entry``
    and per-input ``conversions`` it runs."""

    __slots__ = ("kind", "entry", "conversions", "key", "fixes_inline", "nargs", "all_args", "direct", "alternatives",
                 "checks")

    def __init__(self, kind: PlanKind, key: OpKey, entry: Entry | None = None, conversions: tuple = (),
                 alternatives: tuple = ()):
        self.kind = kind
        self.key = key
        self.entry = entry
        self.conversions = conversions
        self.alternatives = alternatives  # convert plans the sten_convert hook may reach, tried on a first call
        self.checks: bool | None = None  # whether its results are checked (call.checks_results), once known
        # implementations produce tmp_format themselves; the rest need the inline sparsifier applied
        self.fixes_inline = kind in (PlanKind.IMPL, PlanKind.CONVERT, PlanKind.GENERIC)
        self.nargs = max(entry.nargs, len(key.inp)) if entry is not None else 0
        self.all_args = entry is not None and entry.all_args  # it receives every argument, not nargs
        self.direct = kind in (PlanKind.IMPL, PlanKind.GENERIC)  # runs the implementation on the inputs as they are

    def __repr__(self) -> str:
        return f"Plan({self.kind}, {self.key.describe()})"




DENSE_OUT = ((KeepAll, torch.Tensor),)
_inplace_ops: dict[Any, bool] = {}

NOT_DIFFERENTIABLE = frozenset({
    torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like, torch.randn_like,
    torch.randint_like, torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_empty,
    torch.Tensor.new_full, torch.Tensor.new_tensor})
"""Operators whose result has no gradient history, as in torch (``zeros_like(w)`` of a weight that
requires grad is a fresh tensor that does not): calls of them are never recorded by autograd."""


def _collectives() -> frozenset:
    """The ``torch.distributed`` collectives that write into tensors they are given (``all_reduce(t)``,
    ``broadcast(t)``, ``all_gather(outputs, t)``): calls that write, as ``add_`` does."""
    if not torch.distributed.is_available():
        return frozenset()
    names = ("broadcast", "all_reduce", "all_reduce_coalesced", "reduce", "recv", "irecv", "all_gather",
             "all_gather_into_tensor", "all_gather_coalesced", "gather", "scatter", "reduce_scatter",
             "reduce_scatter_tensor", "all_to_all", "all_to_all_single")
    return frozenset(getattr(torch.distributed, name) for name in names if hasattr(torch.distributed, name))


COLLECTIVES = _collectives()


# the augmented assignments and item assignment (not ``__int__``, ``__index__``, ``__invert__``,
# ``__iter__``: ``int(w[0, 0])`` read as a write bumped the wrapper's version)
_INPLACE_DUNDERS = frozenset(f"__i{name}__" for name in (
    "add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "lshift", "rshift", "and", "xor", "or",
    "div")) | {"__setitem__"}


def is_inplace(op: Any, kwargs: dict) -> bool:
    """Whether a call writes into its first argument (``add_``, ``__iadd__``,
    ``__setitem__``, ``F.relu(x, inplace=True)``, the tensors of ``_foreach_mul_``'s
    list), into ``out=`` or into the tensors a collective is given (``dist.all_reduce``)."""
    if kwargs and (kwargs.get("out") is not None or kwargs.get("inplace") is True):
        return True
    try:
        return _inplace_ops[op]
    except (KeyError, TypeError):
        name = getattr(op, "__name__", "")
        result = (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS or op in COLLECTIVES
        try:
            _inplace_ops[op] = result
        except TypeError:
            pass
        return result


def _an_implementation(answer: Any) -> str | None:
    """What a ``sten_resolve_op`` answer should have been, where it is not an ``Entry`` or a callable."""
    return None if isinstance(answer, Entry) or callable(answer) else "an implementation (a callable or an Entry)"


def resolve(key: OpKey) -> Plan:
    """Resolve ``key`` by the chain in the package docstring (uncached)."""
    entry = registry.impls.get(key)
    if entry is not None:
        return Plan(PlanKind.IMPL, key, entry)
    if key.out is None:  # an implicit call: a registered dense-output implementation comes first
        entry = registry.impls.get(key._replace(out=DENSE_OUT))
        if entry is not None:
            return Plan(PlanKind.IMPL, key._replace(out=DENSE_OUT), entry)
    hooked = plugins.first_result("sten_resolve_op", key=key, _valid=_an_implementation)  # a bad answer: warned, skipped
    if hooked is not None:
        entry = hooked if isinstance(hooked, Entry) else Entry(hooked, len(key.inp))
        return Plan(PlanKind.GENERIC, key, entry)
    if key.direction == "bwd":
        return Plan(PlanKind.FALLBACK, key)
    if key.out is None:  # the caller let the implementation choose: dense otherwise
        return resolve(key._replace(out=DENSE_OUT))
    if all(layout in (torch.Tensor, None) for layout in key.inp):
        return Plan(PlanKind.NATIVE, key)
    found = _reachable_implementations(key)
    if not found:
        return Plan(PlanKind.FALLBACK, key)
    (_, cand_key, entry, steps), others = found[0], found[1:]
    return Plan(PlanKind.CONVERT, cand_key, entry, steps, tuple(Plan(PlanKind.CONVERT, *other[1:]) for other in others))


def _reachable_implementations(key: OpKey) -> list[tuple]:
    """``(cost, registered key, entry, target layout per input)`` of the implementations the inputs reach by
    conversions, fewest first. A conversion is a chain of registered ones or, where a plugin implements the
    ``sten_convert`` hook, that hook, asked at the call. The implementation reached by registered conversions
    alone with the fewest steps is the one answer where there is one; otherwise every one the hook might
    reach is kept, tried in order on the key's first call until the hook converts the inputs."""
    hook = plugins.has_hook("sten_convert")
    found = []
    for cand_key, entry in registry.fwd_candidates(key.op, key.out):
        if len(cand_key.inp) != len(key.inp):
            continue
        steps, hooked = [], 0
        for have, want in zip(key.inp, cand_key.inp):
            if have is want:
                steps.append(None)
                continue
            if have is None or want in (None, torch.Tensor):
                break
            if conversion_path(have, want) is None:
                if not hook or have is torch.Tensor:
                    break
                hooked += 1
            steps.append(want)
        else:
            found.append(((hooked, sum(s is not None for s in steps)), cand_key, entry, tuple(steps)))
    found.sort(key=lambda candidate: candidate[0])
    if found and found[0][0][0] == 0:  # registered conversions reach one: always used
        return found[:1]
    return found


def plan_for(key: OpKey) -> Plan:
    """The plan for ``key``, resolved on first use and cached until the registry changes."""
    plan = _cache.get(key)
    if plan is None:
        plan = _cache[key] = resolve(key)
    return plan


def remember(key: OpKey, plan: Plan) -> Plan:
    """Cache ``plan`` as ``key``'s (the plan a convert plan with alternatives settled on at its first call)."""
    _cache[key] = plan
    return plan


def plan_of(key: OpKey) -> Plan | None:
    """The plan already resolved for ``key``, if any (``explain`` shows it)."""
    return _cache.get(key)


def clear_caches() -> None:
    """Forget every resolved plan, conversion path and fast-path entry (as a registration does)."""
    registry.changed()


_cache: dict[OpKey, Plan] = {}
registry.on_change(_cache.clear)
