"""2:4 sparse × dense matmul on the GPU: cuSPARSELt first, CUTLASS second.

``linear(x, weight, bias)`` computes ``x @ weight.T + bias`` for a 2-D
``Sparse24Tensor`` weight on CUDA. Shapes the backends cannot take are
zero-padded inside (weight rows to 32, columns to 64, tokens to 16) and the
result is cut back. The matmul operand is prepared once per weight and cached
on it; cuSPARSELt's algorithm is searched once per problem shape
(``torch._cslt_sparse_mm_search``, opt-in: ``STEN_CUDA24_CSLT_SEARCH=1``) and
cached in ``ALG_CACHE``.

fp32 runs on CUTLASS when the mask is 1:2 (one value per pair), else on the
dense fallback (decompress + cuBLAS) with reason recorded in ``last_path``.

Example (needs a GPU):
    >>> w = Sparse24Tensor.from_dense(pruned.half().cuda())    # doctest: +SKIP
    >>> y = linear(x.half().cuda(), w)                          # doctest: +SKIP
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from sten_core.plugin_api import check_tensor

from . import _compat, encoding, operands
from .sparse24 import Sparse24Tensor

ROW_ALIGN, COL_ALIGN, TOKEN_ALIGN = 32, 64, 16
ALG_CACHE: dict[tuple, int] = {}
_lock = threading.Lock()
last_path: dict[str, str] = {}
"""The path the last ``linear`` call took: ``{"path": ..., "why": ...}`` (for tests/benchmarks)."""


@dataclass
class Prepared:
    """A weight ready for one backend (padded to ``(n_pad, k_pad)``).

    ``source``/``version`` name the values it was last synced with; ``refresh``
    says what an optimizer step costs: ``"view"`` (nothing: CUTLASS reads our
    values), ``"copy"`` (one copy of the values into the padded operand),
    ``"prefix"``/``"scatter"`` (one copy into cuSPARSELt's buffer),
    ``"recompress"`` (densify + ``torch._cslt_compress``), or ``"pending"``
    (not yet updated: the first step discovers the cuSPARSELt layout).
    """

    backend: str
    n: int
    k: int
    n_pad: int
    k_pad: int
    compressed: torch.Tensor | None = None  # cuSPARSELt
    packed: torch.Tensor | None = None      # CUTLASS
    meta: torch.Tensor | None = None        # CUTLASS (reordered)
    source: Any = None
    version: int = -1
    refresh: str = "pending"
    refresher: Any = None


def _round_up(v: int, m: int) -> int:
    return -(-v // m) * m


def _cslt_compress(dense: torch.Tensor) -> torch.Tensor:
    return torch._cslt_compress(dense)


def build(weight: Sparse24Tensor, backend: str, compress: Any = None) -> Prepared | None:
    """The operand for ``backend`` from the weight's own values and metadata
    (``None``: this dtype/pattern has no sparse kernel). Pure tensor code for CUTLASS;
    ``compress`` (default ``torch._cslt_compress``) builds cuSPARSELt's buffer."""
    n, k = weight.shape
    n_pad, k_pad = _round_up(n, ROW_ALIGN), _round_up(k, COL_ALIGN)
    values = operands.padded_values(weight, n_pad, k_pad)
    refresh = "view" if values is weight.packed else "copy"
    if backend == "cusparselt":
        dense = encoding.decompress(values, operands.padded_meta(weight, n_pad, k_pad)).contiguous()
        prep = Prepared(backend, n, k, n_pad, k_pad, compressed=(compress or _cslt_compress)(dense), refresh="pending")
    elif weight.dtype == torch.float32:
        meta = operands.padded_meta(weight, n_pad, k_pad, operands.EMPTY_CODE["fp32"])
        if not operands.fp32_codes_ok(meta):
            return None
        prep = Prepared(backend, n, k, n_pad, k_pad, packed=values, meta=operands.fp32_meta(meta), refresh=refresh)
    else:
        meta = encoding.cutlass_reorder(operands.padded_meta(weight, n_pad, k_pad))
        prep = Prepared(backend, n, k, n_pad, k_pad, packed=values, meta=meta, refresh=refresh)
    prep.source, prep.version = weight.packed, weight.packed._version
    return prep


def sync(prep: Prepared, weight: Sparse24Tensor, compress: Any = None) -> None:
    """Bring ``prep`` up to date with ``weight``'s values (same pattern), in place."""
    if prep.source is weight.packed and prep.version == weight.packed._version:
        return
    if prep.backend == "cusparselt":
        if prep.refresher is None:
            meta = operands.padded_meta(weight, prep.n_pad, prep.k_pad)
            prep.refresher = operands.Refresher(compress or _cslt_compress, meta, weight.dtype)
            prep.refresh = prep.refresher.kind
        values = operands.padded_values(weight, prep.n_pad, prep.k_pad)
        prep.compressed = prep.refresher.refresh(values)
    elif prep.packed is not weight.packed:
        r, half = weight.packed.shape
        prep.packed[:r, :half].copy_(weight.packed)
    prep.source, prep.version = weight.packed, weight.packed._version


def prepare(weight: Sparse24Tensor, backend: str | None = None) -> Prepared | None:
    """The backend operand for ``weight`` (cached on it), or ``None`` for the dense fallback.

    Built once per pattern; after an optimizer step changed the values in place
    it is refreshed in place (``Prepared.refresh`` says how), never rebuilt.
    """
    if len(weight.shape) != 2:
        raise ValueError(f"a 2:4 weight must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    _compat.require_cuda(weight.packed, "the 2:4 semi-structured matmul")
    backend = backend or _compat.semi_structured_backend()
    if backend == "cusparselt" and weight.dtype == torch.float32:
        backend = "cutlass" if _compat.has_cutlass() else None
    if backend is None:
        return None
    key = ("prepared", backend)
    hit = weight._cache.get(key)
    if hit is not None and hit[0] is weight.meta:
        if hit[1] is not None:
            sync(hit[1], weight)
        return hit[1]
    prep = build(weight, backend)
    weight._cache[key] = (weight.meta, prep)
    return prep


def _cslt_alg(prep: Prepared, dense_b: torch.Tensor, bias: torch.Tensor | None) -> int:
    """cuSPARSELt's algorithm id for this problem shape: 0 (the library's default) unless
    ``STEN_CUDA24_CSLT_SEARCH=1`` asks for ``torch._cslt_sparse_mm_search`` (once per shape, cached).

    The search is opt-in because on an H100 with torch 2.11 / cuSPARSELt 0.8 an fp16
    search (``transpose_result=True``) failed inside ``cusparseLtMatmulSearch`` and left
    the CUDA context broken: every later cuSPARSELt call failed ("internal error when
    calling cusparseLtMatmulAlgSelectionInit") and the next kernel with "illegal
    instruction" (docs/cuda24.md). A searched id is kept only if a
    product with it equals the default algorithm's.
    """
    search = _compat.private_op("_cslt_sparse_mm_search")
    if search is None or os.environ.get("STEN_CUDA24_CSLT_SEARCH", "0") in ("", "0"):
        return 0
    key = (prep.n_pad, prep.k_pad, dense_b.shape[1], dense_b.dtype, dense_b.device.index, bias is not None)
    alg = ALG_CACHE.get(key)
    if alg is None:
        with _lock:
            alg = _checked_search(search, prep.compressed, dense_b, bias)
            ALG_CACHE[key] = alg
    return alg


def _checked_search(search: Any, compressed: torch.Tensor, dense_b: torch.Tensor, bias: torch.Tensor | None) -> int:
    try:
        found: Any = search(compressed, dense_b, bias=bias, transpose_result=True)
        alg = int(found[0] if isinstance(found, (tuple, list)) else found)
    except Exception:
        return 0
    if alg == 0:
        return 0
    try:
        ref = torch._cslt_sparse_mm(compressed, dense_b, bias=bias, transpose_result=True, alg_id=0)
        got = torch._cslt_sparse_mm(compressed, dense_b, bias=bias, transpose_result=True, alg_id=alg)
    except Exception:
        return 0
    diff, scale = (got.float() - ref.float()).norm(), ref.float().norm()
    return alg if bool(diff <= 1e-2 * scale) else 0


def _check_operands(x: torch.Tensor, weight: Sparse24Tensor, bias: torch.Tensor | None) -> None:
    check_tensor(x, "input", where="the 2:4 semi-structured matmul")
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
