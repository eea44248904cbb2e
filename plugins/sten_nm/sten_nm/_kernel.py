"""ctypes bindings of the plain-C kernels in ``csrc/`` (built as ``sten_nm._nmkernel``).

All functions take float32 CPU tensors whose last dimension is contiguous and
return new tensors; argument checking happens in the callers, except that every tensor
becomes a pointer through :func:`ptr`, which refuses one without CPU data (meta, GPU,
traced) with a ``ValueError`` instead of letting a kernel crash the process.

Example:
    >>> from sten_nm import _kernel
    >>> _kernel.isa() in ("avx512", "avx2", "generic")
    True
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import warnings
from typing import Callable, Optional

import torch
from torch.autograd.forward_ad import unpack_dual

_c_i64, _c_i32, _c_p = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p


class NMMat(ctypes.Structure):
    _fields_ = [
        ("R", _c_i64), ("C", _c_i64), ("n", _c_i32), ("m", _c_i32),
        ("bits", _c_i32), ("per", _c_i32), ("G", _c_i64), ("iw", _c_i64),
        ("vals", _c_p), ("idx", _c_p),
    ]


class NMGrouped(ctypes.Structure):
    _fields_ = [
        ("N", _c_i64), ("K", _c_i64), ("n", _c_i32), ("m", _c_i32), ("bits", _c_i32), ("per", _c_i32),
        ("Q", _c_i64), ("iw", _c_i64), ("vals", _c_p), ("idx", _c_p), ("perm", _c_p),
    ]


class NMColGrouped(ctypes.Structure):
    _fields_ = [
        ("N", _c_i64), ("K", _c_i64), ("n", _c_i32), ("m", _c_i32), ("P", _c_i32), ("vtype", _c_i32),
        ("Nb", _c_i64), ("L", _c_i64), ("vals", _c_p), ("cols", _c_p), ("pats", _c_p),
        # the forward's tile-major packed copy (sten_nm._cg_tiles), NULL / 0 when unused
        ("tiles", _c_p), ("tile_kt", _c_i64),
    ]


GROUP_ROWS = 16  # NM_GR in csrc/nm_kernel.h

_lib: Optional[ctypes.CDLL] = None
_error: Optional[str] = None
_threading_note: Optional[str] = None

_OPENMP_RUNTIME = re.compile(r"/lib(gomp|iomp5|omp)[^/]*\.so[^/]*$")


def _library_path() -> str:
    """The kernel library: ``STEN_NM_LIBRARY`` (e.g. the ASan build), else the extension."""
    path = os.environ.get("STEN_NM_LIBRARY")
    if path:
        return path
    from . import _nmkernel  # the compiled extension (a normal CPython module)

    return _nmkernel.__file__


@functools.lru_cache(maxsize=None)
def build_id() -> str:
    """A digest of the kernel library's bytes (a rebuilt extension gets a new one), or
    ``"none"`` when it cannot be read. Example: ``len(build_id()) in (4, 12)``."""
    try:
        with open(_library_path(), "rb") as f:
            return hashlib.sha1(f.read()).hexdigest()[:12]
    except (OSError, ImportError):
        return "none"


def _declare(lib: ctypes.CDLL) -> None:
    P, PG = ctypes.POINTER(NMMat), ctypes.POINTER(NMGrouped)
    lib.nm_gather_f32.argtypes = [P, _c_i64, _c_p, _c_i64, _c_p, _c_i64, _c_p, ctypes.c_int]
    lib.nm_scatter_f32.argtypes = [P, _c_i64, _c_p, _c_i64, _c_p, _c_i64, _c_p, ctypes.c_int]
    lib.nm_tgather_f32.argtypes = [P, _c_i64, _c_p, _c_i64, _c_p, _c_i64, _c_p, ctypes.c_int]
    lib.nm_sddmm_f32.argtypes = [P, _c_i64, _c_p, _c_i64, _c_p, _c_i64, _c_p, ctypes.c_int]
    lib.nm_compress_f32.argtypes = [_c_i64, _c_i64, _c_i32, _c_i32, _c_p, _c_i64, _c_p, _c_p, ctypes.c_int]
    lib.nm_compress_mask_f32.argtypes = [_c_i64, _c_i64, _c_i32, _c_i32, _c_p, _c_i64, _c_p, _c_p, _c_p, ctypes.c_int]
    lib.nm_decompress_f32.argtypes = [P, _c_p, _c_i64, ctypes.c_int]
    lib.nm_values_at_f32.argtypes = [P, _c_p, _c_i64, _c_p, ctypes.c_int]
    lib.nm_grouped_gather_f32.argtypes = [PG, _c_i64, _c_p, _c_i64, _c_p, _c_i64, _c_p, ctypes.c_int]
    lib.nm_grouped_sddmm_f32.argtypes = [PG, _c_i64, _c_p, _c_i64, _c_p, _c_i64, _c_p, ctypes.c_int]
    lib.nm_grouped_tgather_f32.argtypes = [PG, _c_i64, _c_p, _c_i64, _c_p, _c_i64, ctypes.c_int]
    lib.nm_colgrouped_gather_f32.argtypes = [ctypes.POINTER(NMColGrouped), _c_i64, _c_p, _c_i64, _c_p, _c_i64,
                                             _c_p, ctypes.c_int]
    lib.nm_colgrouped_gather_f32.restype = ctypes.c_int
    lib.nm_colgrouped_gather_variant_f32.argtypes = lib.nm_colgrouped_gather_f32.argtypes + [ctypes.c_int]
    lib.nm_colgrouped_gather_variant_f32.restype = ctypes.c_int
    _declare_extra(lib)
    for name in ("nm_isa", "nm_threading", "nm_openmp_library"):
        getattr(lib, name).restype = ctypes.c_char_p
    lib.nm_set_isa.argtypes = [ctypes.c_char_p]
    lib.nm_set_threading.argtypes = [ctypes.c_char_p]
    for name in ("nm_gather_f32", "nm_scatter_f32", "nm_tgather_f32", "nm_sddmm_f32", "nm_compress_f32",
                 "nm_compress_mask_f32", "nm_decompress_f32", "nm_values_at_f32", "nm_set_isa",
                 "nm_set_threading", "nm_grouped_gather_f32", "nm_grouped_sddmm_f32", "nm_grouped_tgather_f32",
                 "nm_index_bits", "nm_index_per_word"):
        getattr(lib, name).restype = ctypes.c_int


def loaded_openmp_runtimes() -> list[str]:
    """Files of the OpenMP runtimes mapped into this process (Linux; [] elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if ".so" in line}
    except OSError:
        return []
    return sorted(os.path.realpath(p) for p in paths if _OPENMP_RUNTIME.search(p))


