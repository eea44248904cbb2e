"""Conversions between layouts: the shortest chain of registered lossless
conversions, else a plugin's ``sten_convert`` hook, else a round trip through dense.

Example:
    >>> import torch, sten_core as sten
    >>> w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(3)))
    >>> type(sten.convert(w, sten.CooTensor).wrapped_tensor).__name__
    'CooTensor'
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

import torch

from sten_core.dispatch.errors import DispatchError, fail
from sten_core.dispatch.observers import active, notify
from sten_core.model.layouts import DenseConvertible, builds_from_dense, implements, to_dense_tensor
from sten_core.model.registry import OpKey, registry
from sten_core.model.replacing import replacement_layout, same_values, stores_at_most
from sten_core.model.tensor import DENSE_TYPES, WRAPPER_TYPES, SparseTensorWrapper, densify, detach_at, layout_of
from sten_core.plugins import manager as plugins

if TYPE_CHECKING:
    from sten_core.dispatch.plan import Plan


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
    """Convert a wrapper (or dense tensor) to the layout ``target``.

    Uses registered conversions, then the ``sten_convert`` hook, then a round
    trip through dense, which warns as a lossy step (a ``DispatchWarning`` once per
    pair of layouts; raised in raise mode) when ``target.from_dense`` drops values the
    wrapper stores. Returns a dense tensor for ``torch.Tensor``. ``target`` may also be
    a registered layout name (``"CsrTensor"``).
    """
    plugins.ensure_loaded()
    if not isinstance(target, type):
        target = _target_class(target)
    return _observed(_convert, value, target)


def _observed(run: Callable[[Any, type], Any], value: Any, target: type) -> Any:
    """``run(value, target)``, told to the observers as a conversion (when any listens)."""
    if not active():
        return run(value, target)
    source = layout_of(value)
    started = time.perf_counter()
    result = run(value, target)
    if source is not target:
        notify("convert", OpKey("convert", None, (source,), target), "convert", time.perf_counter() - started)
    return result


def _target_class(target: Any) -> type:
    """The layout class ``target`` names: a registered layout name, else a TypeError.

    >>> _target_class("CooTensor").__name__
    'CooTensor'
    """
    if isinstance(target, str):
        try:
            return registry.layout(target)
        except ValueError as error:
            raise ValueError(f"target: {error}") from None
    raise TypeError(f"target must be a layout class (e.g. sten.CsrTensor), torch.Tensor or a registered "
                    f"layout name, got {target!r}")


def _convert(value: Any, target: type) -> Any:
    if target is torch.Tensor:
        return densify(value)
    if isinstance(value, SparseTensorWrapper):
        layout = value.wrapped_tensor
        if type(layout) is target:
            return value
        try:
            registered = _registered_conversion(layout, target)
        except (RuntimeError, NotImplementedError) as error:
            # torch refusing a step (a 3-D COO to CSR: "coo_to_sparse_csr: ... sparse_dim()!=2"): the target says
            # why, or takes it through dense; a plugin's own ValueError / TypeError says it better and is raised
            _reraise_failures(error)
            registered = None
        if registered is not None:
            return SparseTensorWrapper(registered)
        return _through_dense(layout, target)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"cannot convert {type(value).__name__} to {target.__name__}")
    if not callable(getattr(target, "to_dense", None)):
        raise TypeError(f"target must be a layout class (with to_dense), torch.Tensor or a registered "
                        f"layout name, got {target!r}")
    if not builds_from_dense(target):
        raise DispatchError(
            f"{target.__name__} has no from_dense, so a dense tensor cannot be converted to it. Register a "
            f"sparsifier implementation that produces it: @sten.register_sparsifier_implementation("
            f"sparsifier=..., inp=torch.Tensor, out={target.__name__})")
    return SparseTensorWrapper(target.from_dense(value.detach()))


def _registered_conversion(layout: Any, target: type) -> Any:
    """``layout`` converted to ``target`` by the registered conversions, else the
    ``sten_convert`` hook (a raising plugin: warned); ``None`` where neither serves. A
    step may refuse this tensor (shape, dtype, device): its error propagates, callers decide.
    A registered path is checked on its first use (``_exact_on_first_use``): one that changes
    values is not used again (``None``: the caller goes through dense)."""
    source = type(layout)
    path = conversion_path(source, target)
    if path is not None:
        if (source, target) in _lossy:
            return None
        result = layout
        for fn in path:
            result = fn(result)
        if (source, target) not in _exact and not _exact_on_first_use(layout, result, target):
            return None
        return result
    hooked = plugins.first_result("sten_convert", tensor=layout, target=target)
    if hooked is None or (source, target) in _lossy:
        return None
    if (source, target) not in _exact and not _exact_on_first_use(layout, hooked, target):
        return None
    return hooked


_exact: set[tuple[type, type]] = set()
_lossy: set[tuple[type, type]] = set()
"""Pairs of layout classes whose registered conversion path kept / changed the values on its
first use (cleared when the registry changes)."""


def _exact_on_first_use(layout: Any, result: Any, target: type) -> bool:
    """Whether a registered conversion path gave ``layout``'s values (checked once per pair of
    layout classes; tensors without values, meta or fake, are not checked). A path that changes
    them is warned about (raised in raise mode), naming who registered it, and not used again: a
    plugin's lossy ``CooTensor -> Mine`` conversion gave wrong answers for ``torch.cumsum`` of a
    built-in ``CooTensor``, which the dispatcher routed through it to the plugin's cumsum."""
    source = type(layout)
    before = to_dense_tensor(layout)
    if _without_values(before):
        return True
    after = to_dense_tensor(result)
    if same_values(after, before):
        _exact.add((source, target))
        return True
    _lossy.add((source, target))
    owners = sorted({str(registry.owner_of("conversions", key)) for key in _path_keys(source, target)})
    what = f"the registered conversion (registered by {', '.join(owners)})" if owners else "the sten_convert hook"
    fail(f"Lossy conversion {source.__name__} -> {target.__name__}: {what} changed the values on its first use, so it "
         f"is not used: conversions to "
         f"{target.__name__} go through dense ({target.__name__}.from_dense) instead. A registered conversion "
         f"must keep every value (sten_core.testing.check_layout checks a layout's conversions)",
         ("lossy registered conversion", source, target))
    return False


