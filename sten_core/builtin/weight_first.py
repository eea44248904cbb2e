"""``W @ x`` for any layout with an ``F.linear`` implementation.

A layout that registers ``F.linear(x, W)`` (``x @ W.T``, the product its kernels are
written for) also runs the products with the sparse matrix *first*: ``W @ x``,
``torch.matmul(W, x)``, ``torch.mm(W, x)``, ``W.matmul(x)`` and ``W.mm(x)`` are
``F.linear(x.mT, W).mT`` (``x`` a matrix or a batch of matrices) and ``W @ v`` is
``F.linear(v, W)`` (``v`` a vector), forward and backward, the weight's gradient in
its ``grad_fmt`` as the layout's ``F.linear`` backward gives it. Without this rule
such a call was converted to another plugin's layout on every call (an n:m weight to
scipy CSR) or fell back to dense. A layout's own registration for the product comes
first; this rule is consulted where there is none (``sten_resolve_op``, before
conversions). The compiled counterpart is ``sten_core.dispatch.compiled_products``.

Example:
    >>> import torch, torch.nn.functional as F, sten_core as sten
    >>> from sten_core.model.registry import OpKey
    >>> class Banded(sten.DenseTensor):   # a layout with F.linear only
    ...     pass
    >>> with sten.registry.owner("doc"):
    ...     _ = sten.registry.register_layout(Banded)
    ...     _ = sten.registry.register_fwd_op_impl(
    ...         F.linear, (torch.Tensor, Banded), [(sten.KeepAll, torch.Tensor)],
    ...         lambda ctx, inputs, outs: F.linear(inputs[0], inputs[1].wrapped_tensor.to_dense()))
    >>> resolve(OpKey("fwd", torch.mm, (Banded, torch.Tensor), DENSE_OUT)) is not None
    True
    >>> sten.registry.remove_owner("doc")
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from sten_core.dispatch.compiled_products import WEIGHT_FIRST_MATMULS, WEIGHT_FIRST_MMS
from sten_core.dispatch.plan import DENSE_OUT
from sten_core.model.registry import Entry, OpKey, registry, trim

T = torch.Tensor
PRODUCTS = WEIGHT_FIRST_MATMULS | WEIGHT_FIRST_MMS
_VIEW = "_sten_as_linear"  # where the forward leaves the linear's context for the backward


class _AsLinear:
    """The ``ctx`` a layout's ``F.linear`` implementation sees when it runs ``W @ x`` as
    ``F.linear(x^T, W)``: its inputs and ``needs_input_grad`` in linear's order (``x``,
    ``W``), ``op`` ``F.linear``; saved tensors go to the call's own context (autograd
    checks them as usual) and other attributes stay on this object, kept for backward."""

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx
        self.op = F.linear

    @property
    def inputs(self) -> list:
        weight, other = self._ctx.inputs[0], self._ctx.inputs[1]
        return [other if other.dim() == 1 else other.mT, weight]

    @property
    def call_args(self) -> tuple:
        return tuple(self.inputs), {}

    @property
    def needs_input_grad(self) -> tuple:
        needs = tuple(self._ctx.needs_input_grad) + (True, True)
        return needs[1], needs[0]

    @property
    def saved_tensors(self) -> tuple:
        return self._ctx.saved_tensors

    def save_for_backward(self, *tensors: Any) -> None:
        self._ctx.save_for_backward(*tensors)


def _flip(t: Any, vector: bool) -> Any:
    return t if vector or t is None else t.mT


def _forward(linear: Callable, mm: bool) -> Callable:
    def weight_first_fwd(ctx: Any, inputs: list, output_sparsifiers: list) -> torch.Tensor:
        weight, other = inputs[0], inputs[1]
        name = "mm" if mm else "matmul"
        if not isinstance(other, torch.Tensor):
            raise TypeError(f"torch.{name}: the second operand must be a tensor, got {type(other).__name__}")
        if (mm and other.dim() != 2) or other.dim() == 0:
            raise ValueError(f"torch.{name}: the second operand must be {'2-D' if mm else 'at least 1-D'}, "
                             f"got shape {tuple(other.shape)}")
        k = weight.shape[-1]
        if other.shape[0 if other.dim() == 1 else -2] != k:
            raise ValueError(f"torch.{name}: a sparse first operand of shape {tuple(weight.shape)} needs the second "
                             f"operand's {'length' if other.dim() == 1 else 'second-to-last dimension'} to be {k}, "
                             f"got shape {tuple(other.shape)}")
        view = _AsLinear(ctx)
        setattr(ctx, _VIEW, view)
        vector = other.dim() == 1
        out = linear(view, [_flip(other, vector), weight], output_sparsifiers)
        return out if vector else out.mT.contiguous()

    return weight_first_fwd


def _backward(linear_backward: Callable) -> Callable:
    def weight_first_bwd(ctx: Any, grad_outputs: tuple, input_sparsifiers: list) -> tuple:
        view = getattr(ctx, _VIEW, None)
        if view is None:
            raise RuntimeError(f"{ctx.op}: the backward of a sparse-first product found no F.linear forward to "
                               "differentiate (its forward ran another plugin's implementation that registers no "
                               "backward for these gradient formats)")
        vector = ctx.inputs[1].dim() == 1
        grads = linear_backward(view, (_flip(grad_outputs[0], vector),), input_sparsifiers[::-1])
        grads = tuple(grads) + (None, None)
        return grads[1], _flip(grads[0], vector)

    return weight_first_bwd


def _runs_as_linear(op: Any, layout: Any) -> Entry | None:
    """The layout's ``F.linear`` forward when ``op(W, x)`` has no registration of its own."""
    if registry.impls.get(OpKey("fwd", op, (layout, T), DENSE_OUT)) is not None:
        return None
    return registry.impls.get(OpKey("fwd", F.linear, (T, layout), DENSE_OUT))


def resolve(key: OpKey) -> Entry | None:
    """The ``sten_resolve_op`` part: ``op(W, x)`` through ``W``'s ``F.linear``, forward and backward."""
    if key.op not in PRODUCTS or len(key.inp) != 2 or key.inp[1] is not T or key.inp[0] in (None, T):
        return None
    layout = key.inp[0]
    linear = _runs_as_linear(key.op, layout)
    if linear is None:
        return None
    if key.direction == "fwd":
        return Entry(_forward(linear.fn, key.op in WEIGHT_FIRST_MMS), 2) if key.out == DENSE_OUT else None
    if key.direction != "bwd":
        return None
    pairs = tuple(key.out) + (None, None)
    grads = trim((pairs[1] or DENSE_OUT[0], pairs[0] or DENSE_OUT[0]))
    backward = registry.impls.get(OpKey("bwd", F.linear, (T, layout), grads, key.grad_out))
    return None if backward is None else Entry(_backward(backward.fn), 2)
