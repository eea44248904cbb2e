"""The paper-format forward's tile-major packed weight: per slot tile of the tiled loop order,
the values and int16 tile-relative columns of every (row block, pattern), contiguous, so a
pass streams one block instead of a 64-byte piece of every pattern's row (and half the index
bytes). Built by the C extension (``nm_colgrouped_pack_tiles``), cached on the layout object
per tile length and rebuilt when the values or columns change (in place: ``_version``;
replaced: another tensor); public members and serialization are unchanged.

Example:
    >>> import torch
    >>> from sten_nm import ColumnGroupedNMTensor
    >>> W = ColumnGroupedNMTensor.from_dense(torch.randn(8, 1200), 2, 4)
    >>> d = with_tiles(W, W.desc(), 256, "tiled")
    >>> d.tile_kt > 0 and with_tiles(W, W.desc(), 256, "tiled").tiles == d.tiles
    True
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Optional

import torch

from . import _kernel


def enabled() -> bool:
    """Packed tiles in use (``STEN_NM_CG_TILES=0`` turns them off: the kernel then reads the
    stored tables)."""
    return os.environ.get("STEN_NM_CG_TILES", "1") != "0"


def with_tiles(owner: Any, desc: _kernel.NMColGrouped, B: int, variant: str = "auto",
               nthreads: Optional[int] = None) -> _kernel.NMColGrouped:
    """``desc``, or a copy of it that points at ``owner``'s packed tiles for the tile length
    the forward uses at batch ``B`` in ``variant`` (float32 values, passes of fewer slots than
    a pattern has, i.e. the tiled order; ``desc`` unchanged otherwise: bf16 values, the stream
    order, whose per-pattern rows are already contiguous and measured no faster packed, or a
    tile spanning 32768 columns or more)."""
    if desc.vtype != _kernel.VTYPES[torch.float32] or B < 1 or not enabled():
        return desc
    lib = _kernel._load()
    kt = lib.nm_colgrouped_tile_kt(ctypes.byref(desc), B, _kernel._threads(nthreads), _kernel.CG_VARIANTS[variant])
    if kt < 1 or kt >= desc.L:
        return desc   # one pass over every slot (the stream order): the stored tables, no copy
    vals, cols = desc._keep[0], desc._keep[1]
    cache = owner.__dict__.setdefault("_cg_tiles", {})
    hit = cache.get(kt)
    if hit is not None and hit[0] is vals and hit[1] is cols and hit[2] == (vals._version, cols._version):
        buf = hit[3]
    else:
        nbytes = lib.nm_colgrouped_tiles_bytes(ctypes.byref(desc), kt)
        if nbytes < 0:
            return desc
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if lib.nm_colgrouped_pack_tiles(ctypes.byref(desc), kt, buf.data_ptr(), nbytes) != 0:
            return desc   # a tile spans too many columns for int16: the stored tables
        for k in [k for k, h in cache.items() if h[0] is not vals or h[1] is not cols]:
            del cache[k]   # stale (values or columns replaced)
        cache[kt] = (vals, cols, (vals._version, cols._version), buf)
    d = _kernel.NMColGrouped(desc.N, desc.K, desc.n, desc.m, desc.P, desc.vtype, desc.Nb, desc.L,
                             desc.vals, desc.cols, desc.pats, buf.data_ptr(), kt)
    d._keep = tuple(desc._keep) + (buf,)
    return d
