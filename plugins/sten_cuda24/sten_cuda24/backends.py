"""2:4 sparse × dense matmul on the GPU: cuSPARSELt first, CUTLASS second.

``linear(x, weight, bias)`` computes ``x @ weight.T + bias`` for a 2-D
``Sparse24Tensor`` weight on CUDA. Shapes the backends cannot take are
zero-padded inside (weight rows to 32, columns to 64, tokens to 16) and the
result is cut back. The matmul operand is prepared once per weight and cached
on it; cuSPARSELt's algorithm is searched once per problem shape
(``torch._cslt_sparse_mm_search``) and cached in ``ALG_CACHE``.

fp32 runs on CUTLASS when the mask is 1:2 (one value per pair), else on the
dense fallback (decompress + cuBLAS) with reason recorded in ``last_path``.

Example (needs a GPU):
    >>> w = Sparse24Tensor.from_dense(pruned.half().cuda())    # doctest: +SKIP
    >>> y = linear(x.half().cuda(), w)                          # doctest: +SKIP
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import _compat, encoding
from .sparse24 import Sparse24Tensor

ROW_ALIGN, COL_ALIGN, TOKEN_ALIGN = 32, 64, 16
ALG_CACHE: dict[tuple, int] = {}
_lock = threading.Lock()
last_path: dict[str, str] = {}
"""The path the last ``linear`` call took: ``{"path": ..., "why": ...}`` (for tests/benchmarks)."""


@dataclass
class Prepared:
    """A weight ready for one backend (padded to ``(n_pad, k_pad)``)."""

    backend: str
    n: int
    k: int
    n_pad: int
    k_pad: int
    compressed: torch.Tensor | None = None  # cuSPARSELt
    packed: torch.Tensor | None = None      # CUTLASS
    meta: torch.Tensor | None = None        # CUTLASS (reordered)


def _round_up(v: int, m: int) -> int:
    return -(-v // m) * m


def prepare(weight: Sparse24Tensor, backend: str | None = None) -> Prepared | None:
    """The backend operand for ``weight`` (cached on it), or ``None`` for the dense fallback."""
    if len(weight.shape) != 2:
        raise ValueError(f"a 2:4 weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    _compat.require_cuda(weight.packed, "the 2:4 semi-structured matmul")
    backend = backend or _compat.semi_structured_backend()
    dtype = weight.dtype
    if backend == "cusparselt" and dtype == torch.float32:
        backend = "cutlass" if _compat.has_cutlass() else None
    if backend is None:
        return None
    key = ("prepared", backend, weight.packed.data_ptr(), weight.packed._version)
    hit = weight._cache.get(key)
    if hit is not None:
        return hit
    n, k = weight.shape
    n_pad, k_pad = _round_up(n, ROW_ALIGN), _round_up(k, COL_ALIGN)
    dense = F.pad(weight.to_dense(), (0, k_pad - k, 0, n_pad - n)).contiguous()
    if backend == "cusparselt":
        prep = Prepared(backend, n, k, n_pad, k_pad, compressed=torch._cslt_compress(dense))
    elif dtype == torch.float32:
        if not encoding.is_one_of_two(dense):
            return None
        packed, meta = encoding.fp32_to_cutlass(dense)
        prep = Prepared(backend, n, k, n_pad, k_pad, packed=packed, meta=meta)
    else:
        packed, meta = encoding.compress(dense)
        prep = Prepared(backend, n, k, n_pad, k_pad, packed=packed, meta=encoding.cutlass_reorder(meta))
    weight._cache = {kk: v for kk, v in weight._cache.items() if kk[0] != "prepared"}
    weight._cache[key] = prep
    return prep


def _cslt_alg(prep: Prepared, dense_b: torch.Tensor, bias: torch.Tensor | None) -> int:
    search = _compat.private_op("_cslt_sparse_mm_search")
    if search is None:
        return 0
    key = (prep.n_pad, prep.k_pad, dense_b.shape[1], dense_b.dtype, dense_b.device.index, bias is not None)
    alg = ALG_CACHE.get(key)
    if alg is None:
        with _lock:
            try:
                found: Any = search(prep.compressed, dense_b, bias=bias, transpose_result=True)
                alg = int(found[0] if isinstance(found, (tuple, list)) else found)
            except Exception:
                alg = 0
            ALG_CACHE[key] = alg
    return alg


def _check_operands(x: torch.Tensor, weight: Sparse24Tensor, bias: torch.Tensor | None) -> None:
    if not isinstance(weight, Sparse24Tensor):
        raise TypeError(f"weight must be a Sparse24Tensor, got {type(weight).__name__}")
    if len(weight.shape) != 2:
        raise ValueError(f"a 2:4 weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"input has {x.shape[-1]} features but the weight expects {weight.shape[1]} (weight shape {tuple(weight.shape)})")
    if x.dtype != weight.dtype:
        from .ops import dtype_mismatch

        raise TypeError(dtype_mismatch("the 2:4 semi-structured matmul", x.dtype, weight.dtype))
    if x.device != weight.device:
        raise ValueError(f"input is on {x.device} but the 2:4 weight is on {weight.device}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{weight.shape[0]}] {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")


def linear(x: torch.Tensor, weight: Sparse24Tensor, bias: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` on CUDA through cuSPARSELt / CUTLASS (padding inside)."""
    _check_operands(x, weight, bias)
    _compat.require_cuda(x, "the 2:4 semi-structured matmul")
    prep = prepare(weight, backend)
    if prep is None:
        last_path.update(path="dense", why=f"no semi-structured backend for {weight.dtype} with this mask")
        return F.linear(x, weight.to_dense(), bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, prep.k)
    t = x2.shape[0]
    t_pad = _round_up(max(t, 1), TOKEN_ALIGN)
    if t_pad != t or prep.k_pad != prep.k:
        x2 = F.pad(x2, (0, prep.k_pad - prep.k, 0, t_pad - t))
    x2 = x2.contiguous()
    b = None if bias is None else F.pad(bias, (0, prep.n_pad - prep.n)).contiguous()
    if prep.backend == "cusparselt":
        dense_b = x2.t()
        alg = _cslt_alg(prep, dense_b, b)
        out = torch._cslt_sparse_mm(prep.compressed, dense_b, bias=b, transpose_result=True, alg_id=alg)
        out = out[:t, : prep.n]
    else:
        out = _cutlass_mm(prep, x2, b)[:t, : prep.n]
    last_path.update(path=prep.backend, why="")
    return out.reshape(*lead, prep.n)


