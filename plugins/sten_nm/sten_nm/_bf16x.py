"""bf16 in the C kernels without float32 copies: the paper-format forward with bf16 activations
read by the kernel, and the exact / 16-row input gradients with bf16 values.

On a CPU with AVX512_BF16 (ISA ``avx512``) and bf16 stored values the kernel multiplies on
``vdpbf16ps`` (pairs of slots, float32 accumulation); otherwise it widens x while packing its
panel and runs the float32 kernel. Both are exact products of the bf16 operands up to float32
rounding order (``csrc/nm_cg_bf16x.h``).

    >>> import torch
    >>> from sten_nm import ColumnGroupedNMTensor
    >>> W = ColumnGroupedNMTensor.from_dense(torch.randn(8, 16).bfloat16(), 2, 4)
    >>> colgrouped_gather_bf16x(W.desc(), torch.randn(3, 16).bfloat16()).shape
    torch.Size([3, 8])
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from . import _kernel
from ._kernel import ptr

_declared: set[int] = set()


def _lib() -> ctypes.CDLL:
    lib = _kernel._load()
    if id(lib) not in _declared:
        lib.nm_colgrouped_gather_bf16x.argtypes = [ctypes.POINTER(_kernel.NMColGrouped), ctypes.c_int64,
                                                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                                   ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
        lib.nm_colgrouped_gather_bf16x.restype = ctypes.c_int
        lib.nm_colgrouped_gather_bf16x_variant.argtypes = lib.nm_colgrouped_gather_bf16x.argtypes + [ctypes.c_int]
        lib.nm_colgrouped_gather_bf16x_variant.restype = ctypes.c_int
        lib.nm_colgrouped_gather_bf16x_out16.argtypes = lib.nm_colgrouped_gather_bf16x_variant.argtypes
        lib.nm_colgrouped_gather_bf16x_out16.restype = ctypes.c_int
        lib.nm_bf16_dot.restype = ctypes.c_int
        lib.nm_bf16_dot_enabled.restype = ctypes.c_int
        lib.nm_bf16_dot_supported.restype = ctypes.c_int
        lib.nm_set_bf16_dot.argtypes = [ctypes.c_int]
        lib.nm_set_bf16_dot.restype = ctypes.c_int
        i64, vp, ci = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        lib.nm_tgather_bf16w.argtypes = [ctypes.POINTER(_kernel.NMMat), i64, vp, i64, vp, i64, vp, ci]
        lib.nm_tgather_bf16w.restype = ci
        lib.nm_grouped_tgather_bf16w.argtypes = [ctypes.POINTER(_kernel.NMGrouped), i64, vp, i64, vp, i64, ci]
        lib.nm_grouped_tgather_bf16w.restype = ci
        for fn in (lib.nm_gather_bf16x, lib.nm_gather_bf16wx):
            fn.argtypes = [ctypes.POINTER(_kernel.NMMat), i64, vp, i64, vp, i64, vp, ci]
            fn.restype = ci
        for fn in (lib.nm_grouped_gather_bf16x, lib.nm_grouped_gather_bf16wx):
            fn.argtypes = [ctypes.POINTER(_kernel.NMGrouped), i64, vp, i64, vp, i64, vp, ci]
            fn.restype = ci
        lib.nm_gather_bf16x_out16.argtypes = [ctypes.POINTER(_kernel.NMMat), i64, vp, i64, vp, i64, vp, ci, ci]
        lib.nm_gather_bf16x_out16.restype = ci
        lib.nm_grouped_gather_bf16x_out16.argtypes = [ctypes.POINTER(_kernel.NMGrouped), i64, vp, i64, vp, i64, vp,
                                                      ci, ci]
        lib.nm_grouped_gather_bf16x_out16.restype = ci
        _declare_mixed(lib)
        _declared.add(id(lib))
    return lib


def bf16_dot() -> bool:
    """Whether bf16 x with bf16 values runs on ``vdpbf16ps`` now (CPU has AVX512_BF16, ISA
    ``avx512``, not turned off by ``STEN_NM_BF16_DOT=0`` or :func:`set_bf16_dot`)."""
    return bool(_lib().nm_bf16_dot())


def bf16_dot_supported() -> bool:
    """Whether this CPU can run the ``vdpbf16ps`` path (AVX512_BF16)."""
    return bool(_lib().nm_bf16_dot_supported())


def bf16_dot_enabled() -> bool:
    """The switch of :func:`set_bf16_dot` (used while the ISA is ``avx512``)."""
    return bool(_lib().nm_bf16_dot_enabled())


def set_bf16_dot(on: bool) -> None:
    """Turn the ``vdpbf16ps`` path on or off (tests, benchmarks); on needs AVX512_BF16 (it
    is used while the ISA is ``avx512``)."""
    if _lib().nm_set_bf16_dot(1 if on else 0) != 0:
        raise ValueError("set_bf16_dot(True): this CPU has no AVX512_BF16")


def colgrouped_gather_bf16x(W: _kernel.NMColGrouped, X: torch.Tensor, bias: Optional[torch.Tensor] = None,
                            nthreads: Optional[int] = None, variant: str = "auto",
                            out_bf16: bool = False) -> torch.Tensor:
    """``Y = X W^T (+ bias)`` (float32 ``[B, N]``, or with ``out_bf16`` bfloat16, rounded as the
    kernel writes it: the same bits as ``.bfloat16()`` of the float32 result) for bfloat16
    ``X`` ``[B, K]`` read by the kernel, ``W`` a column-grouped descriptor
    (:func:`sten_nm._kernel.colgrouped`).
    ``variant``: the loop order (:func:`sten_nm._kernel.colgrouped_gather`); with bf16 values
    where :func:`bf16_dot` is on, ``"stream"`` (and ``"auto"`` resolving to it) runs the
    ``vdpbf16ps`` path and ``"tiled"`` widens x into the float32 kernel's tiled order."""
    if variant not in _kernel.CG_VARIANTS:
        raise ValueError(f"variant must be one of {sorted(_kernel.CG_VARIANTS)}, got {variant!r}")
    X = _bf16_x(X, W.K)
    Y = _kernel.empty((X.shape[0], W.N), torch.bfloat16 if out_bf16 else torch.float32)
    b = bias.contiguous().float() if bias is not None else None
    lib, what = _lib(), "nm_colgrouped_gather_bf16x"
    rc = (lib.nm_colgrouped_gather_bf16x_out16 if out_bf16 else lib.nm_colgrouped_gather_bf16x_variant)(
        ctypes.byref(W), X.shape[0], ptr(X, f"{what}: X"), X.stride(0) if W.K else 1, ptr(Y, f"{what}: out"),
        Y.stride(0) if W.N else 1, ptr(b, f"{what}: bias"), _kernel._threads(nthreads), _kernel.CG_VARIANTS[variant])
    _kernel._check(rc, what)
    return Y


