"""Sparsifier dispatch: how a sparsifier turns one layout into another,
resolved by the same chain as operators (registered implementation, hook,
conversion, dense fallback) and cached per (sparsifier class, layouts).

Example:
    >>> import torch, sten_core as sten
    >>> w = sten.sparsify(sten.ScalarFractionSparsifier(0.5), torch.ones(2, 2), sten.CsrTensor)
    >>> w.wrapped_tensor.nnz
    2
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from sten_core.dispatch.conversions import conversion_path, convert, wrap
from sten_core.dispatch.errors import DispatchError, report_missing
from sten_core.dispatch.graph_keeping import every_position, keeping_graph
from sten_core.dispatch.observers import active, notify
from sten_core.dispatch.plan import PlanKind
from sten_core.model.layouts import builds_from_dense
from sten_core.model.masks import stored_mask
from sten_core.model.registry import Entry, OpKey, registry
from sten_core.model.signatures import op_name
from sten_core.model.sparsifiers import KeepAll, SameFormatSparsifier
from sten_core.model.spec import OutputSpec
from sten_core.model.tensor import DENSE_TYPES, WRAPPER_TYPES, SparseTensorWrapper, densify, layout_of
from sten_core.plugins import manager as plugins


def same_format_layout(target: SparseTensorWrapper, dense: torch.Tensor) -> Any:
    """A layout of ``target``'s type holding ``dense`` at ``target``'s positions,
    made by the ``SameFormatSparsifier`` implementation for that layout (an
    in-place update of a layout without the stored-values protocol)."""
    layout_cls = type(target.wrapped_tensor)
    result = apply_sparsifier(SameFormatSparsifier(target), dense, layout_cls)
    if not isinstance(result, SparseTensorWrapper) or type(result.wrapped_tensor) is not layout_cls:
        raise DispatchError(
            f"an in-place update of a {layout_cls.__name__} needs a SameFormatSparsifier implementation "
            f"producing it: @sten.register_sparsifier_implementation(sparsifier=sten.SameFormatSparsifier, "
            f"inp=torch.Tensor, out={layout_cls.__name__}); the tensor is unchanged")
    return result.wrapped_tensor


def _resolve_sparsifier(key: OpKey) -> tuple[PlanKind, Callable]:
    """``(plan kind, impl)`` for a sparsifier key, by the same chain as operators."""
    sp_cls, (inp,), out = key.op, key.inp, key.out
    entry = registry.impls.get(key)
    if entry is not None:
        return PlanKind.IMPL, _call_sparsifier_entry(entry, out)
    hooked = plugins.first_result("sten_resolve_op", key=key)  # a raising plugin: warned, skipped
    if isinstance(hooked, Entry):
        return PlanKind.GENERIC, _call_sparsifier_entry(hooked, out)
    if hooked is not None:
        return PlanKind.GENERIC, lambda sp, t, grad_fmt=None: wrap(hooked(sp, t, grad_fmt))
    if sp_cls is KeepAll:
        if inp is out:
            return PlanKind.IDENTITY, lambda sp, t, grad_fmt=None: t
        return PlanKind.CONVERT, lambda sp, t, grad_fmt=None: convert(t, out)
    dense_key = OpKey("sparsifier", sp_cls, (torch.Tensor,), out)
    if inp is not torch.Tensor and dense_key in registry.impls:
        impl = _call_sparsifier_entry(registry.impls[dense_key], out)
        return PlanKind.CONVERT, lambda sp, t, grad_fmt=None: impl(sp, densify(t), grad_fmt)
    for (k, entry) in list(registry.impls.items()):
        if k.direction == "sparsifier" and k.op is sp_cls and k.inp[0] in (inp, torch.Tensor):
            path = conversion_path(k.out, out) if k.out is not torch.Tensor else None
            if path is not None:
                impl = _call_sparsifier_entry(entry, k.out)
                return PlanKind.CONVERT, lambda sp, t, grad_fmt=None, impl=impl: convert(impl(sp, densify(t), grad_fmt), out)

    buildable = out is torch.Tensor or builds_from_dense(out)

    def fallback(sp: Any, t: Any, grad_fmt: Any = None) -> Any:
        report_missing(key)
        # keep all values: in ``out`` when it can be built from a dense tensor, else dense
        return convert(densify(t), out) if buildable else densify(t)

    return PlanKind.FALLBACK, fallback


def _call_sparsifier_entry(entry: Entry, out: type) -> Callable:
    """The sparsifier implementation of ``entry`` as ``impl(sp, t, grad_fmt=None)``, its result
    wrapped and checked to be what it was registered to produce (``out``) in ``t``'s shape (a
    transposed result made ``Linear(6, 4).weight`` [6, 4], failing later with a size error)."""
    fn = entry.fn
    takes_grad_fmt = entry.arity >= 3

    def run(sp: Any, t: Any, grad_fmt: Any = None) -> Any:
        result = wrap(fn(sp, t, grad_fmt) if takes_grad_fmt else fn(sp, t))
        if not _is_a(result, out):
            got = type(result.wrapped_tensor if isinstance(result, SparseTensorWrapper) else result).__name__
            raise TypeError(f"the sparsifier implementation {op_name(fn)}, registered for out={out.__name__}, "
                            f"returned a {got}: return "
                            + ("a dense torch.Tensor" if out is torch.Tensor else
                               f"a {out.__name__} (a bare layout or a SparseTensorWrapper of one)"))
        if result.shape != t.shape:
            raise ValueError(f"the sparsifier implementation {op_name(fn)}, registered for out={out.__name__}, "
                             f"returned shape {tuple(result.shape)} for an input of shape {tuple(t.shape)}: a "
                             "sparsifier keeps the tensor's shape")
        return result

    return run


def _is_a(result: Any, out: type) -> bool:
    """Whether a sparsifier's ``result`` is of the format ``out``."""
    if isinstance(result, SparseTensorWrapper):
        return isinstance(result.wrapped_tensor, out)
    return out is torch.Tensor and isinstance(result, torch.Tensor)


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
    return apply_sparsifier(sparsifier, tensor, out_format, grad_fmt)


