"""Naming the calls inside a submodule's forward for ``set_interm``: torch.fx node names.

Intermediate tensors are named after the fx node of the call that makes them
(``"intermediate.gelu"``, ``"add_1"``). At run time a ``TorchFunctionMode`` sees the
calls one by one; ``_FxCalls`` identifies each with its fx node by data flow (the
node whose inputs are the values the call receives), so shape and tuple nodes,
fx's renames of calls that shadow Python names (``sum_1``) and constants fx folds
away do not shift the numbering. ``_CountedCalls`` names the calls of modules fx
cannot trace by counting them per base name (``add``, ``add_1``).

Example:
    >>> import torch
    >>> class Block(torch.nn.Module):
    ...     def forward(self, x):
    ...         return torch.relu(x) + x.sum()
    >>> _fx_node_names(Block())
    ['relu', 'sum_1', 'add']
"""

from __future__ import annotations

import collections
import inspect
from typing import Any, Callable, NamedTuple

import torch


# -- names of calls ---------------------------------------------------------------

_ARITHMETIC = ("add", "sub", "mul", "div", "truediv", "floordiv", "matmul", "pow", "mod", "and", "or", "xor",
               "lshift", "rshift")
#: The run-time names of calls fx names after the ``operator`` function (``x / y`` runs ``Tensor.div``).
_CANONICAL = {"div": "truediv", "remainder": "mod", "positive": "pos"}
#: Calls that turn a tensor into a Python value: the branch a forward takes may depend on the data.
_CONVERSIONS = frozenset({"__bool__", "item", "tolist", "__int__", "__float__", "__index__", "__complex__",
                          "equal", "allclose", "is_nonzero"})
#: fx nodes whose value is not a tensor: nothing to sparsify.
_NOT_TENSOR_METHODS = frozenset({"size", "dim", "ndimension", "numel", "nelement", "item", "tolist", "stride",
                                 "element_size", "data_ptr", "is_contiguous", "get_device", "storage_offset"})


def _base_name(name: str) -> str:
    """The base name of a call named ``name``: dunders and the reflected / in-place
    prefix of arithmetic dunders dropped (``__radd__`` → ``add``)."""
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name[:1] in ("r", "i") and name[1:] in _ARITHMETIC:
            name = name[1:]
    return name


def _call_name(func: Any) -> str:
    """The fx-style base name of a called function or method (``x.shape`` → ``getattr``)."""
    name = getattr(func, "__name__", None) or type(func).__name__
    if name == "__get__":
        return "getattr"
    return _base_name(name)


def _canonical(name: str) -> str:
    """One name for the spellings of an operation (``div`` and fx's ``truediv``)."""
    return _CANONICAL.get(name, name)


def _node_base(op: str, target: Any) -> str:
    """The canonical base name of the call an fx node makes, as the run-time mode
    sees it (``operator.and_`` → ``and``, ``operator.truediv`` → ``truediv``)."""
    if op == "call_method":
        return _canonical(_base_name(target))
    name = getattr(target, "__name__", None) or str(target)
    if getattr(target, "__module__", None) in ("_operator", "operator"):
        name = name.rstrip("_")
        if name[:1] == "i" and name[1:] in _ARITHMETIC:
            name = name[1:]
    return _canonical(_base_name(name))


# -- the fx graph of a submodule ----------------------------------------------------

class _Ref(NamedTuple):
    """An fx node used as an argument of another node (by name)."""

    name: str


class _Node(NamedTuple):
    """One fx node, detached from its graph (picklable, cheap to copy)."""

    name: str
    op: str
    target: Any
    args: tuple
    kwargs: dict
    base: str
    leaves: tuple = ()   # the leaves of the arguments a call receives (constants and _Refs)


