"""``torch.compile`` support: the n:m kernels as PyTorch custom operators (``sten_nm::...``).

While Dynamo traces a model, ``F.linear`` (and ``mm`` / ``matmul`` for
``NMTensor``) with an n:m weight becomes one custom-operator node taking the
layout's plain member tensors and its integer constants. Its CPU implementation
rebuilds the layout around those members and runs the eager kernel (the ctypes
calls stay inside it; same arithmetic, same results); its fake implementation
gives the output's metadata; its autograd formula calls two more custom
operators (input gradient, gradient of the stored values) whose
implementations are the eager backward.

==========================================  ===================================
operator                                    layout (members; constants)
==========================================  ===================================
``sten_nm::nm_linear`` / ``nm_matmul``      ``NMTensor`` (values, indices;
                                            rows, cols, n, m, dim)
``sten_nm::grouped_linear``                 ``GroupedNMTensor`` (vals, indices,
                                            perm; rows, cols, n, m)
``sten_nm::column_grouped_linear``          ``ColumnGroupedNMTensor`` (values,
                                            columns; rows, cols, n, m, g)
==========================================  ===================================

Each ``<op>`` has ``<op>_grad_input`` and ``<op>_grad_values``.

Example:
    >>> import torch
    >>> from sten_nm import NMTensor
    >>> from sten_nm.compiled import members
    >>> w = NMTensor.from_dense(torch.ones(3, 8), n=1, m=4)
    >>> tensors, consts = members(w)
    >>> torch.ops.sten_nm.nm_linear(torch.ones(2, 8), tensors, consts, None).tolist()
    [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, List, Optional

import torch
import torch.nn.functional as F

from sten_core import plugin_api

from . import column_grouped_ops, ops
from .column_grouped import ColumnGroupedNMTensor
from .grouped_tensor import GroupedNMTensor
from .nm_tensor import NMTensor

Tensor = torch.Tensor


# -- a layout as (member tensors, integer constants) and back -----------------------
def members(layout: Any) -> tuple[list[Tensor], list[int]]:
    """The plain member tensors and integer constants the custom operators take.

    >>> w = NMTensor.from_dense(torch.ones(2, 4), n=2, m=4)
    >>> [t.shape for t in members(w)[0]], members(w)[1]
    ([torch.Size([2, 2]), torch.Size([2, 1])], [2, 4, 2, 4, 1])
    """
    r, c = layout.shape
    if isinstance(layout, NMTensor):
        return [layout._values, layout.indices], [r, c, layout.n, layout.m, layout.dim]
    if isinstance(layout, GroupedNMTensor):
        return [layout._vals, layout.indices, layout.perm], [r, c, layout.n, layout.m]
    if isinstance(layout, ColumnGroupedNMTensor):
        return [layout._values, layout.columns], [r, c, layout.n, layout.m, layout.g]
    raise TypeError(f"layout must be an NMTensor, GroupedNMTensor or ColumnGroupedNMTensor, got {type(layout).__name__}")


def _nm(t: List[Tensor], c: List[int]) -> NMTensor:
    return NMTensor._trusted(t[0], t[1], (c[0], c[1]), c[2], c[3], c[4])


def _grouped(t: List[Tensor], c: List[int]) -> GroupedNMTensor:
    return GroupedNMTensor._trusted(t[0], t[1], t[2], (c[0], c[1]), c[2], c[3])


def _column_grouped(t: List[Tensor], c: List[int]) -> ColumnGroupedNMTensor:
    return ColumnGroupedNMTensor._trusted(t[0], t[1], (c[0], c[1]), c[2], c[3], c[4])


class _Holder:
    """What the eager backward expects as its saved weight: an object with ``wrapped_tensor``."""

    def __init__(self, layout: Any):
        self.wrapped_tensor = layout


def _ctx(x: Tensor, layout: Any, need_x: bool, need_w: bool) -> SimpleNamespace:
    return SimpleNamespace(saved_tensors=(x, _Holder(layout), None), needs_input_grad=(need_x, need_w, False))


def _out_dtype(*ts: Optional[Tensor]) -> torch.dtype:
    dtype = None
    for t in ts:
        if t is not None:
            dtype = t.dtype if dtype is None else torch.promote_types(dtype, t.dtype)
    return dtype


# -- the operators ---------------------------------------------------------------------
def _define(name: str, rebuild: Callable, forward: Callable, backward: Callable, linear: bool) -> Any:
    """``sten_nm::<name>`` (forward, fake, autograd) and its two gradient operators.

    ``forward(x, layout, bias)`` and ``backward(ctx, (gy,)) -> (gx, gw_wrapper, gb)``
    are the eager implementations."""
    qual = f"sten_nm::{name}"

    @torch.library.custom_op(qual, mutates_args=())
    def op(x: Tensor, tensors: List[Tensor], consts: List[int], bias: Optional[Tensor]) -> Tensor:
        return forward(x, rebuild(tensors, consts), bias).contiguous()

    @op.register_fake
    def _(x: Tensor, tensors: List[Tensor], consts: List[int], bias: Optional[Tensor]) -> Tensor:
        n_out = consts[0] if linear else consts[1]
        return x.new_empty((*x.shape[:-1], n_out), dtype=_out_dtype(x, tensors[0], bias))

    @torch.library.custom_op(f"{qual}_grad_input", mutates_args=())
    def grad_input(gy: Tensor, x: Tensor, tensors: List[Tensor], consts: List[int]) -> Tensor:
        gx = backward(_ctx(x, rebuild(tensors, consts), True, False), (gy,))[0]
        return gx.contiguous()

    @grad_input.register_fake
    def _(gy: Tensor, x: Tensor, tensors: List[Tensor], consts: List[int]) -> Tensor:
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.custom_op(f"{qual}_grad_values", mutates_args=())
    def grad_values(gy: Tensor, x: Tensor, tensors: List[Tensor], consts: List[int]) -> Tensor:
        gw = backward(_ctx(x, rebuild(tensors, consts), False, True), (gy,))[1]
        return gw.wrapped_tensor.values().reshape(tensors[0].shape).to(tensors[0].dtype).contiguous()

    @grad_values.register_fake
    def _(gy: Tensor, x: Tensor, tensors: List[Tensor], consts: List[int]) -> Tensor:
        return torch.empty_like(tensors[0], memory_format=torch.contiguous_format)

    plugin_api.register_member_linear_autograd(op, grad_input, grad_values, values_index=0)
    return op


nm_linear = _define("nm_linear", _nm, ops.nm_linear,
                    lambda ctx, g: ops._backward(ctx, g, sparse_grad=True, linear=True), linear=True)
nm_matmul = _define("nm_matmul", _nm, lambda x, w, bias: ops.nm_matmul(x, w),
                    lambda ctx, g: ops._backward(ctx, g, sparse_grad=True, linear=False), linear=False)
grouped_linear = _define("grouped_linear", _grouped, ops.grouped_linear,
                         lambda ctx, g: ops._grouped_backward(ctx, g, sparse_grad=True), linear=True)
column_grouped_linear = _define("column_grouped_linear", _column_grouped, column_grouped_ops.column_grouped_linear,
                                lambda ctx, g: column_grouped_ops._backward(ctx, g, sparse_grad=True), linear=True)


# -- compiled implementations (what the wrapper runs while Dynamo traces) ----------------
def _check_x(x: Any, k: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"input must be a tensor whose last dimension is {k}, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")


def _linear_with(op: Any, name: str) -> Callable:
    def impl(x: Tensor, weight: Any, bias: Optional[Tensor] = None) -> Tensor:
        layout = weight.wrapped_tensor
        _check_x(x, layout.shape[1])
        tensors, consts = members(layout)
        return op(x, tensors, consts, bias)

    impl.__name__ = f"{name}_compiled"
    impl.__doc__ = f"``F.linear`` while ``torch.compile`` traces: one ``sten_nm::{name}`` node."
    return impl


nm_linear_compiled = _linear_with(nm_linear, "nm_linear")
grouped_linear_compiled = _linear_with(grouped_linear, "grouped_linear")
column_grouped_linear_compiled = _linear_with(column_grouped_linear, "column_grouped_linear")


def nm_matmul_compiled(x: Tensor, other: Any) -> Tensor:
    """``x @ other`` (``matmul``) with an ``NMTensor`` ``other`` while compiling."""
    layout = other.wrapped_tensor
    _check_x(x, layout.shape[0])
    tensors, consts = members(layout)
    return nm_matmul(x, tensors, consts, None)


def nm_mm_compiled(x: Tensor, other: Any) -> Tensor:
    """``torch.mm(x, other)`` with an ``NMTensor`` ``other`` while compiling (``x`` 2-D)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"torch.mm: input must be 2-D, got shape {tuple(getattr(x, 'shape', ()))}")
    return nm_matmul_compiled(x, other)


