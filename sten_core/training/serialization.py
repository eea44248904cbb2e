"""Saving and loading sparse tensors and models.

A wrapper pickles as its layout's name, logical shape and plain tensors
(``layout.state_tensors()``; rebuilt by ``Layout.from_state_tensors``), so
``torch.load(..., weights_only=True)`` reads a sparse model's state dict: the
one rebuild function is registered as a safe global for ``torch.load``.
Layouts without ``state_tensors`` pickle whole (``weights_only=False``).

Loading a *dense* state dict into a sparse model keeps each sparse parameter's
pattern and reads the dense values at it; ``load_dense_state_dict(..., builder=sb)``
re-runs the builder's sparsifiers instead. ``densify_state_dict`` turns a sparse
state dict into one a dense model loads.

Example:
    >>> import io, torch, sten_core as sten
    >>> w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(2)))
    >>> buf = io.BytesIO(); torch.save({"w": w}, buf); _ = buf.seek(0)
    >>> torch.load(buf, weights_only=True)["w"].to_dense().tolist()
    [[1.0, 0.0], [0.0, 1.0]]
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any

import torch

from sten_core.builtin.filled import FilledTensor
from sten_core.model.layouts import StateTensors, implements
from sten_core.model.registry import registry
from sten_core.model.sparsifiers import KeepAll
from sten_core.model.tensor import SparseParameterWrapper, SparseTensorWrapper, _rebuild, services
from sten_core.plugins import manager as plugins
from sten_core.user_frames import user_stacklevel


def _layout_name(cls: type) -> str | None:
    for name, registered in registry.layouts.items():
        if registered is cls:
            return name
    return None


GRAD_FORMAT_NAMES = ("keep", "dense", "layout:<name>", "<tmp name>|<out name>")
"""The gradient formats a plain-tensor checkpoint names, those without sparsifier objects
``(KeepAll(), Tmp, KeepAll(), Out)``: ``Tmp`` and ``Out`` each the weight's own layout
(``"keep"``), the dense ``torch.Tensor`` (``"dense"``) or another registered layout ``L``
(``"layout:" + its registered name``, e.g. an n:m weight's gradient as scipy CSR); one name
when ``Tmp`` is ``Out``, ``"<tmp>|<out>"`` otherwise (``set_weight_grad(name,
out_format=sten.CsrTensor)``: ``"dense|layout:CsrTensor"``)."""


def grad_format_name(wrapper: SparseTensorWrapper) -> str | None:
    """The name of ``wrapper``'s gradient format (see ``GRAD_FORMAT_NAMES``), ``None`` for
    none; raises ``LookupError`` for any other (sparsifier objects: the wrapper pickles whole).

    >>> import torch, sten_core as sten
    >>> w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(2)),
    ...                              grad_fmt=(sten.KeepAll(), sten.CooTensor, sten.KeepAll(), sten.CooTensor))
    >>> grad_format_name(w)
    'layout:CooTensor'
    >>> w.grad_fmt = (sten.KeepAll(), torch.Tensor, sten.KeepAll(), sten.CsrTensor)
    >>> grad_format_name(w)
    'dense|keep'
    """
    fmt = wrapper.grad_fmt
    if fmt is None:
        return None
    if len(fmt) == 4 and isinstance(fmt[0], KeepAll) and isinstance(fmt[2], KeepAll):
        own = type(wrapper.wrapped_tensor)
        tmp, out = _format_part_name(fmt[1], own), _format_part_name(fmt[3], own)
        if tmp is not None and out is not None:
            return tmp if tmp == out else f"{tmp}|{out}"
    raise LookupError(f"grad_fmt {fmt!r} has no plain-tensor name")


def _format_part_name(cls: Any, own: type) -> str | None:
    """``"keep"`` / ``"dense"`` / ``"layout:<name>"`` for a format's layout class, ``None`` for none."""
    if cls is own:
        return "keep"
    if cls is torch.Tensor:
        return "dense"
    name = _layout_name(cls)
    return None if name is None else "layout:" + name


def _grad_format(name: str | None, layout: type) -> tuple | None:
    if name is None:
        return None
    tmp, _, out = name.partition("|")
    kept = _format_part(tmp, layout)
    return (KeepAll(), kept, KeepAll(), _format_part(out, layout) if out else kept)


def _format_part(name: str, layout: type) -> type:
    if name.startswith("layout:"):
        return registry.layout(name[len("layout:"):])
    if name in ("keep", "dense"):
        return layout if name == "keep" else torch.Tensor
    raise ValueError(f"unknown gradient format {name!r} in checkpoint; expected one of {GRAD_FORMAT_NAMES}")