class _Graph:
    """A submodule's fx graph: its nodes in order, found by name and by run-time base name."""

    def __init__(self, nodes: list[_Node]):
        self.nodes = {n.name: n for n in nodes}
        self.order = [n.name for n in nodes]
        self.by_base: dict[str, list[str]] = collections.defaultdict(list)
        for n in nodes:
            if n.op in ("call_function", "call_method"):
                self.by_base[n.base].append(n.name)
        self.modules = [n.name for n in nodes if n.op == "call_module"]

    @classmethod
    def trace(cls, module: torch.nn.Module) -> "_Graph | None":
        """The graph of ``module`` (``None`` where ``torch.fx.symbolic_trace`` fails)."""
        graph = _fx_graph(module)
        return None if graph is None else cls.of(graph)

    @classmethod
    def of(cls, graph: torch.fx.Graph) -> "_Graph":
        return cls([_detach(node) for node in graph.nodes])

    def calls(self) -> list[str]:
        """The names of the function and method calls (what ``set_interm`` may name)."""
        return [name for name in self.order if self.nodes[name].op in ("call_function", "call_method")]


def _fx_graph(module: torch.nn.Module, stack_traces: bool = False) -> torch.fx.Graph | None:
    """``module``'s fx graph (``None`` where fx cannot trace it), with each node's source stack
    when ``stack_traces``. The attributes fx adds to the module it traces (``_tensor_constant0``)
    are removed."""
    before = set(vars(module))
    tracer = torch.fx.Tracer()
    tracer.record_stack_traces = stack_traces
    try:
        return tracer.trace(module)
    except Exception:
        return None
    finally:
        for added in set(vars(module)) - before:
            delattr(module, added)


def _source(node: torch.fx.Node) -> tuple:
    """What makes a node the same call in another trace of its module: its kind, its target and
    the frames of the user's code that made it (torch's own frames left out)."""
    frames = tuple(line.strip() for line in (node.stack_trace or "").splitlines()
                   if line.lstrip().startswith("File ") and _TORCH_DIR not in line)
    return node.op, str(node.target), frames


_TORCH_DIR = torch.__file__.rsplit("__init__.py", 1)[0]


def _align(graph: torch.fx.Graph, reference: torch.fx.Graph) -> None:
    """Rename ``graph``'s nodes after ``reference``'s where they are the same call (``_source``:
    the same source line, the n-th time): fx numbers the nodes of each trace anew, so where a
    ``self.training`` branch adds a call, the eval graph's ``add`` was the training graph's
    ``add_1`` and a ``set_interm`` name sparsified another tensor in eval. Calls of ``graph``
    alone keep their fx names where the reference does not use them, else get an ``_eval`` suffix."""
    candidates: dict[tuple, collections.deque] = collections.defaultdict(collections.deque)
    for node in reference.nodes:
        candidates[_source(node)].append(node.name)
    taken = {node.name for node in reference.nodes}
    names, given = {}, set()
    for node in graph.nodes:
        key = _source(node)
        name = candidates[key].popleft() if candidates[key] else None
        if name is None:
            name = node.name
            while name in taken or name in given:
                name += "_eval"
        names[node] = name
        given.add(name)
    for node, name in names.items():
        node.name = name


def _detach(node: torch.fx.Node) -> _Node:
    """``node`` as a ``_Node``: its node arguments become ``_Ref``s."""
    args = _detach_arg(tuple(node.args))
    kwargs = _detach_arg(dict(node.kwargs))
    base = _node_base(node.op, node.target) if node.op in ("call_function", "call_method") else node.op
    received = args[:1] if base == "getattr" else args   # x.shape: the getter runs on x alone
    return _Node(node.name, node.op, node.target, tuple(args), kwargs, base, tuple(_leaves((received, kwargs), [])))


def _fx_node_names(module: torch.nn.Module) -> list[str] | None:
    """The fx names of ``module``'s function and method calls (``None``: fx cannot trace it)."""
    graph = _Graph.trace(module)
    return None if graph is None else graph.calls()


