"""The dense matrix of a traceable layout as graph nodes: what compiled products fall back to.

Two custom operators:

- ``sten_core::members_to_dense(tensors, consts, layout)``: the dense matrix of the layout
  rebuilt from its member tensors and integer constants (``register_traceable_layout``'s
  ``flatten`` / ``unflatten``; ``layout`` names the class). Its CPU implementation runs the
  layout's own eager ``to_dense()`` (ctypes, scipy or data-dependent shapes stay inside the
  operator), its fake implementation gives the shape and dtype. So every traceable layout
  has a dense form that Dynamo traces, whatever its ``to_dense()`` is written with: ``x @ W``
  with a frozen ``GroupedNMTensor`` or scipy ``W`` runs densely on it with no graph break.
- ``sten_core::wrapper_dense(weight)``: the differentiable dense view of a traceable wrapper
  that requires grad (a graph input). Below autograd it is ``members_to_dense`` on the
  wrapper's members; its autograd formula hands the incoming gradient back unchanged, a
  plain dense tensor: the gradient eager gives a weight whose ``grad_fmt`` is dense (the
  default ``None`` or ``(KeepAll(), Tensor, KeepAll(), Tensor)``) when an operator other than
  ``F.linear`` densifies it (``torch.mm(x, W.t())``, ``x @ W.t()``, ``torch.addmm(b, x, W.t())``).

Example:
    >>> import torch, sten_core as sten
    >>> sten.plugins.manager.ensure_loaded()
    >>> layout = sten.CsrTensor.from_dense(torch.eye(2))
    >>> traced_dense(layout).tolist()
    [[1.0, 0.0], [0.0, 1.0]]
"""

from __future__ import annotations

from typing import Any, List

import torch

from sten_core.model.layouts import layout_metadata, to_dense_tensor
from sten_core.model.tensor import _HANDLERS, _PASS, TRACEABLE_LAYOUTS, TRACED_OPS

Tensor = torch.Tensor


def layout_name(cls: type) -> str:
    """The name ``members_to_dense`` takes for a layout class: ``module.qualname``.

    >>> import sten_core as sten
    >>> layout_name(sten.CsrTensor)
    'sten_core.builtin.torch_layouts.CsrTensor'
    """
    return f"{cls.__module__}.{cls.__qualname__}"


def _layout_class(name: str) -> type:
    for cls in TRACEABLE_LAYOUTS:
        if layout_name(cls) == name:
            return cls
    raise ValueError(f"members_to_dense: layout {name!r} is not a registered traceable layout "
                     f"(register_traceable_layout)")


def _rebuild(tensors: List[Tensor], consts: List[int], layout: str) -> Any:
    return TRACEABLE_LAYOUTS[_layout_class(layout)][1](list(tensors), list(consts))


@torch.library.custom_op("sten_core::members_to_dense", mutates_args=())
def members_to_dense(tensors: List[Tensor], consts: List[int], layout: str) -> Tensor:
    """The layout ``layout`` rebuilt from its members, densified by its own ``to_dense()``."""
    dense = to_dense_tensor(_rebuild(tensors, consts, layout)).contiguous()
    storage = dense.untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() == storage for t in tensors):  # a custom op's output never aliases
        dense = dense.clone()
    return dense


@members_to_dense.register_fake
def _(tensors: List[Tensor], consts: List[int], layout: str) -> Tensor:
    shape, dtype, _ = layout_metadata(_rebuild(tensors, consts, layout))
    return tensors[0].new_empty(tuple(shape), dtype=dtype)


def traced_dense(layout: Any) -> Tensor:
    """``layout``'s dense matrix as one ``members_to_dense`` node (a traceable layout).

    Example: see the module's."""
    flatten = TRACEABLE_LAYOUTS[type(layout)][0]
    tensors, consts = flatten(layout)
    return torch.ops.sten_core.members_to_dense(list(tensors), [int(c) for c in consts], layout_name(type(layout)))


@torch.library.custom_op("sten_core::wrapper_dense", mutates_args=())
def wrapper_dense(weight: Tensor) -> Tensor:
    """The dense matrix of a traceable wrapper ``weight`` (run by its ``__torch_dispatch__``)."""
    raise TypeError(f"sten_core::wrapper_dense: weight must be a traceable sparse wrapper, got {type(weight).__name__}")


@wrapper_dense.register_fake
def _(weight: Tensor) -> Tensor:
    return torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)


def _backward(ctx: Any, grad: Tensor) -> Tensor:
    return grad  # a plain dense tensor: AOTAutograd hands it back as the wrapper input's gradient


wrapper_dense.register_autograd(_backward)


def _dense_below_autograd(weight: Any) -> Tensor:
    return traced_dense(weight.wrapped_tensor)


TRACED_OPS[torch.ops.sten_core.wrapper_dense.default] = _dense_below_autograd
_HANDLERS[torch.ops.sten_core.wrapper_dense] = _HANDLERS[torch.ops.sten_core.wrapper_dense.default] = _PASS


def dense_view(weight: Any) -> Tensor:
    """The differentiable dense view of a trainable traceable wrapper (one ``wrapper_dense`` node)."""
    return torch.ops.sten_core.wrapper_dense(weight)