def apply_sparsifier(sparsifier: Any, tensor: torch.Tensor, out_format: type, grad_fmt: Any = None,
              layout: Any = None) -> Any:
    """``sparsify`` without argument checks (output specs were checked when made);
    ``layout``: the tensor's, when the caller knows it."""
    if layout is None:
        layout = layout_of(tensor)
    resolved = _sparsifier_plans.get((type(sparsifier), layout, out_format))
    if resolved is None:
        resolved = _sparsifier_plan(type(sparsifier), layout, out_format)
    kind, impl = resolved
    if active():
        started = time.perf_counter()
        result = impl(sparsifier, tensor, grad_fmt)
        notify("sparsifier", OpKey("sparsifier", type(sparsifier), (layout,), out_format), kind,
                time.perf_counter() - started)
    else:
        result = impl(sparsifier, tensor, grad_fmt)
    if grad_fmt is not None and isinstance(result, SparseTensorWrapper):
        result.grad_fmt = grad_fmt
    return result


def _sparsifier_plan(sp_cls: type, layout: Any, out_format: type) -> tuple[PlanKind, Callable]:
    """Resolve (and cache, under its ``OpKey`` and a plain tuple) a sparsifier key."""
    key = OpKey("sparsifier", sp_cls, (layout,), out_format)
    resolved = _plans.get(key)
    if resolved is None:
        resolved = _plans[key] = _resolve_sparsifier(key)
    _sparsifier_plans[(sp_cls, layout, out_format)] = resolved
    return resolved


def apply_spec(value: Any, spec: OutputSpec, inline_done: bool = False) -> Any:
    """Run an output through its spec: inline sparsifier to ``tmp_format``
    (unless already done), then the external one to ``out_format``."""
    t = type(value)
    if t not in DENSE_TYPES and t not in WRAPPER_TYPES and not isinstance(value, torch.Tensor):
        return value
    if t in DENSE_TYPES and value.device.type == "meta":   # (shape inference: which values a sparsifier
        return value                                       # keeps is unknown there; it needs .item())
    layout = None
    if not inline_done:
        value = apply_sparsifier(spec.inline_sparsifier, value, spec.tmp_format)
    elif layout_of(value) is not spec.tmp_format:
        value = convert(value, spec.tmp_format)
    else:
        layout = spec.tmp_format
    return apply_sparsifier(spec.external_sparsifier, value, spec.out_format, None, layout)


