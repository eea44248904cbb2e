"""``torch.t`` / ``.T`` / ``transpose`` and ``torch.sum`` on scipy layouts,
forward and backward.

The transpose of a CSR tensor is the CSC tensor of the same arrays (O(1), no
copy), and the other way round. Sums run over the stored values only
(O(nnz)) and return dense tensors.

Example:
    >>> import torch, sten_core as sten
    >>> from sten_scipy import ScipyCsrTensor
    >>> w = sten.SparseTensorWrapper(ScipyCsrTensor.from_dense(torch.tensor([[1., 0.], [2., 3.]])))
    >>> type(w.T.wrapped_tensor).__name__, w.sum(dim=1).tolist()
    ('ScipyCscTensor', [1.0, 5.0])
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from sten_core.plugin_api import KeepAll, SparseTensorWrapper, storage_view
from sten_core.plugin_api import op_name

from .compressed import ScipyCompressed
from .grads import DENSE_PAIR, grad_of
from .kernels import dense_of
from .layouts import SCIPY_LAYOUTS, TRANSPOSED

T = torch.Tensor
T_OPS = (torch.t, T.t, T.T.__get__, T.mT.__get__, torch.transpose, T.transpose)
SUM_OPS = (torch.sum, T.sum)


# -- transpose ---------------------------------------------------------------------

def _swaps(ctx: Any) -> bool:
    """Whether this call transposes (``transpose(x, 0, 0)`` does not)."""
    if ctx.op not in (torch.transpose, T.transpose):
        return True
    args, kwargs = ctx.call_args
    dims = list(args[1:3]) + [kwargs[k] for k in ("dim0", "dim1") if k in kwargs]
    if len(dims) != 2:
        raise TypeError(f"{op_name(ctx.op)}: expected two dims (dim0, dim1), got {dims}")
    d0, d1 = dims
    for d in dims:
        if not isinstance(d, int) or not -2 <= d <= 1:
            raise ValueError(f"{op_name(ctx.op)}: dims must be in [-2, 1] for a 2-D tensor, got {dims}")
    return d0 % 2 != d1 % 2


def t_fwd(dense_out: bool) -> Callable:
    def impl(ctx: Any, inputs: list, output_sparsifiers: list) -> Any:
        (a,) = inputs[:1]
        layout = a.wrapped_tensor
        result = layout.transpose() if _swaps(ctx) else layout
        ctx.save_for_backward(a)
        if dense_out:
            return result.to_dense()
        return storage_view(a, result, _transposed_fmt(a.grad_fmt))   # (the same arrays: writes reach a)

    return impl


def _transposed_fmt(fmt: Any) -> Any:
    """A grad_fmt for the transpose: scipy formats swapped (CSR ↔ CSC), so a
    sampled gradient of the transpose is the transpose of the sampled gradient."""
    if not isinstance(fmt, (tuple, list)) or len(fmt) != 4:
        return fmt
    inline, tmp, external, out = fmt
    return (inline, TRANSPOSED.get(tmp, tmp), external, TRANSPOSED.get(out, out))


def t_bwd(want: type | None) -> Callable:
    def impl(ctx: Any, grad_outputs: tuple, input_sparsifiers: list) -> tuple:
        (a,) = ctx.saved_tensors
        g = grad_outputs[0]
        swap = _swaps(ctx)
        if isinstance(g, SparseTensorWrapper) and isinstance(g.wrapped_tensor, ScipyCompressed) and want not in (None, torch.Tensor):
            back = g.wrapped_tensor.transpose() if swap else g.wrapped_tensor
            if type(back) is want and a.wrapped_tensor.same_pattern(back):
                return (SparseTensorWrapper(back),)
        dense = lambda: dense_of(g).t() if swap else dense_of(g)  # noqa: E731
        return (grad_of(a, want, dense),)

    return impl


# -- sum ---------------------------------------------------------------------------------

def _sum_args(ctx: Any) -> tuple[tuple[int, ...] | None, bool, torch.dtype | None]:
    """``(dims or None for all, keepdim, dtype)`` of a ``sum`` call."""
    args, kwargs = ctx.call_args
    names = ("input", "dim", "keepdim")
    params = dict(zip(names, args))
    params.update(kwargs)
    dim, keepdim, dtype = params.get("dim"), bool(params.get("keepdim", False)), params.get("dtype")
    if isinstance(dim, torch.dtype):  # Tensor.sum(torch.float64)
        dim, dtype = None, dim
    if dim is None:
        return None, keepdim, dtype
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    for d in dims:
        if not isinstance(d, int) or not -2 <= d <= 1:
            raise ValueError(f"{op_name(ctx.op)}: dim must be in [-2, 1] for a 2-D tensor, got {dim!r}")
    if len({d % 2 for d in dims}) != len(dims):   # as torch: w.sum((0, -2)) is an error, not sum(0)
        raise RuntimeError(f"{op_name(ctx.op)}: dim {sorted(d % 2 for d in dims)[0]} appears multiple times in the "
                           f"list of dims, got {dim!r}")
    dims = tuple(sorted(d % 2 for d in dims))
    return (dims if len(dims) == 1 else None), keepdim, dtype


def sum_fwd(ctx: Any, inputs: list, output_sparsifiers: list) -> torch.Tensor:
    (a,) = inputs[:1]
    layout = a.wrapped_tensor
    dims, keepdim, dtype = _sum_args(ctx)
    values = layout.values()
    dtype = dtype or values.dtype
    ctx.save_for_backward(a)
    if dims is None:
        total = values.sum(dtype=dtype)
        return total.reshape(1, 1) if keepdim else total
    (d,) = dims
    rows, cols = layout.coords()
    index = rows if d == 1 else cols
    out = torch.zeros(layout.shape[1 - d], dtype=dtype).index_add_(0, index, values.to(dtype))
    return out.unsqueeze(d) if keepdim else out


def sum_bwd(want: type | None) -> Callable:
    def impl(ctx: Any, grad_outputs: tuple, input_sparsifiers: list) -> tuple:
        (a,) = ctx.saved_tensors
        layout = a.wrapped_tensor
        dims, keepdim, _ = _sum_args(ctx)
        g = dense_of(grad_outputs[0]).to(layout.dtype)
        if dims is None:
            full = g.reshape(1, 1)
        else:
            full = g if keepdim else g.unsqueeze(dims[0])
        expanded = full.expand(tuple(layout.shape))
        return (grad_of(a, want, lambda: expanded.contiguous(), lambda lay: lay.gather(expanded)),)

    return impl


# -- registration ---------------------------------------------------------------------

def register(registry: Any, grad_outs: tuple, table: Any) -> None:
    keep = DENSE_PAIR
    for L in SCIPY_LAYOUTS:
        wants = [keep] + [(KeepAll, M) for M in SCIPY_LAYOUTS]
        for op in T_OPS:
            registry.register_fwd_op_impl(op, (L, ...), [(KeepAll, TRANSPOSED[L])], t_fwd(False))   # (the dims)
            table.hook(op, (L, ...), [keep], t_fwd(True))
            table.default(op, (L,), [(KeepAll, TRANSPOSED[L])])
            for g in grad_outs:
                for want in wants:
                    registry.register_bwd_op_impl(op, (g,), (want,), (L,), t_bwd(want[1]))
        for op in SUM_OPS:
            registry.register_fwd_op_impl(op, (L, ...), [keep], sum_fwd)   # (dim, keepdim, dtype)
            for g in grad_outs:
                for want in wants:
                    registry.register_bwd_op_impl(op, (g,), (want,), (L,), sum_bwd(want[1]))
