"""Triton kernel: one-pass 2:4 magnitude pruning into compressed values + metadata.

Each program takes a ``[BLOCK_R, BLOCK_W]`` tile of metadata words (16 input
columns per word), reads every value once, optionally applies an activation
(``"relu"``, ``"gelu"``, ``"silu"``: the xFormers ``sparsify24`` idea of
sparsifying activations at run time), keeps the two largest magnitudes of each
group of 4 (ties: the lower index) and writes ``packed`` ``[R, Kp/2]``,
``meta`` ``[R, Kp/16]`` (bit-identical to ``sten_cuda24.encoding.compress`` of
the pruned tensor) and, if asked, the pruned dense tensor (what cuSPARSELt's
compressor takes).

Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``.

Example:
    >>> packed, meta, _ = sparsify24(torch.randn(64, 64, device="cuda"))  # doctest: +SKIP
"""

from __future__ import annotations

import torch

from . import _compat, encoding

ACTIVATIONS = {None: 0, "identity": 0, "relu": 1, "gelu": 2, "silu": 3}

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton is optional
    triton = None
    tl = None

if triton is not None:

    @triton.jit
    def _act(x, ACT: tl.constexpr):
        if ACT == 1:
            x = tl.maximum(x, 0.0)
        elif ACT == 2:
            x = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
        elif ACT == 3:
            x = x / (1.0 + tl.exp(-x))
        return x

    @triton.jit
    def _group(x_ptr, col, rmask, K, ACT: tl.constexpr):
        """Load one group of 4 per lane; return (v0, v1, code, x0..x3 kept-or-zero)."""
        x0 = _act(tl.load(x_ptr + col + 0, mask=rmask & (col + 0 < K), other=0.0).to(tl.float32), ACT)
        x1 = _act(tl.load(x_ptr + col + 1, mask=rmask & (col + 1 < K), other=0.0).to(tl.float32), ACT)
        x2 = _act(tl.load(x_ptr + col + 2, mask=rmask & (col + 2 < K), other=0.0).to(tl.float32), ACT)
        x3 = _act(tl.load(x_ptr + col + 3, mask=rmask & (col + 3 < K), other=0.0).to(tl.float32), ACT)
        a0, a1, a2, a3 = tl.abs(x0), tl.abs(x1), tl.abs(x2), tl.abs(x3)
        # NaN ranks as the largest magnitude (as encoding.row_mask): compared as NaN it
        # would neither beat nor be beaten, and three values of its group would rank < 2
        a0 = tl.where(a0 != a0, float("inf"), a0)
        a1 = tl.where(a1 != a1, float("inf"), a1)
        a2 = tl.where(a2 != a2, float("inf"), a2)
        a3 = tl.where(a3 != a3, float("inf"), a3)
        r0 = (a1 > a0).to(tl.int32) + (a2 > a0).to(tl.int32) + (a3 > a0).to(tl.int32)
        r1 = (a0 >= a1).to(tl.int32) + (a2 > a1).to(tl.int32) + (a3 > a1).to(tl.int32)
        r2 = (a0 >= a2).to(tl.int32) + (a1 >= a2).to(tl.int32) + (a3 > a2).to(tl.int32)
        r3 = (a0 >= a3).to(tl.int32) + (a1 >= a3).to(tl.int32) + (a2 >= a3).to(tl.int32)
        m0 = (r0 < 2) & (x0 != 0.0)
        m1 = (r1 < 2) & (x1 != 0.0)
        m2 = (r2 < 2) & (x2 != 0.0)
        m3 = (r3 < 2) & (x3 != 0.0)
        # CUTLASS's choice of positions (also for groups with < 2 nonzeros)
        e0 = m0 & m1
        e1 = (~m0) & m1
        e2 = (~m0) & (~m1)
        b0 = e1.to(tl.int32)
        b1 = e2.to(tl.int32)
        b2 = (e0 | e2 | m3).to(tl.int32)
        b3 = (e1 | (~m1)).to(tl.int32)
        i0 = b0 | (b1 << 1)
        i1 = b2 | (b3 << 1)
        v0 = tl.where(i0 == 0, x0, tl.where(i0 == 1, x1, tl.where(i0 == 2, x2, x3)))
        v1 = tl.where(i1 == 0, x0, tl.where(i1 == 1, x1, tl.where(i1 == 2, x2, x3)))
        code = i0 | (i1 << 2)
        return v0, v1, code, tl.where(m0, x0, 0.0), tl.where(m1, x1, 0.0), tl.where(m2, x2, 0.0), tl.where(m3, x3, 0.0)

    @triton.jit
    def sparsify24_kernel(
        x_ptr, packed_ptr, meta_ptr, dense_ptr,
        R, K, W, stride_x, stride_d,
        ACT: tl.constexpr, WRITE_DENSE: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
    ):
        pid_r = tl.program_id(0)
        pid_w = tl.program_id(1)
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        words = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
        rmask = (rows < R)[:, None] & (words < W)[None, :]
        xrow = x_ptr + rows[:, None].to(tl.int64) * stride_x
        prow = packed_ptr + rows[:, None].to(tl.int64) * (W * 8)
        drow = dense_ptr + rows[:, None].to(tl.int64) * stride_d
        word = tl.zeros((BLOCK_R, BLOCK_W), dtype=tl.int32)
        for s in tl.static_range(4):
            col = words[None, :] * 16 + s * 4
            v0, v1, code, y0, y1, y2, y3 = _group(xrow, col, rmask, K, ACT)
            pcol = words[None, :] * 8 + s * 2
            tl.store(prow + pcol, v0.to(packed_ptr.dtype.element_ty), mask=rmask)
            tl.store(prow + pcol + 1, v1.to(packed_ptr.dtype.element_ty), mask=rmask)
            word = word | (code << (4 * s))
            if WRITE_DENSE:
                ty = dense_ptr.dtype.element_ty
                tl.store(drow + col + 0, y0.to(ty), mask=rmask & (col + 0 < K))
                tl.store(drow + col + 1, y1.to(ty), mask=rmask & (col + 1 < K))
                tl.store(drow + col + 2, y2.to(ty), mask=rmask & (col + 2 < K))
                tl.store(drow + col + 3, y3.to(ty), mask=rmask & (col + 3 < K))
        word = tl.where(word >= 32768, word - 65536, word)
        tl.store(meta_ptr + rows[:, None].to(tl.int64) * W + words[None, :], word.to(tl.int16), mask=rmask)


