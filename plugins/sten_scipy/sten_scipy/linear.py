"""``F.linear``, ``torch.mm`` and ``torch.matmul`` with a scipy operand,
forward and backward.

The forward calls scipy's sparse × dense product once on numpy views of the
torch tensors. The backward gives the dense operand's gradient through scipy
too, and the sparse operand's gradient either dense or, when its ``grad_fmt``
asks for a scipy layout, as the sampled product at the kept positions (no
dense gradient is formed).

Example:
    >>> import torch, torch.nn.functional as F, sten_core as sten
    >>> from sten_scipy import ScipyCscTensor
    >>> w = sten.SparseParameterWrapper(ScipyCscTensor.from_dense(torch.eye(3)))
    >>> x = torch.ones(2, 3, requires_grad=True)
    >>> F.linear(x, w).sum().backward()
    >>> x.grad.tolist()
    [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F

from sten_core.plugin_api import KeepAll
from sten_core.plugin_api import op_name

from ._checks import check_operand
from .grads import DENSE_PAIR, grad_of
from .kernels import dense_of, dense_times_sparse, sampled, sparse_times_dense
from .layouts import SCIPY_LAYOUTS

T = torch.Tensor
MM_OPS = (torch.mm, T.mm)
MATMUL_OPS = (torch.matmul, T.matmul, T.__matmul__)


def _needs(ctx: Any, i: int) -> bool:
    needs = ctx.needs_input_grad
    return needs[i] if i < len(needs) else True


def _rows(t: torch.Tensor, k: int) -> torch.Tensor:
    """``t`` as rows of ``k`` (``reshape(-1, k)`` fails when ``k`` or ``t`` is empty)."""
    return t.reshape(math.prod(t.shape[:-1]), k)


# -- F.linear -----------------------------------------------------------------

def linear_fwd(ctx: Any, inputs: list, output_sparsifiers: list) -> torch.Tensor:
    """``y = x @ Wᵀ + b`` as ``(W @ xᵀ)ᵀ`` with scipy."""
    x, w, bias = (list(inputs) + [None, None])[:3]
    layout = w.wrapped_tensor
    out_f, in_f = layout.shape
    x = check_operand(x, layout.dtype, "F.linear", "input")
    if x.dim() == 0 or x.shape[-1] != in_f:
        raise ValueError(f"F.linear: input's last dim must equal the weight's in_features {in_f} "
                         f"(weight shape {tuple(layout.shape)}), got input shape {tuple(x.shape)}")
    x2 = _rows(x, in_f)
    y = sparse_times_dense(layout, x2.t()).t().contiguous()   # (W xᵀ)ᵀ: rows, as dense's
    if bias is not None:
        bias = check_operand(bias, layout.dtype, "F.linear", "bias")
        if tuple(bias.shape) not in ((out_f,), ()):
            raise ValueError(f"F.linear: bias must have shape ({out_f},) (the weight's out_features), "
                             f"got {tuple(bias.shape)}")
        y = y.add_(bias) if bias.dtype == y.dtype else y + bias  # y is a fresh scipy result: add in place
    ctx.save_for_backward(x, w)
    return y.reshape(*x.shape[:-1], out_f) if x.dim() != 2 else y


def linear_bwd(want_w: type | None) -> Callable:
    def impl(ctx: Any, grad_outputs: tuple, input_sparsifiers: list) -> tuple:
        x, w = ctx.saved_tensors
        layout = w.wrapped_tensor
        out_f, in_f = layout.shape
        g2 = _rows(dense_of(grad_outputs[0]), out_f).to(layout.dtype)
        x2 = _rows(x, in_f)
        grad_x = dense_times_sparse(g2, layout).reshape(x.shape) if _needs(ctx, 0) else None
        grad_w = grad_of(w, want_w, lambda: g2.t() @ x2, lambda lay: sampled(lay, g2.t(), x2)) if _needs(ctx, 1) else None
        has_bias = len(ctx.inputs) > 2 and ctx.inputs[2] is not None
        grad_b = g2.sum_to_size(ctx.inputs[2].shape) if has_bias and _needs(ctx, 2) else None  # () or (out_f,)
        return grad_x, grad_w, grad_b

    return impl


# -- mm / matmul ------------------------------------------------------------------

def _check_mm(ctx: Any, a_shape: tuple, b_shape: tuple, sparse_first: bool) -> None:
    name = op_name(ctx.op)
    dense_shape = b_shape if sparse_first else a_shape
    if ctx.op in MM_OPS and len(dense_shape) != 2:
        raise ValueError(f"{name}: both operands must be 2-D, got shapes {a_shape} and {b_shape}")
    if len(dense_shape) == 0:
        raise ValueError(f"{name}: the dense operand must be at least 1-D, got a scalar")
    k_a = a_shape[-1]
    k_b = b_shape[0] if len(b_shape) == 1 else b_shape[-2]
    if k_a != k_b:
        raise ValueError(f"{name}: inner dims must match: {a_shape} @ {b_shape} (expected the second "
                         f"operand's first dim to be {k_a})")


def _columns(b: torch.Tensor) -> torch.Tensor:
    """``b`` ([K], [K, N] or [..., K, N]: ``matmul`` broadcasts) as one [K, R] matrix."""
    if b.dim() == 1:
        return b.unsqueeze(1)
    # not reshape(K, -1): that raises for an empty batch or N == 0 ([5, 0, 0] @ ...)
    return b if b.dim() == 2 else b.movedim(-2, 0).reshape(b.shape[-2], math.prod(b.shape[:-2]) * b.shape[-1])


def _uncolumns(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_columns`` for a product [M, R] (M in place of ``like``'s K)."""
    if like.dim() == 1:
        return y.squeeze(1)
    return y if like.dim() == 2 else y.reshape(y.shape[0], *like.shape[:-2], like.shape[-1]).movedim(0, -2)