def _cutlass_mm(prep: Prepared, x2: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    mm = _compat.private_op("_sparse_semi_structured_mm")
    addmm = _compat.private_op("_sparse_semi_structured_addmm")
    if mm is not None and (bias is None or addmm is not None):
        if bias is None:
            res = mm(prep.packed, prep.meta, x2.t())
        else:
            res = addmm(bias, prep.packed, prep.meta, x2.t())
        return res.t()
    lin = _compat.private_op("_sparse_semi_structured_linear")
    if lin is None:
        raise RuntimeError("this torch has no CUTLASS semi-structured matmul (_sparse_semi_structured_mm/_linear)")
    return lin(x2, prep.packed, prep.meta, bias=bias)


def sparse_activation_linear(x: Sparse24Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a 2:4 *activation* ``x`` (2:4 along features) and a dense weight."""
    if not isinstance(x, Sparse24Tensor):
        raise TypeError(f"x must be a Sparse24Tensor, got {type(x).__name__}")
    k = x.shape[-1]
    x2 = x if len(x.shape) == 2 else Sparse24Tensor(x.packed, x.meta, (x.packed.shape[0], k))
    # (x @ W^T) = (x @ W^T); the sparse operand is on the left: out = x @ W^T.
    n = weight.shape[0]
    prep = prepare(x2) if x.device.type == "cuda" else None
    if prep is None:
        last_path.update(path="dense", why="no semi-structured backend")
        return F.linear(x.to_dense(), weight, bias)
    w = F.pad(weight, (0, prep.k_pad - k, 0, _round_up(n, TOKEN_ALIGN) - n))
    if prep.backend == "cusparselt":
        out = torch._cslt_sparse_mm(prep.compressed, w.t().contiguous(), transpose_result=False)
    else:
        out = _compat.private_op("_sparse_semi_structured_mm")(prep.packed, prep.meta, w.t().contiguous())
    out = out[: prep.n, :n]
    if bias is not None:
        out = out + bias
    last_path.update(path=prep.backend, why="")
    return out.reshape(*x.shape[:-1], n)