def apply_grad_spec(grad: Any, spec: OutputSpec, value: Any, inline_done: bool = False) -> Any:
    """A dense gradient of ``value`` through its ``grad_fmt`` ``spec``; for a sparse ``value``
    whose ``grad_fmt`` names a layout without sparsifying (``(KeepAll(), L, KeepAll(), L)``) the
    gradient at ``value``'s stored positions, as a registered sparse-gradient backward gives it
    (O(nnz), DESIGN's contract): in ``value``'s own layout, or converted to ``L`` when ``L`` is
    another one; not the dense gradient re-sparsified into a new pattern (which for n:m layouts
    picks the gradient's largest entries, and for CSR stores every nonzero). Used where a
    backward ran densely (the dense fallback, ``SparseTensorWrapper`` densified for a dense
    operator, and an implementation's dense gradient). ``inline_done``: as ``apply_spec``'s.

    >>> import torch, sten_core as sten
    >>> w = sten.SparseTensorWrapper(sten.sparsify(sten.KeepAll(), torch.eye(2), sten.CsrTensor).wrapped_tensor,
    ...                              grad_fmt=(sten.KeepAll(), sten.CsrTensor, sten.KeepAll(), sten.CsrTensor))
    >>> g = apply_grad_spec(torch.ones(2, 2), OutputSpec.coerce(w.grad_fmt, "grad_fmt"), w)
    >>> g.to_dense()
    tensor([[1., 0.],
            [0., 1.]])
    """
    if is_grads_batched(grad):
        return _batched_in_grad_spec(grad, spec, value)
    return keeping_graph(lambda g: _in_grad_spec(g, spec, value, inline_done), grad, spec.out_format,
                         grad_positions(spec, value))


def grad_positions(spec: OutputSpec, value: Any) -> Callable[[Any], torch.Tensor | None]:
    """Where a gradient put in ``spec`` (``value``'s ``grad_fmt``) depends on the dense gradient,
    as ``keeping_graph``'s ``kept``: ``value``'s stored positions for a sparse ``value`` whose
    format keeps its layout, every position where nothing is sparsified away (zeros a layout
    does not store are still the gradient's values), else the positions the result stores."""
    if not spec.keeps_all:
        return stored_mask
    if isinstance(value, SparseTensorWrapper):
        return lambda out: stored_mask(value)
    return every_position


def is_grads_batched(grad: Any) -> bool:
    """Whether ``grad`` is a batch of gradients (``torch.autograd.grad(..., is_grads_batched=True)``
    runs backward under vmap: its tensors are batched)."""
    return type(grad) in DENSE_TYPES and _is_legacy_batched(grad)


_is_legacy_batched = getattr(torch._C._functorch, "is_legacy_batchedtensor", lambda tensor: False)


def _batched_in_grad_spec(grad: torch.Tensor, spec: OutputSpec, value: Any) -> torch.Tensor:
    """A batch of gradients of ``value`` (``is_grads_batched``): a layout holds one gradient, so
    each is dense, at ``value``'s stored positions where its ``grad_fmt`` keeps its layout."""
    if spec.keeps_all:
        if spec.out_format in DENSE_TYPES or not isinstance(value, SparseTensorWrapper):
            return grad
        return grad * stored_mask(value).to(grad.device)
    raise NotImplementedError(
        f"torch.autograd.grad(..., is_grads_batched=True): the gradient of a {layout_of(value).__name__} "
        f"operand has a grad_fmt that sparsifies it ({type(spec.inline_sparsifier).__name__}, "
        f"{type(spec.external_sparsifier).__name__}), which a batch of gradients cannot take per sample; "
        "use a grad_fmt without a sparsifier, or call autograd.grad once per gradient")


def _in_grad_spec(grad: Any, spec: OutputSpec, value: Any, inline_done: bool) -> Any:
    if type(grad) in DENSE_TYPES and grad.layout is not torch.strided and not (
            spec.keeps_all and spec.tmp_format is torch.Tensor and spec.out_format is torch.Tensor):
        grad = grad.to_dense()  # torch's sparse gradient (Embedding(sparse=True)) put in a format: from its values
    if isinstance(value, SparseTensorWrapper) and type(grad) in DENSE_TYPES:
        layout = type(value.wrapped_tensor)
        if spec.keeps_all and spec.out_format is not torch.Tensor:
            at_pattern = apply_sparsifier(SameFormatSparsifier(value), grad, layout)
            if spec.out_format is layout and spec.tmp_format is layout:
                return at_pattern
            # another layout (a CSR weight's gradient as n:m, an n:m weight's as scipy CSR): the
            # gradient at the weight's positions, then converted (warned where that drops values),
            # not the dense gradient re-sparsified into a pattern of its own
            return convert(at_pattern, spec.out_format)
    return apply_spec(grad, spec, inline_done=inline_done)


_plans: dict[OpKey, tuple] = {}
_sparsifier_plans: dict[tuple, tuple] = {}  # (sparsifier class, layout, out format) → (kind, impl)
registry.on_change(_plans.clear)
registry.on_change(_sparsifier_plans.clear)