def _without_values(dense: Any) -> bool:
    """Whether ``dense`` has no values to compare (meta, fake, traced)."""
    if not isinstance(dense, torch.Tensor) or dense.device.type == "meta" or torch.compiler.is_compiling():
        return True
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(dense)


def _path_keys(source: type, target: type) -> list[tuple[type, type]]:
    """The registry keys of the conversion path ``source -> target``."""
    fns = conversion_path(source, target) or ()
    by_fn = {id(fn): key for key, fn in registry.conversions.items()}
    return [by_fn[id(fn)] for fn in fns if id(fn) in by_fn]


def convert_exactly(value: SparseTensorWrapper, target: SparseTensorWrapper, what: str, advice: str) -> Any:
    """A layout object of ``target``'s layout class holding exactly ``value``'s values
    (loading a checkpoint value of another layout): a registered conversion or the
    ``sten_convert`` hook where it gives ``value``'s values and stores no more than ``value`` or
    ``target`` does, else ``replacement_layout``
    (``from_dense``, or ``target``'s pattern), else a ``ValueError`` (every time, never a
    once-per-process warning) saying what ``what`` cannot store and, from ``advice``, what
    to do instead.

    Example:
        >>> import torch, sten_core as sten
        >>> w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.zeros(2, 2)))
        >>> coo = sten.SparseTensorWrapper(sten.CooTensor.from_dense(torch.eye(2)))
        >>> convert_exactly(coo, w, "w.copy_(src)", "").to_dense().tolist()
        [[1.0, 0.0], [0.0, 1.0]]
    """
    layout, target_cls = value.wrapped_tensor, type(target.wrapped_tensor)
    dense = to_dense_tensor(layout)
    try:
        registered = _registered_conversion(layout, target_cls)
    except Exception as error:  # a refusing (or broken) step: the exact conversion through dense may still serve
        _reraise_failures(error)
        registered = None
    if registered is not None and same_values(to_dense_tensor(registered), dense) and (
            stores_at_most(registered, layout) or stores_at_most(registered, target.wrapped_tensor)):
        return registered
    # (a conversion storing more than both, as 2:4 into one padded 64x64 block for a model of 4x4 blocks,
    # would have made the weight dense: the target's own pattern, or an error saying why not)
    return replacement_layout(target, dense, what, advice)


