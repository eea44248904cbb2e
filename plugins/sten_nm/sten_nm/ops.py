"""Operators on ``NMTensor`` operands: ``F.linear``, ``torch.mm``, ``torch.matmul``
(forward and backward) through the C kernels.

Every product is ``y = x @ Weff^T`` with ``Weff`` ``[N, K]``: the ``F.linear``
weight, or the transpose of the second ``mm`` / ``matmul`` operand. The stored
matrix ``A`` is either ``Weff`` (groups along K: the *gather* kernel) or
``Weff^T`` (groups along N: the *scatter* kernel); the input gradient uses the
other kernel and the weight gradient the sampled product (*sddmm*), which
computes only the kept positions.

Example:
    >>> import torch
    >>> from sten_nm import NMTensor, ops
    >>> w = NMTensor.from_dense(torch.ones(3, 8), n=1, m=4)
    >>> ops.nm_linear(torch.ones(2, 8), w).tolist()
    [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from sten_core.plugin_api import linear_inputs, needs_grad, note, observing, register_weight_product

from . import _kernel, tuning
from ._checks import FLOAT_DTYPES
from .nm_tensor import NMTensor


def _layout(w: Any, name: str) -> NMTensor:
    layout = getattr(w, "wrapped_tensor", w)
    if not isinstance(layout, NMTensor):
        raise TypeError(f"{name} must be an NMTensor (or a wrapper of one), got {type(layout).__name__}")
    return layout


def _check_input(x: Any, name: str, k: int, what: str, meta: bool = False) -> torch.Tensor:
    """``x`` checked: a floating-point tensor of last dimension ``k``, on the CPU (on the meta
    device with a ``meta`` weight: shape inference)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"{name} has shape {tuple(x.shape)} but {what} needs its last dimension to be {k}")
    if x.is_meta != meta or not (x.is_meta or x.is_cpu):
        raise ValueError(f"{name} must be on the {'meta device, as the weight is' if meta else 'CPU'}, "
                         f"got device {x.device}")
    return x


def _on_meta(W: Any) -> bool:
    """Whether the layout ``W`` is on the meta device (its products infer shapes, no kernel)."""
    return W.device.type == "meta"


def _meta_rows(x2: torch.Tensor, n_out: int) -> torch.Tensor:
    """A product's float32 ``[B, n_out]`` result for meta ``x2`` ``[B, *]``: its shape, no data."""
    return x2.new_empty((x2.shape[0], n_out), dtype=torch.float32)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as 2-D ``[batch, last]`` (also when ``last`` is 0, where ``reshape(-1, 0)`` fails)."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def _out_dtype(*ts: Optional[torch.Tensor]) -> torch.dtype:
    dtype = None
    for t in ts:
        if t is not None:
            dtype = t.dtype if dtype is None else torch.promote_types(dtype, t.dtype)
    return dtype


# -- the three products on 2-D operands (A is the stored matrix) -------------------
def _bf16_weight(W: NMTensor, a_is_w: bool, round_to: Optional[torch.dtype] = None) -> bool:
    """Whether the product reads the stored values as bf16 in the kernel (``gather`` with bf16
    values, or values rounded to bf16 by CPU autocast): no float32 copy of the weight."""
    return a_is_w and (round_to if round_to is not None else W._values.dtype) == torch.bfloat16


