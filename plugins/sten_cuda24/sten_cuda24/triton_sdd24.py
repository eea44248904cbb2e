"""Sampled 2:4 weight gradient: ``(grad.T @ x)`` at a ``Sparse24Tensor``'s stored slots only.

``sdd24(grad, x, w)`` returns values shaped like ``w.packed`` (``[N, Kp/2]``):
one Triton program per ``[BN, BK]`` tile of the weight accumulates the tile of
``grad.T @ x`` over the tokens in registers and writes only the two kept values
of each group of 4 (selected with the tile's metadata), so the dense ``[N, K]``
gradient is never written or gathered. Same FLOPs as the dense GEMM; it saves
the dense gradient's memory traffic and the gather pass. Filler slots (not
live) are zeroed, as ``Sparse24Tensor.gather`` does.

Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``.

Example (needs a GPU or the interpreter):
    >>> vals = sdd24(grad, x, w)                         # doctest: +SKIP
    >>> torch.equal(vals, w.gather(grad.t() @ x))        # up to rounding  # doctest: +SKIP
"""

from __future__ import annotations

import torch

from . import _compat, encoding
from .sparse24 import Sparse24Tensor
from .triton_sparsify24 import _check_runnable

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None
    tl = None

if triton is not None:

    @triton.jit
    def sdd24_kernel(
        g_ptr, x_ptr, meta_ptr, out_ptr,
        T, N, K, W, stride_g, stride_x,
        BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = pid_k * BK + tl.arange(0, BK)
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
        G: tl.constexpr = BK // 4
        gi = tl.arange(0, G)
        word = pid_k * (BK // 16) + gi // 4
        words = tl.load(meta_ptr + rn[:, None].to(tl.int64) * W + word[None, :],
                        mask=(rn < N)[:, None] & (word < W)[None, :], other=0).to(tl.int32) & 0xFFFF
        codes = (words >> ((gi % 4) * 4)[None, :]) & 0xF
        idx0 = codes & 3
        idx1 = codes >> 2
        acc3 = tl.reshape(acc, (BN, G, 4))
        pos = tl.arange(0, 4)[None, None, :]
        v0 = tl.sum(tl.where(pos == idx0[:, :, None], acc3, 0.0), axis=2)
        v1 = tl.sum(tl.where(pos == idx1[:, :, None], acc3, 0.0), axis=2)
        col = pid_k * (BK // 2) + 2 * gi
        omask = (rn < N)[:, None] & (word < W)[None, :]
        base = out_ptr + rn[:, None].to(tl.int64) * (W * 8) + col[None, :]
        tl.store(base, v0.to(out_ptr.dtype.element_ty), mask=omask)
        tl.store(base + 1, v1.to(out_ptr.dtype.element_ty), mask=omask)


def sdd24(grad: torch.Tensor, x: torch.Tensor, w: Sparse24Tensor) -> torch.Tensor:
    """``w.gather(grad.T @ x)`` without the dense product: ``[N, Kp/2]`` in ``w``'s dtype.

    ``grad`` ``[..., N]`` and ``x`` ``[..., K]`` (same leading dims); ``w`` 2-D ``[N, K]``.
    """
    if not isinstance(w, Sparse24Tensor) or len(w.shape) != 2:
        raise TypeError(f"w must be a 2-D Sparse24Tensor, got {type(w).__name__} {tuple(getattr(w, 'shape', ()))}")
    n, k = w.shape
    g2 = grad.reshape(-1, grad.shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    if g2.shape[1] != n or x2.shape[1] != k or g2.shape[0] != x2.shape[0]:
        raise ValueError(f"grad {tuple(grad.shape)} and x {tuple(x.shape)} do not fit a weight of shape {(n, k)}")
    if g2.dtype != x2.dtype:
        raise TypeError(f"grad ({g2.dtype}) and x ({x2.dtype}) must have one dtype")
    _check_runnable(x2, "the Triton sampled 2:4 weight gradient")
    g2 = g2 if g2.stride(-1) == 1 else g2.contiguous()
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty_like(w.packed)
    words = w.meta.shape[1]
    t = g2.shape[0]
    if n and words:
        bn, bk = 64, 64
        bt = 16 if t <= 16 else 32
        grid = (triton.cdiv(n, bn), triton.cdiv(words * encoding.WORD, bk))
        sdd24_kernel[grid](g2, x2, w.meta, out, t, n, k, words, g2.stride(0), x2.stride(0), BT=bt, BN=bn, BK=bk,
                           IEEE=_compat.ieee_fp32_dot(x2.dtype))
    if w.live is not None:
        out.masked_fill_(~w.live, 0)
    return out