def _through_dense(layout: Any, target: type) -> Any:
    """``layout`` converted by a round trip through dense (no registered path or hook): a
    lossy step, warned like a fallback (raised in raise mode), when ``target.from_dense``
    drops nonzeros that ``layout`` stores (CSR into n:m)."""
    dense = to_dense_tensor(layout)
    result = _convert(dense, target)
    had = int(torch.count_nonzero(dense))
    kept = int(torch.count_nonzero(to_dense_tensor(result.wrapped_tensor)))
    if kept < had:
        source = type(layout).__name__
        fail(f"Lossy conversion {source} -> {target.__name__}: no registered conversion or sten_convert hook, so "
             f"it went through dense and {target.__name__}.from_dense kept {kept} of the {had} nonzero values. "
             f"Register one that keeps them: registry.register_conversion({source}, {target.__name__}, fn)",
             ("lossy conversion", type(layout), target))
    return result


def wrap(value: Any) -> Any:
    """Wrap a bare layout object; tensors, wrappers and ``None`` pass through."""
    if type(value) in DENSE_TYPES or type(value) in WRAPPER_TYPES or value is None or isinstance(value, torch.Tensor) or isinstance(value, (int, float, bool)):
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(wrap(v) for v in value)
    if implements(value, DenseConvertible) or callable(getattr(value, "to_dense", None)):  # from_dense optional here
        return SparseTensorWrapper(value)
    return value


refusals: dict[OpKey, str] = {}
"""The last refusal per convert plan's key, for the fallback's message."""
_REFUSALS = (ValueError, TypeError, RuntimeError, NotImplementedError)
"""What a conversion raises to say it does not apply (shape, dtype, device, rank). Any other
exception (a plugin's ``IndexError``) is taken as a refusal too, named as a failure in the
fallback's message: one plugin's broken conversion must not break calls on another's tensors."""


def _reraise_failures(error: Exception) -> None:
    """Raise ``error`` again when it is a failure of the call, not of the conversion (raise
    mode's ``DispatchError``, running out of memory)."""
    if isinstance(error, (DispatchError, torch.OutOfMemoryError)):
        raise error


def converted_inputs(bound: list, positions: list[int], plan: Plan, detach: bool) -> list | None:
    """A convert plan's inputs (detached when ``detach``), or ``None`` if a
    conversion refuses them: one plugin's layouts never break another's calls."""
    inputs = detach_at(bound, positions) if detach else list(bound)
    try:
        return [_converted_exactly(v, c) if c is not None else v for v, c in zip(inputs, plan.conversions)] \
            + inputs[len(plan.conversions):]
    except Exception as error:  # (a plugin's broken conversion too: IndexError, KeyError, ...)
        _reraise_failures(error)
        steps = ", ".join(f"{layout_of(v).__name__} -> {c.__name__}" for v, c in zip(inputs, plan.conversions)
                          if c is not None)
        verb = "refused these inputs" if isinstance(error, _REFUSALS) else "failed on these inputs (a plugin bug?)"
        refusals[plan.key] = f"the conversion {steps} {verb} ({type(error).__name__}: {error})"
        return None


def _converted_exactly(value: Any, target: type) -> Any:
    """A convert plan's input in ``target``: by the registered conversions or the ``sten_convert`` hook,
    never through dense, which may drop values the operator then would not see (a ``ValueError``, a
    refusal: the call takes the dense path instead)."""
    if type(value.wrapped_tensor) is target:
        return value
    return _observed(_exactly, value, target)


def _exactly(value: SparseTensorWrapper, target: type) -> SparseTensorWrapper:
    converted = _registered_conversion(value.wrapped_tensor, target)
    if converted is None:
        raise ValueError(f"no lossless conversion of {layout_of(value).__name__} to {target.__name__} applies (no "
                         "exact registered one, and no sten_convert hook converts this tensor)")
    return SparseTensorWrapper(converted)


_path_cache: dict[tuple[type, type], tuple | None] = {}
registry.on_change(_path_cache.clear)
registry.on_change(_exact.clear)
registry.on_change(_lossy.clear)