def _pick_threading(lib: ctypes.CDLL, runtimes: Optional[list[str]] = None) -> Optional[str]:
    """Run on PyTorch's OpenMP pool where the kernels share it; where the process holds
    another OpenMP runtime too (a torch wheel with a renamed libgomp), a second pool would
    spin beside torch's: use threads of our own, created per call. Returns the reason."""
    ours = lib.nm_openmp_library()
    if ours is None:
        return "built without OpenMP: threads of its own (pthreads)"
    ours_path = os.path.realpath(ours.decode()) if ours else ""
    others = [p for p in (loaded_openmp_runtimes() if runtimes is None else runtimes) if p != ours_path]
    if others:
        lib.nm_set_threading(b"pthreads")
        return (f"a second OpenMP runtime is loaded ({', '.join(others)}) beside the kernels' "
                f"({ours_path or 'unknown'}): threads of its own (pthreads) instead of a second pool")
    lib.nm_set_threading(b"openmp")
    return None


def _load() -> ctypes.CDLL:
    global _lib, _error, _threading_note
    if _lib is not None:
        return _lib
    if _error is not None:
        raise RuntimeError(_error)
    try:
        lib = ctypes.CDLL(_library_path())
        _declare(lib)
    except Exception as exc:  # no build (no C compiler), a broken or foreign library
        _error = f"sten_nm C extension not available: {type(exc).__name__}: {exc}"
        raise RuntimeError(_error) from exc
    _threading_note = _pick_threading(lib)
    _lib = lib
    forced = os.environ.get("STEN_NM_ISA")
    if forced and lib.nm_isa().decode() != forced:
        warnings.warn(f"STEN_NM_ISA={forced!r} is not an instruction set this CPU runs "
                      f"({', '.join(supported_isas())}); using {isa()!r}", RuntimeWarning, stacklevel=2)
    return lib


