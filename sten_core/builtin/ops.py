"""Operator implementations for the torch-native layouts.

``F.linear`` / ``torch.mm`` / ``torch.matmul`` / ``torch.addmm`` (GPT-2's ``Conv1D``) with a COO, CSR or CSC operand
(forward and backward, the weight gradient dense or at the kept positions
only), and ``torch.add`` of two sparse tensors (union of nonzeros).

Example:
    >>> import torch, torch.nn.functional as F, sten_core as sten
    >>> w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(3)))
    >>> F.linear(torch.ones(2, 3), w).tolist()
    [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch
import torch.nn.functional as F

from sten_core.dispatch.compiled_products import WEIGHT_FIRST_MATMULS, WEIGHT_FIRST_MMS
from sten_core.dispatch.errors import Unsupported
from sten_core.model.helpers import register_weight_product
from sten_core.model.signatures import op_name
from sten_core.model.sparsifiers import KeepAll
from sten_core.model.tensor import SparseTensorWrapper, map_tensors
from sten_core.builtin.torch_layouts import CooTensor, CscTensor, CsrTensor, _Compressed

SPARSE_2D = (CooTensor, CsrTensor, CscTensor)
T = torch.Tensor


def _amp(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Cast float tensors to the autocast dtype when CPU autocast is on (float64 ones stay, as
    autocast leaves them)."""
    if not torch.is_autocast_enabled("cpu"):
        return list(tensors)
    dtype = torch.get_autocast_dtype("cpu")
    return [t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
            for t in tensors]


def _same_dtype(op: str, **operands: Any) -> None:
    """Refuse operands of different dtypes, as dense torch does (after autocast's casts, which
    ``_amp`` made; a weight under autocast counts in autocast's dtype unless float64): the
    weight used to be cast to the input's dtype, rounding a float64 weight to float32 and making
    the result's dtype depend on whether a bias was given."""
    amp = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
    dtypes = {}
    for name, t in operands.items():
        if t is not None:
            dtype = t.dtype
            if amp is not None and isinstance(t, SparseTensorWrapper) and dtype.is_floating_point \
                    and dtype != torch.float64:
                dtype = amp
            dtypes[name] = dtype
    if len(set(dtypes.values())) > 1:
        got = ", ".join(f"{name} {str(dtype).replace('torch.', '')}" for name, dtype in dtypes.items())
        raise RuntimeError(f"{op}: expected all operands to have the same dtype (as dense torch does), got {got}")


def _sparse(w: SparseTensorWrapper, dtype: torch.dtype | None = None) -> torch.Tensor:
    data = w.wrapped_tensor.data
    return data if dtype is None or data.dtype == dtype else data.to(dtype)


