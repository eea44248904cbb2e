"""Moving a wrapper to another dtype or device, keeping its layout.

``w.to(torch.float64)``, ``w.half()``, ``w.cuda()`` and so ``Module.to/half/
double/cuda`` move a sparse parameter's stored tensors and keep its format.
A layout moves by, in this order:

1. its own ``to(device=None, dtype=None)`` method;
2. its ``state_tensors()`` / ``from_state_tensors()``: floating-point parts take
   the dtype, every part the device (index tensors keep their integer dtype);
3. the stored-values protocol, for a dtype change on the same device;
4. a round trip through dense with its ``from_dense`` (the paper's minimal layouts).

A layout that can do none of these raises a ``TypeError`` saying what to
implement, instead of silently staying where it is.

Example:
    >>> import torch, sten_core as sten
    >>> w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(3)))
    >>> h = w.half()
    >>> type(h.wrapped_tensor).__name__, h.dtype
    ('CsrTensor', torch.float16)
"""

from __future__ import annotations

from typing import Any

import torch

from sten_core.model.layouts import Movable, builds_from_dense, implements, layout_metadata, supports_values, to_dense_tensor
from sten_core.model.registry import Entry, OpKey
from sten_core.model.tensor import SparseTensorWrapper, _copy_layout

T = torch.Tensor
_FIXED_DTYPE = {T.half: torch.float16, T.float: torch.float32, T.double: torch.float64,
                T.bfloat16: torch.bfloat16}
MOVES = {T.to, T.cpu, T.cuda, T.type, *_FIXED_DTYPE}


def target_of(op: Any, args: tuple, kwargs: dict) -> tuple[torch.device | None, torch.dtype | None]:
    """The ``(device, dtype)`` a move call asks for (``None``: unchanged)."""
    if op in _FIXED_DTYPE:
        return None, _FIXED_DTYPE[op]
    if op is T.cpu:
        return torch.device("cpu"), None
    if op is T.type:
        return _type_target(args[1] if len(args) > 1 else kwargs.get("dtype"))
    if op is T.cuda:
        device = args[1] if len(args) > 1 else kwargs.get("device")
        if isinstance(device, int):
            device = torch.device("cuda", device)
        return torch.device(device if device is not None else "cuda"), None
    rest = list(args[1:])
    if rest and isinstance(rest[0], torch.Tensor):  # .to(other): other's device and dtype
        other = rest.pop(0)
        return other.device, other.dtype
    rest = [r for r in rest if not isinstance(r, bool)]  # positional non_blocking / copy
    kw = {k: v for k, v in kwargs.items() if k not in ("non_blocking", "copy", "memory_format")}
    device, dtype, _non_blocking, _memory_format = torch._C._nn._parse_to(*rest, **kw)
    return device, dtype


def _type_target(dtype: Any) -> tuple[torch.device | None, torch.dtype | None]:
    """``Tensor.type(dtype)``'s target: a ``torch.dtype``, or a tensor type, by name
    (``"torch.DoubleTensor"``, ``"torch.cuda.HalfTensor"``) or as a class (``torch.DoubleTensor``)."""
    if isinstance(dtype, type) and hasattr(dtype, "dtype"):   # torch.DoubleTensor: a class, named like that
        dtype = f"{dtype.__module__}.{dtype.__name__}"
    if isinstance(dtype, str):
        name = dtype
        dtype = getattr(torch, name.rsplit(".", 1)[-1], None)
        dtype = getattr(dtype, "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"Tensor.type: dtype must be a torch.dtype or a tensor type name, got {name!r}")
        return (torch.device("cuda") if ".cuda." in name else torch.device("cpu")), dtype
    return None, dtype


def move_layout(layout: Any, device: torch.device | None, dtype: torch.dtype | None) -> Any:
    """``layout`` with its stored tensors on ``device`` / in ``dtype``, same format."""
    _shape, have_dtype, have_device = layout_metadata(layout)
    if device is not None and torch.device(device) == have_device:
        device = None
    if dtype == have_dtype:
        dtype = None
    if device is None and dtype is None:
        return layout
    moved = _moved(layout, device, dtype)
    if dtype is not None and layout_metadata(moved)[1] != dtype:
        # state tensors that are not floating point keep their dtype (index tensors), so an
        # integer or bool layout's values stayed as they were: ``w.float()`` was a silent no-op
        if not supports_values(moved):
            raise TypeError(f"{type(layout).__name__} did not move to dtype={dtype} (it holds "
                            f"{layout_metadata(moved)[1]}): implement to(device=None, dtype=None) on the layout")
        moved = moved.with_values(moved.values().to(dtype))
    return moved


def _moved(layout: Any, device: torch.device | None, dtype: torch.dtype | None) -> Any:
    if implements(layout, Movable):
        return layout.to(device=device, dtype=dtype)
    if callable(getattr(layout, "state_tensors", None)) and callable(getattr(type(layout), "from_state_tensors", None)):
        parts = tuple(
            p.to(device=device, dtype=dtype if p.is_floating_point() or p.is_complex() else None)
            for p in layout.state_tensors()
        )
        return type(layout).from_state_tensors(parts, tuple(layout.shape))
    if device is None and supports_values(layout):
        return layout.with_values(layout.values().to(dtype))
    if builds_from_dense(type(layout)):  # the paper's minimal layouts: a round trip through dense
        return type(layout).from_dense(to_dense_tensor(layout).to(device=device, dtype=dtype))
    raise TypeError(
        f"{type(layout).__name__} cannot move to device={device}, dtype={dtype}: implement "
        f"to(device=None, dtype=None), or state_tensors()/from_state_tensors(), on the layout"
    )


def _move(ctx: Any, inputs: list, output_sparsifiers: list) -> Any:
    args, kwargs = ctx.call_args
    self = args[0]
    if ctx.op is T.type and len(args) == 1 and kwargs.get("dtype") is None:  # w.type(): the type's name
        return torch.empty(0, dtype=self.dtype, device=self.device).type()
    device, dtype = target_of(ctx.op, args, kwargs)
    layout = self.wrapped_tensor
    moved = move_layout(layout, device, dtype)
    copy = kwargs.get("copy", False) or sum(isinstance(a, bool) for a in args[1:]) > 1 and args[-1] is True
    if moved is layout:
        if not copy:
            return inputs[0]  # as torch: a no-op move returns the tensor itself (an alias here)
        moved = _copy_layout(layout)
    return SparseTensorWrapper(moved, False, self.grad_fmt)


def resolve(key: OpKey) -> Entry | None:
    """The ``sten_resolve_op`` part: moves of a wrapper, without an explicit output format."""
    if key.direction != "fwd" or key.op not in MOVES or key.out is not None:
        return None
    if not key.inp or key.inp[0] in (None, torch.Tensor):
        return None
    return Entry(_move, len(key.inp), all_args=True)  # reads the target from the call