def rebuild_sparse(is_param: bool, layout_name: str, shape: tuple, tensors: tuple, requires_grad: bool,
                   grad_format: str | None = None, saved_class: str | None = None) -> SparseTensorWrapper:
    """Inverse of ``reduce_wrapper`` (a safe global for ``torch.load``). ``saved_class`` is the
    ``module:qualname`` of the layout class that saved the tensor (absent in older checkpoints)."""
    if _in_torch("_legacy_load"):
        raise RuntimeError(LEGACY_FORMAT.format(what="this file's sparse tensors cannot be rebuilt"))
    plugins.ensure_loaded()
    try:
        layout_cls = registry.layout(layout_name)
    except ValueError as error:
        saved_by = f" (saved by {saved_class.replace(':', '.')})" if saved_class else ""
        raise ValueError(f"the checkpoint holds a {layout_name!r} tensor{saved_by}, a layout no installed plugin "
                         f"registers: install or enable the plugin that provides it ({error})") from None
    if not callable(getattr(layout_cls, "from_state_tensors", None)):
        raise TypeError(f"the checkpoint holds a {layout_name!r} tensor, and the layout registered under that name now "
                        f"({_described(layout_cls, layout_name)}) cannot rebuild one (no from_state_tensors): the "
                        "plugin whose layout saved it is probably not installed, or disabled")
    _check_same_package(layout_cls, layout_name, saved_class)
    try:
        layout = layout_cls.from_state_tensors(tuple(tensors), tuple(shape))
    except Exception as error:
        try:
            named = type(error)(f"rebuilding the checkpoint's {layout_name!r} tensor of shape {tuple(shape)} with "
                                f"{_described(layout_cls, layout_name)} failed: {error}")
        except Exception:  # an exception class that takes other arguments: as it is
            raise error from None
        raise named from error
    cls = SparseParameterWrapper if is_param else SparseTensorWrapper
    return cls(layout, requires_grad, _grad_format(grad_format, layout_cls))


def class_path(cls: type) -> str:
    """``module:qualname`` of a layout class, as a checkpoint records it.

    >>> import sten_core as sten
    >>> class_path(sten.CsrTensor)
    'sten_core.builtin.torch_layouts:CsrTensor'
    """
    return f"{cls.__module__}:{cls.__qualname__}"


def _check_same_package(layout_cls: type, name: str, saved_class: str | None) -> None:
    """Refuse to rebuild a tensor with a class of another package than the one that saved it: two
    plugins' layouts of one name (installed on different machines) store their values differently,
    and the values would be read wrong. A class moved within its package (a refactor) still loads,
    and so does one of a script (``__main__``), whose package is unknown."""
    if not saved_class:
        return
    saved_package = saved_class.partition(":")[0].split(".")[0]
    package = layout_cls.__module__.split(".")[0]
    if saved_package != package and "__main__" not in (saved_package, package):
        raise TypeError(f"the checkpoint's {name!r} tensor was saved by {saved_class.replace(':', '.')} (package "
                        f"{saved_package!r}), but {name!r} is now {_described(layout_cls, name)}: another "
                        f"package's layout of the same name would read its values wrong; install the plugin of "
                        f"{saved_package!r} (and remove the one that registers {name!r} now) to load it")


def _described(layout_cls: type, name: str) -> str:
    """``module.Class, registered by plugin 'x'``: which class a layout name resolves to now."""
    owner = registry.owner_of("layouts", name)
    return f"{layout_cls.__module__}.{layout_cls.__qualname__}" + (f", registered by {owner!r}" if owner else "")


LEGACY_FORMAT = ("STen: torch.save's legacy format (_use_new_zipfile_serialization=False) does not hold sparse "
                 "tensors: its loader reads the tensors' data only after the objects holding them are rebuilt, so {what}")


