"""``torch.add`` and ``torch.mul`` with scipy operands, forward and backward.

- sparse + dense (either order, any ``alpha``) and sparse + scalar give a dense tensor;
- sparse + sparse gives the union of the nonzeros, in the requested scipy layout
  (the first operand's by default), or a dense tensor when asked;
- sparse * dense and sparse * scalar keep the sparse operand's pattern and layout
  (products at the zeros are zero, as in ``scipy.sparse.multiply``).

Example:
    >>> import torch, sten_core as sten
    >>> from sten_scipy import ScipyCsrTensor
    >>> a = sten.SparseTensorWrapper(ScipyCsrTensor.from_dense(torch.eye(2)))
    >>> b = sten.SparseTensorWrapper(ScipyCsrTensor.from_dense(torch.tensor([[0., 3.], [0., 0.]])))
    >>> (a + b).wrapped_tensor.nnz, (a * 2).to_dense().tolist()
    (3, [[2.0, 0.0], [0.0, 2.0]])
"""

from __future__ import annotations

import math

from typing import Any, Callable

import torch

from sten_core.plugin_api import needs_grad

from sten_core.plugin_api import KeepAll, SparseTensorWrapper
from sten_core.plugin_api import trim
from sten_core.plugin_api import Unsupported, op_name

from .compressed import ScipyCompressed
from .grads import DENSE_PAIR, grad_of
from .kernels import dense_of, reduce_to, scatter_dense
from .layouts import SCIPY_LAYOUTS

T = torch.Tensor
ADD_OPS = (torch.add, T.add, T.__add__, T.__radd__)
MUL_OPS = (torch.mul, T.mul, T.__mul__, T.__rmul__)


def _alpha(ctx: Any, inputs: list) -> Any:
    """``alpha`` of ``torch.add``/``Tensor.add`` (the dunders have none)."""
    if ctx.op not in (torch.add, T.add):
        return 1
    args, kwargs = ctx.call_args
    alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
    return 1 if alpha is None else alpha


