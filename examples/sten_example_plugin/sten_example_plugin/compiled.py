"""``torch.compile`` support for ``BitmaskTensor``: custom operators, and compiled training.

What a third-party layout needs (see docs/compile.md and the plugin guide):

1. Its kernels as custom operators on the layout's plain member tensors
   (``bits``, ``packed``) and integer constants (the shape), each with a fake
   implementation giving the output's shape without reading values:
   ``sten_example::bitmask_linear`` and its two gradient operators.
2. ``registry.register_compiled_impl(F.linear, ...)``: inference compiles whole
   and runs the operator (without it, the traced ``to_dense()`` runs densely).
3. ``plugin_api.register_traceable_layout(BitmaskTensor, flatten, unflatten,
   *member_grads(...), values_index)``: a weight whose ``grad_fmt`` keeps
   its layout (``(KeepAll(), BitmaskTensor, KeepAll(), BitmaskTensor)``) trains
   compiled whole, its gradient a ``BitmaskTensor`` of the same mask holding the
   values' gradient.

The example plugin leaves this opt-in (``register_compiled(registry)``) so its
other sections show the dense path; a real plugin calls it from ``sten_register``.

Example:
    >>> import torch
    >>> from sten_example_plugin import BitmaskTensor
    >>> w = BitmaskTensor.from_dense(torch.eye(3))
    >>> torch.ops.sten_example.bitmask_linear(torch.ones(2, 3), [w.bits, w.packed], [3, 3], None).tolist()
    [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.nn.functional as F

from sten_core import plugin_api

from .bitmask import BitmaskTensor

Tensor = torch.Tensor


def members(layout: BitmaskTensor) -> tuple[list[Tensor], list[int]]:
    """``flatten``: the member tensors and the integer constants (the 2-D shape)."""
    rows, cols = layout.shape
    return [layout.bits, layout.packed], [rows, cols]


def from_members(tensors: list[Tensor], consts: list[int]) -> BitmaskTensor:
    """``unflatten``: the layout around its members (reads no values: it runs on fake tensors)."""
    return BitmaskTensor(tensors[0], tensors[1], torch.Size(consts))


def _coords(tensors: List[Tensor], consts: List[int]) -> tuple[Tensor, Tensor]:
    return from_members(tensors, consts).coords()


@torch.library.custom_op("sten_example::bitmask_linear", mutates_args=())
def bitmask_linear(x: Tensor, tensors: List[Tensor], consts: List[int], bias: Optional[Tensor]) -> Tensor:
    """``F.linear(x, W, bias)`` with ``W`` given by its members: the eager kernel (O(batch * nnz))."""
    rows, cols = _coords(tensors, consts)
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.zeros(x2.shape[0], consts[0], dtype=x2.dtype, device=x2.device)
    y.index_add_(1, rows, x2[:, cols] * tensors[1])
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], consts[0])


@bitmask_linear.register_fake
def _(x: Tensor, tensors: List[Tensor], consts: List[int], bias: Optional[Tensor]) -> Tensor:
    return x.new_empty((*x.shape[:-1], consts[0]))


@torch.library.custom_op("sten_example::bitmask_linear_grad_input", mutates_args=())
def bitmask_linear_grad_input(gy: Tensor, x: Tensor, tensors: List[Tensor], consts: List[int]) -> Tensor:
    """``gy @ W``, shaped like ``x``."""
    rows, cols = _coords(tensors, consts)
    g2 = gy.reshape(-1, gy.shape[-1])
    gx = torch.zeros(g2.shape[0], consts[1], dtype=gy.dtype, device=gy.device)
    return gx.index_add_(1, cols, g2[:, rows] * tensors[1]).reshape(x.shape)


@bitmask_linear_grad_input.register_fake
def _(gy: Tensor, x: Tensor, tensors: List[Tensor], consts: List[int]) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("sten_example::bitmask_linear_grad_values", mutates_args=())
def bitmask_linear_grad_values(gy: Tensor, x: Tensor, tensors: List[Tensor], consts: List[int]) -> Tensor:
    """The gradient of the stored values: ``(gy.t() @ x)`` at the kept positions."""
    rows, cols = _coords(tensors, consts)
    g2, x2 = gy.reshape(-1, gy.shape[-1]), x.reshape(-1, x.shape[-1])
    return (g2[:, rows] * x2[:, cols]).sum(0).to(tensors[1].dtype)


@bitmask_linear_grad_values.register_fake
def _(gy: Tensor, x: Tensor, tensors: List[Tensor], consts: List[int]) -> Tensor:
    return torch.empty_like(tensors[1], memory_format=torch.contiguous_format)


plugin_api.register_member_linear_autograd(bitmask_linear, bitmask_linear_grad_input, bitmask_linear_grad_values,
                                           values_index=1)


def linear_compiled(x: Tensor, weight: Any, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear`` with a ``BitmaskTensor`` weight while ``torch.compile`` traces: one node."""
    tensors, consts = members(weight.wrapped_tensor)
    return bitmask_linear(x, tensors, consts, bias)


def register_compiled(registry: Any) -> None:
    """Register the compiled ``F.linear`` and make ``BitmaskTensor`` wrappers traceable."""
    T = torch.Tensor
    for inp in ((T, BitmaskTensor, T), (T, BitmaskTensor)):
        registry.register_compiled_impl(F.linear, inp, linear_compiled)
    grads = plugin_api.member_grads(members, bitmask_linear_grad_input, bitmask_linear_grad_values)
    plugin_api.register_traceable_layout(BitmaskTensor, members, from_members, *grads, values_index=1)