def _traces(module: torch.nn.Module) -> dict[bool, _Graph | None]:
    """``module``'s graph in training and in eval mode (``self.training`` branches differ);
    the training flags of ``module`` and of its submodules are restored afterwards."""
    flags = [(m, m.training) for m in module.modules()]
    traced: dict[bool, torch.fx.Graph | None] = {}
    try:
        for mode in (True, False):
            module.train(mode)
            traced[mode] = _fx_graph(module, stack_traces=True)
    finally:
        for m, flag in flags:
            m.training = flag
    if traced[True] is not None and traced[False] is not None:
        _align(traced[False], traced[True])   # a name means one call in both modes
    return {mode: None if graph is None else _Graph.of(graph) for mode, graph in traced.items()}


# -- identifying the calls of one forward ---------------------------------------------

class _Missing:
    """A value the matcher does not have: ``_UNKNOWN`` can never be known (a tensor
    constant fx folded: it matches any argument); ``_PENDING`` is a call's that has not
    been seen (yet): nothing matches it."""

    def __init__(self, what: str):
        self.what = what

    def __repr__(self) -> str:
        return f"<{self.what}>"


_UNKNOWN = _Missing("unknown")
_PENDING = _Missing("pending")
#: Immutable non-tensor values whose methods may be re-run to learn a value (shapes, numbers).
_IMMUTABLE = (tuple, int, float, bool, str, type(None), torch.dtype, torch.device, slice)
_PURE_BUILTINS = frozenset({"getattr", "len", "min", "max", "abs", "round", "int", "float", "bool", "tuple"})


_CONTAINERS = (tuple, list, dict, slice)


def _leaves(value: Any, out: list) -> list:
    """The leaves of ``value`` (tuples, lists, dicts, slices and shapes flattened)."""
    if isinstance(value, _Ref) or not isinstance(value, _CONTAINERS):
        out.append(value)
        return out
    if isinstance(value, dict):
        value = value.values()
    elif isinstance(value, slice):
        value = (value.start, value.stop, value.step)
    for v in value:
        if isinstance(v, _CONTAINERS) and not isinstance(v, _Ref):
            _leaves(v, out)
        else:
            out.append(v)
    return out


def _map_refs(value: Any, fn: Callable[[str], Any]) -> Any:
    """``value`` with each ``_Ref`` replaced by ``fn(name)``."""
    if isinstance(value, _Ref):
        return fn(value.name)
    if isinstance(value, tuple):
        return tuple(_map_refs(v, fn) for v in value)
    if isinstance(value, list):
        return [_map_refs(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: _map_refs(v, fn) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(*(_map_refs(v, fn) for v in (value.start, value.stop, value.step)))
    return value


def _detach_arg(arg: Any) -> Any:
    """An fx argument with its nodes as ``_Ref``s and fx's immutable containers as plain ones."""
    if isinstance(arg, torch.fx.Node):
        return _Ref(arg.name)
    if isinstance(arg, tuple) and type(arg) is not tuple and hasattr(arg, "_fields"):
        return type(arg)(*(_detach_arg(a) for a in arg))
    if isinstance(arg, tuple):
        return tuple(_detach_arg(a) for a in arg)
    if isinstance(arg, list):
        return [_detach_arg(a) for a in arg]
    if isinstance(arg, dict):
        return {k: _detach_arg(v) for k, v in arg.items()}
    if isinstance(arg, slice):
        return slice(*(_detach_arg(a) for a in (arg.start, arg.stop, arg.step)))
    return arg


def _same(want: Any, got: Any) -> bool:
    """Whether a node's argument ``want`` is the call's argument ``got``: tensors by
    identity, other values by equality."""
    if want is got:
        return True
    if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor):
        return want is got
    try:
        return bool(want == got)
    except Exception:
        return False


def _fetch(module: torch.nn.Module, target: str) -> Any:
    """The live attribute ``target`` (dotted) of ``module``, or ``_UNKNOWN`` (fx's tensor constants)."""
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part, _UNKNOWN)
        if obj is _UNKNOWN:
            break
    return obj


