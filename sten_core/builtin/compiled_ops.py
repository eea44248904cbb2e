"""Custom operators (``sten_core::...``) for the built-in layouts' kernels under ``torch.compile``.

Each operator takes a layout's plain member tensors (never a sparse torch
tensor or a wrapper), so Dynamo and AOTAutograd see it as one opaque graph
node: its fake implementation gives the output's metadata, its CPU/CUDA
implementation is the eager kernel (same arithmetic, same results), and its
autograd formula is registered.

Example:
    >>> import torch
    >>> from sten_core.builtin.torch_layouts import CsrTensor
    >>> w = CsrTensor.from_dense(torch.eye(3))
    >>> crow, col, values = w.state_tensors()
    >>> torch.ops.sten_core.csr_mm(crow, col, values, 3, torch.ones(3, 2)).tolist()
    [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from sten_core.builtin.ops import _sparse_times, sampled_at_csr
from sten_core.builtin.torch_layouts import CscTensor, CsrTensor


def _no_autocast() -> Any:
    """The custom operators compute in their operands' dtypes: the graph chose them
    (``compiled.autocast_result``). A graph run by Dynamo's ``eager`` backend or
    ``torch._dynamo.explain`` under ``torch.autocast`` calls them with CPU autocast on, which
    cast ``torch.sparse.mm``'s float32 operands to bfloat16 (MKL: not implemented)."""
    return torch.autocast("cpu", enabled=False)


def _csr(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, columns: int,
         dtype: torch.dtype) -> torch.Tensor:
    values = values if values.dtype == dtype else values.to(dtype)
    return torch.sparse_csr_tensor(crow, col, values, (crow.shape[0] - 1, columns))


@torch.library.custom_op("sten_core::csr_mm", mutates_args=())
def csr_mm(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, columns: int,
           dense: torch.Tensor) -> torch.Tensor:
    """``W @ dense`` for a CSR ``W`` [R, columns] given by its members and ``dense``
    [columns, M] (the eager kernel: ``torch.sparse.mm``, MKL on the CPU); [R, M]."""
    with _no_autocast():
        return _sparse_times(_csr(crow, col, values, columns, dense.dtype), dense).contiguous()


@csr_mm.register_fake
def _(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, columns: int, dense: torch.Tensor) -> torch.Tensor:
    return dense.new_empty(crow.shape[0] - 1, dense.shape[1])


@torch.library.custom_op("sten_core::csr_t_mm", mutates_args=())
def csr_t_mm(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, columns: int,
             dense: torch.Tensor) -> torch.Tensor:
    """``W.t() @ dense`` for a CSR ``W`` [R, columns] and ``dense`` [R, M]; [columns, M]."""
    w = _csr(crow, col, values, columns, dense.dtype)
    with _no_autocast():
        return _sparse_times(w.t(), dense).contiguous()


@csr_t_mm.register_fake
def _(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, columns: int, dense: torch.Tensor) -> torch.Tensor:
    return dense.new_empty(columns, dense.shape[1])