def _in_torch(function: str, depth: int = 40) -> bool:
    """Whether ``torch.serialization``'s ``function`` is on the call stack (within ``depth`` frames)."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name == function and frame.f_globals.get("__name__") == "torch.serialization":
            return True
        frame = frame.f_back
    return False


def reduce_wrapper(wrapper: SparseTensorWrapper) -> tuple:
    """The pickle form of a wrapper: plain tensors where the layout allows.

    A wrapper whose ``grad_fmt`` holds sparsifier objects pickles whole, but for a
    state dict's detached weight, saved in plain form without it (``load_state_dict``
    never reads the format); no ``grad_fmt`` or one of ``GRAD_FORMAT_NAMES`` (which a
    state dict's detached wrappers keep) is named in plain form.
    """
    if _in_torch("_legacy_save"):   # the file would not load back (see rebuild_sparse)
        raise RuntimeError(LEGACY_FORMAT.format(what="the file would not load back: save in torch.save's default format"))
    layout = wrapper.wrapped_tensor
    if isinstance(layout, FilledTensor):   # a temporary or state after t.add_(c): saved as its inner layout, grown
        layout = layout.materialized()
    plugins.ensure_loaded()
    name = _layout_name(type(layout))
    is_param = wrapper._is_param   # (nn.Parameter(wrapper) too; not a detached parameter, as in a state dict)
    try:
        grad_format = grad_format_name(wrapper)
    except LookupError:   # sparsifier objects: the wrapper pickles whole, but for a state dict's entry
        if wrapper.__dict__.get("_weight_alias") and not wrapper.requires_grad:
            grad_format = None   # (a detached weight: load_state_dict never reads its format)
        else:
            name = None
    if name is not None and implements(layout, StateTensors):
        tensors = _kept_alive(layout, tuple(layout.state_tensors()))
        args = (is_param, name, tuple(wrapper.shape), tensors, wrapper.requires_grad, grad_format)
        return (rebuild_sparse, args + (class_path(type(layout)),))
    if name is not None and _in_torch("_save"):
        _warn_pickled_whole(type(layout))
    return (_rebuild, (type(wrapper), layout, wrapper.requires_grad, wrapper.grad_fmt, is_param))


_WARNED_WHOLE: weakref.WeakSet = weakref.WeakSet()  # layout classes warned about


def _warn_pickled_whole(cls: type) -> None:
    """Say once per layout class, when ``torch.save`` writes one whole (it has no ``state_tensors``),
    that the file needs ``weights_only=False``: loading it by default failed with torch's "Unsupported
    global: sten_core.model.tensor._rebuild", which names neither the layout nor the fix."""
    if cls in _WARNED_WHOLE:
        return
    _WARNED_WHOLE.add(cls)
    warnings.warn(f"torch.save: the layout {cls.__name__} has no state_tensors() / from_state_tensors(), so its "
                  "tensors are pickled whole and the file loads only with torch.load(..., weights_only=False) "
                  "(trusted files only); implement both in the layout to save plain tensors", UserWarning,
                  stacklevel=user_stacklevel())


def _kept_alive(layout: Any, tensors: tuple) -> tuple:
    """``tensors`` (what ``layout.state_tensors()`` gave) kept alive as long as ``layout``:
    ``torch.multiprocessing`` shares a tensor through a file descriptor that a spawned worker opens
    later, and a tensor made just for pickling (n:m's ``[n, m, dim]``, scipy's index arrays) was
    freed, its descriptor closed, before the worker read it (the worker died unpickling)."""
    key = id(layout)
    if key not in _PICKLED_STATE:
        try:
            weakref.finalize(layout, _PICKLED_STATE.pop, key, None)
        except TypeError:  # a layout that takes no weak reference (__slots__): not kept
            return tensors
    _PICKLED_STATE[key] = tensors
    return tensors


_PICKLED_STATE: dict[int, tuple] = {}  # id(layout) -> its state tensors, while the layout lives


def densify_state_dict(state_dict: dict) -> dict:
    """A copy of ``state_dict`` with every sparse wrapper made dense (for a dense model)."""
    return {k: (v.to_dense() if isinstance(v, SparseTensorWrapper) else v) for k, v in state_dict.items()}


def load_dense_state_dict(model: torch.nn.Module, state_dict: dict, builder: Any = None, strict: bool = True) -> Any:
    """Load a dense model's ``state_dict`` into the sparse ``model``.

    Without ``builder`` each sparse parameter keeps its pattern (values read at
    it); with a ``SparsityBuilder`` its weights are sparsified anew from the
    loaded values, by the builder's settings.
    """
    if builder is None:
        return model.load_state_dict(state_dict, strict=strict)
    state = dict(state_dict)
    for name in builder.weights:
        if name in state:
            state[name] = builder.sparse_weight(name, state[name])
    return model.load_state_dict(state, strict=strict)


torch.serialization.add_safe_globals([rebuild_sparse])
services.install(reduce_wrapper=reduce_wrapper)
