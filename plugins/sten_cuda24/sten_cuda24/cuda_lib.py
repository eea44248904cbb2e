"""Build ``csrc/sparsify24.cu`` with nvcc on first use and call it through ctypes.

The shared library goes to ``$STEN_CUDA24_CACHE`` (default
``~/.cache/sten_cuda24``), named by a hash of the source and flags, so a
changed source rebuilds and concurrent processes do not clash (atomic rename).
No torch C++ extension is involved: tensors are passed as raw pointers with the
current CUDA stream.

Example (needs nvcc and a GPU):
    >>> packed, meta, pt, mt, dense = sparsify24_cuda(w, transposable=True)   # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from sten_core.plugin_api import check_tensor

from . import _compat, encoding

SOURCE = Path(__file__).parent / "csrc" / "sparsify24.cu"
ARCHS = ("80", "90")
DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
_lib: ctypes.CDLL | None = None
_lock = threading.Lock()


def gencode_flags(archs: tuple[str, ...] = ARCHS) -> list[str]:
    """``-gencode`` flags: SASS for each arch plus PTX of the newest (forward compatible)."""
    flags = []
    for arch in archs:
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    flags += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
    return flags


def cache_dir() -> Path:
    return Path(os.environ.get("STEN_CUDA24_CACHE", Path.home() / ".cache" / "sten_cuda24"))


def compile_command(nvcc: str, out: str, shared: bool = True, archs: tuple[str, ...] = ARCHS) -> list[str]:
    cmd = [nvcc, "-O3", "-std=c++17", "-Xcompiler", "-fPIC"] + gencode_flags(archs)
    cmd += ["-shared", "-o", out, str(SOURCE)] if shared else ["-c", "-o", out, str(SOURCE)]
    return cmd


def build(force: bool = False) -> Path:
    """Compile the library (if not cached) and return its path."""
    nvcc = _compat.nvcc_path()
    if nvcc is None:
        raise RuntimeError("the CUDA 2:4 sparsifier needs nvcc to build (set STEN_NVCC or CUDA_HOME, or put nvcc on PATH)")
    flags = " ".join(compile_command("nvcc", "out"))
    digest = hashlib.sha256(SOURCE.read_bytes() + flags.encode()).hexdigest()[:16]
    target = cache_dir() / f"libsten_cuda24_{digest}.so"
    if target.exists() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmp_out = os.path.join(tmp, target.name)
        proc = subprocess.run(compile_command(nvcc, tmp_out), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed to build {SOURCE.name}:\n{proc.stderr[-4000:]}")
        os.replace(tmp_out, target)
    return target


def load() -> ctypes.CDLL:
    """The loaded library (built on first use)."""
    global _lib
    with _lock:
        if _lib is None:
            lib = ctypes.CDLL(str(build()))
            p, i = ctypes.c_void_p, ctypes.c_int
            lib.sten24_rows.argtypes = [p, p, p, p, i, i, i, p]
            lib.sten24_rows.restype = i
            lib.sten24_transposable.argtypes = [p, p, p, p, p, p, i, i, i, p]
            lib.sten24_transposable.restype = i
            lib.sten24_error_string.argtypes = [i]
            lib.sten24_error_string.restype = ctypes.c_char_p
            _lib = lib
    return _lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def sparsify24_cuda(
    x: torch.Tensor, transposable: bool = False, write_dense: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """2:4-prune a CUDA matrix ``[R, K]`` in one pass.

    Returns ``(packed, meta, packed_t, meta_t, pruned_dense)``; the transposed
    pair (of ``pruned.T``) only when ``transposable`` (the mask is then 2:4
    along both dims), the dense tensor only when ``write_dense``.
    """
    check_tensor(x, "x", where="the CUDA 2:4 sparsifier")
    if x.dtype not in DTYPE_CODES:
        raise TypeError(f"the CUDA 2:4 sparsifier supports float16, bfloat16, float32; got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"the CUDA 2:4 sparsifier takes a 2-D [rows, K] tensor, got {x.dim()}-D")
    _compat.require_cuda(x, "the CUDA 2:4 sparsifier")
    if x.shape[0] >= 2**31 or x.shape[1] >= 2**31:
        raise ValueError("the CUDA 2:4 sparsifier supports dims < 2**31")
    x = x.contiguous()
    r, k = x.shape
    w = encoding.padded_k(k) // encoding.WORD
    packed = torch.empty(r, w * 8, dtype=x.dtype, device=x.device)
    meta = torch.empty(r, w, dtype=torch.int16, device=x.device)
    dense = torch.empty_like(x) if write_dense else None
    lib = load()
    stream = ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream)
    with torch.cuda.device(x.device):
        if transposable:
            wt = encoding.padded_k(r) // encoding.WORD
            packed_t = torch.empty(k, wt * 8, dtype=x.dtype, device=x.device)
            meta_t = torch.empty(k, wt, dtype=torch.int16, device=x.device)
            err = lib.sten24_transposable(_ptr(x), _ptr(packed), _ptr(meta), _ptr(packed_t), _ptr(meta_t), _ptr(dense), r, k, DTYPE_CODES[x.dtype], stream)
        else:
            packed_t = meta_t = None
            err = lib.sten24_rows(_ptr(x), _ptr(packed), _ptr(meta), _ptr(dense), r, k, DTYPE_CODES[x.dtype], stream)
    if err != 0:
        raise RuntimeError(f"CUDA 2:4 sparsifier failed: {lib.sten24_error_string(err).decode()}")
    return packed, meta, packed_t, meta_t, dense