def reset() -> None:
    """Forget the loaded library and any load error (the next call loads again; for tests)."""
    global _lib, _error, _threading_note
    _lib, _error, _threading_note = None, None, None


def available() -> tuple[bool, Optional[str]]:
    """(True, None) if the C library loads, else (False, reason)."""
    try:
        _load()
        return True, None
    except RuntimeError as exc:
        return False, str(exc)


def threading_mode() -> tuple[str, Optional[str]]:
    """How the kernels run in parallel: ``("openmp" | "pthreads", why not OpenMP or None)``."""
    lib = _load()
    return lib.nm_threading().decode(), _threading_note


def isa() -> str:
    """Instruction set picked at run time: ``"avx512"``, ``"avx2"`` or ``"generic"``."""
    return _load().nm_isa().decode()


def set_isa(name: str) -> None:
    """Force an instruction set (for tests and benchmarks); ``STEN_NM_ISA`` does it at load."""
    if _load().nm_set_isa(name.encode()) != 0:
        raise ValueError(f"isa {name!r} is not supported on this machine (supported: {supported_isas()})")


ISAS = ("generic", "avx2", "avx512")


def supported_isas() -> list[str]:
    """The instruction sets this CPU can run, portable first (the last is the default).

    >>> supported_isas()[0]
    'generic'
    """
    lib, current = _load(), isa()
    try:
        return [name for name in ISAS if lib.nm_set_isa(name.encode()) == 0]
    finally:
        lib.nm_set_isa(current.encode())


def index_bits(m: int) -> int:
    """Bits per stored offset for group size ``m``."""
    return max(1, (m - 1).bit_length())


def index_per_word(m: int) -> int:
    """Offsets packed in one 32-bit word."""
    return 32 // index_bits(m)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def ptr(t: Optional[torch.Tensor], what: str) -> Optional[int]:
    """The address a C kernel reads or writes ``t`` at (``None`` for ``None``): the one place a
    tensor becomes a pointer. A tensor without CPU data (the meta device, whose address is 0, a
    GPU, a tensor that ``torch.compile`` traces) raises a ``ValueError`` naming ``what`` instead
    of crashing the process.

    >>> ptr(torch.ones(1, device="meta"), "nm_gather: x")
    Traceback (most recent call last):
    ValueError: nm_gather: x is on the meta device, ...
    """
    if t is None:
        return None
    if t.is_cpu:
        try:   # (a FakeTensor's storage is on meta; a functional tensor's address is 0)
            address = t.data_ptr() if type(t) in _PLAIN or t.untyped_storage().device.type == "cpu" else 0
        except RuntimeError:   # no storage (a functorch batched tensor)
            address = 0
        if address or t.numel() == 0:
            return address
    if t.is_cpu:   # a CPU tensor whose data is not its own: a torch.func transform's or a tracer's
        raise ValueError(f"{what} is a CPU tensor without data of its own ({type(t).__name__}: a torch.func "
                         f"transform's or a tracer's), which the sten_nm C kernels cannot read. Under "
                         f"torch.func, differentiate with respect to dense inputs with the n:m weights frozen "
                         f"(requires_grad_(False)), or take the weights' gradients with torch.autograd")
    where = ("the meta device, which holds no data" if t.is_meta
             else f"device {t.device} ({type(t).__name__} without CPU data)")
    raise ValueError(f"{what} is on {where}; the sten_nm C kernels read CPU tensors only. Move the "
                     f"layout (and the operands) to the CPU first, e.g. module.to_empty(device='cpu') "
                     f"after building on the meta device, then load the weights")