def _bf16_rows(X: torch.Tensor) -> torch.Tensor:
    """``X`` as it is where the kernels can read it (bf16 rows with unit column stride, any row
    stride at least the row length, any offset), else a contiguous copy."""
    if X.stride(-1) != 1 or (X.size(0) > 1 and X.stride(0) < X.size(1)):
        X = X.contiguous()
    return X


def _bf16_x(X: torch.Tensor, cols: int) -> torch.Tensor:
    """``X`` checked (2-D bfloat16 with ``cols`` columns, else a ValueError naming it) and made
    readable by the kernels (:func:`_bf16_rows`)."""
    if X.dtype != torch.bfloat16 or X.dim() != 2:
        raise ValueError(f"X must be a 2-D bfloat16 tensor, got {X.dtype} of shape {tuple(X.shape)}")
    if X.shape[1] != cols:
        raise ValueError(f"X must have {cols} columns, got shape {tuple(X.shape)}")
    return _bf16_rows(X)


def _gather_x16(base: str, desc: ctypes.Structure, X: torch.Tensor, cols: int, rows: int,
                bias: Optional[torch.Tensor], nthreads: Optional[int], out_bf16: bool) -> torch.Tensor:
    """The body of :func:`gather_bf16x` and :func:`grouped_gather_bf16x`: ``X`` checked, then the
    C kernel ``nm_<base>_bf16x`` (float32 values) or ``nm_<base>_bf16wx`` (bf16 values) into a
    float32 ``[B, rows]``, or ``nm_<base>_bf16x_out16`` into a bfloat16 one."""
    X = _bf16_x(X, cols)
    vals = getattr(desc, "_keep", (None,))[0]
    if vals is None or vals.dtype not in (torch.float32, torch.bfloat16) or not vals.is_contiguous():
        raise ValueError(f"{base}_bf16x needs a descriptor of contiguous float32 or bfloat16 values")
    w16 = vals.dtype == torch.bfloat16
    what = f"nm_{base}_bf16x_out16" if out_bf16 else f"nm_{base}_bf16{'w' if w16 else ''}x"
    b = bias.contiguous().float() if bias is not None else None
    args = (ctypes.byref(desc), X.shape[0], ptr(X, f"{what}: X"), X.stride(0) if cols else 1)
    tail = (ptr(b, f"{what}: bias"), _kernel._threads(nthreads))
    Y = _kernel.empty((X.shape[0], rows), torch.bfloat16 if out_bf16 else torch.float32)
    out = (ptr(Y, f"{what}: out"), Y.stride(0) if rows else 1)
    kernel = getattr(_lib(), what)
    rc = kernel(*args, *out, *tail, int(w16)) if out_bf16 else kernel(*args, *out, *tail)
    _kernel._check(rc, what)
    return Y