def register(registry: Any, kernels: bool = True) -> None:
    """Register the compiled implementations (called by the plugin). Without the C
    kernels (``kernels=False``) only ``ColumnGroupedNMTensor``'s (pure torch) is."""
    T = torch.Tensor
    pairs = [(ColumnGroupedNMTensor, column_grouped_linear_compiled)]
    if kernels:
        pairs += [(NMTensor, nm_linear_compiled), (GroupedNMTensor, grouped_linear_compiled)]
        for op in (torch.mm, T.mm):
            registry.register_compiled_impl(op, (T, NMTensor), nm_mm_compiled)
        for op in (torch.matmul, T.matmul, T.__matmul__):
            registry.register_compiled_impl(op, (T, NMTensor), nm_matmul_compiled)
    for layout, impl in pairs:
        for inp in ((T, layout, T), (T, layout)):
            registry.register_compiled_impl(F.linear, inp, impl)



# -- traceable wrappers (compiled training of n:m weights) --------------------------------
_REBUILD = {NMTensor: (_nm, nm_linear), GroupedNMTensor: (_grouped, grouped_linear),
            ColumnGroupedNMTensor: (_column_grouped, column_grouped_linear)}


def register_traceable(kernels: bool = True) -> None:
    """Make the n:m layouts' wrappers traceable (``plugin_api.register_traceable_layout``): compiled training
    steps of n:m weights whose gradient is in their own layout compile whole."""
    try:
        from sten_core.plugin_api import member_grads, register_traceable_layout
    except ImportError:  # an older core
        return
    names = {NMTensor: "nm_linear", GroupedNMTensor: "grouped_linear", ColumnGroupedNMTensor: "column_grouped_linear"}
    for layout, name in names.items():
        if not kernels and layout is not ColumnGroupedNMTensor:
            continue
        grads = member_grads(members, getattr(torch.ops.sten_nm, f"{name}_grad_input"),
                             getattr(torch.ops.sten_nm, f"{name}_grad_values"))
        register_traceable_layout(layout, members, _REBUILD[layout][0], *grads)
