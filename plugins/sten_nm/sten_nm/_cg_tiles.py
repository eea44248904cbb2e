"""The paper-format forward's tile-major packed weight: per slot tile of the tiled loop order,
the values and int16 tile-relative columns of every (row block, pattern), contiguous, so a
pass streams one block instead of a 64-byte piece of every pattern's row (and half the index
bytes). Built by the C extension (``nm_colgrouped_pack_tiles``), cached per values tensor (a
weak-keyed table: a compiled model's custom operator rebuilds the layout object every call but
passes the same member tensors, and pickling or copying a layout never carries the copy) per
tile length, and rebuilt when the values or columns change (in place: ``_version``; replaced:
another tensor); public members and serialization are unchanged.

Example:
    >>> import torch
    >>> from sten_nm import ColumnGroupedNMTensor
    >>> W = ColumnGroupedNMTensor.from_dense(torch.randn(8, 1200), 2, 4)
    >>> d = with_tiles(W.desc(), 256, "tiled")
    >>> d.tile_kt > 0 and with_tiles(W.desc(), 256, "tiled").tiles == d.tiles
    True
"""

from __future__ import annotations

import ctypes
import os
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import _kernel

_CACHE = WeakIdKeyDictionary()
"""values tensor -> {tile length: (columns, (values, columns) versions, packed buffer)} (the
entry holds no reference to its key, so a freed weight frees its packed copy)."""


def enabled() -> bool:
    """Packed tiles in use (``STEN_NM_CG_TILES=0`` turns them off: the kernel then reads the
    stored tables)."""
    return os.environ.get("STEN_NM_CG_TILES", "1") != "0"


def with_tiles(desc: _kernel.NMColGrouped, B: int, variant: str = "auto",
               nthreads: Optional[int] = None) -> _kernel.NMColGrouped:
    """``desc``, or a copy of it that points at its weight's packed tiles for the tile length
    the forward uses at batch ``B`` in ``variant`` (float32 values; bf16 ones kept bf16 at
    n = 1 and widened to float32 at n >= 2, where the pass reads them faster that way;
    passes of fewer slots than a pattern has, i.e. the tiled order; ``desc`` unchanged
    otherwise: the stream order, whose per-pattern rows are already contiguous and measured no
    faster packed, or a tile spanning 32768 columns or more)."""
    if desc.vtype not in (_kernel.VTYPES[torch.float32], _kernel.VTYPES[torch.bfloat16]) or B < 1 or not enabled():
        return desc
    lib = _kernel._load()
    kt = lib.nm_colgrouped_tile_kt(ctypes.byref(desc), B, _kernel._threads(nthreads), _kernel.CG_VARIANTS[variant])
    if kt < 1 or kt >= desc.L:
        return desc   # one pass over every slot (the stream order): the stored tables, no copy
    vals, cols = desc._keep[0], desc._keep[1]
    cache = _CACHE.setdefault(vals, {})
    hit = cache.get(kt)
    if hit is not None and hit[0] is cols and hit[1] == (vals._version, cols._version):
        buf = hit[2]
    else:
        nbytes = lib.nm_colgrouped_tiles_bytes(ctypes.byref(desc), kt)
        if nbytes < 0:
            return desc
        buf = _kernel.empty((nbytes,), torch.uint8)
        if lib.nm_colgrouped_pack_tiles(ctypes.byref(desc), kt, _kernel.ptr(buf, "nm_colgrouped tiles"), nbytes) != 0:
            return desc   # a tile spans too many columns for int16: the stored tables
        for k in [k for k, h in cache.items() if h[0] is not cols]:
            del cache[k]   # stale (columns replaced)
        cache[kt] = (cols, (vals._version, cols._version), buf)
    d = _kernel.NMColGrouped(desc.N, desc.K, desc.n, desc.m, desc.P, desc.vtype, desc.Nb, desc.L,
                             desc.vals, desc.cols, desc.pats, _kernel.ptr(buf, "nm_colgrouped tiles"), kt)
    d._keep = tuple(desc._keep) + (buf,)
    return d
