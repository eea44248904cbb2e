"""Views of a wrapper that write back: ``w[0]``, ``w.view(-1)``, ``w.narrow(...)``, ``w.T``.

A view operator on a wrapper runs on its dense copy (the dense path), so the result is a view
of that copy, not of the wrapper: ``w[0][1] = 5``, ``w.narrow(0, 2, 1).zero_()`` and
``nn.init.orthogonal_(w)`` (which writes through ``w.view_as(q)``) changed the copy and were
lost without a word. Outside autograd such a result is a ``WrapperView``: a dense tensor whose
in-place writes (and ``out=``, ``__setitem__``) are written back into the wrapper at its stored
positions, as writes into the wrapper itself are (values written elsewhere are dropped, with a
``DispatchWarning``: ``zeros_like(w).diagonal().fill_(1)`` on a CSR ``w`` stores nothing);
views of it are ``WrapperView``s of the same wrapper; every other operator gives plain tensors.
Each call on a ``WrapperView`` first brings its copy up to date with the wrapper, so views kept
across in-place changes of the wrapper read and write its current values. Under autograd (a
wrapper that requires grad) a view is a ``GradView`` (below).

Example:
    >>> import torch, sten_core as sten
    >>> w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.ones(2, 2)))
    >>> with torch.no_grad():
    ...     w[0][1] = 5.0
    >>> w.to_dense().tolist()
    [[1.0, 5.0], [1.0, 1.0]]
"""

from __future__ import annotations

from typing import Any

import torch

from sten_core.dispatch.plan import is_inplace
from sten_core.dispatch.writes import write_back_warned, write_growing, writes_exactly
from sten_core.model.layouts import supports_values
from sten_core.model.replacing import same_values
from sten_core.model.signatures import op_name
from sten_core.model.tensor import SparseTensorWrapper, densify, map_tensors

_Plain = torch._C.DisableTorchFunctionSubclass
_forward_ad = torch.autograd.forward_ad


def _format_as_tensor(self: torch.Tensor, spec: str) -> str:
    """``f"{w[0, 0]:.3f}"`` as for a dense element: torch formats a 0-d tensor with a spec only
    when its type is ``Tensor`` (a view's raised "unsupported format string")."""
    if self.dim() == 0 and spec and not self.is_meta:
        return self.item().__format__(spec)
    return torch.Tensor.__format__(self, spec)


class WrapperView(torch.Tensor):
    """A view of a wrapper's dense copy whose in-place writes reach the wrapper."""

    _sten_source: tuple  # (the wrapper, its dense copy this is a view of)

    __format__ = _format_as_tensor

    @staticmethod
    def of(view: torch.Tensor, wrapper: SparseTensorWrapper, root: torch.Tensor) -> "WrapperView":
        made = torch.Tensor._make_subclass(WrapperView, view)
        made._sten_source = (wrapper, root)
        return made

    @classmethod
    def __torch_function__(cls, func: Any, types: tuple, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            return _traced(super(), func, types, args, kwargs)
        target = written(args, kwargs)
        if type(target) is WrapperView and hasattr(target, "_sten_source") and is_inplace(func, kwargs):
            return _write_through(func, args, kwargs, target._sten_source)
        _refresh((args, kwargs))
        if _has_wrapper(types):
            return NotImplemented
        with _Plain():
            out = func(*args, **kwargs)
        source = next((a._sten_source for a in args if hasattr(a, "_sten_source")), None)
        if source is None:   # (a compiled graph's output made a WrapperView has none)
            return out
        return views_of(out, *source)


def _has_wrapper(types: tuple) -> bool:
    """Whether a call's overriding types include a sparse wrapper's (``w[1:3] * c``): the view then
    leaves the call to the wrapper's ``__torch_function__``, which dispatches it (``c``'s kernels,
    its ``grad_fmt``) with the view as a dense operand; run plainly, ``c`` was densified below
    autograd and its gradient came back dense, its ``grad_fmt`` ignored."""
    return any(issubclass(t, SparseTensorWrapper) for t in types)


def written(args: tuple, kwargs: dict) -> Any:
    """What an in-place call writes into: ``out=``, else its first argument, else the first tensor
    passed by keyword (``nn.init.constant_`` hands its tensor to ``__torch_function__`` as
    ``tensor=``: the write through a view went unseen and was lost)."""
    if kwargs.get("out") is not None:
        return kwargs["out"]
    if args:
        return args[0]
    return next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)