def _check_runnable(x: torch.Tensor, what: str) -> None:
    if triton is None:
        raise RuntimeError(f"{what} needs triton (pip install triton)")
    if x.device.type != "cuda" and not _compat.triton_interpret():
        raise ValueError(f"{what} runs on CUDA tensors (or on CPU with TRITON_INTERPRET=1); got a tensor on {x.device}")
    if not _compat.triton_runs_on(x):
        raise ValueError(f"{what} does not run on {_compat.INTERPRETED_BF16}")


def sparsify24(
    x: torch.Tensor,
    activation: str | None = None,
    write_dense: bool = False,
    block_r: int = 32,
    block_w: int = 8,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """2:4-prune ``x`` (any leading dims) along its last dim: ``(packed, meta, pruned_dense|None)``.

    ``packed`` is ``[R, Kp/2]``, ``meta`` ``[R, Kp/16]`` int16 with ``R`` the
    product of the leading dims; ``pruned_dense`` has ``x``'s shape.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(k for k in ACTIVATIONS if k)} or None, got {activation!r}")
    encoding.check_dtype(x.dtype)
    if x.dim() == 0:
        raise ValueError("sparsify24 needs at least a 1-D tensor")
    _check_runnable(x, "the Triton 2:4 sparsifier")
    k = x.shape[-1]
    x2 = encoding.as_rows(x)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r = x2.shape[0]
    w = encoding.padded_k(k) // encoding.WORD
    packed = torch.empty(r, w * 8, dtype=x.dtype, device=x.device)
    meta = torch.empty(r, w, dtype=torch.int16, device=x.device)
    dense = torch.empty(r, k, dtype=x.dtype, device=x.device) if write_dense else packed
    if r and w:
        grid = (triton.cdiv(r, block_r), triton.cdiv(w, block_w))
        sparsify24_kernel[grid](
            x2, packed, meta, dense, r, k, w, x2.stride(0), dense.stride(0) if write_dense else 0,
            ACT=ACTIVATIONS[activation], WRITE_DENSE=write_dense, BLOCK_R=block_r, BLOCK_W=block_w,
        )
    return packed, meta, (dense.reshape(x.shape) if write_dense else None)


def reference_sparsify24(x: torch.Tensor, activation: str | None = None) -> torch.Tensor:
    """The same pruning in torch ops (the kernel's test oracle): pruned dense tensor."""
    y = x.float()
    if activation == "relu":
        y = torch.relu(y)
    elif activation == "gelu":
        y = torch.nn.functional.gelu(y)
    elif activation == "silu":
        y = torch.nn.functional.silu(y)
    return y.masked_fill(~encoding.row_mask(y), 0).to(x.dtype)  # not y * mask: a pruned inf would give NaN