def _sparse_times(w: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """sparse [M, K] @ dense [K, N]; CSC goes through CSR (MKL path).

    Half precision on the CPU (no sparse kernel there) computes in float32 and
    returns the input's dtype, as autocast expects.
    """
    if not (dense.is_floating_point() or dense.is_complex()):  # MKL's CSR product: floating point only
        return torch.sparse.mm(w if w.layout is torch.sparse_coo else w.to_sparse_coo(), dense)
    if w.layout is torch.sparse_csc:
        w = w.to_sparse_csr()
    if dense.device.type == "cpu" and dense.dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", enabled=False):
            return torch.sparse.mm(w.to(torch.float32), dense.float()).to(dense.dtype)
    return torch.sparse.mm(w, dense)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a matrix of its last dimension's rows (``reshape(-1, k)`` fails on 0 elements)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _matrices(**operands: Any) -> None:
    """Decline (``Unsupported``: the dense path runs) a call whose sparse operands are not
    matrices: the products here are 2-D sparse times dense (a 1-D or 3-D COO weight raised)."""
    for name, value in operands.items():
        if isinstance(value, SparseTensorWrapper) and value.dim() != 2:
            raise Unsupported(f"{name} is {value.dim()}-D; the built-in sparse products take matrices")


def linear_fwd(ctx: Any, inputs: list, output_sparsifiers: list) -> torch.Tensor:
    x, w, bias = (list(inputs) + [None])[:3]
    _matrices(weight=w)
    x, bias = _amp(x, bias)
    _same_dtype("F.linear", input=x, weight=w, bias=bias)
    x2 = _as_rows(x)
    y = _sparse_times(_sparse(w, x2.dtype), x2.t()).t().contiguous()   # (W xᵀ)ᵀ: rows, as dense's
    if bias is not None:
        y = y + bias
    ctx.save_for_backward(x, w)
    return y.reshape(*x.shape[:-1], w.shape[0])


def sampled_at_csr(pattern: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Values of ``a @ b`` at the positions of the CSR tensor ``pattern`` (``sampled_addmm``).

    Half precision computes in float32 and returns ``a``'s dtype: ``sampled_addmm`` has no
    bfloat16 / float16 kernel on the CPU ("Expected self to be a floating-point or complex
    tensor, but got BFloat16"), so a half CSR weight whose ``grad_fmt`` keeps its layout failed
    in backward.
    """
    if a.dtype in (torch.bfloat16, torch.float16):
        out = torch.sparse.sampled_addmm(pattern.to(torch.float32), a.float(), b.float(), beta=0.0).values()
        return out.to(a.dtype)
    if pattern.dtype != a.dtype:
        pattern = pattern.to(a.dtype)
    return torch.sparse.sampled_addmm(pattern, a, b, beta=0.0).values()


def _sampled(layout: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Values of ``a @ b`` at the stored positions of a 2-D layout."""
    if isinstance(layout, CsrTensor):
        return sampled_at_csr(layout.data, a, b)
    rows, cols = layout.coords() if isinstance(layout, _Compressed) else tuple(layout.data._indices())
    out = torch.empty(rows.numel(), dtype=a.dtype, device=a.device)
    step = max(1, (1 << 22) // max(1, a.shape[1]))
    for start in range(0, rows.numel(), step):
        r, c = rows[start:start + step], cols[start:start + step]
        out[start:start + step] = (a[r] * b[:, c].t()).sum(1)
    return out


def _weight_grad(w: SparseTensorWrapper, g2: torch.Tensor, x2: torch.Tensor, sparse: bool) -> Any:
    if not sparse:
        return g2.t() @ x2
    layout = w.wrapped_tensor
    values = _sampled(layout, g2.t().contiguous(), x2.contiguous())
    return SparseTensorWrapper(layout.with_values(values.to(layout.dtype)))


def linear_bwd(sparse_weight_grad: bool) -> Callable:
    def impl(ctx: Any, grad_outputs: tuple, input_sparsifiers: list) -> tuple:
        x, w = ctx.saved_tensors
        (g,) = grad_outputs
        g2 = _as_rows(g)
        x2 = _as_rows(x).to(g2.dtype)
        needs = ctx.needs_input_grad + (True,) * 3
        grad_x = _sparse_times(_sparse(w, g2.dtype).t(), g2.t()).t().reshape(x.shape) if needs[0] else None
        grad_w = _weight_grad(w, g2, x2, sparse_weight_grad) if needs[1] else None
        bias = ctx.inputs[2] if len(ctx.inputs) > 2 else None
        grad_b = g.sum_to_size(bias.shape) if bias is not None and needs[2] else None  # bias may be [B, N]
        return grad_x, grad_w, grad_b

    return impl


def _as_columns(b: torch.Tensor) -> torch.Tensor:
    """``b`` ([K], [K, N] or [..., K, N]) as one [K, R] matrix (``matmul``'s broadcasting)."""
    if b.dim() == 1:
        return b.unsqueeze(1)
    if b.dim() == 2:
        return b
    return b.movedim(-2, 0).reshape(b.shape[-2], math.prod(b.shape[:-2]) * b.shape[-1])  # (-1: no size at K = 0)


def _from_columns(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_as_columns`` for a result [M, R] (M replaces ``like``'s K)."""
    if like.dim() == 1:
        return y.squeeze(1)
    if like.dim() == 2:
        return y
    return y.reshape(y.shape[0], *like.shape[:-2], like.shape[-1]).movedim(0, -2)


MM_OPS, MATMUL_OPS = WEIGHT_FIRST_MMS, WEIGHT_FIRST_MATMULS  # every spelling of the two products


def _check_mm(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> None:
    """``torch.mm`` takes matrices only (``matmul`` broadcasts)."""
    if ctx.op in MM_OPS and (a.dim() != 2 or b.dim() != 2):
        raise RuntimeError(f"torch.mm: expected 2-D matrices, got {a.dim()}-D and {b.dim()}-D tensors")


def _coo(w: SparseTensorWrapper, dtype: torch.dtype) -> torch.Tensor:
    """A 2-D built-in layout's data as a coalesced torch COO tensor of ``dtype``."""
    data = w.wrapped_tensor.data
    data = data if data.layout is torch.sparse_coo else data.to_sparse_coo()
    return data.to(dtype).coalesce()


def _rows(coo: torch.Tensor) -> torch.Tensor:
    """A COO tensor [..., K] as a 2-D one [prod(...), K] (leading dims flattened)."""
    if coo.dim() == 2:
        return coo
    lead, k = coo.shape[:-1], coo.shape[-1]
    index = coo.indices()
    strides = torch.tensor([math.prod(lead[i + 1:]) for i in range(len(lead))], device=index.device)
    rows = (index[:-1] * strides[:, None]).sum(0)
    return torch.sparse_coo_tensor(torch.stack([rows, index[-1]]), coo.values(), (math.prod(lead), k)).coalesce()


def linear_sparse_sparse_fwd(ctx: Any, inputs: list, output_sparsifiers: list) -> torch.Tensor:
    """``F.linear`` with a sparse input [..., K] and a sparse weight [N, K] (paper A.1):
    one sparse-sparse product, dense [..., N] output."""
    x, w, bias = (list(inputs) + [None])[:3]
    _matrices(weight=w)
    (bias,) = _amp(bias)
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else w.dtype
    y = _sparse_sparse(_rows(_coo(x, dtype)), _coo(w, dtype).t().coalesce()).to_dense()
    if bias is not None:
        y = y + bias
    ctx.save_for_backward(x, w)
    return y.reshape(*x.shape[:-1], w.shape[0])


def _sparse_sparse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """COO @ COO; half precision on the CPU (no kernel there: autocast and ``.half()`` raised)
    in float32, returned in the operands' dtype."""
    if a.device.type == "cpu" and a.dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", enabled=False):
            return torch.sparse.mm(a.float(), b.float()).to(a.dtype)
    return torch.sparse.mm(a, b)


def linear_sparse_sparse_bwd(sparse_weight_grad: bool) -> Callable:
    def impl(ctx: Any, grad_outputs: tuple, input_sparsifiers: list) -> tuple:
        x, w = ctx.saved_tensors
        (g,) = grad_outputs
        g = densify_any(g)
        g2 = _as_rows(g)
        needs = ctx.needs_input_grad + (True,) * 3
        grad_x = _sparse_times(_coo(w, g.dtype).t().coalesce(), g2.t()).t().reshape(x.shape) if needs[0] else None
        grad_w = None
        if needs[1]:
            x_dense = _as_rows(densify_any(x).to(g.dtype))
            grad_w = _weight_grad(w, g2, x_dense, sparse_weight_grad)
        bias = ctx.inputs[2] if len(ctx.inputs) > 2 else None
        grad_b = g.sum_to_size(bias.shape) if bias is not None and needs[2] else None  # bias may be [B, N]
        return grad_x, grad_w, grad_b

    return impl


def densify_any(value: Any) -> torch.Tensor:
    """A wrapper's dense tensor; plain tensors as they are."""
    return value.to_dense() if isinstance(value, SparseTensorWrapper) else value


def mm_sparse_dense_fwd(ctx: Any, inputs: list, output_sparsifiers: list) -> torch.Tensor:
    """sparse [M, K] @ dense [K], [K, N] or [..., K, N]."""
    a, b = inputs[:2]
    _matrices(input=a)
    _check_mm(ctx, a, b)
    (b,) = _amp(b)
    _same_dtype(op_name(ctx.op), input=a, other=b)
    ctx.save_for_backward(a, b)
    return _from_columns(_sparse_times(_sparse(a, b.dtype), _as_columns(b)), b)


def mm_sparse_dense_bwd(ctx: Any, grad_outputs: tuple, input_sparsifiers: list) -> tuple:
    a, b = ctx.saved_tensors
    (g,) = grad_outputs
    g2, b2 = _as_columns(g), _as_columns(b).to(g.dtype)
    grad_a = g2 @ b2.t()
    grad_b = _from_columns(_sparse_times(_sparse(a, g.dtype).t(), g2), b)
    return grad_a, grad_b


def mm_dense_sparse_fwd(ctx: Any, inputs: list, output_sparsifiers: list) -> torch.Tensor:
    """dense [K], [M, K] or [..., M, K] @ sparse [K, N]."""
    a, b = inputs[:2]
    _matrices(other=b)
    _check_mm(ctx, a, b)
    (a,) = _amp(a)
    _same_dtype(op_name(ctx.op), input=a, other=b)
    ctx.save_for_backward(a, b)
    a2 = _as_rows(a)
    y = _sparse_times(_sparse(b, a.dtype).t(), a2.t()).t().contiguous()
    return y.reshape(*a.shape[:-1], b.shape[1])


def mm_dense_sparse_bwd(ctx: Any, grad_outputs: tuple, input_sparsifiers: list) -> tuple:
    a, b = ctx.saved_tensors
    (g,) = grad_outputs
    g2 = _as_rows(g)
    a2 = _as_rows(a).to(g.dtype)
    grad_a = _sparse_times(_sparse(b, g.dtype), g2.t()).t().reshape(a.shape)
    grad_b = a2.t() @ g2
    return grad_a, grad_b


def _scalars(ctx: Any) -> tuple[Any, Any]:
    """``addmm``'s ``(beta, alpha)`` as the call gave them."""
    args, kwargs = ctx.call_args
    return kwargs.get("beta", 1), kwargs.get("alpha", 1)


def addmm_dense_sparse_fwd(ctx: Any, inputs: list, output_sparsifiers: list) -> torch.Tensor:
    """``beta * bias + alpha * (x @ W)`` with a sparse W [in, out] (GPT-2's ``Conv1D``)."""
    bias, x, w = inputs[:3]
    beta, alpha = _scalars(ctx)
    bias, x = _amp(bias, x)
    _same_dtype("torch.addmm", input=bias, mat1=x, mat2=w)
    if x.dim() != 2 or w.dim() != 2:
        raise RuntimeError(f"torch.addmm: expected 2-D matrices, got {x.dim()}-D and {w.dim()}-D tensors")
    ctx.save_for_backward(x, w, bias)
    y = _sparse_times(_sparse(w, x.dtype).t(), x.t()).t().contiguous()
    if alpha != 1:
        y = y * alpha
    if beta == 0:  # torch ignores input then: NaN or inf there must not reach the result
        return y
    return y + (bias if beta == 1 else beta * bias)


def addmm_dense_sparse_bwd(sparse_weight_grad: bool) -> Callable:
    def impl(ctx: Any, grad_outputs: tuple, input_sparsifiers: list) -> tuple:
        x, w, bias = ctx.saved_tensors
        (g,) = grad_outputs
        beta, alpha = _scalars(ctx)
        needs = ctx.needs_input_grad + (True,) * 3
        grad_bias = None
        if needs[0]:
            grad_bias = g * beta
            while grad_bias.dim() > bias.dim():
                grad_bias = grad_bias.sum(0)
            for d, size in enumerate(bias.shape):
                if size == 1 and grad_bias.shape[d] != 1:
                    grad_bias = grad_bias.sum(d, keepdim=True)
        grad_x = _sparse_times(_sparse(w, g.dtype), g.t()).t() * alpha if needs[1] else None
        grad_w = None
        if needs[2]:
            x2 = x.to(g.dtype)
            if sparse_weight_grad:
                layout = w.wrapped_tensor
                values = _sampled(layout, x2.t().contiguous(), g.contiguous()) * alpha
                grad_w = SparseTensorWrapper(layout.with_values(values.to(layout.dtype)))
            else:
                grad_w = x2.t() @ g * alpha
        return grad_bias, grad_x, grad_w

    return impl


def _alpha(ctx: Any) -> Any:
    """``torch.add``'s ``alpha`` as the call gave it (its pattern lists two inputs)."""
    args, kwargs = ctx.call_args
    alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
    return 1 if alpha is None else alpha


def add_union_fwd(ctx: Any, inputs: list, output_sparsifiers: list) -> Any:
    a, b = inputs[:2]
    total = (a.wrapped_tensor.data.to_sparse() + _alpha(ctx) * b.wrapped_tensor.data.to_sparse()).coalesce()
    return SparseTensorWrapper(CooTensor(total))


def add_union_bwd(ctx: Any, grad_outputs: tuple, input_sparsifiers: list) -> tuple:
    (g,) = grad_outputs
    return g, g * _alpha(ctx)


def shapes_on_meta(fwd: Callable) -> Callable:
    """``fwd``, except that a call with an operand on the meta device (a model moved there with
    ``model.to("meta")``) gives the dense operator's meta result: torch's sparse kernels have no
    meta implementation ("Could not run 'aten::addmm.out' ... 'SparseCsrMeta' backend")."""
    @functools.wraps(fwd)
    def run(ctx: Any, inputs: list, output_sparsifiers: list) -> Any:
        if any(isinstance(v, SparseTensorWrapper) and v.wrapped_tensor.data.is_meta for v in inputs):
            args, kwargs = ctx.call_args
            return ctx.op(*map_tensors(_meta_empty, args), **map_tensors(_meta_empty, kwargs))
        return fwd(ctx, inputs, output_sparsifiers)
    return run


def _meta_empty(t: Any) -> Any:
    return torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, SparseTensorWrapper) else t


def register(registry: Any) -> None:
    keep = (KeepAll, T)
    for L in SPARSE_2D:
        register_weight_product(registry, F.linear, L, shapes_on_meta(linear_fwd), linear_bwd(False), linear_bwd(True))
        for op in MM_OPS | MATMUL_OPS:  # the method forms too (``W @ x`` is ``Tensor.matmul``)
            registry.register_fwd_op_impl(op, (L, T), [keep], shapes_on_meta(mm_sparse_dense_fwd))
            registry.register_bwd_op_impl(op, (T,), (keep, keep), (L, T), mm_sparse_dense_bwd)
            registry.register_fwd_op_impl(op, (T, L), [keep], shapes_on_meta(mm_dense_sparse_fwd))
            registry.register_bwd_op_impl(op, (T,), (keep, keep), (T, L), mm_dense_sparse_bwd)
        for X in SPARSE_2D:  # a sparse input times a sparse weight (paper A.1)
            register_weight_product(registry, F.linear, L, shapes_on_meta(linear_sparse_sparse_fwd),
                                    linear_sparse_sparse_bwd(False), linear_sparse_sparse_bwd(True), input_layout=X)
        registry.register_fwd_op_impl(torch.addmm, (T, T, L, ...), [keep], shapes_on_meta(addmm_dense_sparse_fwd))  # beta, alpha
        registry.register_bwd_op_impl(torch.addmm, (T,), (keep, keep, keep), (T, T, L), addmm_dense_sparse_bwd(False))
        registry.register_bwd_op_impl(torch.addmm, (T,), (keep, keep, (KeepAll, L)), (T, T, L),
                                      addmm_dense_sparse_bwd(True))
        for M in SPARSE_2D:
            registry.register_fwd_op_impl(torch.add, (L, M, ...), [(KeepAll, CooTensor)], add_union_fwd)  # alpha
            registry.register_bwd_op_impl(torch.add, (T,), (keep, keep), (L, M), add_union_bwd)
