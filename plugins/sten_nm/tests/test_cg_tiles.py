"""The paper-format forward's tile-major packed weight (sten_nm._cg_tiles,
nm_colgrouped_pack_tiles): its layout, the forward on it in every loop order and ISA at edge
sizes, and that it follows changes of the values and columns."""

import functools
import pickle

import pytest
import torch
import torch.nn.functional as F

from sten_nm import ColumnGroupedNMTensor, column_grouped_linear
from sten_nm import _cg_tiles
from sten_nm import compiled as nmc
from sten_nm._cg_tiles import with_tiles

from conftest import requires_kernel

PATTERNS = [(1, 2), (2, 4), (1, 4), (3, 4), (4, 5), (2, 8), (1, 10)]
# (variant, environment): default tiles (multiples of 16 slots: the unrolled pass kernel),
# 1-slot tiles, the smallest default tile (16 slots) with single-row-block units, 8 vectors
# per batch chunk, 48-slot tiles (three unrolled blocks per pass), full tiles through the
# general slot loop (STEN_NM_CG_KFIX=0), and the stream order (one tile of every slot)
VARIANTS = [("tiled", {}), ("tiled", {"STEN_NM_CG_KT": "1", "STEN_NM_CG_QB": "3"}),
            ("tiled", {"STEN_NM_CG_TILE_BYTES": "1", "STEN_NM_CG_ACC_BYTES": "1"}),
            ("tiled", {"STEN_NM_CG_NVI": "4"}), ("tiled", {"STEN_NM_CG_KT": "48"}),
            ("tiled", {"STEN_NM_CG_KFIX": "0"}), ("stream", {})]


@functools.lru_cache(maxsize=None)
def _layout(N: int, K: int, n: int, m: int, g) -> ColumnGroupedNMTensor:
    """A random layout, built once per test session (the sparsifier is the slow part)."""
    gen = torch.Generator().manual_seed(N * 7919 + K * 31 + n * 7 + m)
    return ColumnGroupedNMTensor.from_dense(torch.randn(N, K, generator=gen), n, m, g=g)


