"""``SparsityBuilder``: make an existing model sparse (paper §2.1, appendix A.1).

Weights are named by their fully-qualified parameter names. Intermediate
tensors are named ``"<submodule path>.<fx node name>"`` (e.g.
``"intermediate.gelu"``): the output of that call inside the submodule's
forward. The named call becomes a sparse operator with the given output spec.
Calls are matched at run time by a ``TorchFunctionMode`` that is active only
while that submodule runs. Where fx can trace the submodule, names are checked
against its graph up front, and each call the mode sees is identified with its
fx node by data flow (the node's inputs are the values the call receives), so a
name selects exactly the node it names. Modules that ``torch.fx`` cannot trace
(data-dependent control flow, ``is_causal`` arguments) work as well: there the
names are the run-time call names, counted per base name (``add``, ``add_1``).

Example:
    >>> import torch, sten_core as sten
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    >>> sb = sten.SparsityBuilder(model)
    >>> sb.set_weight("0.weight", sten.ScalarFractionSparsifier(0.5), out_format=sten.CsrTensor)
    >>> sparse = sb.get_sparse_model()
    >>> type(sparse[0].weight.wrapped_tensor).__name__
    'CsrTensor'

The original STen's form, a builder without a model, works too (names are
checked when the model is given):

    >>> sb = sten.SparsityBuilder()
    >>> sb.set_weight("0.weight", sten.ScalarFractionSparsifier(0.5), out_format=sten.CsrTensor)
    >>> type(sb.get_sparse_model(model)[0].weight.wrapped_tensor).__name__
    'CsrTensor'
"""

from __future__ import annotations

import collections
import copy
import inspect
import sys
import threading
import warnings
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from sten_core.dispatch import call_op, sparsify
from sten_core.model.sparsifiers import KeepAll
from sten_core.model.spec import OutputSpec, check_sparsifier
from sten_core.model.tensor import SparseParameterWrapper, SparseTensorWrapper
from sten_core.training.fx_calls import (_CONVERSIONS, _NOT_TENSOR_METHODS, _CountedCalls, _FxCalls, _Graph,
                                        _fx_node_names, _traces)
from sten_core.training.weight_names import unknown_weight


def _spec(inline: Any, tmp: Any, external: Any, out: Any, what: str) -> OutputSpec:
    """The output spec of a builder setting; ``None`` sparsifiers mean ``KeepAll()``."""
    return OutputSpec.coerce((_or_keep_all(inline), tmp, _or_keep_all(external), out), what)


def _or_keep_all(sparsifier: Any) -> Any:
    """``KeepAll()`` for ``None`` (an argument left out), else the argument itself
    (``0`` or ``0.0`` is not a sparsifier: ``OutputSpec.coerce`` rejects it)."""
    return KeepAll() if sparsifier is None else sparsifier


_DENSE = OutputSpec.coerce((KeepAll(), torch.Tensor, KeepAll(), torch.Tensor), "set_interm")
"""The forward spec of an intermediate with only ``set_interm_grad``: the call's dense output."""

_active = threading.local()   # .modes: the _IntermediateModes entered, outermost first


def _active_modes() -> list:
    """The ``_IntermediateMode``s of the submodules now running, outermost first."""
    if not hasattr(_active, "modes"):
        _active.modes = []
    return _active.modes


