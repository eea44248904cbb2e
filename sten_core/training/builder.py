"""``SparsityBuilder``: make an existing model sparse (paper §2.1, appendix A.1).

Weights are named by their fully-qualified parameter names. Intermediate
tensors are named ``"<submodule path>.<fx node name>"`` (e.g.
``"intermediate.gelu"``): the output of that call inside the submodule's
forward. The named call becomes a sparse operator with the given output spec.
Calls are matched at run time by a ``TorchFunctionMode`` that is active only
while that submodule runs, so modules that ``torch.fx`` cannot trace (data-
dependent control flow, ``is_causal`` arguments) work as well; where fx can
trace the submodule, names are checked against its graph up front.

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
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from sten_core.dispatch import call_op, sparsify
from sten_core.model.sparsifiers import KeepAll
from sten_core.model.spec import OutputSpec
from sten_core.model.tensor import SparseParameterWrapper, SparseTensorWrapper


def _spec(inline: Any, tmp: Any, external: Any, out: Any, what: str) -> OutputSpec:
    return OutputSpec.coerce((inline, tmp, external, out), what)


def _call_name(func: Any) -> str:
    """The fx-style base name of a called function or method."""
    name = getattr(func, "__name__", None) or type(func).__name__
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
        if name[:1] in ("r", "i") and name[1:] in ("add", "sub", "mul", "truediv", "matmul"):
            name = name[1:]
    return name


class _IntermediateMode(TorchFunctionMode):
    """Turns the named calls inside one submodule's forward into sparse ops. Calls made
    inside the torch.nn modules it calls (``paused``: fx shows each as one ``call_module``
    node) are neither counted nor matched; a custom module's calls are, as fx traces
    through it."""

    def __init__(self, targets: dict[str, tuple[OutputSpec, OutputSpec | None]]):
        super().__init__()
        self.targets = targets
        self.counts: collections.Counter = collections.Counter()
        self.seen: list[str] = []
        self.paused = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        base = _call_name(func)
        n = self.counts[base]
        self.counts[base] += 1
        name = base if n == 0 else f"{base}_{n}"
        self.seen.append(name)
        target = self.targets.get(name)
        if target is None:
            return func(*args, **kwargs)
        out_spec, grad_spec = target
        return call_op(func, args, kwargs, (out_spec,), (grad_spec,) if grad_spec else None)


def _fx_node_names(module: torch.nn.Module) -> list[str] | None:
    try:
        graph = torch.fx.symbolic_trace(module).graph
    except Exception:
        return None
    return [node.name for node in graph.nodes if node.op in ("call_function", "call_method")]


class _Intermediates:
    """Forward hooks that activate an ``_IntermediateMode`` around a submodule."""

    def __init__(self, path: str, targets: dict):
        self.path, self.targets = path, targets
        self.checked = False
        self._stack: list[_IntermediateMode] = []

    def pre(self, module: torch.nn.Module, args: Any) -> None:
        mode = _IntermediateMode(self.targets)
        self._stack.append(mode)
        mode.__enter__()

    def inner_pre(self, module: torch.nn.Module, args: Any) -> None:
        """A module called from the submodule's forward starts: its calls are its own."""
        if self._stack:
            self._stack[-1].paused += 1

    def inner_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack[-1].paused -= 1

    def post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        mode = self._stack.pop()
        mode.__exit__(None, None, None)
        if not self.checked:
            self.checked = True
            missing = sorted(set(self.targets) - set(mode.seen))
            if missing:
                raise ValueError(
                    f"intermediate {self.path + '.' if self.path else ''}{missing[0]} was not produced by "
                    f"{self.path or 'the model'}'s forward; its calls are: {', '.join(mode.seen)}"
                )


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
        raise ValueError(f"unknown weight {name!r}; the model's parameters are: {', '.join(names)}")

    def set_weight(self, name: str, initial_sparsifier: Any = None, inline_sparsifier: Any = None,
                   tmp_format: type = torch.Tensor, external_sparsifier: Any = None,
                   out_format: type = torch.Tensor) -> None:
        """Store weight ``name`` in ``out_format``, sparsified by
        ``initial_sparsifier`` then the inline and external sparsifiers."""
        self._check_weight(name)
        spec = _spec(inline_sparsifier or KeepAll(), tmp_format, external_sparsifier or KeepAll(), out_format, "set_weight")
        self.weights[name] = (initial_sparsifier or KeepAll(), spec)

    def set_weight_grad(self, name: str, inline_sparsifier: Any = None, tmp_format: type = torch.Tensor,
                        external_sparsifier: Any = None, out_format: type = torch.Tensor) -> None:
        """The format of weight ``name``'s gradient (``.grad``)."""
        self._check_weight(name)
        self.weight_grads[name] = _spec(inline_sparsifier or KeepAll(), tmp_format,
                                        external_sparsifier or KeepAll(), out_format, "set_weight_grad")

    def _check_interm(self, name: str, model: torch.nn.Module | None = None) -> tuple[str, str]:
        path, _, node = name.rpartition(".")
        model = self.model if model is None else model
        if model is None:
            return path, node  # checked when the model is given
        modules = dict(model.named_modules())
        if path not in modules:
            raise ValueError(f"unknown intermediate {name!r}: no submodule {path!r}; submodules: {', '.join(m for m in modules if m)}")
        names = _fx_node_names(modules[path])
        if names is not None and node not in names:
            if names:
                listed = f"the fx nodes of {path or 'the model'} are: {', '.join(names)}"
            else:
                listed = f"{path or 'the model'} has no function or method calls of its own (only submodule calls)"
            hint = ""
            child = dict(modules[path].named_children()).get(node)
            if child is not None:   # a submodule named, not one of its calls
                inner = _fx_node_names(child) or []
                hint = (f"; {name!r} is a submodule: its intermediates are named '{name}.<fx node>'"
                        + (f", here {', '.join(repr(f'{name}.{n}') for n in inner)}" if inner else ""))
            raise ValueError(f"unknown intermediate {name!r}; {listed}{hint}")
        return path, node

    def set_interm(self, name: str, inline_sparsifier: Any = None, tmp_format: type = torch.Tensor,
                   external_sparsifier: Any = None, out_format: type = torch.Tensor) -> None:
        """Sparsify the intermediate ``"<submodule>.<fx node>"``."""
        self._check_interm(name)
        self.interms[name] = _spec(inline_sparsifier or KeepAll(), tmp_format,
                                   external_sparsifier or KeepAll(), out_format, "set_interm")

    def set_interm_grad(self, name: str, inline_sparsifier: Any = None, tmp_format: type = torch.Tensor,
                        external_sparsifier: Any = None, out_format: type = torch.Tensor) -> None:
        """The format of the gradient flowing into intermediate ``name``."""
        self._check_interm(name)
        self.interm_grads[name] = _spec(inline_sparsifier or KeepAll(), tmp_format,
                                        external_sparsifier or KeepAll(), out_format, "set_interm_grad")

    # -- building -------------------------------------------------------------
    def sparse_weight(self, name: str, dense: torch.Tensor) -> SparseParameterWrapper:
        """The sparse parameter for weight ``name`` made from ``dense``."""
        initial, spec = self.weights[name]
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

    def _apply(self, model: torch.nn.Module) -> dict[int, torch.nn.Parameter]:
        """Replace weights and hook intermediates in ``model``; returns old id → new param."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self._check_all(model)
        replaced = {}
        for name in self.weights:
            path, _, attr = name.rpartition(".")
            module = model.get_submodule(path)
            old = getattr(module, attr)
            new = self.sparse_weight(name, old)
            if not isinstance(new, SparseTensorWrapper):
                new = torch.nn.Parameter(new, requires_grad=old.requires_grad)
            for owner, owner_attr in _places_of(model, old):  # every name of a tied weight
                setattr(owner, owner_attr, new)
            replaced[id(old)] = new
        for name in set(self.weight_grads) - set(self.weights):
            path, _, attr = name.rpartition(".")
            getattr(model.get_submodule(path), attr).grad_fmt = self.weight_grads[name]
        by_module: dict[str, dict] = collections.defaultdict(dict)
        for name, spec in self.interms.items():
            path, _, node = name.rpartition(".")
            by_module[path][node] = (spec, self.interm_grads.get(name))
        for path, targets in by_module.items():
            hooks = _Intermediates(path, targets)
            module = model.get_submodule(path)
            module.register_forward_pre_hook(hooks.pre)
            module.register_forward_hook(hooks.post, always_call=True)
            tracer = torch.fx.Tracer()   # its leaf modules are fx's call_module nodes: calls inside are theirs
            for qualname, inner in module.named_modules():
                if inner is not module and tracer.is_leaf_module(inner, qualname):
                    inner.register_forward_pre_hook(hooks.inner_pre)
                    inner.register_forward_hook(hooks.inner_post, always_call=True)
        return replaced

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
        """Sparsify ``model`` (default: the builder's) in place and return it.

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
        like them. Returns ``(model, optimizer)``, as the original STen."""
        model = self._model(model, "sparsify_model_and_optimizer_inplace")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        replaced = self._apply(model)
        if optimizer is not None:
            for group in optimizer.param_groups:
                group["params"] = [replaced.get(id(p), p) for p in group["params"]]
            for old_id, new in replaced.items():
                old = next((p for p in list(optimizer.state) if id(p) == old_id), None)
                if old is None:
                    continue
                state = optimizer.state.pop(old)
                optimizer.state[new] = {
                    k: _like(new, v) for k, v in state.items()
                }
        return model, optimizer


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