def _check_float(value: Any, where: str, name: str) -> None:
    """Refuse an operand on another device; decline a complex one (``Unsupported``: the dense path gives
    dense torch's complex result, with a warning; scipy layouts hold float32 / float64)."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise ValueError(f"{where}: {name} must be on the CPU (scipy.sparse is CPU-only), got device {value.device}")
        if value.is_complex():
            raise Unsupported(f"{name} is complex ({value.dtype}); scipy layouts hold float32/float64")
    elif isinstance(value, complex):
        raise Unsupported(f"{name} is complex ({value!r}); scipy layouts hold float32/float64")


# -- add ------------------------------------------------------------------------------

def add_dense_fwd(ctx: Any, inputs: list, output_sparsifiers: list) -> torch.Tensor:
    """sparse + dense, dense + sparse, sparse + scalar, or sparse + sparse → dense."""
    a, b = inputs[0], inputs[1]
    alpha = _alpha(ctx, inputs)
    _check_float(b, op_name(ctx.op), "other")
    ctx.save_for_backward(a, b)
    return torch.add(dense_of(a), dense_of(b), alpha=alpha)


def add_union_fwd(target: type) -> Callable:
    """sparse + sparse → the union of the nonzeros in ``target``."""

    def impl(ctx: Any, inputs: list, output_sparsifiers: list) -> SparseTensorWrapper:
        a, b = inputs[0], inputs[1]
        alpha = _alpha(ctx, inputs)
        la, lb = a.wrapped_tensor, b.wrapped_tensor
        if la.shape != lb.shape:
            raise ValueError(f"{op_name(ctx.op)}: sparse operands must have the same shape, "
                             f"got {tuple(la.shape)} and {tuple(lb.shape)}")
        total = la.data + (lb.data * alpha if alpha != 1 else lb.data)
        total = total.tocsr() if target._major == 0 else total.tocsc()
        ctx.save_for_backward(a, b)
        return SparseTensorWrapper(target(total))

    return impl


def add_bwd(wants: tuple) -> Callable:
    def impl(ctx: Any, grad_outputs: tuple, input_sparsifiers: list) -> tuple:
        a, b = ctx.saved_tensors
        alpha = _alpha(ctx, ctx.inputs)
        g = dense_of(grad_outputs[0])
        grads = []
        for i, (value, scale) in enumerate(((a, 1), (b, alpha))):
            if not isinstance(value, torch.Tensor) or not needs_grad(ctx, i):
                grads.append(None)
                continue
            shape = tuple(value.shape)
            dense = lambda shape=shape, scale=scale: reduce_to(g, shape) * scale  # noqa: E731
            grads.append(grad_of(value, wants[i] if i < len(wants) else None, dense))
        return tuple(grads)

    return impl


# -- mul ------------------------------------------------------------------------------

def _split(inputs: list) -> tuple[SparseTensorWrapper, Any, int]:
    """(the sparse operand, the other one, the sparse one's position)."""
    a, b = inputs[0], inputs[1]
    if isinstance(a, SparseTensorWrapper) and isinstance(a.wrapped_tensor, ScipyCompressed):
        return a, b, 0
    return b, a, 1


def _fits(other: Any, shape: torch.Size) -> bool:
    if not isinstance(other, torch.Tensor):
        return True
    try:
        return torch.broadcast_shapes(other.shape, shape) == shape
    except RuntimeError:
        return False


def _finite(value: Any) -> bool:
    """Whether a factor is finite everywhere (a scalar or a tensor)."""
    if isinstance(value, torch.Tensor):
        return bool(torch.isfinite(value).all()) if value.is_floating_point() or value.is_complex() else True
    return not isinstance(value, float) or math.isfinite(value)


def mul_fwd(sparse_out: bool) -> Callable:
    def impl(ctx: Any, inputs: list, output_sparsifiers: list) -> Any:
        s, other, _ = _split(inputs)
        layout = s.wrapped_tensor
        _check_float(other, op_name(ctx.op), "other")
        ctx.save_for_backward(inputs[0], inputs[1])
        other = dense_of(other)
        if not sparse_out or not _fits(other, layout.shape) or not _finite(other):
            return dense_of(s) * other   # (0 * inf and 0 * nan are NaN at the unstored positions, as dense)
        factor = layout.gather(other) if isinstance(other, torch.Tensor) and other.dim() > 0 else other
        return SparseTensorWrapper(layout.with_values(layout.values() * factor))

    return impl


def mul_bwd(wants: tuple) -> Callable:
    def impl(ctx: Any, grad_outputs: tuple, input_sparsifiers: list) -> tuple:
        s, other, pos = _split(list(ctx.saved_tensors))
        layout = s.wrapped_tensor
        g = dense_of(grad_outputs[0])
        other_d = dense_of(other)
        want_s = wants[pos] if pos < len(wants) else None
        grads: list = [None, None]
        if needs_grad(ctx, pos):
            if g.shape == layout.shape:
                at = lambda lay: lay.gather(g) * (lay.gather(other_d) if isinstance(other_d, torch.Tensor) and other_d.dim() else other_d)  # noqa: E731
            else:
                at = None
            grads[pos] = grad_of(s, want_s, lambda: reduce_to(g * other_d, tuple(layout.shape)), at)
        if isinstance(other, torch.Tensor) and needs_grad(ctx, 1 - pos):
            if g.shape == layout.shape:
                prod = scatter_dense(layout, layout.values() * layout.gather(g))
            else:
                prod = g * dense_of(s)
            other_want = wants[1 - pos] if 1 - pos < len(wants) else None
            grads[1 - pos] = grad_of(other, other_want, lambda: reduce_to(prod, tuple(other.shape)).to(other.dtype))
        return tuple(grads)

    return impl


# -- registration ---------------------------------------------------------------------

def register(registry: Any, grad_outs: tuple, table: Any) -> None:
    keep = DENSE_PAIR
    sparse_wants = [(KeepAll, M) for M in SCIPY_LAYOUTS]
    for L in SCIPY_LAYOUTS:
        mine = (KeepAll, L)
        for op in ADD_OPS:
            for inp in ((L, T), (T, L), (L, None)):  # (L, None): a scalar other
                registry.register_fwd_op_impl(op, (*inp, ...), [keep], add_dense_fwd)   # (alpha)
            for M in SCIPY_LAYOUTS:
                for out in SCIPY_LAYOUTS:
                    registry.register_fwd_op_impl(op, (L, M, ...), [(KeepAll, out)], add_union_fwd(out))
                table.hook(op, (L, M, ...), [keep], add_dense_fwd)
                table.default(op, (L, M), [mine])
            for g in grad_outs:
                for inp, sparse_pos in (((L, T), (0,)), ((T, L), (1,)), ((L, None), (0,))) + tuple(((L, M), (0, 1)) for M in SCIPY_LAYOUTS):
                    for wants in _grad_wants(len(trim(inp)), sparse_pos, sparse_wants):
                        registry.register_bwd_op_impl(op, (g,), wants, inp, add_bwd(tuple(w[1] for w in wants)))
        for op in MUL_OPS:
            for inp, sparse_pos in (((L, T), (0,)), ((T, L), (1,)), ((L, None), (0,))):
                registry.register_fwd_op_impl(op, inp, [mine], mul_fwd(True))
                table.hook(op, inp, [keep], mul_fwd(False))
                table.default(op, inp, [mine])
                for g in grad_outs:
                    for wants in _grad_wants(len(trim(inp)), sparse_pos, sparse_wants):
                        registry.register_bwd_op_impl(op, (g,), wants, inp, mul_bwd(tuple(w[1] for w in wants)))


def _grad_wants(n: int, sparse_pos: tuple, sparse_wants: list) -> list[tuple]:
    """Every grad_inp pattern: dense everywhere, or a scipy layout at sparse positions."""
    options = [[DENSE_PAIR] + (sparse_wants if i in sparse_pos else []) for i in range(n)]
    result: list[tuple] = [()]
    for opts in options:
        result = [r + (o,) for r in result for o in opts]
    return result