def _refresh(tree: Any) -> None:
    """The dense copies that the ``WrapperView``s and ``GradView``s in ``tree`` view, brought up
    to date with their wrappers where those changed since (``_sync_key``): a view is taken of a
    copy, so after an in-place change of the wrapper (``w.mul_(10)``, an optimizer step) it read
    the old values, and a write through it wrote the whole old copy back (``row = w[0];
    w.mul_(10); row.mul_(2)`` undid the ``mul_(10)`` everywhere; ``top, bottom = w[0], w[1]``,
    each written, kept only the second write; a view of a parameter kept across ``opt.step()``
    computed with the old weights). Nothing is densified, and no saved copy's version bumped,
    while the wrapper is unchanged."""
    sources: dict[int, tuple] = {}

    def note(t: Any) -> None:
        if type(t) in (WrapperView, GradView) and hasattr(t, "_sten_source"):
            sources.setdefault(id(t._sten_source[1]), t._sten_source)

    args, kwargs = tree
    if any(isinstance(a, (list, tuple, dict)) for a in (*args, *kwargs.values())):
        map_tensors(note, tree)
    else:   # (the usual flat call, without a walk of the tree: a view's every call comes here)
        for a in (*args, *kwargs.values()):
            note(a)
    if sources and torch._C._current_graph_task_id() != -1:
        return   # a backward re-running an op on a saved view: the values the forward saw
    for wrapper, root in sources.values():
        key = _sync_key(wrapper)
        if key is None or root.__dict__.setdefault("_sten_synced", key) != key:
            _refuse_stale_history(wrapper, root)
            _refresh_root(wrapper, root)
            root._sten_synced = key


def _refuse_stale_history(wrapper: SparseTensorWrapper, root: torch.Tensor) -> None:
    """The ``RuntimeError`` of a view of a wrapper with autograd history (``v = h.t()`` of
    ``h = w * x``) used under autograd after an in-place write into the wrapper that autograd
    recorded (``h.add_(d)``): its values would be brought up to date, but its gradients would go
    to the wrapper as it was (``d`` got none, silently). Dense torch re-bases a view on the
    write; a view of a copy cannot."""
    made = root.__dict__.get("_sten_recorded")
    if made is None or not torch.is_grad_enabled() or not wrapper.requires_grad or wrapper.is_leaf \
            or wrapper.__dict__.get("_sten_recorded_writes", 0) == made:   # (a write under no_grad: not in
        return                                                              # the graph, for dense torch either)
    raise RuntimeError(
        f"STen: a view of a {type(wrapper.wrapped_tensor).__name__} wrapper that has autograd history (h.t(), h[0], "
        "h.view(...) of h = w * x) is used after an in-place write into the wrapper (h.add_(...)): its gradients "
        "would miss the write (the view is of a dense copy, made before it). Take the view after the write, or "
        "compute out of place (h = h + d)")


def _refresh_root(wrapper: SparseTensorWrapper, root: torch.Tensor) -> None:
    """``root``, a dense copy of ``wrapper``, made equal to its current values."""
    with _Plain(), torch.no_grad():
        current = densify(wrapper)
        if current.shape == root.shape and current.data_ptr() != root.data_ptr() \
                and not same_values(root, current):   # (unchanged: no version bump of a saved copy)
            root.copy_(current)


def _sync_key(wrapper: SparseTensorWrapper) -> tuple | None:
    """What changes when ``wrapper``'s values may have: its version (every write through the
    wrapper bumps it), its layout object, and its stored values' version (a write into them);
    ``None`` where that would not tell (compare the values instead): no version to read
    (inference tensors), stored values that are a fresh tensor at each call (scipy's
    ``from_numpy``, a copy of non-contiguous data: their version stays 0 whatever is written),
    or in shared memory (another process writes without a version bump)."""
    layout = wrapper.wrapped_tensor
    if not supports_values(layout):
        return None
    values = layout.values()
    if values._base is None:   # not a view: the same tensor at each call, or a fresh one
        if layout.values() is not values:
            return None
    elif layout.values()._base is not values._base:
        return None
    if values.untyped_storage().is_shared():
        return None
    try:
        return wrapper._version, id(layout), values._version
    except RuntimeError:   # "Inference tensors do not track version counter"
        return None


def _mark_synced(wrapper: SparseTensorWrapper, root: torch.Tensor) -> None:
    """``root`` made from ``wrapper`` as it is now (views of views keep the first mark)."""
    if "_sten_synced" not in root.__dict__:
        root._sten_synced = _sync_key(wrapper)
        root._sten_recorded = wrapper.__dict__.get("_sten_recorded_writes", 0)   # (dense_path._InPlace counts)