def gather_bf16x(A: _kernel.NMMat, X: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 nthreads: Optional[int] = None, out_bf16: bool = False) -> torch.Tensor:
    """:func:`sten_nm._kernel.gather` (``Y = X A^T (+ bias)``, float32 ``[B, R]``) for bfloat16
    ``X`` ``[B, C]`` read by the kernel: widened while packing its panel (exact), no float32
    copy of X. ``A`` may describe float32 or bfloat16 values (``nm_gather_bf16x`` /
    ``nm_gather_bf16wx``); the result has the same bits as ``gather`` of ``X.float()``.
    ``out_bf16``: a bfloat16 result, rounded on the kernels' threads unit by unit while in cache
    (``nm_gather_bf16x_out16``; the same bits as the float32 result ``.to(torch.bfloat16)``).

        >>> from sten_nm import NMTensor
        >>> W = NMTensor.from_dense(torch.randn(8, 16), 2, 4)
        >>> gather_bf16x(W.fp32().mat(), torch.randn(3, 16).bfloat16()).shape
        torch.Size([3, 8])
    """
    return _gather_x16("gather", A, X, A.C, A.R, bias, nthreads, out_bf16)


def grouped_gather_bf16x(W: _kernel.NMGrouped, X: torch.Tensor, bias: Optional[torch.Tensor] = None,
                         nthreads: Optional[int] = None, out_bf16: bool = False) -> torch.Tensor:
    """:func:`sten_nm._kernel.grouped_gather` (``Y = X W^T (+ bias)``, float32 ``[B, N]``) for
    bfloat16 ``X`` ``[B, K]`` read by the kernel: widened while packing its 6-row micro-panels
    (exact), no float32 copy of X. ``W`` may describe float32 or bfloat16 values
    (``nm_grouped_gather_bf16x`` / ``nm_grouped_gather_bf16wx``); the result has the same bits
    as the float32-x kernel on ``X.float()``. ``out_bf16``: a bfloat16 result, each row rounded
    as the kernel's threads write it (``nm_grouped_gather_bf16x_out16``; the same bits as
    rounding the float32 result).

        >>> from sten_nm import GroupedNMTensor
        >>> W = GroupedNMTensor.from_dense(torch.randn(16, 16), 2, 4)
        >>> grouped_gather_bf16x(W.desc(), torch.randn(3, 16).bfloat16()).shape
        torch.Size([3, 16])
    """
    return _gather_x16("grouped_gather", W, X, W.K, W.N, bias, nthreads, out_bf16)


def tgather_bf16w(A: _kernel.NMMat, Y: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  nthreads: Optional[int] = None) -> torch.Tensor:
    """:func:`sten_nm._kernel.tgather` (``X = Y A``, float32) for a descriptor of bfloat16
    values (``_kernel.mat`` of bf16 values): widened for this call only, fp32 accumulation."""
    _kernel._require_bf16_values(A, "tgather_bf16w")
    return _kernel._product(_lib().nm_tgather_bf16w, "nm_tgather_bf16w", A, Y, A.C, bias, nthreads)


def grouped_tgather_bf16w(W: _kernel.NMGrouped, dY: torch.Tensor, nthreads: Optional[int] = None) -> torch.Tensor:
    """:func:`sten_nm._kernel.grouped_tgather` (``dX = dY W``, float32) for a descriptor of
    bfloat16 values (``_kernel.grouped`` of bf16 values): widened for this call only."""
    _kernel._require_bf16_values(W, "grouped_tgather_bf16w")
    dY = _kernel._rowmajor(dY)
    dX = _kernel.empty((dY.shape[0], W.K))
    rc = _lib().nm_grouped_tgather_bf16w(ctypes.byref(W), dY.shape[0], ptr(dY, "nm_grouped_tgather_bf16w: dY"),
                                         dY.stride(0), ptr(dX, "nm_grouped_tgather_bf16w: out"),
                                         dX.stride(0) if W.K else 1, _kernel._threads(nthreads))
    _kernel._check(rc, "nm_grouped_tgather_bf16w")
    return dX