def sparse_dense_fwd(ctx: Any, inputs: list, output_sparsifiers: list) -> torch.Tensor:
    a, b = inputs[:2]
    layout = a.wrapped_tensor
    b = check_operand(b, layout.dtype, op_name(ctx.op), "the dense operand")
    _check_mm(ctx, tuple(layout.shape), tuple(b.shape), True)
    ctx.save_for_backward(a, b)
    return _uncolumns(sparse_times_dense(layout, _columns(b)), b)


def sparse_dense_bwd(want_a: type | None) -> Callable:
    def impl(ctx: Any, grad_outputs: tuple, input_sparsifiers: list) -> tuple:
        a, b = ctx.saved_tensors
        layout = a.wrapped_tensor
        g2 = _columns(dense_of(grad_outputs[0]).to(layout.dtype))
        b2 = _columns(b)
        grad_a = grad_of(a, want_a, lambda: g2 @ b2.t(), lambda lay: sampled(lay, g2, b2.t())) if _needs(ctx, 0) else None
        grad_b = _uncolumns(sparse_times_dense(layout.transpose(), g2), b) if _needs(ctx, 1) else None
        return grad_a, grad_b

    return impl


def dense_sparse_fwd(ctx: Any, inputs: list, output_sparsifiers: list) -> torch.Tensor:
    a, b = inputs[:2]
    layout = b.wrapped_tensor
    a = check_operand(a, layout.dtype, op_name(ctx.op), "the dense operand")
    _check_mm(ctx, tuple(a.shape), tuple(layout.shape), False)
    ctx.save_for_backward(a, b)
    k, n = layout.shape
    y = dense_times_sparse(_rows(a, k), layout)
    return y if a.dim() == 2 else y.reshape(*a.shape[:-1], n)


def dense_sparse_bwd(want_b: type | None) -> Callable:
    def impl(ctx: Any, grad_outputs: tuple, input_sparsifiers: list) -> tuple:
        a, b = ctx.saved_tensors
        layout = b.wrapped_tensor
        k, n = layout.shape
        g2 = _rows(dense_of(grad_outputs[0]).to(layout.dtype), n)
        a2 = _rows(a, k)
        grad_a = dense_times_sparse(g2, layout.transpose()).reshape(a.shape) if _needs(ctx, 0) else None
        grad_b = grad_of(b, want_b, lambda: a2.t() @ g2, lambda lay: sampled(lay, a2.t(), g2)) if _needs(ctx, 1) else None
        return grad_a, grad_b

    return impl


# -- registration -------------------------------------------------------------------

def register(registry: Any, grad_outs: tuple) -> None:
    keep = DENSE_PAIR
    sparse_wants = [(KeepAll, M) for M in SCIPY_LAYOUTS]
    for L in SCIPY_LAYOUTS:
        for inp in ((T, L, T), (T, L)):
            registry.register_fwd_op_impl(F.linear, inp, [keep], linear_fwd)
            for g in grad_outs:
                registry.register_bwd_op_impl(F.linear, (g,), (keep, keep, keep)[: len(inp)], inp, linear_bwd(None))
                for want in sparse_wants:
                    registry.register_bwd_op_impl(F.linear, (g,), (keep, want, keep)[: len(inp)], inp, linear_bwd(want[1]))
        for op in MM_OPS + MATMUL_OPS:
            registry.register_fwd_op_impl(op, (L, T), [keep], sparse_dense_fwd)
            registry.register_fwd_op_impl(op, (T, L), [keep], dense_sparse_fwd)
            for g in grad_outs:
                registry.register_bwd_op_impl(op, (g,), (keep, keep), (L, T), sparse_dense_bwd(None))
                registry.register_bwd_op_impl(op, (g,), (keep, keep), (T, L), dense_sparse_bwd(None))
                for want in sparse_wants:
                    registry.register_bwd_op_impl(op, (g,), (want, keep), (L, T), sparse_dense_bwd(want[1]))
                    registry.register_bwd_op_impl(op, (g,), (keep, want), (T, L), dense_sparse_bwd(want[1]))