def _pure(node: _Node) -> bool:
    """Whether ``node`` is a side-effect-free Python call (on shapes, tuples, numbers) that may be re-run."""
    if node.op == "call_method":
        return True   # checked on the value of self: immutable non-tensors only
    module = getattr(node.target, "__module__", None)
    name = getattr(node.target, "__name__", "")
    if module in ("_operator", "operator"):
        return not (name in ("setitem", "delitem", "iconcat") or name[:1] == "i" and name[1:].rstrip("_") in _ARITHMETIC)
    return module == "math" or (module == "builtins" and name in _PURE_BUILTINS)


class _FxCalls:
    """Identifies the calls one forward of a traced submodule makes with its fx nodes, by
    data flow: a call is the first open node with the call's base name whose arguments
    (placeholders bound to the forward's arguments, live attributes, earlier calls'
    outputs, shape arithmetic re-run here) are the call's arguments. Calls with no node
    (constants fx folded) match none, so they shift no name. Where no node fits exactly
    (a branch fx traced was not taken, so a node's input was never made), an argument
    not made yet stands for any tensor this forward's nodes made, never for a constant."""

    def __init__(self, graph: _Graph, module: torch.nn.Module, args: tuple, kwargs: dict,
                 signature: inspect.Signature | None = None):
        self.graph, self.module = graph, module
        self.env: dict[str, Any] = {}
        self.open = {base: list(names) for base, names in graph.by_base.items()}
        self.open_modules = list(graph.modules)
        self.produced: set[str] = set()
        self.evaluated: set[str] = set()
        self.made: dict[int, torch.Tensor] = {}   # id → the tensors the nodes hold (kept alive: ids stay unique)
        self._wants: dict[str, list] = {}          # node → its arguments' values, once all are known
        self._bind(args, kwargs, signature)

    def _bind(self, args: tuple, kwargs: dict, signature: inspect.Signature | None) -> None:
        """The placeholders' values: the forward's arguments, defaults applied."""
        try:
            signature = signature or inspect.signature(self.module.forward)
            bound = signature.bind(*args, **kwargs)
        except (TypeError, ValueError):
            return
        bound.apply_defaults()
        for name in self.graph.order:
            node = self.graph.nodes[name]
            if node.op == "placeholder" and str(node.target).lstrip("*") in bound.arguments:
                self.record(name, bound.arguments[str(node.target).lstrip("*")])

    def value(self, name: str) -> Any:
        """Node ``name``'s value in this forward, or a ``_Missing`` (``_UNKNOWN``, ``_PENDING``)."""
        if name in self.env:
            return self.env[name]
        node = self.graph.nodes[name]
        value: Any = _PENDING
        if node.op == "get_attr":
            value = _fetch(self.module, node.target)
        elif node.op in ("call_function", "call_method") and _pure(node):
            value = self._evaluate(node)
        if not isinstance(value, _Missing):
            self.record(name, value)
        return value

    def _evaluate(self, node: _Node) -> Any:
        """Re-run a call the mode does not see (shape and tuple arithmetic) from its inputs' values."""
        args, kwargs = _map_refs(node.args, self.value), _map_refs(node.kwargs, self.value)
        direct = list(args) + list(kwargs.values())
        if any(isinstance(v, (_Missing, torch.Tensor)) for v in direct):
            return _PENDING   # a tensor operand: the mode sees that call (or it has not run yet)
        if node.op == "call_method" and not isinstance(args[0], _IMMUTABLE):
            return _PENDING
        if any(isinstance(v, _Missing) for v in _leaves((args, kwargs), [])):
            return _PENDING
        try:
            out = getattr(args[0], node.target)(*args[1:], **kwargs) if node.op == "call_method" \
                else node.target(*args, **kwargs)
        except Exception:
            return _PENDING
        self.evaluated.add(node.name)
        return out

    def identify(self, func: Any, args: tuple, kwargs: dict) -> str | None:
        """The fx node this call is (``None``: no node, e.g. a constant fx folded)."""
        names = self.open.get(_canonical(_call_name(func)))
        if not names:
            return None
        got = list(args) if not kwargs and not any(isinstance(a, _CONTAINERS) for a in args) \
            else _leaves((args, kwargs), [])
        attr = getattr(getattr(func, "__self__", None), "__name__", None)
        for exact in (True, False):
            for i, name in enumerate(names):
                if self._fits(self.graph.nodes[name], got, attr, exact):
                    del names[i]
                    self.produced.add(name)
                    return name
        return None

    def _fits(self, node: _Node, got: list, attr: str | None, exact: bool) -> bool:
        """Whether ``node``'s arguments are the call's: its known ones equal, an unknown one
        (a constant) matches anything; a pending one fails unless not ``exact``, where it
        matches tensors that this forward's nodes made."""
        if node.base == "getattr" and (len(node.args) < 2 or node.args[1] != attr):
            return False   # x.shape: the call is the attribute's getter
        want = self._want(node)
        if len(want) == len(got) and all(_same(w, g) for w, g in zip(want, got)):
            return True   # the usual case: the same arguments in the same order
        if exact and len(want) != len(got) and not any(w is _UNKNOWN for w in want):
            return False
        remaining, unknown, pending = list(got), 0, 0
        for w in want:
            if w is _PENDING:
                if exact:
                    return False
                pending += 1
            elif w is _UNKNOWN:
                unknown += 1
            else:
                j = next((j for j, g in enumerate(remaining) if _same(w, g)), None)
                if j is None:
                    return False
                del remaining[j]
        if not remaining or unknown:
            return True
        return pending > 0 and all(id(g) in self.made for g in remaining if isinstance(g, torch.Tensor))

    def _want(self, node: _Node) -> list:
        """The leaves of ``node``'s arguments' values in this forward (cached once known)."""
        want = self._wants.get(node.name)
        if want is None:
            want = []
            for leaf in node.leaves:
                value = self.value(leaf.name) if isinstance(leaf, _Ref) else leaf
                if isinstance(value, _CONTAINERS):
                    _leaves(value, want)
                else:
                    want.append(value)
            if not any(isinstance(w, _Missing) for w in want):
                self._wants[node.name] = want
        return want

    def record(self, name: str, out: Any) -> None:
        """Node ``name`` produced ``out``."""
        self.env[name] = out
        for leaf in (out,) if isinstance(out, torch.Tensor) else _leaves(out, []):
            if isinstance(leaf, torch.Tensor):
                self.made[id(leaf)] = leaf

    def module_done(self, module: torch.nn.Module, output: Any) -> None:
        """A submodule the graph calls (a ``call_module`` node) returned ``output``."""
        for i, name in enumerate(self.open_modules):
            if _fetch(self.module, self.graph.nodes[name].target) is module:
                del self.open_modules[i]
                self.record(name, output)
                return

    def describe(self) -> str:
        """The calls fx lists for this submodule (for messages)."""
        return ", ".join(self.graph.calls())


class _CountedCalls:
    """Names the calls of a submodule fx cannot trace: run-time base name, counted
    (``add``, ``add_1``, ...) in the order the forward makes them."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.seen: list[str] = []
        self.produced: set[str] = set()

    def identify(self, func: Any, args: tuple, kwargs: dict) -> str:
        base = _call_name(func)
        n = self.counts[base]
        self.counts[base] += 1
        name = base if n == 0 else f"{base}_{n}"
        self.seen.append(name)
        self.produced.add(name)
        return name

    def record(self, name: str, out: Any) -> None:
        pass

    def module_done(self, module: torch.nn.Module, output: Any) -> None:
        pass

    def describe(self) -> str:
        return ", ".join(self.seen)