# -- the backward kernels with bf16 grad_output (and x) read in C ------------------------
def _operand(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` as a kernel reads it and whether it is bf16 (1: read as bf16 bits, widened while
    the kernel packs it; 0: float32, other dtypes converted)."""
    if t.dtype == torch.bfloat16:
        return _bf16_rows(t), 1
    return _kernel._rowmajor(t), 0


def _values_bf16(desc: ctypes.Structure) -> int:
    vals = getattr(desc, "_keep", (None,))[0]
    if vals is None or vals.dtype not in (torch.float32, torch.bfloat16) or not vals.is_contiguous():
        raise ValueError("the descriptor must hold contiguous float32 or bfloat16 values")
    return int(vals.dtype == torch.bfloat16)


def _declare_mixed(lib: ctypes.CDLL) -> None:
    i64, vp, ci = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    M, G, C = (ctypes.POINTER(t) for t in (_kernel.NMMat, _kernel.NMGrouped, _kernel.NMColGrouped))
    lib.nm_tgather_mixed.argtypes = [M, i64, vp, i64, vp, i64, vp, ci, ci, ci]
    lib.nm_sddmm_mixed.argtypes = [M, i64, vp, i64, vp, i64, vp, ci, ci, ci]
    lib.nm_grouped_tgather_mixed.argtypes = [G, i64, vp, i64, vp, i64, ci, ci, ci]
    lib.nm_grouped_sddmm_mixed.argtypes = [G, i64, vp, i64, vp, i64, vp, ci, ci, ci]
    lib.nm_colgrouped_grad_input_mixed.argtypes = [C, i64, vp, i64, vp, i64, ci, ci]
    lib.nm_colgrouped_grad_values_mixed.argtypes = [C, i64, vp, i64, vp, i64, vp, ci, ci, ci]
    for name in ("nm_tgather_mixed", "nm_sddmm_mixed", "nm_grouped_tgather_mixed", "nm_grouped_sddmm_mixed",
                 "nm_colgrouped_grad_input_mixed", "nm_colgrouped_grad_values_mixed"):
        getattr(lib, name).restype = ci


def tgather_mixed(A: _kernel.NMMat, Y: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  nthreads: Optional[int] = None) -> torch.Tensor:
    """:func:`sten_nm._kernel.tgather` (``X = Y A``, float32 ``[B, C]``) with ``Y`` float32 or
    bfloat16 (read by the kernel, widened while packing) and ``A``'s values float32 or bfloat16.

        >>> from sten_nm import NMTensor
        >>> W = NMTensor.from_dense(torch.randn(8, 16), 2, 4)
        >>> tgather_mixed(W.fp32().mat(), torch.randn(3, 8).bfloat16()).shape
        torch.Size([3, 16])
    """
    w16 = _values_bf16(A)
    Y, y16 = _operand(Y)
    X = _kernel.empty((Y.shape[0], A.C))
    b = bias.contiguous().float() if bias is not None else None
    rc = _lib().nm_tgather_mixed(ctypes.byref(A), Y.shape[0], ptr(Y, "nm_tgather_mixed: Y"), Y.stride(0) if A.R else 1,
                                 ptr(X, "nm_tgather_mixed: out"), X.stride(0) if A.C else 1,
                                 ptr(b, "nm_tgather_mixed: bias"), _kernel._threads(nthreads), w16, y16)
    _kernel._check(rc, "nm_tgather_mixed")
    return X


def sddmm_mixed(A: _kernel.NMMat, Y: torch.Tensor, X: torch.Tensor, nthreads: Optional[int] = None) -> torch.Tensor:
    """:func:`sten_nm._kernel.sddmm` (``[R, G*n]`` float32) with ``Y`` and ``X`` each float32 or
    bfloat16, read by the kernel (no float32 copies)."""
    Y, y16 = _operand(Y)
    X, x16 = _operand(X)
    out = _kernel.empty((A.R, A.G * A.n))
    rc = _lib().nm_sddmm_mixed(ctypes.byref(A), Y.shape[0], ptr(Y, "nm_sddmm_mixed: Y"), Y.stride(0) if A.R else 1,
                               ptr(X, "nm_sddmm_mixed: X"), X.stride(0) if A.C else 1, ptr(out, "nm_sddmm_mixed: out"),
                               _kernel._threads(nthreads), y16, x16)
    _kernel._check(rc, "nm_sddmm_mixed")
    return out


def grouped_tgather_mixed(W: _kernel.NMGrouped, dY: torch.Tensor, nthreads: Optional[int] = None) -> torch.Tensor:
    """:func:`sten_nm._kernel.grouped_tgather` (``dX = dY W``, float32) with ``dY`` float32 or
    bfloat16 (read by the kernel) and ``W``'s values float32 or bfloat16."""
    w16 = _values_bf16(W)
    dY, y16 = _operand(dY)
    dX = _kernel.empty((dY.shape[0], W.K))
    rc = _lib().nm_grouped_tgather_mixed(ctypes.byref(W), dY.shape[0], ptr(dY, "nm_grouped_tgather_mixed: dY"),
                                         dY.stride(0) if W.N else 1, ptr(dX, "nm_grouped_tgather_mixed: out"),
                                         dX.stride(0) if W.K else 1, _kernel._threads(nthreads), w16, y16)
    _kernel._check(rc, "nm_grouped_tgather_mixed")
    return dX


def grouped_sddmm_mixed(W: _kernel.NMGrouped, dY: torch.Tensor, X: torch.Tensor,
                        nthreads: Optional[int] = None) -> torch.Tensor:
    """:func:`sten_nm._kernel.grouped_sddmm` (``[Q, G*n, 16]`` float32) with ``dY`` and ``X``
    each float32 or bfloat16, read by the kernel."""
    dY, y16 = _operand(dY)
    X, x16 = _operand(X)
    out = _kernel.empty((W.Q, -(-W.K // W.m) * W.n, _kernel.GROUP_ROWS))
    what = "nm_grouped_sddmm_mixed"
    rc = _lib().nm_grouped_sddmm_mixed(ctypes.byref(W), dY.shape[0], ptr(dY, f"{what}: dY"), dY.stride(0) if W.N else 1,
                                       ptr(X, f"{what}: X"), X.stride(0) if W.K else 1, ptr(out, f"{what}: out"),
                                       _kernel._threads(nthreads), y16, x16)
    _kernel._check(rc, "nm_grouped_sddmm_mixed")
    return out


def colgrouped_grad_input_mixed(W: _kernel.NMColGrouped, dY: torch.Tensor,
                                nthreads: Optional[int] = None) -> torch.Tensor:
    """:func:`sten_nm._kernel.colgrouped_grad_input` with ``dY`` float32 or bfloat16 (read by the
    kernel, widened while packing)."""
    dY, y16 = _operand(dY)
    dX = _kernel.empty((dY.shape[0], W.K))
    what = "nm_colgrouped_grad_input_mixed"
    rc = _lib().nm_colgrouped_grad_input_mixed(ctypes.byref(W), dY.shape[0], ptr(dY, f"{what}: dY"),
                                               dY.stride(0) if W.N else 1, ptr(dX, f"{what}: out"),
                                               dX.stride(0) if W.K else 1, _kernel._threads(nthreads), y16)
    _kernel._check(rc, "nm_colgrouped_grad_input_mixed")
    return dX


def colgrouped_grad_values_mixed(W: _kernel.NMColGrouped, dY: torch.Tensor, X: torch.Tensor,
                                 nthreads: Optional[int] = None) -> torch.Tensor:
    """:func:`sten_nm._kernel.colgrouped_grad_values` with ``dY`` and ``X`` each float32 or
    bfloat16, read by the kernel."""
    dY, y16 = _operand(dY)
    X, x16 = _operand(X)
    out = _kernel.empty((W.Nb, W.P, W.n, W.L))
    what = "nm_colgrouped_grad_values_mixed"
    rc = _lib().nm_colgrouped_grad_values_mixed(ctypes.byref(W), dY.shape[0], ptr(dY, f"{what}: dY"),
                                                dY.stride(0) if W.N else 1, ptr(X, f"{what}: X"),
                                                X.stride(0) if W.K else 1, ptr(out, f"{what}: out"),
                                                _kernel._threads(nthreads), y16, x16)
    _kernel._check(rc, "nm_colgrouped_grad_values_mixed")
    return out
