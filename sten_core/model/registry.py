"""The registry: every layout, implementation and conversion known to STen.

Plugins fill it from their ``sten_register(registry)`` hook; users through the
``register_*`` decorators. Each entry remembers the plugin that made it, so a
plugin that fails half-way is removed whole.

Example:
    >>> import torch, sten_core as sten
    >>> key = OpKey("fwd", torch.add, (torch.Tensor, torch.Tensor), ((sten.KeepAll, torch.Tensor),))
    >>> key.describe()
    'fwd torch.add inp=(Tensor, Tensor) out=((KeepAll, Tensor),)'
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Any, Callable, Iterator, NamedTuple

import torch

from sten_core.model.signatures import op_name, signature_of
from sten_core.model.sparsifiers import NOT_SPARSIFIERS


class OverrideWarning(UserWarning):
    """A plugin replaced a registration of another plugin (the last one wins
    while it exists; removing it brings the previous one back)."""


_KIND_LABELS = {"impls": "implementation", "layouts": "layout", "conversions": "conversion",
                "compiled": "compiled implementation"}


class OpKey(NamedTuple):
    """What a dispatch looks up.

    ``direction`` is ``"fwd"``, ``"bwd"``, ``"sparsifier"`` or ``"convert"`` (what observers
    are told of a conversion: ``op`` is ``None``, ``inp`` ``(source layout,)``, ``out`` the
    target). For ``fwd``: ``inp`` are the argument layouts and ``out`` the ``(inline
    sparsifier class, tmp_format)`` of each output (``None`` when the caller let the
    implementation choose). For ``bwd``: ``grad_out`` are the layouts of the
    incoming gradients and ``out`` the ``(inline class, tmp_format)`` wanted per
    input gradient. For ``sparsifier``: ``op`` is the sparsifier class, ``inp``
    ``(input layout,)`` and ``out`` the output layout.
    """

    direction: str
    op: Any
    inp: tuple
    out: Any
    grad_out: tuple = ()

    def describe(self) -> str:
        if self.direction == "sparsifier":
            return f"sparsifier {_name(self.op)} inp={_name(self.inp[0])} out={_name(self.out)}"
        if self.direction == "convert":  # a conversion's key has no operator (it read "convert torch.None ...")
            return f"convert {_name(self.inp[0])} -> {_name(self.out)}"
        text = f"{self.direction} {op_name(self.op)} inp={_names(self.inp)}"
        if self.direction == "bwd":
            return f"{text} grad_out={_names(self.grad_out)} grad_inp={_names(self.out)}"
        return f"{text} out={_names(self.out)}"


def _name(obj: Any) -> str:
    if obj is None:
        return "None"
    if isinstance(obj, type):
        return obj.__name__
    return repr(obj)


def _names(items: Any) -> str:
    if items is None:
        return "None"
    if isinstance(items, (tuple, list)):
        inner = ", ".join(_names(i) for i in items)
        return f"({inner},)" if len(items) == 1 else f"({inner})"
    return _name(items)


# -- pattern normalisation -------------------------------------------------------

def trim(pattern: tuple) -> tuple:
    """Drop trailing ``None`` entries: ``(T, T, None, None)`` ≡ ``(T, T)``."""
    end = len(pattern)
    while end and pattern[end - 1] is None:
        end -= 1
    return tuple(pattern[:end])


def _layout_entry(entry: Any, name: str) -> Any:
    if entry is None:
        return None
    if entry is torch.nn.Parameter:
        return torch.Tensor
    if entry is Ellipsis:
        raise TypeError(f"{name}: ... (every further argument) may only end a pattern")
    if not isinstance(entry, type):
        raise TypeError(f"{name}: expected a layout class, torch.Tensor or None, got {entry!r}")
    return entry


def _sparsifier_class(entry: Any, name: str) -> type:
    """The sparsifier class ``entry`` names (a class, or an instance of one).

    Numbers, strings, tensors and their classes are refused: ``0.5`` is a
    fraction, not a sparsifier (``ScalarFractionSparsifier(0.5)`` is one).
    """
    cls = entry if isinstance(entry, type) else type(entry)
    if entry is None or issubclass(cls, NOT_SPARSIFIERS) or cls in (object, type(None), bool):
        raise TypeError(f"{name}: expected a sparsifier class or instance (e.g. sten.KeepAll), got {entry!r}")
    return cls


def _check_callable(fn: Any, name: str, expected: str, nargs: int | None = None) -> None:
    """Refuse a non-callable ``fn``, or one that cannot be called with ``nargs`` positional
    arguments (it would fail only at the first call, with Python's bare message)."""
    if not callable(fn):
        raise TypeError(f"{name} must be callable ({expected}), got {fn!r}")
    if nargs is None:
        return
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or an extension: nothing to check
        return
    try:
        signature.bind(*[None] * nargs)
    except TypeError as error:
        raise TypeError(f"{name} {getattr(fn, '__qualname__', fn)}{signature} cannot be called as {expected}: "
                        f"{error}") from None


def normalize_inp(inp: Any, op: Any, name: str = "inp") -> tuple:
    """Check an input pattern against the operator's signature and trim it (a trailing
    ``...``, "and every further argument", is dropped: see ``takes_every_argument``)."""
    if isinstance(inp, type) or inp is None:
        inp = (inp,)
    if not isinstance(inp, (tuple, list)):
        raise TypeError(f"{name} must be a tuple of layout classes / None, got {inp!r}")
    inp = inp[:-1] if takes_every_argument(inp) else inp
    pattern = trim(tuple(_layout_entry(e, f"{name}[{i}]") for i, e in enumerate(inp)))
    params = signature_of(op)
    if params is not None and len(pattern) > len(params.names):
        raise ValueError(
            f"{name} has {len(pattern)} entries but {op_name(op)} takes "
            f"{len(params.names)} arguments ({', '.join(params.names)})"
        )
    return pattern


def normalize_out_pairs(out: Any, name: str = "out") -> tuple:
    """``[(SparsifierClass, tmp_format), ...]`` → tuple of class pairs."""
    if out is None:
        return ((_keep_all(), torch.Tensor),)
    if isinstance(out, tuple) and len(out) in (2, 4) and not isinstance(out[0], (tuple, list)):
        out = (out,)
    if not isinstance(out, (tuple, list)):
        raise TypeError(f"{name} must be a sequence of (sparsifier, format) pairs, got {out!r}")
    pairs = []
    for i, item in enumerate(out):
        if item is None:
            pairs.append(None)
            continue
        if not isinstance(item, (tuple, list)) or len(item) not in (2, 4):
            raise ValueError(f"{name}[{i}] must be a (sparsifier, format) pair, got {item!r}")
        pairs.append((_sparsifier_class(item[0], f"{name}[{i}][0]"), _layout_entry(item[1], f"{name}[{i}][1]")))
    return trim(tuple(pairs))


def _keep_all() -> type:
    from sten_core.model.sparsifiers import KeepAll

    return KeepAll


def takes_every_argument(inp: Any) -> bool:
    """Whether a pattern ends with ``...``: its implementation receives every argument of
    the call, not only those the pattern lists (``inp=(MyLayout, ...)`` for ``torch.sum``
    sees ``dim`` and ``keepdim``). Without it, a call giving an argument past the pattern a
    value other than its default is not run by the implementation, which could not see it."""
    return isinstance(inp, (tuple, list)) and len(inp) > 0 and inp[-1] is Ellipsis


def entry_for(impl: Callable, inp: Any) -> Entry:
    """The ``Entry`` of an implementation registered for the pattern ``inp``: it receives as
    many bound arguments as ``inp`` lists, or all of them where ``inp`` ends with ``...``.

    >>> entry_for(print, (None, ...)).all_args
    True
    """
    if takes_every_argument(inp):
        return Entry(impl, len(inp) - 1, all_args=True)
    return Entry(impl, len(inp) if isinstance(inp, (tuple, list)) else 1)


def _count_positional(fn: Callable) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 3
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 3
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


class Entry(NamedTuple):
    """A registered implementation and how to call it."""

    fn: Callable
    nargs: int  # how many bound arguments it receives (its pattern's full length)
    arity: int = 3  # positional parameters of fn (sparsifier impls take 2 or 3)
    all_args: bool = False  # it receives every argument of the call (a pattern ending with ...)


USER = "user"  # the owner of registrations made outside any plugin (user code)


class Registry:
    """All registrations, by kind, each tagged with its owner plugin."""

    def __init__(self) -> None:
        self.layouts: dict[str, type] = {}
        self.impls: dict[OpKey, Entry] = {}
        self.conversions: dict[tuple[type, type], Callable] = {}
        self.compiled: dict[tuple, Callable] = {}  # (operator, input layouts) -> traceable kernel
        self._owners: dict[Any, str] = {}  # (kind, key) -> the owner of the registration in force
        self._stacks: dict[Any, list[tuple[str, Any]]] = {}  # (kind, key) -> [(owner, value), ...], in force last
        self._owner = USER
        self._listeners: list[Callable[[], None]] = []
        self.silent_owners: set[str] = {USER}
        """Owners whose registrations another owner may override without an
        ``OverrideWarning``: the user context and the core's built-in plugins
        (loaded first, so a plugin's override of them does not depend on load order)."""
        self._warned_overrides: set[tuple[str, str]] = set()

    # -- bookkeeping -------------------------------------------------------------
    def on_change(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` after every change (the dispatcher clears its cache)."""
        self._listeners.append(callback)

    def changed(self) -> None:
        """Tell the listeners that what they derived from the registry is stale."""
        for callback in self._listeners:
            callback()

    @contextlib.contextmanager
    def owner(self, name: str) -> Iterator["Registry"]:
        """Tag registrations made inside the block with plugin ``name``."""
        previous, self._owner = self._owner, name
        try:
            yield self
        finally:
            self._owner = previous

    def remove_owner(self, name: str) -> None:
        """Undo every registration of plugin ``name``; a key it had overridden
        gets back the registration it replaced (the previous owner's).

        >>> reg = Registry()
        >>> _ = reg.register_conversion(int, float, float)          # user code
        >>> with reg.owner("plugin"):
        ...     _ = reg.register_conversion(int, float, lambda x: x / 1)
        >>> reg.remove_owner("plugin")
        >>> reg.conversions[(int, float)] is float, reg.owner_of("conversions", (int, float))
        (True, 'user')
        """
        for slot, stack in list(self._stacks.items()):
            if not any(owner == name for owner, _ in stack):
                continue
            kind, key = slot
            table = getattr(self, kind)
            remaining = [(owner, value) for owner, value in stack if owner != name]
            if key not in table or not remaining:  # gone (or removed by hand meanwhile): forget it
                table.pop(key, None)
                self._owners.pop(slot, None)
                del self._stacks[slot]
                continue
            self._stacks[slot] = remaining
            self._owners[slot], table[key] = remaining[-1]
        self._warned_overrides = {pair for pair in self._warned_overrides if name not in pair}
        self.changed()

    def owner_of(self, kind: str, key: Any) -> str | None:
        """The plugin (or ``"user"`` context) that registered ``key`` of ``kind``
        (``"impls"``, ``"layouts"``, ``"conversions"``), if known."""
        return self._owners.get((kind, key))

    def registered_by(self, kind: str, key: Any) -> list[str]:
        """Every owner with a registration of ``key``, the one in force last (those underneath
        come back when it is removed)."""
        stack = self._stacks.get((kind, key))
        if stack:
            return [owner for owner, _ in stack]
        owner = self._owners.get((kind, key))
        return [] if owner is None else [owner]

    def owned_by(self, name: str, kind: str) -> list:
        return [key for (k, key), owner in self._owners.items() if owner == name and k == kind]

    def _put(self, kind: str, key: Any, value: Any) -> None:
        """Register ``value`` for ``key``, owned by the current owner.

        The last registration wins while it exists: the earlier ones of other
        owners are kept underneath (a stack per key), and ``remove_owner``
        brings the previous one back. A registration of user code (owner
        ``"user"``) stays in force over plugins registering the key later:
        plugins load on the first dispatched call, which may come after it.
        An owner re-registering replaces its own entry; registering the value
        already in force (the same layout class under its name) keeps the
        current owner in force.
        """
        table, slot = getattr(self, kind), (kind, key)
        stack = self._stacks.get(slot, []) if key in table else []  # a key removed by hand starts afresh
        if key in table and (not stack or stack[-1][1] is not table[key]):  # set by hand: that one is in force
            stack = stack[:-1] + [(self._owners.get(slot, USER), table[key])]
        stack = [(owner, old) for owner, old in stack if owner != self._owner]
        below_user = len(stack)
        if self._owner != USER:  # plugins load on first use: user code's registrations stay in force
            while below_user and stack[below_user - 1][0] == USER:
                below_user -= 1
        if below_user < len(stack):
            stack.insert(below_user, (self._owner, value))
        elif stack and stack[-1][1] is value:
            stack.insert(len(stack) - 1, (self._owner, value))  # the same object: ownership unchanged
        else:
            if stack:
                self._warn_override(kind, key, stack[-1][0])
            stack.append((self._owner, value))
        self._stacks[slot] = stack
        self._owners[slot], table[key] = stack[-1]
        self.changed()

    def _warn_override(self, kind: str, key: Any, previous: str) -> None:
        """Warn (once per pair of owners) when one plugin replaces another's registration,
        since which plugin loads last is not specified."""
        pair = (previous, self._owner)
        if previous in self.silent_owners or self._owner in self.silent_owners or pair in self._warned_overrides:
            return
        self._warned_overrides.add(pair)
        what = key.describe() if isinstance(key, OpKey) else _names(key)
        warnings.warn(
            f"sten plugin {self._owner!r} overrides the {_KIND_LABELS.get(kind, kind)} {what} registered by "
            f"plugin {previous!r} "
            f"(further overrides of {previous!r} by {self._owner!r} are not reported); the last registration "
            f"wins while it exists, and the previous one comes back if {self._owner!r} is removed",
            OverrideWarning, stacklevel=4)  # the register_* call

    # -- layouts -------------------------------------------------------------------
    def register_layout(self, cls: type, name: str | None = None) -> type:
        """Make ``cls`` known by ``name`` (default: the class name)."""
        if not isinstance(cls, type):
            raise TypeError(f"layout must be a class, got {cls!r}")
        for method in ("from_dense", "to_dense"):
            if not callable(getattr(cls, method, None)):
                raise TypeError(f"layout {cls.__name__} must define {method}()")
        if name is not None and (not isinstance(name, str) or not name):
            raise TypeError(f"name must be a non-empty string (the layout's name in checkpoints), got {name!r}")
        name = name or cls.__name__
        previous = self.layouts.get(name)
        if previous is not None and previous is not cls and _qualified(previous) != _qualified(cls):
            owner = self._owners.get(("layouts", name), USER)
            raise ValueError(
                f"layout name {name!r} is taken: {_qualified(previous)} (registered by {owner!r}) and "
                f"{_qualified(cls)} (by {self._owner!r}) would overwrite each other and checkpoints would "
                f"load the wrong class; register one under another name: "
                f"registry.register_layout({cls.__name__}, name='<package>.{cls.__name__}')"
            )
        self._put("layouts", name, cls)
        return cls

    def layout(self, name: str) -> type:
        """The layout class registered as ``name`` (ValueError lists the valid ones)."""
        try:
            return self.layouts[name]
        except KeyError:
            raise ValueError(
                f"unknown layout {name!r}; known layouts: {', '.join(sorted(self.layouts)) or 'none'}"
            ) from None

    # -- implementations ---------------------------------------------------------
    def register_fwd_op_impl(self, operator: Any, inp: Any, out: Any, impl: Callable) -> Callable:
        if not callable(operator):
            raise TypeError(f"operator must be a callable torch operator, got {operator!r}")
        if isinstance(out, (list, tuple)) and len(out) == 0:
            out = None  # the original STen's out=[]: the default dense output
        _check_callable(impl, "impl", "impl(ctx, inputs, output_sparsifiers)", 3)
        key = OpKey("fwd", operator, normalize_inp(inp, operator), normalize_out_pairs(out))
        self._put("impls", key, entry_for(impl, inp))
        return impl

    def register_bwd_op_impl(self, operator: Any, grad_out: Any, grad_inp: Any, inp: Any, impl: Callable) -> Callable:
        if not callable(operator):
            raise TypeError(f"operator must be a callable torch operator, got {operator!r}")
        _check_callable(impl, "impl", "impl(ctx, grad_outputs, input_sparsifiers)", 3)
        grad_out = tuple(_layout_entry(g, "grad_out") for g in (grad_out if isinstance(grad_out, (tuple, list)) else (grad_out,)))
        grads = normalize_out_pairs(grad_inp, "grad_inp")
        pattern = normalize_inp(inp, operator)
        params = signature_of(operator)
        if params is not None and len(grads) > max(len(pattern), len(params.names)):
            raise ValueError(f"grad_inp has {len(grads)} entries but {op_name(operator)} takes {len(params.names)} arguments")
        key = OpKey("bwd", operator, pattern, grads, grad_out)
        self._put("impls", key, entry_for(impl, inp))
        return impl

    def register_sparsifier_implementation(self, sparsifier: type, inp: type, out: type, impl: Callable) -> Callable:
        sp = _sparsifier_class(sparsifier, "sparsifier")
        _check_callable(impl, "impl", "impl(sparsifier, tensor, grad_fmt=None)")
        key = OpKey("sparsifier", sp, (_layout_entry(inp, "inp"),), _layout_entry(out, "out"))
        self._put("impls", key, Entry(impl, 1, _count_positional(impl)))
        return impl

    def register_conversion(self, src: type, dst: type, fn: Callable[[Any], Any]) -> Callable:
        """Register a lossless conversion ``fn(src_layout_obj) -> dst_layout_obj``."""
        _check_callable(fn, "fn", "fn(src_layout_obj) -> dst_layout_obj", nargs=1)
        self._put("conversions", (_layout_entry(src, "src"), _layout_entry(dst, "dst")), fn)
        return fn

    def register_compiled_impl(self, operator: Any, inp: Any, impl: Callable) -> Callable:
        """Register what a call of ``operator`` with input layouts ``inp`` runs while
        ``torch.compile`` traces it: ``impl(*args, **kwargs)``, traceable code (torch
        ops and custom operators on the layouts' plain tensors); see ``sten_core.dispatch.compiled``."""
        if not callable(operator):
            raise TypeError(f"operator must be a callable torch operator, got {operator!r}")
        if not callable(impl):
            raise TypeError(f"impl must be callable, got {impl!r}")
        self._put("compiled", (operator, normalize_inp(inp, operator)), impl)
        return impl

    def fwd_candidates(self, op: Any, out: Any) -> list[tuple[OpKey, Entry]]:
        return [(k, v) for k, v in self.impls.items() if k.direction == "fwd" and k.op is op and k.out == out]


registry = Registry()


def _qualified(cls: type) -> str:
    """``module.QualName`` of a class (a re-imported module gives the same string)."""
    return f"{cls.__module__}.{cls.__qualname__}"