class _IntermediateMode(TorchFunctionMode):
    """Turns the named calls inside one submodule's forward into sparse ops. Calls made
    inside the torch.nn modules it calls (``paused``: fx shows each as one ``call_module``
    node) are neither counted nor matched; a custom module's calls are, as fx traces
    through it. ``branched``: the forward turned a tensor into a Python value (its
    branches may depend on the data)."""

    def __init__(self, targets: dict[str, tuple[OutputSpec, OutputSpec | None]],
                 calls: _FxCalls | _CountedCalls | None = None, path: str = ""):
        super().__init__()
        self.targets = targets
        self.path = path  # the submodule's, to name an intermediate in errors
        self.calls = _CountedCalls() if calls is None else calls
        self.paused = 0
        self.branched = False

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # Dynamo tracing: one graph break, the call run eagerly
            return _eager_mode_call()(self, func, args, kwargs)
        return self._call(func, args, kwargs)

    def _call(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self.paused:
            return func(*args, **kwargs)
        if getattr(func, "__name__", None) in _CONVERSIONS:
            self.branched = True
        name = self.calls.identify(func, args, kwargs)
        target = None if name is None else self.targets.get(name)
        if target is None:
            out = func(*args, **kwargs)   # the enclosing submodules' modes see this call next
        else:
            try:
                out = self._sparse_call(func, args, kwargs, target)
            except (ValueError, TypeError, NotImplementedError) as error:  # a layout refusing the intermediate
                full = f"{self.path}.{name}" if self.path else name
                raise _with_context(error, f"set_interm({full!r}, ...)") from error
        if name is not None:
            self.calls.record(name, out)
        return out

    def _sparse_call(self, func: Any, args: tuple, kwargs: dict, target: tuple) -> Any:
        """Run a named call as a sparse op. The modes of the enclosing submodules (a
        parent with intermediates of its own) see it as the one call it is, with the
        sparse output, not the dispatcher's calls inside it."""
        modes = _active_modes()
        outer = [m for m in modes[:modes.index(self)] if not m.paused] if self in modes else []
        for mode in outer:
            mode.paused += 1
        try:
            out_spec, grad_spec = target
            out = call_op(func, args, kwargs, (out_spec,), (grad_spec,) if grad_spec else None)
        finally:
            for mode in outer:
                mode.paused -= 1
        for mode in reversed(outer):
            mode.observe(func, args, kwargs, out)
        return out

    def observe(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """An inner submodule's mode ran this call as a sparse op: name it, as if seen."""
        name = self.calls.identify(func, args, kwargs)
        if name is not None:
            self.calls.record(name, out)


_EAGER_MODE_CALL: list = []


def _non_strict_export() -> bool:
    """Whether non-strict ``torch.export`` runs this code (``is_exporting`` is in torch 2.6+)."""
    exporting = getattr(torch.compiler, "is_exporting", None)
    return exporting is not None and exporting() and not torch.compiler.is_dynamo_compiling()


_INTERM_EAGER = ("SparsityBuilder.set_interm / set_interm_grad intermediates run eagerly (a graph break): "
                 "torch.export and fullgraph=True cannot hold them; export the model before get_sparse_model(), "
                 "or sparsify its weights only")


def _eager_mode_call() -> Any:
    """``_IntermediateMode._call`` as Dynamo meets it: never traced into (its run-time naming of
    calls is plain Python Dynamo cannot trace), so ``torch.compile`` breaks the graph there and
    strict ``torch.export`` names the reason. Made when a model's intermediates are set up
    (``disable`` imports Dynamo); made first under tracing, it was Dynamo's own "function marked
    as skipped" error instead."""
    if not _EAGER_MODE_CALL:
        _EAGER_MODE_CALL.append(torch.compiler.disable(
            lambda mode, func, args, kwargs: mode._call(func, args, kwargs),
            reason=_INTERM_EAGER))
    return _EAGER_MODE_CALL[0]


class _Intermediates:
    """Forward hooks that activate an ``_IntermediateMode`` around a submodule.

    ``graphs``: the submodule's fx graph in training and in eval mode (``None`` where fx
    cannot trace it: run-time names then). A name that a forward does not produce is
    reported once, as a warning, when the name is an fx node (a branch not taken) or the
    forward took a data-dependent branch; for a submodule fx cannot trace whose forward
    took none, it is a ``ValueError`` (the same calls run every time: a wrong name).
    """

    def __init__(self, path: str, targets: dict, graphs: dict[bool, _Graph | None] | None = None):
        self.path, self.targets = path, targets
        self.graphs = graphs or {}
        self.produced: set[str] = set()   # the names some forward produced
        self.reported: set[str] = set()   # the names warned about
        self._signature: inspect.Signature | None = None   # of the module's forward, once known
        self._stack: list[_IntermediateMode] = []
        _eager_mode_call()   # made now, eagerly: Dynamo cannot trace torch.compiler.disable itself

    def pre(self, module: torch.nn.Module, args: Any, kwargs: Any = None) -> None:
        if torch.compiler.is_compiling() and _non_strict_export():
            # fake values (a sparsifier's .item() failed with no hint of why); raised before the mode
            # is entered: raised inside it, export's own mode was left on the stack
            raise NotImplementedError(f"STen: non-strict torch.export: {_INTERM_EAGER}")
        graph = self.graphs.get(module.training)
        if graph is not None and self._signature is None:
            try:
                self._signature = inspect.signature(module.forward)
            except (TypeError, ValueError):
                pass
        calls = _CountedCalls() if graph is None else _FxCalls(graph, module, args, kwargs or {}, self._signature)
        mode = _IntermediateMode(self.targets, calls, self.path)
        self._stack.append(mode)
        _active_modes().append(mode)
        mode.__enter__()

    def inner_pre(self, module: torch.nn.Module, args: Any) -> None:
        """A module called from the submodule's forward starts: its calls are its own."""
        if self._stack:
            self._stack[-1].paused += 1

    def inner_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            mode = self._stack[-1]
            mode.paused -= 1
            if not mode.paused:
                mode.calls.module_done(module, output)

    def post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._stack:   # (pre raised)
            return
        mode = self._stack.pop()
        mode.__exit__(None, None, None)
        modes = _active_modes()
        if mode in modes:
            modes.remove(mode)
        if sys.exc_info()[0] is not None:
            return   # the forward raised: that error is the one to see
        self.produced |= mode.calls.produced & set(self.targets)
        for name in sorted(set(self.targets) - self.produced - self.reported):
            self._missing(name, mode, module.training)

    def _missing(self, name: str, mode: _IntermediateMode, training: bool) -> None:
        """Report that this forward did not produce target ``name`` (none before it did either)."""
        full = f"{self.path}.{name}" if self.path else name
        where = self.path or "the model"
        calls = mode.calls
        if isinstance(calls, _FxCalls):
            if name in calls.graph.nodes:
                calls.value(name)
                if name in calls.evaluated:
                    raise ValueError(
                        f"intermediate {full!r} is not a tensor operation: fx node {name} computes on shapes or "
                        f"tuples, which have nothing to sparsify; name a call that produces a tensor")
                why = "in a branch this call did not take, or with an input fx did not see"
            else:
                why = f"fx has no node {name} when {where} is in {'training' if training else 'eval'} mode"
            self._warn(f"intermediate {full!r} (fx node {name}) was not produced by this forward of {where} "
                       f"({why}); it is sparsified on the calls that produce it")
        elif mode.branched:
            self._warn(f"intermediate {full!r} was not produced by this forward of {where}, which fx cannot trace "
                       f"and which took a data-dependent branch (a branch not taken?); it is sparsified on the calls "
                       f"that produce it; this call's calls are: {calls.describe()}")
        else:
            raise ValueError(
                f"intermediate {full} was not produced by {where}'s forward (fx cannot trace it: names are its "
                f"run-time calls); its calls are: {calls.describe()}")
        self.reported.add(name)

    @staticmethod
    def _warn(message: str) -> None:
        warnings.warn(message, UserWarning, stacklevel=4)


def _with_context(error: Exception, context: str) -> Exception:
    """``error`` again, its message prefixed by ``context`` (same type where it can be made)."""
    message = f"{context}: {error}"
    try:
        new = type(error)(message)
    except Exception:
        new = RuntimeError(f"{context}: {type(error).__name__}: {error}")
    return new


class SparsityBuilder:
    """Collects sparsity settings for a model's weights and intermediates.

    Args:
        model: the dense ``nn.Module`` (optional: the original STen's
            ``SparsityBuilder()`` takes the model in ``get_sparse_model(model)``,
            ``sparsify_model_inplace(model)`` and
            ``sparsify_model_and_optimizer_inplace(model, optimizer)``, where the
            names set are checked); ``get_sparse_model`` leaves it untouched.
    """

    def __init__(self, model: torch.nn.Module | None = None):
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.weights: dict[str, tuple[Any, OutputSpec]] = {}
        self.weight_grads: dict[str, OutputSpec] = {}
        self.interms: dict[str, OutputSpec] = {}
        self.interm_grads: dict[str, OutputSpec] = {}

    # -- settings -------------------------------------------------------------
    def _check_weight(self, name: str, model: torch.nn.Module | None = None) -> None:
        model = self.model if model is None else model
        if model is None:
            if not isinstance(name, str) or not name:
                raise ValueError(f"weight name must be a non-empty string, got {name!r}")
            return  # checked when the model is given
        names = dict(model.named_parameters())
        if name in names:
            return
        if name in _tied_names(model):
            return  # another name of a tied parameter: both names are sparsified, and stay tied
        raise unknown_weight(model, name)

    def set_weight(self, name: str, initial_sparsifier: Any = None, inline_sparsifier: Any = None,
                   tmp_format: type = torch.Tensor, external_sparsifier: Any = None,
                   out_format: type = torch.Tensor) -> None:
        """Store weight ``name`` in ``out_format``, sparsified by
        ``initial_sparsifier`` then the inline and external sparsifiers."""
        self._check_weight(name)
        initial = check_sparsifier(_or_keep_all(initial_sparsifier), "set_weight: initial_sparsifier")
        spec = _spec(inline_sparsifier, tmp_format, external_sparsifier, out_format, "set_weight")
        self.weights[name] = (initial, spec)

    def set_weight_grad(self, name: str, inline_sparsifier: Any = None, tmp_format: type = torch.Tensor,
                        external_sparsifier: Any = None, out_format: type = torch.Tensor) -> None:
        """The format of weight ``name``'s gradient (``.grad``)."""
        self._check_weight(name)
        self.weight_grads[name] = _spec(inline_sparsifier, tmp_format, external_sparsifier, out_format,
                                        "set_weight_grad")

    def _check_interm(self, name: str, model: torch.nn.Module | None = None) -> tuple[str, str]:
        if not isinstance(name, str) or not name:
            raise ValueError(f"intermediate name must be a non-empty string '<submodule>.<fx node>', got {name!r}")
        path, _, node = name.rpartition(".")
        model = self.model if model is None else model
        if model is None:
            return path, node  # checked when the model is given
        modules = dict(model.named_modules())
        if path not in modules:
            raise ValueError(f"unknown intermediate {name!r}: no submodule {path!r}; submodules: {', '.join(m for m in modules if m)}")
        graph = _Graph.trace(modules[path])
        if graph is None:
            return path, node   # fx cannot trace it: names are checked at run time
        names = graph.calls()
        if node not in names:
            raise ValueError(f"unknown intermediate {name!r}; {_listing(path, names)}"
                             f"{_submodule_hint(name, modules[path], node)}{_builtin_hint(node, names)}")
        found = graph.nodes[node]
        if found.base == "getattr" or (found.op == "call_method" and found.target in _NOT_TENSOR_METHODS):
            raise ValueError(f"intermediate {name!r} is not a tensor operation: fx node {node} is "
                             f"{found.target if found.op == 'call_method' else 'getattr'}, whose value is not a "
                             f"tensor; {_listing(path, names)}")
        return path, node

    def set_interm(self, name: str, inline_sparsifier: Any = None, tmp_format: type = torch.Tensor,
                   external_sparsifier: Any = None, out_format: type = torch.Tensor) -> None:
        """Sparsify the intermediate ``"<submodule>.<fx node>"`` (a call returning
        several tensors has its first one sparsified)."""
        self._check_interm(name)
        self.interms[name] = _spec(inline_sparsifier, tmp_format, external_sparsifier, out_format, "set_interm")

    def set_interm_grad(self, name: str, inline_sparsifier: Any = None, tmp_format: type = torch.Tensor,
                        external_sparsifier: Any = None, out_format: type = torch.Tensor) -> None:
        """The format of the gradient flowing into intermediate ``name``; without a
        ``set_interm`` for ``name`` its forward value stays dense.

        >>> import torch, sten_core as sten
        >>> class M(torch.nn.Module):
        ...     def forward(self, x):
        ...         return torch.relu(x) * 2
        >>> sb = sten.SparsityBuilder(M())
        >>> sb.set_interm_grad("relu", sten.ScalarFractionSparsifier(0.75))
        >>> x = torch.tensor([1., 2., 3., 4.], requires_grad=True)
        >>> sb.get_sparse_model()(x).backward(torch.tensor([1., 2., 3., 4.]))   # dL/d relu = [2, 4, 6, 8]
        >>> x.grad                                                  # its largest quarter flows back
        tensor([0., 0., 0., 8.])
        """
        self._check_interm(name)
        self.interm_grads[name] = _spec(inline_sparsifier, tmp_format, external_sparsifier, out_format,
                                        "set_interm_grad")

    # -- building -------------------------------------------------------------
    def sparse_weight(self, name: str, dense: torch.Tensor) -> SparseParameterWrapper:
        """The sparse parameter for weight ``name`` made from ``dense``; an error names
        the weight and its formats."""
        initial, spec = self.weights[name]
        try:
            return self._sparse_weight(name, dense, initial, spec)
        except Exception as e:
            context = (f"set_weight({name!r}, initial_sparsifier={initial!r}, tmp_format={spec.tmp_format.__name__}, "
                       f"out_format={spec.out_format.__name__})")
            if dense.is_meta:
                context += (": the weight is on the meta device, so it has no values to sparsify: build the dense "
                            "model on a real device, sparsify it, then move it (model.to('meta'), to_empty + "
                            "load_state_dict)")
            raise _with_context(e, context) from e

    def _sparse_weight(self, name: str, dense: torch.Tensor, initial: Any, spec: OutputSpec) -> Any:
        with torch.no_grad():
            if type(spec.inline_sparsifier) is KeepAll and type(spec.external_sparsifier) is KeepAll:
                # straight into the output layout: it sees the initial sparsifier's structure
                value = sparsify(initial, dense.detach(), spec.out_format)
            else:
                value = sparsify(initial, dense.detach(), spec.tmp_format)
                value = sparsify(spec.inline_sparsifier, value, spec.tmp_format)
                value = sparsify(spec.external_sparsifier, value, spec.out_format)
        grad_fmt = self.weight_grads.get(name)
        if not isinstance(value, SparseTensorWrapper):
            return value  # a dense out_format: stays a plain tensor
        return SparseParameterWrapper(value.wrapped_tensor, requires_grad=dense.requires_grad, grad_fmt=grad_fmt)

    def _check_all(self, model: torch.nn.Module) -> None:
        """Check every name set against ``model`` (a builder made without a model)."""
        for name in list(self.weights) + list(self.weight_grads):
            self._check_weight(name, model)
        for name in list(self.interms) + list(self.interm_grads):
            self._check_interm(name, model)
        tied = _tied_names(model)
        for settings in (self.weights, self.weight_grads):
            for alias, name in tied.items():
                if alias in settings and name in settings:
                    raise ValueError(
                        f"weight {alias!r} is tied to {name!r} (one parameter under two names) and both are set; "
                        f"set one of them: the setting applies to both names, which stay tied"
                    )

    def _build_weights(self, model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(old, new)`` for every weight set, all built before any is swapped in."""
        built = []
        for name in self.weights:
            path, _, attr = name.rpartition(".")
            old = getattr(model.get_submodule(path), attr)
            new = self.sparse_weight(name, old)
            if not isinstance(new, SparseTensorWrapper):
                new = torch.nn.Parameter(new, requires_grad=old.requires_grad)
            built.append((old, new))
        return built

    def _apply(self, model: torch.nn.Module) -> dict[int, torch.nn.Parameter]:
        """Replace weights and hook intermediates in ``model``; returns old id → new param.
        All or nothing: every new weight is built (and every graph traced) before the
        model is changed, so an error leaves it as it was."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self._check_all(model)
        built = self._build_weights(model)
        hooks = self._intermediate_hooks(model)
        replaced = {}
        for old, new in built:
            for owner, owner_attr in _places_of(model, old):  # every name of a tied weight
                setattr(owner, owner_attr, new)
            replaced[id(old)] = new
        for name in set(self.weight_grads) - set(self.weights):
            path, _, attr = name.rpartition(".")
            getattr(model.get_submodule(path), attr).grad_fmt = self.weight_grads[name]
        for path, hook in hooks.items():
            _install(model.get_submodule(path), hook)
        return replaced

    def _intermediate_hooks(self, model: torch.nn.Module) -> dict[str, _Intermediates]:
        """One ``_Intermediates`` per submodule with intermediates set (its fx graphs traced).
        A name with only ``set_interm_grad`` keeps its forward value dense (``_DENSE``) and
        gets its gradient sparsified: the paper's error signals have layouts and
        sparsifiers independent of their forward tensors."""
        by_module: dict[str, dict] = collections.defaultdict(dict)
        for name in dict.fromkeys([*self.interms, *self.interm_grads]):
            path, _, node = name.rpartition(".")
            by_module[path][node] = (self.interms.get(name, _DENSE), self.interm_grads.get(name))
        return {path: _Intermediates(path, targets, _traces(model.get_submodule(path)))
                for path, targets in by_module.items()}

    def _model(self, model: torch.nn.Module | None, method: str) -> torch.nn.Module:
        model = self.model if model is None else model
        if model is None:
            raise TypeError(f"{method}() needs the model: this builder was made without one (SparsityBuilder())")
        return model

    def get_sparse_model(self, model: torch.nn.Module | None = None) -> torch.nn.Module:
        """A sparsified copy of ``model`` (default: the builder's); the original is not changed."""
        model = copy.deepcopy(self._model(model, "get_sparse_model"))
        self._apply(model)
        return model

    def sparsify_model_inplace(self, model: torch.nn.Module | None = None) -> torch.nn.Module:
        """Sparsify ``model`` (default: the builder's) in place and return it (on an
        error, the model is left unchanged).

        An optimizer built on the model still holds the old dense parameters; use
        ``sparsify_model_and_optimizer_inplace`` then.
        """
        model = self._model(model, "sparsify_model_inplace")
        self._apply(model)
        return model

    def sparsify_model_and_optimizer_inplace(self, model: torch.nn.Module | None = None,
                                             optimizer: torch.optim.Optimizer | None = None
                                             ) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
        """Sparsify ``model`` (default: the builder's) in place, and make
        ``optimizer`` hold the new sparse parameters, its state sparsified
        like them. Returns ``(model, optimizer)``, as the original STen. On an
        error neither the model nor the optimizer is changed."""
        model = self._model(model, "sparsify_model_and_optimizer_inplace")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        replaced = self._apply(model)
        if optimizer is not None:
            _swap_in_optimizer(optimizer, replaced)
        return model, optimizer


def _swap_in_optimizer(optimizer: torch.optim.Optimizer, replaced: dict[int, Any]) -> None:
    """Make ``optimizer`` hold the new parameters (``old id → new``), its state like them."""
    for group in optimizer.param_groups:   # (in place: LBFGS keeps the list itself as its _params)
        group["params"][:] = [replaced.get(id(p), p) for p in group["params"]]
    for old_id, new in replaced.items():
        old = next((p for p in list(optimizer.state) if id(p) == old_id), None)
        if old is None:
            continue
        state = optimizer.state.pop(old)
        optimizer.state[new] = {k: _like(new, v) for k, v in state.items()}


def _install(module: torch.nn.Module, hooks: _Intermediates) -> None:
    """Register ``hooks`` on ``module`` and on the leaf modules it calls (fx's
    ``call_module`` nodes: the calls inside them are theirs)."""
    module.register_forward_pre_hook(hooks.pre, with_kwargs=True)
    module.register_forward_hook(hooks.post, always_call=True)
    tracer = torch.fx.Tracer()
    for qualname, inner in module.named_modules():
        if inner is not module and tracer.is_leaf_module(inner, qualname):
            inner.register_forward_pre_hook(hooks.inner_pre)
            inner.register_forward_hook(hooks.inner_post, always_call=True)


def _listing(path: str, names: list[str]) -> str:
    """The valid intermediate names of submodule ``path`` (for messages)."""
    if names:
        return f"the fx nodes of {path or 'the model'} are: {', '.join(names)}"
    return f"{path or 'the model'} has no function or method calls of its own (only submodule calls)"


def _builtin_hint(node: str, names: list[str]) -> str:
    """A hint when ``node`` is the run-time spelling of a call fx renamed (``sum`` → ``sum_1``)."""
    import builtins

    renamed = f"{node}_1" if hasattr(builtins, node) else f"{node}_"
    if renamed in names and node not in names:
        return (f"; fx renames calls that shadow Python names: the first {node!r} call is {renamed!r}")
    return ""


def _submodule_hint(name: str, module: torch.nn.Module, node: str) -> str:
    """A hint when ``name`` names a submodule rather than one of its calls."""
    child = dict(module.named_children()).get(node)
    if child is None:
        return ""
    inner = _fx_node_names(child) or []
    return (f"; {name!r} is a submodule: its intermediates are named '{name}.<fx node>'"
            + (f", here {', '.join(repr(f'{name}.{n}') for n in inner)}" if inner else ""))


def _tied_names(model: torch.nn.Module) -> dict[str, str]:
    """Each extra name of a tied parameter → the name ``named_parameters()`` gives it."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
    return tied


def _places_of(model: torch.nn.Module, param: torch.Tensor) -> list[tuple[torch.nn.Module, str]]:
    """Every (module, attribute) holding ``param`` (more than one when weights are tied)."""
    return [(module, attr) for module in model.modules()
            for attr, p in module._parameters.items() if p is param]


def _like(param: Any, value: Any) -> Any:
    """Optimizer state entry ``value`` in ``param``'s layout and pattern."""
    if isinstance(param, SparseTensorWrapper) and isinstance(value, torch.Tensor) and value.shape == param.shape:
        from sten_core.model.sparsifiers import SameFormatSparsifier

        return sparsify(SameFormatSparsifier(param), value, type(param.wrapped_tensor))
    return value
