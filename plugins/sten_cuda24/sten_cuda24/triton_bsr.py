"""Triton kernels for ``BlockSparseTensor``: ``F.linear`` forward and backward.

- ``bsr_linear(x, w, bias)``: ``x @ w.T + bias`` with ``w`` BSR ``[N, K]``. One
  program per (token tile, block row of ``w``) walks that row's blocks.
- input gradient: ``grad @ w`` = ``bsr_linear(grad, w.transposed())``.
- ``bsr_sdd(grad, x, w)``: weight gradient at the stored blocks only,
  ``grad[:, rows].T @ x[:, cols]`` per block (one program per block).

Block sides must be powers of two in 16..128. Runs on CUDA tensors, or on CPU
tensors under ``TRITON_INTERPRET=1``.

Example:
    >>> w = BlockSparseTensor.from_dense(dense.cuda(), (64, 64))   # doctest: +SKIP
    >>> y = bsr_linear(x.cuda(), w)                                # doctest: +SKIP
"""

from __future__ import annotations

import torch

from . import _compat
from .blocksparse import BlockSparseTensor
from .triton_sparsify24 import _check_runnable

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None
    tl = None

if triton is not None:

    @triton.jit
    def bsr_linear_kernel(
        x_ptr, crow_ptr, col_ptr, blk_ptr, bias_ptr, out_ptr,
        T, N, K, stride_x, stride_o,
        HAS_BIAS: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
    ):
        pid_t = tl.program_id(0)
        nb = tl.program_id(1)
        rt = pid_t * BT + tl.arange(0, BT)
        rn = tl.arange(0, BN)
        rk = tl.arange(0, BK)
        start = tl.load(crow_ptr + nb)
        end = tl.load(crow_ptr + nb + 1)
        acc = tl.zeros((BT, BN), dtype=tl.float32)
        for j in range(start, end):
            kb = tl.load(col_ptr + j)
            cols = kb * BK + rk
            a = tl.load(x_ptr + rt[:, None].to(tl.int64) * stride_x + cols[None, :],
                        mask=(rt < T)[:, None] & (cols < K)[None, :], other=0.0)
            b = tl.load(blk_ptr + j * (BN * BK) + rn[:, None] * BK + rk[None, :])
            if IEEE:
                acc += tl.dot(a, tl.trans(b), input_precision="ieee")
            else:
                acc += tl.dot(a, tl.trans(b))
        n_idx = nb * BN + rn
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n_idx, mask=n_idx < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rt[:, None].to(tl.int64) * stride_o + n_idx[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=(rt < T)[:, None] & (n_idx < N)[None, :])

    @triton.jit
    def bsr_sdd_kernel(
        g_ptr, x_ptr, brow_ptr, col_ptr, out_ptr,
        T, N, K, stride_g, stride_x,
        BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
    ):
        j = tl.program_id(0)
        nb = tl.load(brow_ptr + j)
        kb = tl.load(col_ptr + j)
        rn = nb * BN + tl.arange(0, BN)
        rk = kb * BK + tl.arange(0, BK)
        acc = tl.zeros((BN, BK), dtype=tl.float32)
        for t0 in range(0, T, BT):
            rt = t0 + tl.arange(0, BT)
            g = tl.load(g_ptr + rt[:, None].to(tl.int64) * stride_g + rn[None, :],
                        mask=(rt < T)[:, None] & (rn < N)[None, :], other=0.0)
            x = tl.load(x_ptr + rt[:, None].to(tl.int64) * stride_x + rk[None, :],
                        mask=(rt < T)[:, None] & (rk < K)[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(tl.trans(g), x, input_precision="ieee")
            else:
                acc += tl.dot(tl.trans(g), x)
        ln = tl.arange(0, BN)
        lk = tl.arange(0, BK)
        tl.store(out_ptr + j.to(tl.int64) * (BN * BK) + ln[:, None] * BK + lk[None, :], acc.to(out_ptr.dtype.element_ty))


def _check_block(w: BlockSparseTensor) -> None:
    for side in w.block_shape:
        if side < 16 or side > 128 or side & (side - 1):
            raise ValueError(f"the Triton BSR kernel needs block sides that are powers of two in 16..128, got {w.block_shape}")


def _tokens_tile(t: int) -> int:
    return 16 if t <= 16 else (32 if t <= 32 else 64)


def bsr_linear(x: torch.Tensor, w: BlockSparseTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + bias`` (``x`` ``[..., K]``, ``w`` BSR ``[N, K]``)."""
    if not isinstance(w, BlockSparseTensor):
        raise TypeError(f"w must be a BlockSparseTensor, got {type(w).__name__}")
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"input has {x.shape[-1]} features but the block-sparse weight expects {k} (shape {tuple(w.shape)})")
    if x.dtype != w.dtype or x.device != w.device:
        raise ValueError(f"input ({x.dtype}, {x.device}) and weight ({w.dtype}, {w.device}) must match in dtype and device")
    _check_runnable(x, "the Triton block-sparse kernel")
    _check_block(w)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    t = x2.shape[0]
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    bn, bk = w.block_shape
    bt = _tokens_tile(t)
    if t and n:
        grid = (triton.cdiv(t, bt), w.grid[0])
        bsr_linear_kernel[grid](
            x2, w.crow, w.col, w.blocks, bias if bias is not None else out, out,
            t, n, k, x2.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BT=bt, BN=bn, BK=bk, IEEE=_compat.ieee_fp32_dot(x.dtype),
        )
    return out.reshape(*x.shape[:-1], n)


def bsr_sdd(grad: torch.Tensor, x: torch.Tensor, w: BlockSparseTensor) -> torch.Tensor:
    """Weight gradient ``grad.T @ x`` at ``w``'s stored blocks: ``[nnzb, bh, bw]``."""
    n, k = w.shape
    g2 = grad.reshape(-1, n)
    x2 = x.reshape(-1, k)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    _check_runnable(x2, "the Triton block-sparse kernel")
    _check_block(w)
    bn, bk = w.block_shape
    out = torch.empty_like(w.blocks)
    if w.num_blocks:
        t = g2.shape[0]
        bsr_sdd_kernel[(w.num_blocks,)](
            g2, x2, w.block_rows(), w.col, out, t, n, k, g2.stride(0), x2.stride(0),
            BT=_tokens_tile(t), BN=bn, BK=bk, IEEE=_compat.ieee_fp32_dot(x2.dtype),
        )
    return out