def can_read(*ts: torch.Tensor) -> bool:
    """Whether the C kernels may stand in for torch ops on ``ts``: plain CPU tensors that
    autograd (backward or forward mode), torch.func and tracers do not follow, with no lazy
    negation or conjugation, and the library loaded.

    >>> can_read(torch.ones(2, requires_grad=True))
    False
    """
    return all(type(t) in _PLAIN and t.is_cpu and not (t.requires_grad and torch.is_grad_enabled())
               and not t.is_neg() and not t.is_conj()
               and not torch._C._functorch.is_functorch_wrapped_tensor(t) and unpack_dual(t).tangent is None
               for t in ts) and available()[0]


def empty(shape: tuple, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A kernel's output buffer: on the CPU, also under a ``torch.device("meta")`` default."""
    return torch.empty(shape, dtype=dtype, device="cpu")


def _threads(nthreads: Optional[int]) -> int:
    return torch.get_num_threads() if nthreads is None else int(nthreads)


def _check(rc: int, what: str) -> None:
    if rc == -2:
        raise ValueError(f"{what}: the mask keeps more than n of some group of m")
    if rc == -3:
        raise MemoryError(f"{what}: out of memory")
    if rc != 0:
        raise RuntimeError(f"{what}: kernel rejected its arguments (code {rc})")


def mat(values: torch.Tensor, indices: torch.Tensor, R: int, C: int, n: int, m: int) -> NMMat:
    """The C descriptor of an n:m matrix (float32 contiguous values, int32 indices)."""
    G = -(-C // m)
    per = index_per_word(m)
    desc = NMMat(R, C, n, m, index_bits(m), per, G, -(-G * n // per), ptr(values, "NMTensor values"),
                 ptr(indices, "NMTensor indices"))
    desc._keep = (values, indices)  # the descriptor keeps its buffers alive
    return desc


def _rowmajor(t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.float32:
        t = t.float()
    if t.stride(-1) != 1 or (t.dim() == 2 and t.size(0) > 1 and t.stride(0) < t.size(1)):
        t = t.contiguous()
    return t


def _product(kernel: Callable[..., int], what: str, desc: ctypes.Structure, inp: torch.Tensor, out_cols: int,
             bias: Optional[torch.Tensor], nthreads: Optional[int], *extra: int) -> torch.Tensor:
    """``out`` ``[B, out_cols]`` float32 from the C product ``kernel(desc, B, inp, ld_in, out,
    ld_out, bias, threads, *extra)`` of ``inp`` ``[B, *]`` (made float32 row-major); errors name ``what``."""
    inp = _rowmajor(inp)
    out = empty((inp.shape[0], out_cols))
    b = bias.contiguous().float() if bias is not None else None
    rc = kernel(ctypes.byref(desc), inp.shape[0], ptr(inp, f"{what}: input"), inp.stride(0), ptr(out, f"{what}: out"),
                out.stride(0) if out_cols else 1, ptr(b, f"{what}: bias"), _threads(nthreads), *extra)
    _check(rc, what)
    return out


def _require_bf16_values(desc: ctypes.Structure, fn: str) -> None:
    """``fn``'s check that ``desc`` describes contiguous bfloat16 values (a ``ValueError`` otherwise)."""
    vals = getattr(desc, "_keep", (None,))[0]
    if vals is None or vals.dtype != torch.bfloat16 or not vals.is_contiguous():
        got = "no values" if vals is None else f"{vals.dtype}{'' if vals.is_contiguous() else ', not contiguous'}"
        raise ValueError(f"{fn} needs a descriptor of contiguous bfloat16 values, got {got}")


def gather(A: NMMat, X: torch.Tensor, bias: Optional[torch.Tensor] = None, nthreads: Optional[int] = None) -> torch.Tensor:
    """``Y[b, r] = sum_c A[r, c] X[b, c] (+ bias[r])`` for X ``[B, C]``."""
    return _product(_load().nm_gather_f32, "nm_gather", A, X, A.R, bias, nthreads)


def scatter(A: NMMat, Y: torch.Tensor, bias: Optional[torch.Tensor] = None, nthreads: Optional[int] = None) -> torch.Tensor:
    """``X[b, c] = sum_r A[r, c] Y[b, r] (+ bias[c])`` for Y ``[B, R]``."""
    return _product(_load().nm_scatter_f32, "nm_scatter", A, Y, A.C, bias, nthreads)


def tgather(A: NMMat, Y: torch.Tensor, bias: Optional[torch.Tensor] = None, nthreads: Optional[int] = None) -> torch.Tensor:
    """Same as :func:`scatter` (``X = Y A``) through a transposed copy of A (register accumulation)."""
    return _product(_load().nm_tgather_f32, "nm_tgather", A, Y, A.C, bias, nthreads)


def sddmm(A: NMMat, Y: torch.Tensor, X: torch.Tensor, nthreads: Optional[int] = None) -> torch.Tensor:
    """``out[r, j] = sum_b Y[b, r] X[b, c_j]`` at A's stored positions, ``[R, G*n]``."""
    Y, X = _rowmajor(Y), _rowmajor(X)
    out = empty((A.R, A.G * A.n))
    rc = _load().nm_sddmm_f32(ctypes.byref(A), Y.shape[0], ptr(Y, "nm_sddmm: Y"), Y.stride(0), ptr(X, "nm_sddmm: X"),
                              X.stride(0), ptr(out, "nm_sddmm: out"), _threads(nthreads))
    _check(rc, "nm_sddmm")
    return out


def compress(D: torch.Tensor, n: int, m: int, mask: Optional[torch.Tensor] = None,
             nthreads: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Values ``[R, G*n]`` and packed indices ``[R, iw]`` (int32) of dense ``D [R, C]``."""
    if not available()[0]:   # no C library: the same result in torch
        from . import _portable

        return _portable.compress(D, n, m, mask)
    D = _rowmajor(D)
    R, C = D.shape
    G = -(-C // m)
    per = index_per_word(m)
    vals = empty((R, G * n))
    idx = empty((R, -(-G * n // per)), torch.int32)
    lib = _load()
    d, v, i = ptr(D, "nm_compress: dense"), ptr(vals, "nm_compress: values"), ptr(idx, "nm_compress: indices")
    if mask is None:
        rc = lib.nm_compress_f32(R, C, n, m, d, D.stride(0), v, i, _threads(nthreads))
    else:
        mk = mask.to(torch.uint8).contiguous()
        rc = lib.nm_compress_mask_f32(R, C, n, m, d, D.stride(0), ptr(mk, "nm_compress: mask"), v, i,
                                      _threads(nthreads))
    _check(rc, "nm_compress")
    return vals, idx


def values_at(A: NMMat, D: torch.Tensor, nthreads: Optional[int] = None) -> torch.Tensor:
    """The entries of dense ``D`` ``[R, C]`` at A's stored positions, ``[R, G*n]`` float32
    (0 in the padding); A's values are not read."""
    D = _rowmajor(D)
    if tuple(D.shape) != (A.R, A.C):
        raise ValueError(f"nm_values_at: dense must be of shape {(A.R, A.C)}, got {tuple(D.shape)}")
    out = empty((A.R, A.G * A.n))
    _check(_load().nm_values_at_f32(ctypes.byref(A), ptr(D, "nm_values_at: dense"), D.stride(0) if A.C else 1,
                                    ptr(out, "nm_values_at: out"), _threads(nthreads)), "nm_values_at")
    return out


def decompress(A: NMMat, nthreads: Optional[int] = None) -> torch.Tensor:
    """Dense ``[R, C]`` float32 tensor of A."""
    D = empty((A.R, A.C))
    _check(_load().nm_decompress_f32(ctypes.byref(A), ptr(D, "nm_decompress: out"), D.stride(0) if A.C else 1,
                                     _threads(nthreads)), "nm_decompress")
    return D


def grouped(vals: torch.Tensor, indices: torch.Tensor, perm: torch.Tensor, N: int, K: int, n: int, m: int) -> NMGrouped:
    """C descriptor of a grouped n:m matrix (see ``GroupedNMTensor``)."""
    G = -(-K // m)
    per = index_per_word(m)
    desc = NMGrouped(N, K, n, m, index_bits(m), per, -(-N // GROUP_ROWS), -(-G * n // per),
                     ptr(vals, "GroupedNMTensor values"), ptr(indices, "GroupedNMTensor indices"),
                     ptr(perm, "GroupedNMTensor perm"))
    desc._keep = (vals, indices, perm)
    return desc


def grouped_gather(W: NMGrouped, X: torch.Tensor, bias: Optional[torch.Tensor] = None,
                   nthreads: Optional[int] = None) -> torch.Tensor:
    """``Y = X W^T (+ bias)`` for a grouped n:m ``W`` ``[N, K]``, X ``[B, K]``."""
    return _product(_load().nm_grouped_gather_f32, "nm_grouped_gather", W, X, W.N, bias, nthreads)


def grouped_sddmm(W: NMGrouped, dY: torch.Tensor, X: torch.Tensor, nthreads: Optional[int] = None) -> torch.Tensor:
    """Gradient of a grouped ``W``'s stored values for ``Y = X W^T``: ``[Q, G*n, 16]``, the layout's order."""
    dY, X = _rowmajor(dY), _rowmajor(X)
    G = -(-W.K // W.m)
    out = empty((W.Q, G * W.n, GROUP_ROWS))
    rc = _load().nm_grouped_sddmm_f32(ctypes.byref(W), dY.shape[0], ptr(dY, "nm_grouped_sddmm: dY"), dY.stride(0),
                                      ptr(X, "nm_grouped_sddmm: X"), X.stride(0), ptr(out, "nm_grouped_sddmm: out"),
                                      _threads(nthreads))
    _check(rc, "nm_grouped_sddmm")
    return out


def grouped_tgather(W: NMGrouped, dY: torch.Tensor, nthreads: Optional[int] = None) -> torch.Tensor:
    """Input gradient for a grouped ``W`` ``[N, K]``: ``dX = dY W``, ``[B, K]``."""
    dY = _rowmajor(dY)
    dX = empty((dY.shape[0], W.K))
    rc = _load().nm_grouped_tgather_f32(ctypes.byref(W), dY.shape[0], ptr(dY, "nm_grouped_tgather: dY"), dY.stride(0),
                                        ptr(dX, "nm_grouped_tgather: out"),
                                        dX.stride(0) if W.K else 1, _threads(nthreads))
    _check(rc, "nm_grouped_tgather")
    return dX


VTYPES = {torch.float32: 0, torch.bfloat16: 1}  # NM_F32, NM_BF16 in csrc/nm_kernel.h
CG_VARIANTS = {"auto": 0, "stream": 1, "tiled": 2}  # NM_CG_AUTO, NM_CG_STREAM, NM_CG_TILED


def colgrouped(vals: torch.Tensor, cols: torch.Tensor, pats: torch.Tensor, N: int, K: int, n: int, m: int) -> NMColGrouped:
    """C descriptor of a column-grouped n:m matrix (see ``ColumnGroupedNMTensor``): float32 or
    bfloat16 contiguous ``vals [Nb, P, n, L]`` (bf16 is widened in the kernel, fp32
    accumulation), int32 ``cols [Nb, P, L]`` and ``pats [P, n]``."""
    if vals.dtype not in VTYPES or not vals.is_contiguous():
        raise ValueError(f"vals must be contiguous float32 or bfloat16, got {vals.dtype}")
    Nb, P, _, L = vals.shape
    desc = NMColGrouped(N, K, n, m, P, VTYPES[vals.dtype], Nb, L, ptr(vals, "ColumnGroupedNMTensor values"),
                        ptr(cols, "ColumnGroupedNMTensor columns"), ptr(pats, "ColumnGroupedNMTensor patterns"))
    desc._keep = (vals, cols, pats)
    return desc


def colgrouped_gather(W: NMColGrouped, X: torch.Tensor, bias: Optional[torch.Tensor] = None,
                      nthreads: Optional[int] = None, variant: str = "auto") -> torch.Tensor:
    """``Y = X W^T (+ bias)`` for a column-grouped n:m ``W`` ``[N, K]``, X ``[B, K]``.

    ``variant`` picks the kernel's loop order (same result): ``"stream"`` (every slot per
    pass, x from L2 with prefetch), ``"tiled"`` (an L1 tile of x columns swept by many row
    blocks, the original STen's order) or ``"auto"`` (``STEN_NM_CG_VARIANT``, else stream).
    """
    if variant not in CG_VARIANTS:
        raise ValueError(f"variant must be one of {sorted(CG_VARIANTS)}, got {variant!r}")
    return _product(_load().nm_colgrouped_gather_variant_f32, "nm_colgrouped_gather", W, X, W.N, bias, nthreads,
                    CG_VARIANTS[variant])


def _declare_extra(lib: ctypes.CDLL) -> None:
    """Signatures of the kernels added after the first set (column-grouped backward)."""
    PC = ctypes.POINTER(NMColGrouped)
    lib.nm_colgrouped_grad_input_f32.argtypes = [PC, _c_i64, _c_p, _c_i64, _c_p, _c_i64, ctypes.c_int]
    lib.nm_colgrouped_grad_input_f32.restype = ctypes.c_int
    lib.nm_colgrouped_grad_values_f32.argtypes = [PC, _c_i64, _c_p, _c_i64, _c_p, _c_i64, _c_p, ctypes.c_int]
    lib.nm_colgrouped_grad_values_f32.restype = ctypes.c_int
    lib.nm_gather_bf16w.argtypes = [ctypes.POINTER(NMMat), _c_i64, _c_p, _c_i64, _c_p, _c_i64, _c_p, ctypes.c_int]
    lib.nm_gather_bf16w.restype = ctypes.c_int
    lib.nm_f32_to_bf16.argtypes = [_c_p, _c_p, _c_i64, ctypes.c_int]
    lib.nm_f32_to_bf16.restype = ctypes.c_int
    lib.nm_grouped_gather_bf16w.argtypes = [ctypes.POINTER(NMGrouped), _c_i64, _c_p, _c_i64, _c_p, _c_i64, _c_p,
                                            ctypes.c_int]
    lib.nm_grouped_gather_bf16w.restype = ctypes.c_int
    lib.nm_colgrouped_tiles_bytes.argtypes = [PC, _c_i64]
    lib.nm_colgrouped_tiles_bytes.restype = _c_i64
    lib.nm_colgrouped_pack_tiles.argtypes = [PC, _c_i64, _c_p, _c_i64]
    lib.nm_colgrouped_pack_tiles.restype = ctypes.c_int
    lib.nm_colgrouped_tile_kt.argtypes = [PC, _c_i64, ctypes.c_int, ctypes.c_int]
    lib.nm_colgrouped_tile_kt.restype = _c_i64
    lib.nm_colgrouped_decompress_f32.argtypes = [PC, _c_p, _c_i64, ctypes.c_int]
    lib.nm_colgrouped_decompress_f32.restype = ctypes.c_int
    lib.nm_colgrouped_values_at_f32.argtypes = [PC, _c_p, _c_i64, _c_p, ctypes.c_int]
    lib.nm_colgrouped_values_at_f32.restype = ctypes.c_int


def colgrouped_decompress(W: NMColGrouped, nthreads: Optional[int] = None) -> torch.Tensor:
    """The dense ``[N, K]`` float32 matrix of a column-grouped ``W`` with float32 values."""
    D = empty((W.N, W.K))
    _check(_load().nm_colgrouped_decompress_f32(ctypes.byref(W), ptr(D, "nm_colgrouped_decompress: out"),
                                                D.stride(0) if W.K else 0, _threads(nthreads)),
           "nm_colgrouped_decompress")
    return D


def colgrouped_values_at(W: NMColGrouped, D: torch.Tensor, nthreads: Optional[int] = None) -> torch.Tensor:
    """The entries of dense ``D`` ``[N, K]`` at a column-grouped ``W``'s stored positions,
    float32 ``[Nb, P, n, L]`` (0 at padding); W's values are not read."""
    D = _rowmajor(D)
    if tuple(D.shape) != (W.N, W.K):
        raise ValueError(f"nm_colgrouped_values_at: dense must be of shape {(W.N, W.K)}, got {tuple(D.shape)}")
    out = empty((W.Nb, W.P, W.n, W.L))
    _check(_load().nm_colgrouped_values_at_f32(ctypes.byref(W), ptr(D, "nm_colgrouped_values_at: dense"),
                                               D.stride(0) if W.K else 0, ptr(out, "nm_colgrouped_values_at: out"),
                                               _threads(nthreads)), "nm_colgrouped_values_at")
    return out


def colgrouped_grad_input(W: NMColGrouped, dY: torch.Tensor, nthreads: Optional[int] = None) -> torch.Tensor:
    """Input gradient for a column-grouped ``W`` ``[N, K]``: ``dX = dY W``, ``[B, K]`` float32."""
    dY = _rowmajor(dY)
    dX = empty((dY.shape[0], W.K))
    rc = _load().nm_colgrouped_grad_input_f32(ctypes.byref(W), dY.shape[0], ptr(dY, "nm_colgrouped_grad_input: dY"),
                                              dY.stride(0) if W.N else 1, ptr(dX, "nm_colgrouped_grad_input: out"),
                                              dX.stride(0) if W.K else 1, _threads(nthreads))
    _check(rc, "nm_colgrouped_grad_input")
    return dX


def colgrouped_grad_values(W: NMColGrouped, dY: torch.Tensor, X: torch.Tensor,
                           nthreads: Optional[int] = None) -> torch.Tensor:
    """Gradient of a column-grouped ``W``'s stored values for ``Y = X Wᵀ`` (``dYᵀ X`` at the
    kept positions only): float32 ``[Nb, P, n, L]``, the layout's order."""
    dY, X = _rowmajor(dY), _rowmajor(X)
    out = empty((W.Nb, W.P, W.n, W.L))
    what = "nm_colgrouped_grad_values"
    rc = _load().nm_colgrouped_grad_values_f32(ctypes.byref(W), dY.shape[0], ptr(dY, f"{what}: dY"),
                                               dY.stride(0) if W.N else 1, ptr(X, f"{what}: X"),
                                               X.stride(0) if W.K else 1, ptr(out, f"{what}: out"), _threads(nthreads))
    _check(rc, "nm_colgrouped_grad_values")
    return out


def gather_bf16w(A: NMMat, X: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 nthreads: Optional[int] = None) -> torch.Tensor:
    """:func:`gather` for a descriptor whose values are bfloat16 (``mat`` of bf16 contiguous
    values): widened per block of rows in the kernel, float32 accumulation, float32 result."""
    _require_bf16_values(A, "gather_bf16w")
    return _product(_load().nm_gather_bf16w, "nm_gather_bf16w", A, X, A.R, bias, nthreads)


def to_bf16(x: torch.Tensor, nthreads: Optional[int] = None) -> torch.Tensor:
    """A float32 tensor rounded to bfloat16 as ``x.to(torch.bfloat16)`` (nearest even, the
    same bits; NaN as 0x7fc0), on the kernels' threads (a kernel's output under bf16 autocast)."""
    if x.dtype != torch.float32:
        raise ValueError(f"x must be float32, got {x.dtype}")
    x = x.contiguous()
    y = empty(x.shape, torch.bfloat16)
    _check(_load().nm_f32_to_bf16(ptr(x, "nm_f32_to_bf16: x"), ptr(y, "nm_f32_to_bf16: out"), x.numel(),
                                  _threads(nthreads)), "nm_f32_to_bf16")
    return y


def grouped_gather_bf16w(W: NMGrouped, X: torch.Tensor, bias: Optional[torch.Tensor] = None,
                         nthreads: Optional[int] = None) -> torch.Tensor:
    """:func:`grouped_gather` for a descriptor of bfloat16 values (``grouped`` of bf16
    contiguous ``vals``): widened per row group and chunk in the kernel, float32 result."""
    _require_bf16_values(W, "grouped_gather_bf16w")
    return _product(_load().nm_grouped_gather_bf16w, "nm_grouped_gather_bf16w", W, X, W.N, bias, nthreads)