@torch.library.custom_op("sten_core::csr_sampled", mutates_args=())
def csr_sampled(a: torch.Tensor, b: torch.Tensor, crow: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """Values of ``a @ b`` at a CSR pattern (the weight gradient, pattern kept)."""
    ones = torch.ones(col.shape[0], dtype=a.dtype, device=a.device)
    pattern = torch.sparse_csr_tensor(crow, col, ones, (crow.shape[0] - 1, b.shape[1]))
    with _no_autocast():
        return sampled_at_csr(pattern, a.contiguous(), b.contiguous()).clone()


@csr_sampled.register_fake
def _(a: torch.Tensor, b: torch.Tensor, crow: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    return a.new_empty(col.shape[0])


def _setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    crow, col, values, columns, dense = inputs
    ctx.save_for_backward(crow, col, values, dense)
    ctx.columns = columns


def _mm_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    """``W @ D``: grad D = ``W.t() @ grad``; grad of W's values = ``grad @ D.t()`` at W's pattern."""
    crow, col, values, dense = ctx.saved_tensors
    needs = ctx.needs_input_grad
    grad_values = torch.ops.sten_core.csr_sampled(grad, dense.t(), crow, col).to(values.dtype) if needs[2] else None
    grad_dense = torch.ops.sten_core.csr_t_mm(crow, col, values, ctx.columns, grad) if needs[4] else None
    return None, None, grad_values, None, grad_dense


def _t_mm_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    """``W.t() @ D``: grad D = ``W @ grad``; grad of W's values = ``D @ grad.t()`` at W's pattern."""
    crow, col, values, dense = ctx.saved_tensors
    needs = ctx.needs_input_grad
    grad_values = torch.ops.sten_core.csr_sampled(dense, grad.t(), crow, col).to(values.dtype) if needs[2] else None
    grad_dense = torch.ops.sten_core.csr_mm(crow, col, values, ctx.columns, grad) if needs[4] else None
    return None, None, grad_values, None, grad_dense


csr_mm.register_autograd(_mm_backward, setup_context=_setup)
csr_t_mm.register_autograd(_t_mm_backward, setup_context=_setup)


def csr_linear_kernel(x: torch.Tensor, weight: Any, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` with a ``CsrTensor`` weight while ``torch.compile`` traces: one
    ``sten_core::csr_mm`` node (``W @ x.t()``, eager's product) on the layout's
    members; the transposes, reshapes and the bias are graph ops."""
    crow, col, values = weight.wrapped_tensor.state_tensors()
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.ops.sten_core.csr_mm(crow, col, values, x.shape[-1], x2.t()).t().contiguous()
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], crow.shape[0] - 1)


def csc_linear_kernel(x: torch.Tensor, weight: Any, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` with a ``CscTensor`` weight ``W`` [N, K] while compiling: its members
    are those of the CSR ``W.t()`` [K, N], so ``W @ x.t()`` is one ``sten_core::csr_t_mm``."""
    layout = weight.wrapped_tensor
    ccol, row, values = layout.state_tensors()
    n = layout.size_2d[0]
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.ops.sten_core.csr_t_mm(ccol, row, values, n, x2.t()).t().contiguous()
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], n)


def second_operand_kernel(x: torch.Tensor, weight: Any) -> torch.Tensor:
    """``x @ W`` (``torch.matmul(x, W)``) with a frozen ``CsrTensor`` / ``CscTensor`` ``W`` [N, K] while
    compiling: the transposed product, one node on the members. A CSR ``W``'s ``x @ W`` is
    ``(W.t() @ x.t()).t()``, one ``sten_core::csr_t_mm``; a CSC ``W``'s members are the CSR ``W.t()``,
    so it is one ``sten_core::csr_mm``. Both have autograd formulas (``x``'s gradient)."""
    layout = weight.wrapped_tensor
    n, k = layout.size_2d
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != n:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"matmul: the first operand's last dimension must be {n} (W is [{n}, {k}]), got {got}")
    compressed, plain, values = layout.state_tensors()
    x2 = x.reshape(-1, n).t()
    if isinstance(layout, CsrTensor):
        y = torch.ops.sten_core.csr_t_mm(compressed, plain, values, k, x2)
    else:
        y = torch.ops.sten_core.csr_mm(compressed, plain, values, n, x2)
    return y.t().reshape(*x.shape[:-1], k).contiguous()


def second_operand_mm_kernel(x: torch.Tensor, weight: Any) -> torch.Tensor:
    """``torch.mm(x, W)`` (``x`` 2-D) with a frozen ``CsrTensor`` / ``CscTensor`` ``W``: ``second_operand_kernel``."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"mm: the first operand must be 2-D, got {tuple(getattr(x, 'shape', ()))}")
    return second_operand_kernel(x, weight)


def _csr_members(layout: Any) -> tuple[list, list]:
    """A ``CsrTensor``'s or ``CscTensor``'s (compressed indices, plain indices, values) and shape."""
    rows, cols = layout.shape
    return list(layout.state_tensors()), [rows, cols]


def _compressed_from_members(cls: type, tensors: list, consts: list) -> Any:
    """A ``CsrTensor`` / ``CscTensor`` around its members; while tracing (fake members, where
    no sparse tensor can be made) its ``data`` is the dense matrix computed from the members
    in traced torch ops (what ``to_dense()`` and aten-level fallbacks read; the compiled
    implementations take the members; unused ops are dropped from the graph)."""
    compressed, plain, values = tensors
    shape = (consts[0], consts[1])
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(values) or is_fake(compressed):
        data = _dense_from_compressed(cls, compressed, plain, values, shape)
    else:
        make = torch.sparse_csr_tensor if cls is CsrTensor else torch.sparse_csc_tensor
        data = make(compressed, plain, values, shape, check_invariants=False)
    return cls(data, (compressed, plain, values))


def dense_from_members(layout: Any) -> torch.Tensor:
    """The dense matrix of a ``CsrTensor`` / ``CscTensor`` from its members in torch ops whose
    output sizes are static (nnz is the plain indices' length), so Dynamo traces it on a
    traceable wrapper's fake members.

    >>> dense_from_members(CsrTensor.from_dense(torch.eye(2))).tolist()
    [[1.0, 0.0], [0.0, 1.0]]
    """
    cls, shape = type(layout), tuple(layout.size_2d)  # plain ints: the shape reads the sparse tensor
    compressed, plain, values = layout.state_tensors()
    return _dense_from_compressed(cls, compressed, plain, values, shape)


def _dense_from_compressed(cls: type, compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
                           shape: tuple) -> torch.Tensor:
    # every new tensor derives from the members (no torch.arange): unflatten runs this on fake
    # members outside the fake mode
    position = torch.ones_like(plain, dtype=torch.int64).cumsum(0) - 1            # 0 .. nnz-1
    major = torch.searchsorted(compressed.to(torch.int64), position, right=True) - 1
    rows, cols = (major, plain.long()) if cls is CsrTensor else (plain.long(), major)
    return values.new_zeros(shape).index_put((rows, cols), values)


def _csr_from_members(tensors: list, consts: list) -> CsrTensor:
    return _compressed_from_members(CsrTensor, tensors, consts)


def _csc_from_members(tensors: list, consts: list) -> CscTensor:
    return _compressed_from_members(CscTensor, tensors, consts)


def _csr_grad_input(gy: torch.Tensor, x: torch.Tensor, layout: CsrTensor) -> torch.Tensor:
    crow, col, values = layout.state_tensors()
    g2 = gy.reshape(-1, gy.shape[-1])
    return torch.ops.sten_core.csr_t_mm(crow, col, values, x.shape[-1], g2.t()).t().reshape(x.shape)


def _csr_grad_values(gy: torch.Tensor, x: torch.Tensor, layout: CsrTensor) -> torch.Tensor:
    crow, col, values = layout.state_tensors()
    g2, x2 = gy.reshape(-1, gy.shape[-1]), x.reshape(-1, x.shape[-1])
    return torch.ops.sten_core.csr_sampled(g2.t(), x2.to(g2.dtype), crow, col).to(values.dtype)


def _csc_grad_input(gy: torch.Tensor, x: torch.Tensor, layout: CscTensor) -> torch.Tensor:
    """``gy @ W`` for a CSC ``W`` [N, K]: its members are the CSR ``W.t()`` [K, N], so
    ``(W.t() @ gy.t()).t()`` is one ``sten_core::csr_mm``."""
    ccol, row, values = layout.state_tensors()
    g2 = gy.reshape(-1, gy.shape[-1])
    return torch.ops.sten_core.csr_mm(ccol, row, values, gy.shape[-1], g2.t()).t().reshape(x.shape)


def _csc_grad_values(gy: torch.Tensor, x: torch.Tensor, layout: CscTensor) -> torch.Tensor:
    """The values' gradient: ``(gy.t() @ x).t() = x.t() @ gy`` at the CSR-of-``W.t()`` pattern."""
    ccol, row, values = layout.state_tensors()
    g2, x2 = gy.reshape(-1, gy.shape[-1]), x.reshape(-1, x.shape[-1])
    return torch.ops.sten_core.csr_sampled(x2.t().to(g2.dtype), g2, ccol, row).to(values.dtype)


def register(registry: Any) -> None:
    from sten_core.dispatch.traceable import register_traceable_layout

    register_traceable_layout(CsrTensor, _csr_members, _csr_from_members, _csr_grad_input, _csr_grad_values,
                              values_index=2)
    register_traceable_layout(CscTensor, _csr_members, _csc_from_members, _csc_grad_input, _csc_grad_values,
                              values_index=2)
    from sten_core.dispatch.compiled import TRACED_DENSE

    TRACED_DENSE[CsrTensor] = TRACED_DENSE[CscTensor] = dense_from_members
    T = torch.Tensor
    for inp in ((T, CsrTensor, T), (T, CsrTensor)):
        registry.register_compiled_impl(F.linear, inp, csr_linear_kernel)
    for inp in ((T, CscTensor, T), (T, CscTensor)):
        registry.register_compiled_impl(F.linear, inp, csc_linear_kernel)
    for layout in (CsrTensor, CscTensor):  # x @ W: the transposed product
        for op in (torch.mm, T.mm):
            registry.register_compiled_impl(op, (T, layout), second_operand_mm_kernel)
        for op in (torch.matmul, T.matmul, T.__matmul__):
            registry.register_compiled_impl(op, (T, layout), second_operand_kernel)