def _x_at(W: NMTensor, x2: torch.Tensor, bias: Optional[torch.Tensor], a_is_w: bool,
          round_to: Optional[torch.dtype] = None, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``x2 @ Weff^T (+ bias)`` in float32 (bf16 values widened in the kernel, fp32 accumulation;
    bf16 ``x2`` widened while the kernel packs it, no float32 copy); with bf16 ``x2`` and
    ``out_dtype`` bf16 the result is bf16, rounded by the kernel's threads while in cache."""
    out16 = out_dtype == torch.bfloat16 and x2.dtype == torch.bfloat16
    if _bf16_weight(W, a_is_w, round_to):
        from ._fp32 import kernel_values

        R, C = W._rc()
        v = kernel_values(W, W._values, round_to)
        if x2.dtype == torch.bfloat16:
            from ._bf16x import gather_bf16x

            return gather_bf16x(_kernel.mat(v, W.indices, R, C, W.n, W.m), x2, bias, out_bf16=out16)
        return _kernel.gather_bf16w(_kernel.mat(v, W.indices, R, C, W.n, W.m), x2, bias)
    if (round_to if round_to is not None else W._values.dtype) == torch.bfloat16:   # transposed product
        from ._bf16x import tgather_bf16w
        from ._fp32 import kernel_values

        R, C = W._rc()
        v = kernel_values(W, W._values, round_to)
        return tgather_bf16w(_kernel.mat(v, W.indices, R, C, W.n, W.m), x2, bias)
    A = W.fp32(round_to)
    mat = A.mat()
    if a_is_w and x2.dtype == torch.bfloat16:
        from ._bf16x import gather_bf16x

        return gather_bf16x(mat, x2, bias, out_bf16=out16)
    return _kernel.gather(mat, x2, bias) if a_is_w else _kernel.tgather(mat, x2, bias)


def _bf16_mat(W: NMTensor) -> Optional[Any]:
    """A descriptor of W's own bf16 values (no float32 copy), or None for other dtypes."""
    if W._values.dtype != torch.bfloat16:
        return None
    from ._fp32 import kernel_values

    R, C = W._rc()
    return _kernel.mat(kernel_values(W, W._values), W.indices, R, C, W.n, W.m)


def _gy_w(W: NMTensor, gy2: torch.Tensor, a_is_w: bool) -> torch.Tensor:
    """``gy2 @ Weff`` in float32 (gradient wrt the input; bf16 values widened in the kernel call,
    bf16 ``gy2`` widened while the kernel packs it: no float32 copy of either)."""
    from ._bf16x import gather_bf16x, tgather_mixed

    m16 = _bf16_mat(W)
    mat = m16 if m16 is not None else W.fp32().mat()
    if a_is_w:
        return tgather_mixed(mat, gy2)
    if gy2.dtype == torch.bfloat16:
        return gather_bf16x(mat, gy2)
    return _kernel.gather_bf16w(mat, gy2) if m16 is not None else _kernel.gather(mat, gy2)


def _grad_values(W: NMTensor, x2: torch.Tensor, gy2: torch.Tensor, a_is_w: bool) -> torch.Tensor:
    """Gradient of the stored values (``gy2^T x2`` at the kept positions only; reads no values;
    bf16 ``gy2`` / ``x2`` widened while the kernel packs them)."""
    from ._bf16x import sddmm_mixed

    mat = _bf16_mat(W)
    mat = mat if mat is not None else W.fp32().mat()
    return sddmm_mixed(mat, gy2, x2) if a_is_w else sddmm_mixed(mat, x2, gy2)


def _grad_values_dense(W: NMTensor, x2: torch.Tensor, gy2: torch.Tensor, a_is_w: bool) -> torch.Tensor:
    """The same values as :func:`_grad_values` from the full product (a dense GEMM, then the
    stored positions' entries, in C): the faster of the two at 2:4 where dense GEMM is strong
    (3072x768, 2 threads, Xeon SPR: 20 ms against the kernel's 31)."""
    Y, X = (gy2, x2) if a_is_w else (x2, gy2)
    with torch.autocast("cpu", enabled=False):
        full = Y.float().t() @ X.float()
    return _kernel.values_at(W.mat(), full)


def _dtype_key(values: torch.dtype, **operands: torch.Tensor) -> str:
    """A tuning key's dtype part: the stored values' dtype, then each operand that is not
    float32. The candidates read operands as they are or widen them first, and some are
    offered for float32 operands only, so each combination has an entry of its own.

    >>> _dtype_key(torch.float32, gy=torch.ones(1, dtype=torch.bfloat16), x=torch.ones(1))
    'float32 gy=bfloat16'
    """
    def name(dtype: torch.dtype) -> str:
        return str(dtype).removeprefix("torch.")

    return name(values) + "".join(f" {k}={name(t.dtype)}" for k, t in operands.items() if t.dtype != torch.float32)


def _autocast_dtype(*ts: Optional[torch.Tensor]) -> Optional[torch.dtype]:
    """CPU autocast's dtype when it is on and would cast these operands (``linear``, ``mm``
    and ``matmul`` are on its lower-precision list; float64 operands are never cast)."""
    if not torch.is_autocast_enabled("cpu"):
        return None
    if any(t is not None and t.dtype == torch.float64 for t in ts):
        return None
    return torch.get_autocast_dtype("cpu")


def _cast(t: Optional[torch.Tensor], dtype: Optional[torch.dtype]) -> Optional[torch.Tensor]:
    return t if t is None or dtype is None or t.dtype == dtype else t.to(dtype)


def _apply(x: torch.Tensor, W: NMTensor, bias: Optional[torch.Tensor], a_is_w: bool, n_out: int) -> torch.Tensor:
    amp = _autocast_dtype(x, W._values, bias)
    dtype = _out_dtype(x, W._values, bias)
    if amp is not None:  # as dense under autocast: operands rounded to amp, result in amp
        x, bias, dtype = _cast(x, amp), _cast(bias, amp), amp
    x2 = _rows(x)
    if _on_meta(W):
        y2 = _meta_rows(x2, n_out)
    elif dtype == torch.float64:  # keep double precision: dense reference path
        y2 = x2.double() @ (W.to_dense().double().t() if a_is_w == (W.dim == 1) else W.to_dense().double())
        y2 = y2 if bias is None else y2 + bias.double()
    else:
        bf16 = _bf16_weight(W, a_is_w, amp)

        def dense() -> torch.Tensor:   # decompress into a scratch buffer + dense GEMM
            D = _cast(W.to_dense(), amp).float() if bf16 else W.fp32(amp).to_dense()
            with torch.autocast("cpu", enabled=False):
                y = x2.float() @ (D.t() if a_is_w == (W.dim == 1) else D)
                return y if bias is None else y + bias.float()

        # keyed by the weight's dtype as the kernel reads it and by x's (bf16 x has its own
        # entry: the kernel reads it as bf16, dense widens it first)
        y2 = _tuned("fwd", W, x2.shape[0], a_is_w, lambda: _x_at(W, x2, bias, a_is_w, amp, dtype), dense,
                    _dtype_key(torch.bfloat16 if bf16 else torch.float32, x=x2),
                    _scatter_candidate(W, x2, not a_is_w, bias) if amp is None else None)
    return _result(y2, dtype).reshape(*x.shape[:-1], n_out)


def _result(y2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float32 kernel result in ``dtype``: bf16 rounded on the kernels' threads (the same
    bits as ``.to``, faster there), anything else by ``.to``."""
    if (dtype == torch.bfloat16 and y2.dtype == torch.float32 and y2.is_cpu and y2.is_contiguous()
            and _kernel.available()[0]):
        return _kernel.to_bf16(y2)
    return y2.to(dtype)


def _scatter_candidate(W: NMTensor, y2: torch.Tensor, transposed: bool,
                       bias: Optional[torch.Tensor] = None) -> dict[str, Callable[[], torch.Tensor]]:
    """For a product ``X = Y A`` (``transposed``) on float32 values and ``y2``: the kernel that
    adds into X's columns (``scatter``) as a candidate beside the one that builds A's
    transpose per call (the default kernel, ``tgather``). Which wins depends on the machine
    (Xeon SPR, 2 threads, gy @ W for 3072x768 at B = 1024: 2:4 48 against 65 ms, 1:10 13
    against 24; the transpose alone took 29 ms at 2:4); elsewhere none."""
    if not transposed or W._values.dtype != torch.float32 or y2.dtype != torch.float32:
        return {}
    return {"scatter": lambda: _kernel.scatter(W.mat(), y2, bias)}


def _tuned(op: str, W: Any, B: int, a_is_w: bool, kernel: Callable[[], torch.Tensor],
           dense: Callable[[], torch.Tensor], dtype: str = "float32",
           more: Optional[dict[str, Callable[[], torch.Tensor]]] = None) -> torch.Tensor:
    """Run the faster of the sparse kernel and its dense-GEMM route (decompress + GEMM, or GEMM +
    the stored positions' entries) for this (op, shape, pattern, batch bucket, threads, ISA):
    timed once, cached on disk (:mod:`sten_nm.tuning`). ``W``: an :class:`NMTensor` (keyed
    by its stored orientation), or a grouped or paper-format layout (by its shape);
    ``more``: other kernels to time."""
    R, C = W._rc() if isinstance(W, NMTensor) else W.shape
    k = tuning.key(op, R, C, W.n, W.m, a_is_w, B, dtype, torch.get_num_threads(), _kernel.isa())
    candidates = {tuning.KERNEL: kernel, tuning.DENSE: dense, **(more or {})}
    return candidates[tuning.pick(k, candidates, empty=B == 0)]()


def nm_linear(x: torch.Tensor, weight: Any, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for an n:m ``weight`` ``[out, in]``; x of any batch shape.

    >>> w = NMTensor.from_dense(torch.eye(4), n=1, m=2)
    >>> nm_linear(torch.arange(4.).reshape(1, 4), w).tolist()
    [[0.0, 1.0, 2.0, 3.0]]
    """
    W = _layout(weight, "weight")
    N, K = W.shape
    _check_input(x, "input", K, f"F.linear with a weight of shape {(N, K)}", _on_meta(W))
    if bias is not None:
        _check_input(bias, "bias", N, f"F.linear with a weight of shape {(N, K)}", _on_meta(W))
        if bias.dim() != 1:
            raise ValueError(f"bias must be 1-D of size {N}, got shape {tuple(bias.shape)}")
    return _apply(x, W, bias, W.dim == 1, N)


def nm_matmul(x: torch.Tensor, other: Any) -> torch.Tensor:
    """``x @ other`` for an n:m ``other`` ``[K, N]``; x ``[..., K]``.

    >>> s = NMTensor.from_dense(torch.eye(4), n=1, m=2, dim=0)
    >>> nm_matmul(torch.ones(1, 4), s).tolist()
    [[1.0, 1.0, 1.0, 1.0]]
    """
    S = _layout(other, "other")
    K, N = S.shape
    _check_input(x, "input", K, f"a product with an n:m operand of shape {(K, N)}", _on_meta(S))
    return _apply(x, S, None, S.dim == 0, N)


# -- STen implementations --------------------------------------------------------
def linear_fwd(ctx: Any, inputs: list, output_sparsifiers: list) -> torch.Tensor:
    x, w, bias = linear_inputs(inputs)
    ctx.save_for_backward(x, w, bias)
    return nm_linear(x, w, bias)


def _mm_fwd(ctx: Any, inputs: list, output_sparsifiers: list, name: str) -> torch.Tensor:
    x, s = inputs[0], inputs[1]
    if name == "mm" and x.dim() != 2:
        raise ValueError(f"torch.mm: input must be 2-D, got shape {tuple(x.shape)}")
    ctx.save_for_backward(x, s, None)
    return nm_matmul(x, s)


def mm_fwd(ctx: Any, inputs: list, output_sparsifiers: list) -> torch.Tensor:
    return _mm_fwd(ctx, inputs, output_sparsifiers, "mm")


def matmul_fwd(ctx: Any, inputs: list, output_sparsifiers: list) -> torch.Tensor:
    return _mm_fwd(ctx, inputs, output_sparsifiers, "matmul")


def _backward(ctx: Any, grad_outputs: tuple, sparse_grad: bool, linear: bool, saved: Optional[tuple] = None) -> tuple:
    x, w, bias = saved if saved is not None else ctx.saved_tensors
    W = _layout(w, "weight")
    a_is_w = (W.dim == 1) if linear else (W.dim == 0)
    gy = grad_outputs[0]
    gy2 = _rows(gy)
    x2 = _rows(x)
    reference = _out_dtype(x, W._values) == torch.float64 or _on_meta(W)   # torch ops: float64, or meta shapes
    gx = gw = gb = None
    if needs_grad(ctx, 0):
        if reference:
            dense = W.to_dense().double()
            g = gy2.double() @ (dense if linear else dense.t())
        else:
            def dense() -> torch.Tensor:
                D = W.fp32().to_dense()
                with torch.autocast("cpu", enabled=False):   # float32, as the kernels
                    return gy2.float() @ (D if linear else D.t())

            g = _tuned("bwd_x", W, gy2.shape[0], a_is_w, lambda: _gy_w(W, gy2, a_is_w), dense,
                       _dtype_key(W._values.dtype, gy=gy2), _scatter_candidate(W, gy2, a_is_w))
        gx = g.to(x.dtype).reshape(x.shape)
    if needs_grad(ctx, 1):
        if sparse_grad:
            if reference:
                full = gy2.double().t() @ x2.double() if linear else x2.double().t() @ gy2.double()
                vals = W.gather(full)
            else:
                vals = _tuned("bwd_w", W, gy2.shape[0], a_is_w, lambda: _grad_values(W, x2, gy2, a_is_w),
                              lambda: _grad_values_dense(W, x2, gy2, a_is_w), _dtype_key(W._values.dtype, gy=gy2, x=x2))
            from sten_core.plugin_api import SparseTensorWrapper

            gw = SparseTensorWrapper(W.with_values(vals.to(W.dtype)))
        else:
            full = gy2.t() @ x2.to(gy2.dtype) if linear else x2.to(gy2.dtype).t() @ gy2
            gw = full.to(W.dtype)
    if linear and bias is not None and needs_grad(ctx, 2):
        gb = gy2.sum(0).to(bias.dtype)
    return (gx, gw, gb) if linear else (gx, gw)


def linear_bwd_dense(ctx: Any, grad_outputs: tuple, input_sparsifiers: list) -> tuple:
    return _backward(ctx, grad_outputs, sparse_grad=False, linear=True)


def linear_bwd_sparse(ctx: Any, grad_outputs: tuple, input_sparsifiers: list) -> tuple:
    return _backward(ctx, grad_outputs, sparse_grad=True, linear=True)


def mm_bwd_dense(ctx: Any, grad_outputs: tuple, input_sparsifiers: list) -> tuple:
    return _backward(ctx, grad_outputs, sparse_grad=False, linear=False)


def mm_bwd_sparse(ctx: Any, grad_outputs: tuple, input_sparsifiers: list) -> tuple:
    return _backward(ctx, grad_outputs, sparse_grad=True, linear=False)


def register(registry: Any) -> None:
    """Register the forward and backward implementations (called by the plugin)."""
    register_weight_product(registry, F.linear, NMTensor, linear_fwd, linear_bwd_dense, linear_bwd_sparse)
    # the method and operator spellings too (x.mm(W), x.matmul(W), x @ W): registered for
    # torch.mm / torch.matmul only, they went to another plugin's layout through a conversion
    # every call (scipy's CSR, which ignores autocast), or to the dense fallback
    for op in (torch.mm, torch.Tensor.mm):
        register_weight_product(registry, op, NMTensor, mm_fwd, mm_bwd_dense, mm_bwd_sparse)
    for op in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__):
        register_weight_product(registry, op, NMTensor, matmul_fwd, mm_bwd_dense, mm_bwd_sparse)
    # with the n:m operand first (W @ x) they run as F.linear(x^T, W)^T: the core's rule for any
    # layout with an F.linear (sten_core.builtin.weight_first)


# -- grouped n:m (F.linear only) ---------------------------------------------------
def grouped_linear(x: torch.Tensor, weight: Any, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a :class:`GroupedNMTensor` weight.

    >>> from sten_nm import GroupedNMTensor
    >>> w = GroupedNMTensor.from_dense(torch.eye(4), n=1, m=2)
    >>> grouped_linear(torch.arange(4.).reshape(1, 4), w).tolist()
    [[0.0, 1.0, 2.0, 3.0]]
    """
    from .grouped_tensor import GroupedNMTensor

    W = getattr(weight, "wrapped_tensor", weight)
    if not isinstance(W, GroupedNMTensor):
        raise TypeError(f"weight must be a GroupedNMTensor, got {type(W).__name__}")
    N, K = W.shape
    _check_input(x, "input", K, f"F.linear with a weight of shape {(N, K)}", _on_meta(W))
    if bias is not None:
        _check_input(bias, "bias", N, f"F.linear with a weight of shape {(N, K)}", _on_meta(W))
        if bias.dim() != 1:   # the kernel adds bias[:N] to every row
            raise ValueError(f"bias must be 1-D of size {N}, got shape {tuple(bias.shape)}")
    amp = _autocast_dtype(x, W._vals, bias)
    dtype = _out_dtype(x, W._vals, bias)
    if amp is not None:  # as dense under autocast: operands rounded to amp, result in amp
        x, bias, dtype = _cast(x, amp), _cast(bias, amp), amp
    x2 = _rows(x)
    if _on_meta(W):
        y2 = _meta_rows(x2, N)
    elif dtype == torch.float64:
        y2 = F.linear(x2.double(), W.to_dense().double(), None if bias is None else bias.double())
    else:
        bf16 = (amp if amp is not None else W._vals.dtype) == torch.bfloat16
        if observing():
            note(f"sten_nm: nm_grouped_gather ({_kernel.isa()}, {'bf16' if bf16 else 'fp32'} values, not tuned)")
        if bf16:   # bf16 values read in the kernel (no float32 copy of the weight)
            from ._fp32 import kernel_values

            desc = _kernel.grouped(kernel_values(W, W._vals, amp), W.indices, W.perm, N, K, W.n, W.m)
        else:
            desc = W.desc(amp)
        if x2.dtype == torch.bfloat16:   # bf16 x widened while the kernel packs it (no float32 copy)
            from ._bf16x import grouped_gather_bf16x

            y2 = grouped_gather_bf16x(desc, x2, bias, out_bf16=dtype == torch.bfloat16)
        elif bf16:
            y2 = _kernel.grouped_gather_bf16w(desc, x2, bias)
        else:
            y2 = _kernel.grouped_gather(desc, x2, bias)
    return _result(y2, dtype).reshape(*x.shape[:-1], N)


def grouped_linear_fwd(ctx: Any, inputs: list, output_sparsifiers: list) -> torch.Tensor:
    x, w, bias = linear_inputs(inputs)
    ctx.save_for_backward(x, w, bias)
    return grouped_linear(x, w, bias)


def _grouped_bf16_desc(G: Any) -> Any:
    """C descriptor of G's own bf16 values (no float32 copy)."""
    from ._fp32 import kernel_values

    N, K = G.shape
    return _kernel.grouped(kernel_values(G, G._vals), G.indices, G.perm, N, K, G.n, G.m)


def _grouped_backward(ctx: Any, grad_outputs: tuple, sparse_grad: bool) -> tuple:
    """Input gradient and weight gradient at the kept positions by the grouped kernels
    (the latter in the layout's own order); a dense weight gradient is the full product."""
    from sten_core.plugin_api import SparseTensorWrapper

    x, w, bias = ctx.saved_tensors
    G = w.wrapped_tensor
    N, K = G.shape
    if _out_dtype(x, G._vals) == torch.float64 or _on_meta(G):  # float64, or meta shapes: dense reference path
        gx, gw, gb = _backward(ctx, grad_outputs, sparse_grad=sparse_grad, linear=True, saved=(x, G.to_nm(), bias))
        if sparse_grad and gw is not None:
            gw = SparseTensorWrapper(G.with_values(G.from_row_values(gw.wrapped_tensor.values())))
        return gx, gw, gb
    gy2 = _rows(grad_outputs[0])
    x2 = _rows(x)
    gx = gw = gb = None
    # the grouped kernels or the dense-GEMM routes (float32, as the kernels), each gradient
    # timed once per shape and cached (the kernels lose at 2:4: 3072x768, 2 threads, Xeon SPR:
    # 24 ms against 20 for the input's, 34 against 22 for the values')
    @functools.cache   # built once, only when a kernel runs
    def desc() -> Any:
        return _grouped_bf16_desc(G) if G._vals.dtype == torch.bfloat16 else G.desc()

    def dense_x() -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return gy2.float() @ G.to_dense().float()

    def dense_w() -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return G.gather(gy2.float().t() @ x2.float())

    if needs_grad(ctx, 0):
        # bf16 values widened in the kernel call, bf16 gy2 while the kernel regroups it
        from ._bf16x import grouped_tgather_mixed

        gx2 = _tuned("grouped_bwd_x", G, gy2.shape[0], True, lambda: grouped_tgather_mixed(desc(), gy2), dense_x,
                     _dtype_key(G._vals.dtype, gy=gy2))
        gx = gx2.to(x.dtype).reshape(x.shape)
    if needs_grad(ctx, 1):
        if sparse_grad:   # reads no values: the bf16 descriptor as is
            from ._bf16x import grouped_sddmm_mixed

            vals = _tuned("grouped_bwd_w", G, gy2.shape[0], True, lambda: grouped_sddmm_mixed(desc(), gy2, x2),
                          dense_w, _dtype_key(G._vals.dtype, gy=gy2, x=x2))
            gw = SparseTensorWrapper(G.with_values(vals.to(G.dtype)))
        else:
            gw = (gy2.t() @ x2.to(gy2.dtype)).to(G.dtype)
    if bias is not None and needs_grad(ctx, 2):
        gb = gy2.sum(0).to(bias.dtype)
    return gx, gw, gb


def grouped_linear_bwd_dense(ctx: Any, grad_outputs: tuple, input_sparsifiers: list) -> tuple:
    return _grouped_backward(ctx, grad_outputs, sparse_grad=False)


def grouped_linear_bwd_sparse(ctx: Any, grad_outputs: tuple, input_sparsifiers: list) -> tuple:
    return _grouped_backward(ctx, grad_outputs, sparse_grad=True)


def register_grouped(registry: Any) -> None:
    """Register ``F.linear`` with a :class:`GroupedNMTensor` weight (forward and backward)."""
    from .grouped_tensor import GroupedNMTensor

    register_weight_product(registry, F.linear, GroupedNMTensor, grouped_linear_fwd, grouped_linear_bwd_dense,
                     grouped_linear_bwd_sparse)