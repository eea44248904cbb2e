"""Operator signatures: bind a call's arguments in signature order.

Implementations receive the arguments of a call bound to the operator's
signature with defaults applied: ``torch.add(a, b)`` gives ``(a, b, 1, None)``
for ``input, other, alpha, out``.

Example:
    >>> import torch
    >>> signature_of(torch.add).names
    ('input', 'other', 'alpha', 'out')
    >>> bind(torch.add, (1, 2), {})
    [1, 2, 1, None]
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any, NamedTuple

import torch


class Params(NamedTuple):
    names: tuple[str, ...]
    defaults: tuple[Any, ...]  # one per name; _REQUIRED where there is none


_REQUIRED = object()

# Signatures that torch's testing overrides state incompletely.
_EXPLICIT = {
    "add": ("input", "other", ("alpha", 1), ("out", None)),
    "sub": ("input", "other", ("alpha", 1), ("out", None)),
    "mm": ("input", "mat2", ("out", None)),
    "addmm": ("input", "mat1", "mat2", ("beta", 1), ("alpha", 1), ("out", None)),
    "linear": ("input", "weight", ("bias", None)),
    # reductions: the overloads merged, positional parameters first in torch's order (the
    # overrides name only (input, dim) for sum, and put dtype second for prod, out for max)
    "sum": ("input", ("dim", None), ("keepdim", False), ("dtype", None), ("out", None)),
    "nansum": ("input", ("dim", None), ("keepdim", False), ("dtype", None), ("out", None)),
    "mean": ("input", ("dim", None), ("keepdim", False), ("dtype", None), ("out", None)),
    "prod": ("input", ("dim", None), ("keepdim", False), ("dtype", None), ("out", None)),
    "amax": ("input", ("dim", ()), ("keepdim", False), ("out", None)),
    "amin": ("input", ("dim", ()), ("keepdim", False), ("out", None)),
    "max": ("input", ("dim", None), ("keepdim", False), ("out", None), ("other", None)),
    "min": ("input", ("dim", None), ("keepdim", False), ("out", None), ("other", None)),
    "argmax": ("input", ("dim", None), ("keepdim", False), ("out", None)),
    "argmin": ("input", ("dim", None), ("keepdim", False), ("out", None)),
    "median": ("input", ("dim", None), ("keepdim", False), ("out", None)),
    "all": ("input", ("dim", None), ("keepdim", False), ("out", None)),
    "logsumexp": ("input", "dim", ("keepdim", False), ("out", None)),
    "std": ("input", ("dim", None), ("unbiased", True), ("keepdim", False), ("correction", None), ("out", None)),
    "var": ("input", ("dim", None), ("unbiased", True), ("keepdim", False), ("correction", None), ("out", None)),
    "count_nonzero": ("input", ("dim", None)),
}


def _from_spec(spec: tuple) -> Params:
    names, defaults = [], []
    for item in spec:
        if isinstance(item, tuple):
            names.append(item[0])
            defaults.append(item[1])
        else:
            names.append(item)
            defaults.append(_REQUIRED)
    return Params(tuple(names), tuple(defaults))


@lru_cache(maxsize=None)
def _testing_overrides() -> dict:
    return torch.overrides.get_testing_overrides()


def _from_callable(fn: Any) -> Params | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    names, defaults = [], []
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:  # f(x, *args, sep=...): positions cannot be named
            return None
        if p.kind is p.VAR_KEYWORD:
            continue
        names.append(p.name)
        defaults.append(_REQUIRED if p.default is p.empty else p.default)
    return Params(tuple(names), tuple(defaults))


_cache: dict[Any, Params | None] = {}


def signature_of(op: Any) -> Params | None:
    """The parameter names and defaults of a torch operator (``None`` if unknown)."""
    try:
        return _cache[op]
    except (KeyError, TypeError):
        pass
    name = getattr(op, "__name__", "")
    explicit = _EXPLICIT.get(name.rstrip("_"))
    is_torch = getattr(op, "__module__", None) in (None, "torch", "torch._C._nn", "torch.nn.functional", "torch._C._VariableFunctions") or "Tensor" in getattr(op, "__qualname__", "")
    if explicit is not None and is_torch:
        params = _from_spec(explicit)
    else:
        override = _testing_overrides().get(op)
        params = _from_callable(override) if override is not None else _from_callable(op)
    try:
        _cache[op] = params
    except TypeError:
        pass
    return params


class _Binder(NamedTuple):
    """Precomputed per operator: where each keyword goes, and the defaults
    (``None`` for a required argument that was not given)."""

    index: dict[str, int]
    fill: tuple[Any, ...]


_binders: dict[Any, _Binder | None] = {}


def _binder(op: Any) -> _Binder | None:
    params = signature_of(op)
    binder = None
    if params is not None:
        fill = tuple(None if d is _REQUIRED else d for d in params.defaults)
        binder = _Binder({name: i for i, name in enumerate(params.names)}, fill)
    try:
        _binders[op] = binder
    except TypeError:
        pass
    return binder


def bind(op: Any, args: tuple, kwargs: dict) -> list:
    """Arguments in signature order with defaults; unknown ops keep positional
    arguments followed by keyword values.

    This runs on every dispatched call: the per-operator work is cached.
    """
    try:
        binder = _binders[op]
    except (KeyError, TypeError):
        binder = _binder(op)
    if binder is None:
        return [*args, *kwargs.values()] if kwargs else list(args)
    fill = binder.fill
    n = len(args)
    if n > len(fill):
        return [*args, *kwargs.values()] if kwargs else list(args)
    bound = [*args, *fill[n:]]
    if kwargs:
        index = binder.index
        for key, value in kwargs.items():
            i = index.get(key)
            if i is None:
                bound.append(value)
            else:
                bound[i] = value
    return bound


def given_past(op: Any, bound: list, n: int, kwargs: dict | None = None) -> list[str]:
    """The arguments of a bound call past its first ``n`` that it gives a value other than
    the default, as ``name=value``: what an implementation receiving ``n`` arguments would
    not see. Keywords the signature does not name (``bind`` appends them) always count,
    named where ``kwargs`` is given.

    >>> given_past(torch.add, bind(torch.add, (1, 2), {"alpha": 3}), 2)
    ['alpha=3']
    >>> given_past(torch.add, bind(torch.add, (1, 2, 1), {}), 2)
    []
    >>> given_past(torch.sub, bind(torch.sub, (1, 2), {"rounding": 0}), 2, {"rounding": 0})
    ['rounding=0']
    """
    try:
        binder = _binders[op]
    except (KeyError, TypeError):
        binder = _binder(op)
    names = signature_of(op).names if binder is not None else ()
    unnamed = [k for k in (kwargs or {}) if binder is None or k not in binder.index]
    labels = dict(zip(range(len(bound) - len(unnamed), len(bound)), unnamed))
    given = []
    for i in range(n, len(bound)):
        value = bound[i]
        if i < len(names) and i not in labels:  # a parameter of the signature: given unless it is the default
            if not _is_default(value, binder.fill[i]):
                given.append(f"{names[i]}={value!r}")
        elif value is not None or i in labels:  # a keyword the signature does not name, or an unknown op's argument
            given.append(f"{labels.get(i, f'argument {i}')}={value!r}")
    return given


def _is_default(value: Any, default: Any) -> bool:
    if value is default:
        return True
    if isinstance(value, torch.Tensor) or isinstance(default, torch.Tensor):
        return False
    try:
        return type(value) is type(default) and bool(value == default) or (
            isinstance(value, (int, float)) and isinstance(default, (int, float)) and value == default)
    except Exception:  # an argument whose == is not a truth value
        return False


def op_name(op: Any) -> str:
    """A readable name: ``torch.add``, ``torch.nn.functional.linear``, ``Tensor.add_``;
    for a callable without a ``__name__``, what it is (``functools.partial(torch.add)``, the
    class of a callable object). Only an operator that *is* ``torch.<name>`` is called so
    (``None`` was ``torch.None``: ``getattr(torch, "None", None) is None``).

    Example:
        >>> import functools
        >>> op_name(torch.add), op_name(torch.Tensor.add_), op_name(functools.partial(torch.mul, other=2))
        ('torch.add', 'Tensor.add_', 'functools.partial(torch.mul)')
        >>> op_name(None), op_name(torch.Tensor.mT.__get__)
        ('None', 'Tensor.mT.__get__')
    """
    if isinstance(op, _ATEN_OPS):  # torch.ops.aten.add.Tensor: its own str is aten.add.Tensor
        return f"torch.ops.{op}"
    owner = getattr(op, "__self__", None)
    if type(owner).__name__ == "getset_descriptor" and getattr(owner, "__objclass__", None) is torch._C.TensorBase:
        return f"Tensor.{owner.__name__}.{op.__name__}"  # w.T, w.mT: the property's getter
    name = getattr(op, "__name__", None)
    if not isinstance(name, str):
        return _unnamed(op)
    qual = getattr(op, "__qualname__", None) or name
    if "TensorBase" in qual or qual.startswith("Tensor."):
        return f"Tensor.{name}"
    module = getattr(op, "__module__", None)
    if module in (None, "torch._C._VariableFunctions", "torch"):
        if getattr(torch, name, _REQUIRED) is op:
            return f"torch.{name}"
    if module in ("torch._C._nn", "torch.nn.functional") or getattr(torch.nn.functional, name, None) is op:
        return f"torch.nn.functional.{name}"
    return f"{module}.{qual}" if module else qual


_ATEN_OPS = tuple(t for t in (getattr(torch._ops, "OpOverload", None), getattr(torch._ops, "OpOverloadPacket", None))
                  if isinstance(t, type))


def _unnamed(op: Any) -> str:
    """The name of an operator without a ``__name__``: a partial names its function,
    a callable object its class, ``None`` is ``None``."""
    if op is None:
        return "None"
    func = getattr(op, "func", None)
    if func is not None and callable(func) and func is not op:   # functools.partial
        return f"{type(op).__module__}.{type(op).__qualname__}({op_name(func)})"
    cls = type(op)
    return f"{cls.__qualname__} object" if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__} object"
