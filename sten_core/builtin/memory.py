"""A wrapper's memory: ``torch.empty_like``, ``share_memory_`` / ``is_shared``, ``storage()``.

- ``torch.empty_like(w)`` (and so ``Module.to_empty``) is a wrapper of ``w``'s layout
  class, shape, dtype and device with uninitialised values. Its pattern is ``w``'s own
  when ``w`` holds one (or the result stays on meta); a wrapper on the meta device
  holds no pattern, so one materialised from it (``to_empty(device="cpu")``) gets an
  empty one (the layout's ``from_dense`` of zeros), until a checkpoint is loaded.
- ``w.share_memory_()`` (and so ``Module.share_memory``) puts every tensor the layout
  holds in shared memory, so a forked worker's in-place update is seen by all;
  ``w.is_shared()`` says whether they all are. A layout on memory torch does not own
  (scipy's arrays) raises instead of sharing nothing.
- ``w.storage()`` raises: a wrapper has no storage of its own (code reading a tensor's
  bytes, such as safetensors, needs dense tensors: ``sten.densify_state_dict``).

Example:
    >>> import torch, sten_core as sten
    >>> w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(3)))
    >>> e = torch.empty_like(w)
    >>> type(e.wrapped_tensor).__name__, e.wrapped_tensor.same_pattern(w.wrapped_tensor)
    ('CsrTensor', True)
    >>> w.share_memory_().is_shared()
    True
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from sten_core.builtin.moves import move_layout
from sten_core.model.layouts import (StateTensors, attribute_tensors, builds_from_dense, implements, layout_metadata,
                                     supports_values)
from sten_core.model.registry import Entry, OpKey
from sten_core.model.tensor import SparseTensorWrapper, _copy_layout, sync_class

T = torch.Tensor
_SETTING_TYPES = (bool, int, float, str, tuple)


def empty_layout(layout: Any, device: torch.device | None = None, dtype: torch.dtype | None = None) -> Any:
    """A layout like ``layout`` on ``device`` / in ``dtype`` with uninitialised values: ``layout``'s
    pattern, or an empty one when ``layout`` is on meta and the result is not; a layout's own
    ``empty_like(device=None, dtype=None)`` method decides instead where it has one.

    >>> import torch, sten_core as sten
    >>> meta = sten.CsrTensor.from_dense(torch.eye(2)).data.to("meta")
    >>> empty_layout(sten.CsrTensor(meta), torch.device("cpu")).nnz
    0
    """
    if callable(getattr(layout, "empty_like", None)):  # the layout's own (an n:m layout's)
        return layout.empty_like(device=device, dtype=dtype)
    _shape, have_dtype, have_device = layout_metadata(layout)
    device = have_device if device is None else torch.device(device)
    if have_device.type == "meta" and device.type != "meta":
        return zero_pattern(layout, device, dtype or have_dtype)
    moved = move_layout(layout, device, dtype)
    if supports_values(moved):
        return moved.with_values(torch.empty_like(moved.values()))
    return _copy_layout(moved) if moved is layout else moved


def zero_pattern(layout: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """``type(layout).from_dense`` of zeros on ``device``, with ``layout``'s own settings
    (``from_dense``'s keyword parameters it keeps as attributes: an n:m layout's ``n``, ``m``).

    >>> import torch, sten_core as sten
    >>> zero_pattern(sten.CooTensor.from_dense(torch.eye(2)), torch.device("cpu"), torch.float64).nnz
    0
    """
    cls = type(layout)
    if not builds_from_dense(cls):
        raise TypeError(f"torch.empty_like / Module.to_empty: a {cls.__name__} on the meta device holds no pattern "
                        f"and {cls.__name__} has no from_dense to build an empty one: implement "
                        f"{cls.__name__}.from_dense, or materialise the model on a device from the start")
    shape = layout_metadata(layout)[0]
    return cls.from_dense(torch.zeros(shape, dtype=dtype, device=device), **layout_settings(layout))


def layout_settings(layout: Any) -> dict:
    """The keyword parameters of ``type(layout).from_dense`` that ``layout`` holds as plain
    attributes of the same name.

    >>> import torch, sten_core as sten
    >>> layout_settings(sten.CsrTensor.from_dense(torch.eye(2)))
    {}
    """
    try:
        params = list(inspect.signature(type(layout).from_dense).parameters.values())[1:]
    except (TypeError, ValueError):
        return {}
    found = {p.name: getattr(layout, p.name, None) for p in params if p.default is not p.empty}
    return {name: value for name, value in found.items() if isinstance(value, _SETTING_TYPES)}


def strided_parts(layout: Any) -> list[torch.Tensor]:
    """The strided tensors behind ``layout``'s tensors (a torch sparse tensor's indices and values).

    >>> import torch, sten_core as sten
    >>> len(strided_parts(sten.CooTensor.from_dense(torch.eye(2))))
    4
    """
    parts = []
    for t in attribute_tensors(layout):
        parts.extend(_members(t))
    return parts


def _members(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if t.layout is torch.strided:
        return (t,)
    if t.layout is torch.sparse_coo:
        return (t._indices(), t._values())
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return (t.crow_indices(), t.col_indices(), t.values())
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return (t.ccol_indices(), t.row_indices(), t.values())
    raise TypeError(f"share_memory_: a {t.layout} tensor cannot be shared")


def shared_layout(layout: Any) -> Any:
    """``layout`` with every tensor it holds in shared memory (``Tensor.share_memory_``): rebuilt
    from its shared ``state_tensors()`` when it has them, else its own tensors shared in place.
    Raises ``TypeError`` when the result is not all in torch's shared memory (a layout on
    memory torch does not own, such as scipy's arrays): a worker's updates would be lost.

    >>> import torch, sten_core as sten
    >>> all(t.is_shared() for t in shared_layout(sten.CsrTensor.from_dense(torch.eye(2))).state_tensors())
    True
    """
    if implements(layout, StateTensors):
        parts = tuple(layout.state_tensors())
        _share(parts)
        layout = type(layout).from_state_tensors(parts, tuple(layout.shape))
    else:
        _share(attribute_tensors(layout))
    if not layout_is_shared(layout):
        raise TypeError(f"share_memory_: {type(layout).__name__} keeps its values in memory that torch cannot put "
                        f"in shared memory, so a worker's updates to it would be lost; use a layout of torch "
                        f"tensors (e.g. sten.CsrTensor) for weights shared between processes")
    return layout


def _share(tensors: Any) -> None:
    for t in tensors:
        for part in _members(t):
            part.share_memory_()


def layout_is_shared(layout: Any) -> bool:
    """Whether ``layout``'s data is in shared memory: its stored values (what an in-place update
    writes; caches such as a CSR layout's coordinates are not data), else all its tensors.

    >>> import torch, sten_core as sten
    >>> layout_is_shared(sten.CsrTensor.from_dense(torch.eye(2)))
    False
    """
    parts = [layout.values()] if supports_values(layout) else strided_parts(layout)
    return bool(parts) and all(p.is_shared() for p in parts)


def _empty_like(ctx: Any, inputs: list, output_sparsifiers: list) -> SparseTensorWrapper:
    args, kwargs = ctx.call_args
    self = args[0]
    if kwargs.get("layout") not in (None, torch.strided):
        raise TypeError(f"torch.empty_like: a sparse wrapper takes no layout= (got {kwargs['layout']}); "
                        "its layout object decides its format")
    layout = empty_layout(self.wrapped_tensor, kwargs.get("device"), kwargs.get("dtype"))
    return SparseTensorWrapper(layout, bool(kwargs.get("requires_grad", False)), self.grad_fmt)


def _share_memory(ctx: Any, inputs: list, output_sparsifiers: list) -> SparseTensorWrapper:
    self = ctx.call_args[0][0]
    layout = self.wrapped_tensor
    shared = layout if layout_is_shared(layout) else shared_layout(layout)
    if shared is not layout:  # the same values elsewhere: no version bump, as torch's share_memory_
        self._cell[0] = shared
        sync_class(self)
    return self


def _is_shared(ctx: Any, inputs: list, output_sparsifiers: list) -> bool:
    return layout_is_shared(inputs[0].wrapped_tensor)


def _no_storage(ctx: Any, inputs: list, output_sparsifiers: list) -> Any:
    layout = inputs[0].wrapped_tensor
    raise RuntimeError(
        f"Tensor.storage(): a sparse wrapper ({type(layout).__name__}, shape {tuple(inputs[0].shape)}) has no storage "
        f"of its own: its values live in its layout's tensors (w.wrapped_tensor). Code that reads a tensor's bytes "
        f"(safetensors, Hugging Face save_pretrained) needs dense tensors: save sten.densify_state_dict("
        f"model.state_dict()) (model.save_pretrained(path, state_dict=...)) and sparsify again after loading")


_IMPLS = {torch.empty_like: _empty_like, T.share_memory_: _share_memory, T.is_shared: _is_shared,
          T.storage: _no_storage}


def resolve(key: OpKey) -> Entry | None:
    """The ``sten_resolve_op`` part: the calls above on a wrapper, without an explicit output format."""
    if key.direction != "fwd" or key.out is not None or not key.inp or key.inp[0] in (None, torch.Tensor):
        return None
    impl = _IMPLS.get(key.op)
    return None if impl is None else Entry(impl, len(key.inp), all_args=True)  # reads device, dtype, ...