def _traced(parent: Any, func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    """A view's call while torch.compile traces (the eager result of a graph-broken STen call taken
    as a graph's input): ``torch.Tensor``'s own ``__torch_function__``, which Dynamo traces as a
    plain tensor's call (writes through the view in compiled code are not written back). A
    tensor-valued attribute (``h.T``) is read from a plain alias: Dynamo calls
    ``__torch_function__`` again for it, whatever ``DisableTorchFunctionSubclass`` says, without end."""
    if getattr(func, "__name__", None) == "__get__" and len(args) == 1:
        with _Plain():
            return func(args[0].as_subclass(torch.Tensor))
    return parent.__torch_function__(func, types, args, kwargs)


def _shares(tensor: Any, root: torch.Tensor) -> bool:
    """Whether ``tensor`` views ``root``'s storage (a ``torch.func`` transform's tensor and a
    torch sparse one, as ``sparse_mask`` gives, have none) and may become a ``WrapperView``:
    not a dual tensor (``fwAD.make_dual(w, t)``), whose tangent a subclass copy would drop."""
    return (type(tensor) is torch.Tensor and tensor.layout is torch.strided and tensor.device == root.device
            and not torch._C._functorch.is_functorch_wrapped_tensor(tensor)
            and tensor.untyped_storage().data_ptr() == root.untyped_storage().data_ptr()
            and (_forward_ad._current_level < 0 or _forward_ad.unpack_dual(tensor).tangent is None))


def views_of(out: Any, wrapper: SparseTensorWrapper, root: torch.Tensor) -> Any:
    """``out`` with each tensor that is a view of ``root`` (``wrapper``'s dense copy) made a
    ``WrapperView`` of ``wrapper``."""
    _mark_synced(wrapper, root)
    return map_tensors(lambda t: WrapperView.of(t, wrapper, root) if _shares(t, root) else t, out)


_NOT_WRITES = frozenset({torch.Tensor.requires_grad_, torch.Tensor.share_memory_, torch.Tensor.detach_})
"""Methods named like in-place ones that change no values (a dense backward re-run calls
``requires_grad_`` on the saved view)."""


class GradView(torch.Tensor):
    """Under autograd, a view of a wrapper's dense copy (``h[1:]`` of a wrapper that requires grad),
    still attached to the graph (``as_subclass``), that refuses in-place writes under grad mode:
    they changed the copy, so the wrapper kept its values and its gradients were the unwritten
    ones (a write-back would not be differentiable). Under ``no_grad`` (``nn.init.constant_(p[:2],
    5.0)``) a write reaches the wrapper, as a ``WrapperView``'s does. Reads give plain tensors;
    views of it are ``GradView``s too."""

    _sten_source: tuple   # (the wrapper, its dense copy this is a view of)

    __format__ = _format_as_tensor

    @staticmethod
    def of(view: torch.Tensor, wrapper: SparseTensorWrapper, root: torch.Tensor) -> "GradView":
        made = view.as_subclass(GradView)
        made._sten_source = (wrapper, root)
        return made

    @classmethod
    def __torch_function__(cls, func: Any, types: tuple, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            return _traced(super(), func, types, args, kwargs)
        _refresh((args, kwargs))
        target = written(args, kwargs)
        if isinstance(target, GradView) and is_inplace(func, kwargs) and func not in _NOT_WRITES:
            if torch.is_grad_enabled() and getattr(func, "__module__", None) != "torch.nn.init":  # (no_grad inside)
                raise RuntimeError(
                    f"STen: {op_name(func)} writes in place through a view of a sparse wrapper that requires grad "
                    "(w[i], w.T, w.view(...) of it): the view is of a dense copy, so the write would not reach the "
                    "wrapper or its gradients. Write into the wrapper itself (h.mul_(m), h[i] = v), compute out "
                    "of place (torch.where, index_put), or write under torch.no_grad()")
            return _write_through(func, args, kwargs, target._sten_source)
        if _has_wrapper(types):
            return NotImplemented
        with _Plain():
            out = func(*args, **kwargs)
        source = next((a._sten_source for a in args if hasattr(a, "_sten_source")), None)
        if source is None:   # (a compiled graph's output made a GradView has none)
            return out
        return grad_views_of(out, *source)


def _write_through(func: Any, args: tuple, kwargs: dict, source: tuple) -> Any:
    """An in-place ``func`` through a view of ``source``'s dense copy, on the wrapper's current
    values, written back into the wrapper: a temporary's pattern grows to hold it
    (``writes.writes_exactly``); a weight keeps its stored positions (values written elsewhere
    are dropped with a ``DispatchWarning``)."""
    wrapper, root = source
    _refresh((args, kwargs))
    with _Plain():
        out = func(*args, **kwargs)
    with torch.no_grad():
        if writes_exactly(wrapper):   # a temporary's pattern grows to hold the write
            write_growing(wrapper, root, func)
        else:
            write_back_warned(wrapper, root, func)
    return out


def grad_views_of(out: Any, wrapper: SparseTensorWrapper, root: torch.Tensor) -> Any:
    """``out`` with each tensor that is a view of ``root`` (``wrapper``'s dense copy) a ``GradView``."""
    _mark_synced(wrapper, root)
    return map_tensors(lambda t: GradView.of(t, wrapper, root) if _shares(t, root) else t, out)


def guarded_views(out: Any, made: list) -> Any:
    """The dense path's result under autograd with the views of its wrappers' dense copies made
    ``GradView``s (``made``: the path's ``(wrapper, dense copy, version)`` entries)."""
    for wrapper, root, _ in made:
        if root.numel():
            out = grad_views_of(out, wrapper, root)
    return out


def writable_views(out: Any, made: list) -> Any:
    """The dense path's result with the views of its wrappers' dense copies made writable
    (``made``: the path's ``(wrapper, dense copy, version)`` entries)."""
    for wrapper, root, _ in made:
        if root.numel():
            out = views_of(out, wrapper, root)
    return out