def _unpack(W: ColumnGroupedNMTensor, buf: torch.Tensor, kt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Values [Nb, P, n, L] and absolute columns [Nb, P, L] read back from the packed bytes."""
    Nb, P, n, L = W.values().shape
    # bf16 values stay bf16 at n = 1 (widened as broadcast), are widened to float32 at n >= 2
    dtype = W.values().dtype if n == 1 else torch.float32
    vb = dtype.itemsize
    nt = -(-L // kt)
    hdr = -(-nt * 4 // 64) * 64
    base = buf[:nt * 4].view(torch.int32)
    vals = torch.empty(Nb, P, n, L, dtype=dtype)
    cols = torch.empty(Nb, P, L, dtype=torch.int64)
    off = hdr
    for tau in range(nt):
        t0, t1 = tau * kt, min(L, tau * kt + kt)
        w = t1 - t0
        vbytes = (n * w * vb + 3) // 4 * 4
        rec = vbytes + (2 * w + 3) // 4 * 4
        for qp in range(Nb * P):
            r = buf[off + qp * rec: off + (qp + 1) * rec]
            q, p = divmod(qp, P)
            vals[q, p, :, t0:t1] = r[:n * w * vb].view(dtype).reshape(n, w)
            cols[q, p, t0:t1] = r[vbytes: vbytes + 2 * w].view(torch.int16).long() + int(base[tau])
        off += Nb * P * rec
    assert off == buf.numel()
    return vals, cols


@requires_kernel
@pytest.mark.parametrize("n,m", [(2, 4), (1, 10), (3, 4)])
@pytest.mark.parametrize("kt", [1, 3, 16, 1000])
@pytest.mark.parametrize("vdtype", [torch.float32, torch.bfloat16])
def test_packed_layout_holds_values_and_columns(n, m, kt, vdtype):
    """Every (tile, row block, pattern) record holds the stored values (float32; bf16 as
    stored at n = 1, an odd w of them padded to 4 bytes, widened exactly to float32 at n >= 2)
    and columns (int16 relative to the tile's base column), the last tile narrower when kt
    does not divide L."""
    from sten_nm import _kernel

    W = ColumnGroupedNMTensor.from_dense(torch.randn(21, 203).to(vdtype), n, m, g=3)
    d = W.desc()
    lib = _kernel._load()
    size = lib.nm_colgrouped_tiles_bytes(d, kt)
    buf = torch.empty(size, dtype=torch.uint8)
    assert lib.nm_colgrouped_pack_tiles(d, kt, buf.data_ptr(), size) == 0
    v, c = _unpack(W, buf, min(kt, W.values().shape[-1]))
    torch.testing.assert_close(v, W.values().to(v.dtype), rtol=0, atol=0)
    assert torch.equal(c, W.columns.long())
    assert lib.nm_colgrouped_pack_tiles(d, kt, buf.data_ptr(), size - 1) == -1   # too small
    assert lib.nm_colgrouped_tiles_bytes(d, 0) == -1


@requires_kernel
@pytest.mark.parametrize("n,m", PATTERNS)
@pytest.mark.parametrize("B", [1, 7, 64, 130])
@pytest.mark.parametrize("variant,env", VARIANTS)
def test_forward_on_tiles_every_isa(isa, n, m, B, variant, env, monkeypatch):
    """The forward on the packed tiles equals dense in each loop order, on each ISA: tiny K,
    K not a multiple of the tile, batch 1, odd N, several threads."""
    from sten_nm import _kernel

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for N, K, g in ((13, 5, None), (19, 37, None), (40, 203, 3), (23, 1000, None)):
        t = _layout(N, K, n, m, g)
        x, b = torch.randn(B, K), torch.randn(N)
        d = with_tiles(t.desc(), B, variant)
        assert bool(d.tiles) == (variant == "tiled" and 1 <= d.tile_kt < d.L)   # packed for tiled passes
        y = _kernel.colgrouped_gather(d, x, b, variant=variant)
        torch.testing.assert_close(y, F.linear(x, t.to_dense(), b), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(_kernel.colgrouped_gather(d, x, nthreads=3, variant=variant),
                                   F.linear(x, t.to_dense()), rtol=1e-4, atol=1e-4)


@requires_kernel
@pytest.mark.parametrize("n,m", PATTERNS)
@pytest.mark.parametrize("B", [7, 130])
@pytest.mark.parametrize("variant,env", VARIANTS)
def test_forward_on_bf16_tiles_every_isa(isa, n, m, B, variant, env, monkeypatch):
    """bf16 stored values: the tiles keep them bf16 at n = 1 (widened as broadcast) and hold
    them widened at n >= 2; the forward equals the float32 product of the same values (x
    float32) in each loop order."""
    from sten_nm import _kernel

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for N, K, g in ((13, 5, None), (40, 203, 3), (23, 1000, None)):
        t = _layout(N, K, n, m, g)
        t = t.with_values(t.values().bfloat16())
        x, b = torch.randn(B, K), torch.randn(N)
        d = with_tiles(t.desc(), B, variant)
        assert bool(d.tiles) == (variant == "tiled" and 1 <= d.tile_kt < d.L)
        ref = F.linear(x.double(), t.to_dense().double(), b.double()).float()
        torch.testing.assert_close(_kernel.colgrouped_gather(d, x, b, variant=variant), ref, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(_kernel.colgrouped_gather(d, x, b, nthreads=3, variant=variant), ref,
                                   rtol=1e-5, atol=1e-4)


@requires_kernel
def test_tiles_for_another_tile_length_are_ignored(monkeypatch):
    """A descriptor packed for one tile length given to passes of another (other tiles, the
    stream order) reads the stored tables: still exact."""
    from sten_nm import _kernel

    t = ColumnGroupedNMTensor.from_dense(torch.randn(40, 1000), 1, 10)
    x = torch.randn(70, 1000)
    dt = with_tiles(t.desc(), 70, "tiled")
    assert dt.tiles and dt.tile_kt != 5
    assert not with_tiles(t.desc(), 70, "stream").tiles
    torch.testing.assert_close(_kernel.colgrouped_gather(dt, x, variant="stream"), F.linear(x, t.to_dense()),
                               rtol=1e-4, atol=1e-4)
    monkeypatch.setenv("STEN_NM_CG_KT", "5")
    torch.testing.assert_close(_kernel.colgrouped_gather(dt, x, variant="tiled"), F.linear(x, t.to_dense()),
                               rtol=1e-4, atol=1e-4)


@requires_kernel
def test_tiles_follow_value_and_column_changes(monkeypatch):
    """The cached packed copy is rebuilt when the values change in place or are replaced, and
    F.linear on the layout uses it (tiled order; the tests run with tuning off)."""
    monkeypatch.setenv("STEN_NM_CG_VARIANT", "2")
    t = ColumnGroupedNMTensor.from_dense(torch.randn(30, 300), 2, 4)
    x = torch.randn(50, 300)
    torch.testing.assert_close(column_grouped_linear(x, t), F.linear(x, t.to_dense()), rtol=1e-4, atol=1e-4)
    assert _cg_tiles._CACHE.get(t.values())   # F.linear packed it
    assert len(pickle.dumps(t)) < len(pickle.dumps(ColumnGroupedNMTensor.from_dense(torch.randn(30, 300), 2, 4))) * 1.01
    with torch.no_grad():
        t.values().mul_(-3.0)                     # in place
    torch.testing.assert_close(column_grouped_linear(x, t), F.linear(x, t.to_dense()), rtol=1e-4, atol=1e-4)
    u = t.with_values(torch.randn_like(t.values()))   # replaced: another layout object
    torch.testing.assert_close(column_grouped_linear(x, u), F.linear(x, u.to_dense()), rtol=1e-4, atol=1e-4)
    t._values = torch.randn_like(t._values)         # replaced under the same object
    torch.testing.assert_close(column_grouped_linear(x, t), F.linear(x, t.to_dense()), rtol=1e-4, atol=1e-4)
    assert len(_cg_tiles._CACHE[t.values()]) == 1   # one copy per values tensor


@requires_kernel
def test_no_tiles_for_wide_tiles_or_when_off(monkeypatch):
    """A tile spanning 32768 columns or more (int16 columns) and STEN_NM_CG_TILES=0 leave the
    descriptor as it was; the forward is exact either way."""
    from sten_nm import _kernel

    wide = ColumnGroupedNMTensor.from_dense(torch.randn(4, 40000), 1, 4)
    x = torch.randn(3, 40000)
    d = wide.desc()
    assert with_tiles(d, 3, "stream") is d      # one tile of 40000 columns
    dt = with_tiles(d, 3, "tiled")
    assert dt.tiles
    torch.testing.assert_close(_kernel.colgrouped_gather(dt, x, variant="tiled"), F.linear(x, wide.to_dense()),
                               rtol=1e-4, atol=1e-4)
    monkeypatch.setenv("STEN_NM_CG_TILES", "0")
    assert with_tiles(d, 3, "tiled") is d


@requires_kernel
def test_a_layout_rebuilt_on_the_same_members_reuses_the_packed_copy(monkeypatch):
    """A compiled model's custom operator rebuilds the layout object around the same member
    tensors on every call: the packed copy is kept per values tensor, so it is built once
    (it was rebuilt on every compiled call while it was kept on the layout object)."""
    monkeypatch.setenv("STEN_NM_CG_VARIANT", "2")
    t = ColumnGroupedNMTensor.from_dense(torch.randn(30, 300), 2, 4)
    x = torch.randn(50, 300)
    column_grouped_linear(x, t)
    (kt, (_, _, buf)), = _cg_tiles._CACHE[t.values()].items()
    u = nmc._column_grouped(*nmc.members(t))   # what the compiled operator does on every call
    assert u is not t and u.values() is t.values()
    torch.testing.assert_close(column_grouped_linear(x, u), F.linear(x, t.to_dense()), rtol=1e-4, atol=1e-4)
    assert _cg_tiles._CACHE[t.values()][kt][2] is buf
