"""``F.linear`` with a :class:`ColumnGroupedNMTensor` weight, forward and backward.

The forward runs the C kernel (``nm_colgrouped_gather_f32``: per row block and pattern,
each owned column's batch vector of ``x`` from a packed panel feeds ``n`` FMAs; of its two
loop orders the tuner picks the faster per shape) where the
extension is available and the compute dtype is float32. The backward runs the layout's own
C kernels (``nm_colgrouped_grad_input_f32``, ``nm_colgrouped_grad_values_f32``; float32 or
bf16 stored values, float32 accumulation) or decompress + dense GEMMs, whichever tuning
found faster here; without the extension or in float64 (gradcheck) it decompresses the
weight and runs dense GEMMs. The torch reference (the forward for other dtypes and without the extension;
``input_grad`` / ``values_grad``, which the tests hold to dense): one dense product per (row block,
pattern) - the columns a pattern owns gathered from ``x`` times that pattern's ``[n, L]``
values - batched with ``torch.bmm`` over slabs of row blocks (the gathered ``x`` of a slab
stays within ``SLAB_FLOATS``).

* forward ``y = x Wᵀ``: ``y[:, q*m + pattern[p]] += x[:, columns[q, p]] @ values[q, p]ᵀ``;
* input gradient ``gx = gy W``: ``gx[:, columns[q, p]] += gy[:, q*m + pattern[p]] @ values[q, p]``;
* weight gradient at the kept positions: ``gy[:, q*m + pattern[p]]ᵀ @ x[:, columns[q, p]]``.

Half-precision operands are computed in float32 (results in the operands' dtype); under
CPU autocast the operands are rounded to its dtype first, as for dense.

Example:
    >>> import torch
    >>> from sten_nm import ColumnGroupedNMTensor
    >>> from sten_nm.column_grouped_ops import column_grouped_linear
    >>> w = ColumnGroupedNMTensor.from_dense(torch.eye(4), n=1, m=2)
    >>> column_grouped_linear(torch.arange(4.).reshape(1, 4), w).tolist()
    [[0.0, 1.0, 2.0, 3.0]]
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.nn.functional as F

from . import _bf16x, _kernel, tuning
from ._cg_tiles import with_tiles
from .column_grouped import ColumnGroupedNMTensor, patterns
from sten_core.plugin_api import linear_inputs, needs_grad, note, observing, register_weight_product

from .ops import _autocast_dtype, _cast, _check_input, _dtype_key, _meta_rows, _on_meta, _out_dtype, _rows, _tuned

SLAB_FLOATS = 1 << 24


def _layout(w: Any) -> ColumnGroupedNMTensor:
    W = getattr(w, "wrapped_tensor", w)
    if not isinstance(W, ColumnGroupedNMTensor):
        raise TypeError(f"weight must be a ColumnGroupedNMTensor, got {type(W).__name__}")
    return W


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _slab(B: int, P: int, L: int, Nb: int) -> int:
    """Row blocks per slab: the slab's gathered x (B x blocks x P x L) within SLAB_FLOATS."""
    return max(1, min(Nb, SLAB_FLOATS // max(1, B * P * L)))


def _columns_major(W: ColumnGroupedNMTensor, x2: torch.Tensor) -> torch.Tensor:
    """``x2ᵀ`` ``[Kp, B]``, zero rows for the padding columns: gathering a pattern's
    columns is then a copy of whole rows."""
    Kp = W.num_patterns * W._values.shape[3]
    xt = x2.new_zeros((Kp, x2.shape[0]))
    xt[: x2.shape[1]] = x2.t()
    return xt


def _row_blocks_major(W: ColumnGroupedNMTensor, gy2: torch.Tensor) -> torch.Tensor:
    """``gy2ᵀ`` as ``[Nb, m, B]`` (zero padding rows)."""
    Nb = W._values.shape[0]
    gyt = gy2.new_zeros((Nb * W.m, gy2.shape[0]))
    gyt[: gy2.shape[1]] = gy2.t()
    return gyt.reshape(Nb, W.m, gy2.shape[0])


def forward(W: ColumnGroupedNMTensor, x2: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``x2 @ Wᵀ`` (``[B, N]``) with ``values`` in the compute dtype."""
    N, _ = W.shape
    Nb, P, n, L = values.shape
    B = x2.shape[0]
    yt = x2.new_zeros((Nb, W.m, B))
    if B and Nb and L:
        xt, cols, rows = _columns_major(W, x2), W.columns.long(), patterns(n, W.m).reshape(-1)
        step = _slab(B, P, L, Nb)
        for q0 in range(0, Nb, step):
            q1 = min(Nb, q0 + step)
            xg = xt.index_select(0, cols[q0:q1].reshape(-1)).reshape((q1 - q0) * P, L, B)
            yp = torch.bmm(values[q0:q1].reshape((q1 - q0) * P, n, L), xg)        # [q*P, n, B]
            yt[q0:q1].index_add_(1, rows, yp.reshape(q1 - q0, P * n, B))
    return yt.reshape(Nb * W.m, B)[:N].t()


def input_grad(W: ColumnGroupedNMTensor, gy2: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``gy2 @ W`` (``[B, K]``)."""
    N, K = W.shape
    Nb, P, n, L = values.shape
    B = gy2.shape[0]
    gxt = gy2.new_zeros((P * L, B))
    if B and Nb and L:
        gyb = _row_blocks_major(W, gy2)[:, patterns(n, W.m).reshape(-1)]         # [Nb, P*n, B]
        cols = W.columns.long()
        step = _slab(B, P, L, Nb)
        for q0 in range(0, Nb, step):
            q1 = min(Nb, q0 + step)
            v = values[q0:q1].reshape((q1 - q0) * P, n, L)
            part = torch.bmm(v.transpose(1, 2), gyb[q0:q1].reshape((q1 - q0) * P, n, B))   # [q*P, L, B]
            gxt.index_add_(0, cols[q0:q1].reshape(-1), part.reshape(-1, B))
    return gxt[:K].t()


def values_grad(W: ColumnGroupedNMTensor, gy2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """Gradient of the stored values: ``[Nb, P, n, L]``."""
    Nb, P, n, L = W._values.shape
    B = gy2.shape[0]
    out = x2.new_zeros((Nb, P, n, L))
    if B and Nb and L:
        gyb = _row_blocks_major(W, gy2)[:, patterns(n, W.m).reshape(-1)]         # [Nb, P*n, B]
        xt, cols = _columns_major(W, x2), W.columns.long()
        step = _slab(B, P, L, Nb)
        for q0 in range(0, Nb, step):
            q1 = min(Nb, q0 + step)
            xg = xt.index_select(0, cols[q0:q1].reshape(-1)).reshape((q1 - q0) * P, L, B)
            g = gyb[q0:q1].reshape((q1 - q0) * P, n, B)
            out[q0:q1] = torch.bmm(g, xg.transpose(1, 2)).reshape(q1 - q0, P, n, L)
    return out


def column_grouped_linear(x: torch.Tensor, weight: Any, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a :class:`ColumnGroupedNMTensor` weight ``[N, K]``."""
    W = _layout(weight)
    N, K = W.shape
    _check_input(x, "input", K, f"F.linear with a weight of shape {(N, K)}", _on_meta(W))
    if bias is not None:
        _check_input(bias, "bias", N, f"F.linear with a weight of shape {(N, K)}", _on_meta(W))
        if bias.dim() != 1:
            raise ValueError(f"bias must be 1-D of size {N}, got shape {tuple(bias.shape)}")
    amp = _autocast_dtype(x, W._values, bias)
    x, bias = _cast(x, amp), _cast(bias, amp)
    dtype = amp if amp is not None else _out_dtype(x, W._values, bias)
    c = _compute_dtype(dtype)
    if _on_meta(W):   # shape inference
        y2 = _meta_rows(_rows(x), N)
    elif c == torch.float32 and _kernel.available()[0]:   # the C kernel (float32 accumulation)
        x2 = _rows(x)
        # a bf16 result rounded by the kernel as it writes each block (no float32 pass)
        y2 = _tuned_forward(W, W.desc(amp), x2, bias, out_bf16=dtype == torch.bfloat16 and x2.dtype == dtype)
    else:
        if observing():
            note(f"sten_nm: per-pattern torch products in {c} (no C kernel for this dtype)")
        values = _cast(W._values, amp)
        with torch.autocast("cpu", enabled=False):   # operands already cast; compute in c
            y2 = forward(W, _rows(x).to(c), values.to(c))
            if bias is not None:
                y2 = y2 + bias.to(c)
    return y2.to(dtype).reshape(*x.shape[:-1], N)


def _tuned_forward(W: ColumnGroupedNMTensor, desc: Any, x2: torch.Tensor,
                   bias: Optional[torch.Tensor], out_bf16: bool = False) -> torch.Tensor:
    """The C forward in the faster of its loop orders (``"stream"``: all slots per pass over
    few row blocks; ``"tiled"``: an L1 tile of x swept by many row blocks), timed once per
    (shape, pattern, batch bucket, dtype, threads, ISA) and cached (:mod:`sten_nm.tuning`);
    ``STEN_NM_TUNE=0``: ``STEN_NM_CG_VARIANT`` or stream. bf16 x: widened while the kernel
    packs it, or (bf16 values, the stream order, :func:`sten_nm._bf16x.bf16_dot` on) read
    by ``vdpbf16ps``: 3072x768 1:10 ran 0.93x the float32 forward there, the tiled order
    with x widened 1.0x."""
    B, (N, K) = x2.shape[0], W.shape
    dt = "bfloat16" if desc.vtype == _kernel.VTYPES[torch.bfloat16] else "float32"
    gather = _kernel.colgrouped_gather
    if x2.dtype == torch.bfloat16:   # x widened in the kernel's pack, or read by vdpbf16ps
        dt = f"{dt} x=bfloat16" + (" out=bfloat16" if out_bf16 else "")
        gather = functools.partial(_bf16x.colgrouped_gather_bf16x, out_bf16=out_bf16)
    k = tuning.key("cg_fwd", N, K, W.n, W.m, True, B, dt, torch.get_num_threads(), _kernel.isa())
    # each order on the weight's tile-major packed copy for its slot tile (sten_nm._cg_tiles)
    run = {v: (lambda v=v: gather(with_tiles(desc, B, v), x2, bias, variant=v)) for v in ("stream", "tiled")}
    choice = tuning.pick(k, run, empty=B == 0, default=None, reps=5)
    return gather(with_tiles(desc, B), x2, bias) if choice is None else run[choice]()


def linear_fwd(ctx: Any, inputs: list, output_sparsifiers: list) -> torch.Tensor:
    x, w, bias = linear_inputs(inputs)
    ctx.save_for_backward(x, w, bias)
    return column_grouped_linear(x, w, bias)


def _backward(ctx: Any, grad_outputs: tuple, sparse_grad: bool) -> tuple:
    from sten_core.plugin_api import SparseTensorWrapper

    x, w, bias = ctx.saved_tensors
    W = _layout(w)
    c = _compute_dtype(_out_dtype(x, W._values))
    gy_in, x_in = _rows(grad_outputs[0]), _rows(x)
    gx = gw = gb = None
    need_x, need_w = needs_grad(ctx, 0), needs_grad(ctx, 1)

    # the layout's own C kernels (csrc/nm_colgrouped_bwd.h): per (row block, pattern),
    # gx[:, owned columns] += gy[:, pattern rows] @ values, and the values' gradient
    # gy[:, pattern rows]ᵀ x[:, owned columns] at the kept positions only; bf16 gy / x read
    # by the kernels (widened while packing), no float32 copies
    @functools.cache   # built once, only when a kernel runs
    def desc() -> Any:
        return W.desc()

    def kernel_x() -> torch.Tensor:
        if gy_in.dtype == torch.bfloat16:
            return _bf16x.colgrouped_grad_input_mixed(desc(), gy_in)
        return _kernel.colgrouped_grad_input(desc(), gy_in)

    def kernel_w() -> torch.Tensor:
        if torch.bfloat16 in (gy_in.dtype, x_in.dtype):
            return _bf16x.colgrouped_grad_values_mixed(desc(), gy_in, x_in)
        return _kernel.colgrouped_grad_values(desc(), gy_in, x_in)

    # decompress + dense GEMM, and dense GEMM + the stored positions' entries (the reference
    # the tests hold the kernels to)
    def dense_x() -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return gy_in.to(c) @ W.to_dense().to(c)

    def dense_w() -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return W.gather(gy_in.to(c).t() @ x_in.to(c))

    # the pattern is exact n:m of Wᵀ along N (NMTensor(dim=0), lossless): exact n:m's forward
    # kernel gives gx = gy W, its SDDMM the values' gradient (float32 operands only)
    def exact_x() -> torch.Tensor:
        return _kernel.gather(W.to_nm().mat(), gy_in)

    def exact_w() -> torch.Tensor:   # (reads the pattern only: no values in exact n:m's order)
        indices, _ = W._nm_pattern()
        N, K = W.shape
        pattern = _kernel.mat(W._values.detach(), indices, K, N, W.n, W.m)   # values unread
        return W.values_from_nm(_kernel.sddmm(pattern, x_in, gy_in))

    # each gradient by the faster on this machine (timed once, cached on disk; STEN_NM_TUNE=0:
    # the layout's kernels): they need not agree (768x3072 2:8, 2 threads, Xeon SPR: the
    # input's kernel 19 ms against 22 dense, the values' 39 against 23); exact n:m's kernels
    # where the operands are float32 (768x3072 1:4: the values' 28 ms against the layout's 65)
    tuned = c == torch.float32 and _kernel.available()[0] and not _on_meta(W)
    B, f32 = gy_in.shape[0], W._values.dtype == gy_in.dtype == torch.float32
    if need_x:
        g = _tuned("cg_bwd_x", W, B, True, kernel_x, dense_x, _dtype_key(W._values.dtype, gy=gy_in),
                   {"exact": exact_x} if f32 else None) if tuned else dense_x()
        gx = g.to(x.dtype).reshape(x.shape)
    if need_w:
        if sparse_grad:
            gv = _tuned("cg_bwd_w", W, B, True, kernel_w, dense_w, _dtype_key(W._values.dtype, gy=gy_in, x=x_in),
                        {"exact": exact_w} if f32 and x_in.dtype == torch.float32 else None) if tuned else dense_w()
            gw = SparseTensorWrapper(W.with_values(gv.to(W.dtype)))
        else:
            with torch.autocast("cpu", enabled=False):
                gw = (gy_in.to(c).t() @ x_in.to(c)).to(W.dtype)
    if bias is not None and needs_grad(ctx, 2):
        gb = gy_in.to(c).sum(0).to(bias.dtype)
    return gx, gw, gb


def linear_bwd_dense(ctx: Any, grad_outputs: tuple, input_sparsifiers: list) -> tuple:
    return _backward(ctx, grad_outputs, sparse_grad=False)


def linear_bwd_sparse(ctx: Any, grad_outputs: tuple, input_sparsifiers: list) -> tuple:
    return _backward(ctx, grad_outputs, sparse_grad=True)


def register(registry: Any) -> None:
    """Register ``F.linear`` with a :class:`ColumnGroupedNMTensor` weight (forward and backward)."""
    register_weight_product(registry, F.linear, ColumnGroupedNMTensor, linear_fwd, linear_bwd_dense, linear_bwd_sparse)
