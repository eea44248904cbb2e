"""ColumnGroupedNMTensor (the paper's grouped n:m): format invariants, mask quality,
forward and backward against the dense reference (pure torch: no C kernel needed)."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import sten_core as sten
from sten_nm import ColumnGroupedNMSparsifier, ColumnGroupedNMTensor, NMTensor, column_grouped_linear
from sten_nm.column_grouped import assign_patterns, chunk_widths, default_g, patterns

from conftest import requires_kernel

CG_PATTERNS = [(1, 2), (2, 4), (1, 4), (3, 4), (1, 8), (2, 8), (1, 10)]


def _check_format(t: ColumnGroupedNMTensor, w: torch.Tensor) -> None:
    """Every column keeps n of each block of m rows; per chunk every pattern owns g columns;
    kept values are w's."""
    N, K = w.shape
    n, m, g = t.n, t.m, t.g
    P = math.comb(m, n)
    Nb = -(-N // m)
    mask = torch.zeros((Nb * m, K), dtype=torch.bool)
    mask[:N] = t.mask()
    d = t.to_dense()
    assert torch.equal(d, torch.where(t.mask(), w, torch.zeros((), dtype=w.dtype)))
    # the stored pattern of each (block, column): which rows it keeps (incl. padding rows)
    full = torch.zeros((Nb * m, P * t.values().shape[3]), dtype=torch.bool)
    full[t._rows(), t.columns.long()[:, :, None, :]] = True
    per_block = full.reshape(Nb, m, full.shape[1])
    assert bool((per_block.sum(1) == n).all())
    assert torch.equal(full[:N, :K], mask[:N])
    # pattern index of each column, per block: each pattern g (or g_last) times per chunk
    code = (per_block.long() * (1 << torch.arange(m))[None, :, None]).sum(1)    # [Nb, Kp]
    start = 0
    for width in chunk_widths(K, P, g) if Nb else []:
        counts = torch.stack([(code[:, start:start + P * width] == c).sum(1) for c in code[:, start:start + P * width].unique()])
        assert bool((counts == width).all()) and counts.shape[0] == P
        start += P * width


@settings(max_examples=40, deadline=None)
@given(N=st.integers(0, 23), K=st.integers(0, 70), nm=st.sampled_from(CG_PATTERNS),
       g=st.sampled_from([None, 1, 2, 3]), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
def test_format_and_round_trip(N, K, nm, g, dtype):
    n, m = nm
    w = torch.randn(N, K).to(dtype)
    t = ColumnGroupedNMTensor.from_dense(w, n, m, g)
    assert t.shape == w.shape and t.dtype == dtype
    _check_format(t, w)
    d = t.to_dense()
    assert t.nnz == int(t.mask().sum()) >= int((d != 0).sum())
    again = ColumnGroupedNMTensor.from_dense(d, n, m, g)                 # a compliant matrix is kept
    assert torch.equal(again.to_dense(), d)
    assert torch.equal(t.gather(w), t.values())
    assert torch.equal(t.with_values(t.values() * 2).to_dense(), d * 2)


@pytest.mark.parametrize("shape", [(3072, 768), (768, 3072)])
@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (1, 10)])
def test_mask_quality_at_least_98_percent_of_exact(shape, n, m):
    """Σ|W| kept relative to exact n:m along the rows (random normal weights, BERT shapes)."""
    w = torch.randn(*shape)
    t = ColumnGroupedNMTensor.from_dense(w, n, m)
    assert t.g == 16
    assert t.kept_magnitude_ratio(w) >= 0.98


def test_assignment_optimal_on_small_cases():
    """Against brute force over all balanced assignments (2 patterns x 2 columns each)."""
    import itertools

    torch.manual_seed(1)
    for _ in range(30):
        s = torch.rand(1, 4, 2)
        got = assign_patterns(s, 2)
        assert bool((torch.bincount(got[0], minlength=2) == 2).all())
        best = max(sum(float(s[0, c, p]) for c, p in enumerate(a))
                   for a in itertools.product(range(2), repeat=4) if a.count(0) == 2)
        assert abs(float(s[0, torch.arange(4), got[0]].sum()) - best) < 1e-6


def test_defaults_and_patterns():
    assert patterns(2, 4).tolist() == [[0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3]]
    assert default_g(768, 2, 4) == 16 and default_g(20, 2, 4) == 2 and default_g(3, 2, 4) == 1
    assert chunk_widths(100, 6, 16) == [16, 1]


@pytest.mark.parametrize("N,K", [(19, 37), (16, 96), (4, 5), (33, 200)])
@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (1, 10), (3, 8)])
@pytest.mark.parametrize("B", [1, 7, 64])
def test_linear_fwd_bwd_against_dense(N, K, n, m, B):
    torch.manual_seed(N * K + B)
    t = ColumnGroupedNMTensor.from_dense(torch.randn(N, K), n, m)
    for sparse_grad in (True, False):
        fmt = (sten.KeepAll(), ColumnGroupedNMTensor, sten.KeepAll(), ColumnGroupedNMTensor) if sparse_grad else None
        W = sten.SparseParameterWrapper(t, grad_fmt=fmt)
        x = torch.randn(B, K, requires_grad=True)
        b = torch.randn(N, requires_grad=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # our implementation, no dense fallback
            y = F.linear(x, W, b)
            gy = torch.randn_like(y)
            y.backward(gy)
        xr, wr, br = x.detach().requires_grad_(), t.to_dense().requires_grad_(), b.detach().requires_grad_()
        yr = F.linear(xr, wr, br)
        yr.backward(gy)
        torch.testing.assert_close(y, yr, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b.grad, br.grad, rtol=1e-4, atol=1e-4)
        if sparse_grad:
            g = W.grad.wrapped_tensor
            assert isinstance(g, ColumnGroupedNMTensor) and g.same_pattern(t)
            torch.testing.assert_close(g.to_dense(), wr.grad * t.mask(), rtol=1e-4, atol=1e-4)
        else:
            torch.testing.assert_close(W.grad, wr.grad, rtol=1e-4, atol=1e-4)


@settings(max_examples=25, deadline=None)
@given(N=st.integers(0, 20), K=st.integers(0, 40), B=st.integers(0, 9), nm=st.sampled_from(CG_PATTERNS),
       g=st.sampled_from([None, 1, 2]))
def test_kernels_against_dense_any_shape(N, K, B, nm, g):
    from sten_nm import column_grouped_ops as cg

    n, m = nm
    t = ColumnGroupedNMTensor.from_dense(torch.randn(N, K), n, m, g)
    d = t.to_dense()
    x, gy = torch.randn(B, K), torch.randn(B, N)
    torch.testing.assert_close(cg.forward(t, x, t.values()), x @ d.t(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cg.input_grad(t, gy, t.values()), gy @ d, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cg.values_grad(t, gy, x), t.gather(gy.t() @ x), rtol=1e-4, atol=1e-4)


def test_slabs_do_not_change_results(monkeypatch):
    from sten_nm import column_grouped_ops as cg

    t = ColumnGroupedNMTensor.from_dense(torch.randn(30, 50), 2, 4, g=2)
    x, gy = torch.randn(11, 50), torch.randn(11, 30)
    ref = (cg.forward(t, x, t.values()), cg.input_grad(t, gy, t.values()), cg.values_grad(t, gy, x))
    monkeypatch.setattr(cg, "SLAB_FLOATS", 1)   # one row block per slab
    got = (cg.forward(t, x, t.values()), cg.input_grad(t, gy, t.values()), cg.values_grad(t, gy, x))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_other_dtypes_and_autocast():
    t = ColumnGroupedNMTensor.from_dense(torch.randn(12, 40), 2, 4)
    x = torch.randn(5, 40)
    y64 = column_grouped_linear(x.double(), t.with_values(t.values().double()))
    assert y64.dtype == torch.float64
    torch.testing.assert_close(y64, x.double() @ t.to_dense().double().t())
    yb = column_grouped_linear(x.bfloat16(), t.with_values(t.values().bfloat16()))
    assert yb.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = F.linear(x, sten.SparseTensorWrapper(t))
        yr = F.linear(x, t.to_dense())
    assert y.dtype == yr.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), yr.float(), rtol=2e-2, atol=5e-2)


def test_sparsifier_conversions_and_conformance():
    w = torch.randn(16, 48)
    sp = ColumnGroupedNMSparsifier(1, 4)
    out = sten.sparsify(sp, w, ColumnGroupedNMTensor)
    assert isinstance(out.wrapped_tensor, ColumnGroupedNMTensor)
    assert torch.equal(sp.mask(w), out.wrapped_tensor.mask())
    nm = sten.convert(out, NMTensor).wrapped_tensor
    assert isinstance(nm, NMTensor) and nm.dim == 0 and torch.equal(nm.to_dense(), out.wrapped_tensor.to_dense())
    testing = pytest.importorskip("sten_core.testing")
    sp24 = ColumnGroupedNMSparsifier(2, 4)
    testing.check_layout(ColumnGroupedNMTensor, sparsifier=sp24, dtypes=(torch.float32, torch.bfloat16))
    testing.check_linear(ColumnGroupedNMTensor, sparsifier=sp24)


def test_bad_arguments():
    t = ColumnGroupedNMTensor.from_dense(torch.randn(8, 24), 2, 4, g=2)
    with pytest.raises(ValueError, match="g must be"):
        ColumnGroupedNMTensor.from_dense(torch.randn(8, 24), 2, 4, g=0)
    with pytest.raises(ValueError, match="patterns"):
        ColumnGroupedNMTensor.from_dense(torch.randn(8, 24), 8, 16)
    with pytest.raises(ValueError, match="patterns"):
        ColumnGroupedNMSparsifier(3, 32)
    cols = t.columns.clone()
    cols[0, 0, 0] = cols[0, 1, 0]          # a column owned twice, another never
    with pytest.raises(ValueError, match="columns: row block 0"):
        ColumnGroupedNMTensor(t.values(), cols, t.shape, 2, 4, 2)
    cols = t.columns.clone()
    cols[1, 2, 1] = 999                    # out of range
    with pytest.raises(ValueError, match="columns: row block 1"):
        ColumnGroupedNMTensor(t.values(), cols, t.shape, 2, 4, 2)
    with pytest.raises(ValueError, match="values must have shape"):
        ColumnGroupedNMTensor(t.values()[:1], t.columns, t.shape, 2, 4, 2)
    with pytest.raises(ValueError, match="input has shape"):
        column_grouped_linear(torch.randn(3, 23), t)
    assert ColumnGroupedNMTensor(t.values(), t.columns, t.shape, 2, 4, 2).same_pattern(t)


# loop orders of the C forward: (variant, environment) - the tiled order with its default
# tile, with 8-slot tiles and one row block per unit, with passes of one slot each, and with
# 8 vectors per batch chunk (STEN_NM_CG_NVI)
CG_VARIANTS = [("stream", {}), ("tiled", {}),
               ("tiled", {"STEN_NM_CG_TILE_BYTES": "1", "STEN_NM_CG_ACC_BYTES": "1"}),
               ("stream", {"STEN_NM_CG_KT": "1"}), ("tiled", {"STEN_NM_CG_KT": "1", "STEN_NM_CG_QB": "3"}),
               ("tiled", {"STEN_NM_CG_NVI": "4"}), ("stream", {"STEN_NM_CG_NVI": "4"})]   # 8 vectors per batch chunk


@requires_kernel
@pytest.mark.parametrize("n,m", CG_PATTERNS)
@pytest.mark.parametrize("B", [1, 7, 64, 130])
@pytest.mark.parametrize("variant,env", CG_VARIANTS)
def test_c_forward_every_isa(isa, n, m, B, variant, env, monkeypatch):
    """The C forward kernel in each loop order against dense and the torch reference (odd
    N, K; padding; several passes and units)."""
    from sten_nm import _kernel
    from sten_nm import column_grouped_ops as cg

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    for N, K in ((19, 37), (40, 200)):
        t = ColumnGroupedNMTensor.from_dense(torch.randn(N, K), n, m, g=None if K < 100 else 3)
        x, b = torch.randn(B, K), torch.randn(N)
        y = _kernel.colgrouped_gather(t.desc(), x, b, variant=variant)
        torch.testing.assert_close(y, F.linear(x, t.to_dense(), b), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(y, cg.forward(t, x, t.values()) + b, rtol=1e-4, atol=1e-4)
        for threads in (1, 3):
            torch.testing.assert_close(_kernel.colgrouped_gather(t.desc(), x, nthreads=threads, variant=variant),
                                       F.linear(x, t.to_dense()), rtol=1e-4, atol=1e-4)


@requires_kernel
@pytest.mark.parametrize("variant", ["stream", "tiled"])
def test_c_forward_variants_bf16_and_larger(isa, variant, monkeypatch):
    """Both loop orders on bf16 values (widened in the kernel) and on a shape with several
    tiles and units at the default sizes (K = 1000: 1:10 tiles of 8 slots; B = 300: batch chunks
    of 128 rows with AVX-512, and a short one)."""
    from sten_nm import _kernel

    for (N, K, n, m, B) in ((130, 1000, 1, 10, 70), (96, 300, 2, 4, 33), (130, 1000, 1, 10, 300)):
        t = ColumnGroupedNMTensor.from_dense(torch.randn(N, K), n, m)
        x, b = torch.randn(B, K), torch.randn(N)
        torch.testing.assert_close(_kernel.colgrouped_gather(t.desc(), x, b, variant=variant),
                                   F.linear(x, t.to_dense(), b), rtol=1e-4, atol=1e-4)
        tb = ColumnGroupedNMTensor.from_dense(torch.randn(N, K).bfloat16(), n, m)
        torch.testing.assert_close(_kernel.colgrouped_gather(tb.desc(), x, variant=variant),
                                   F.linear(x, tb.to_dense().float()), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="variant must be one of"):
        _kernel.colgrouped_gather(t.desc(), x, variant="fast")

@requires_kernel
@pytest.mark.parametrize("variant", ["stream", "tiled"])
@pytest.mark.parametrize("B,threads", [(64, 3), (200, 3), (256, 3), (400, 2), (256, 2)])
def test_c_forward_whole_and_shared_batch_chunks(isa, variant, B, threads, monkeypatch):
    """Units of the forward: batch chunks packed into each thread's own panel, and chunks
    split in row-block groups over a shared panel (fewer chunks than threads: B = 64; one
    or more left over: 4 chunks on 3 threads, 7 on 2), bf16 x included, against dense."""
    from sten_nm import _kernel
    from sten_nm._bf16x import colgrouped_gather_bf16x

    monkeypatch.setenv("STEN_NM_CG_QB", "3")   # several row-block groups per chunk
    monkeypatch.setenv("STEN_NM_CG_NVI", "3")  # 64-row batch chunks on every ISA with 16-float vectors
    for n, m in ((2, 4), (1, 10)):
        t = ColumnGroupedNMTensor.from_dense(torch.randn(200, 1000), n, m)
        x, b = torch.randn(B, 1000), torch.randn(200)
        ref = F.linear(x, t.to_dense(), b)
        torch.testing.assert_close(_kernel.colgrouped_gather(t.desc(), x, b, nthreads=threads, variant=variant),
                                   ref, rtol=1e-4, atol=1e-4)
        xh = x.bfloat16()
        torch.testing.assert_close(colgrouped_gather_bf16x(t.desc(), xh, b, nthreads=threads, variant=variant),
                                   F.linear(xh.float(), t.to_dense(), b), rtol=1e-4, atol=1e-4)



def test_forward_variant_is_tuned_and_cached(tmp_path, monkeypatch):
    """F.linear's C forward times both loop orders once per shape and caches the choice."""
    from sten_nm import _kernel, tuning

    if not _kernel.available()[0]:
        pytest.skip("needs the C kernels")
    monkeypatch.setenv("STEN_NM_TUNE", "1")
    monkeypatch.setenv("STEN_NM_TUNE_CACHE", str(tmp_path / "t.json"))
    t = ColumnGroupedNMTensor.from_dense(torch.randn(40, 96), 1, 4)
    x = torch.randn(20, 96)
    torch.testing.assert_close(column_grouped_linear(x, t), F.linear(x, t.to_dense()), rtol=1e-4, atol=1e-4)
    chosen = {k: v for k, v in tuning.choices().items() if k.startswith("cg_fwd R=40 C=96 1:4")}
    assert len(chosen) == 1
    entry = next(iter(chosen.values()))
    assert entry["choice"] in ("stream", "tiled") and set(entry["ms"]) == {"stream", "tiled"}
    torch.testing.assert_close(column_grouped_linear(x, t), F.linear(x, t.to_dense()), rtol=1e-4, atol=1e-4)


@requires_kernel
def test_c_forward_values_at_odd_offset_and_empty():
    from sten_nm import _kernel

    t = ColumnGroupedNMTensor.from_dense(torch.randn(24, 48), 2, 4)
    v = t.values()
    flat = torch.empty(v.numel() + 1)
    flat[1:] = v.flatten()
    t2 = t.with_values(flat[1:].view_as(v))
    x = torch.randn(9, 48)
    torch.testing.assert_close(column_grouped_linear(x, t2), F.linear(x, t.to_dense()), rtol=1e-4, atol=1e-4)
    for N, K in ((0, 8), (8, 0), (0, 0)):
        e = ColumnGroupedNMTensor.from_dense(torch.randn(N, K), 2, 4)
        b = torch.randn(N)
        assert torch.equal(_kernel.colgrouped_gather(e.desc(), torch.randn(3, K), b), b.expand(3, N))


@settings(max_examples=30, deadline=None)
@given(N=st.integers(0, 21), K=st.integers(0, 45), nm=st.sampled_from(CG_PATTERNS), g=st.sampled_from([None, 1, 3]))
def test_to_nm_is_lossless_and_values_map_back(N, K, nm, g):
    n, m = nm
    t = ColumnGroupedNMTensor.from_dense(torch.randn(N, K), n, m, g)
    e = t.to_nm()
    assert isinstance(e, NMTensor) and e.dim == 0 and (e.n, e.m) == (n, m)
    assert torch.equal(e.to_dense(), t.to_dense())
    assert torch.equal(t.values_from_nm(e.values()), t.values())
    t2 = t.with_values(t.values() * 3)                  # pattern cache shared, values not
    assert torch.equal(t2.to_nm().to_dense(), 3 * t.to_dense())


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_backward_other_dtypes(dtype):
    """float64 (decompress + dense path) and bf16 values (widened to fp32 kernels) against dense."""
    t = ColumnGroupedNMTensor.from_dense(torch.randn(20, 36).to(dtype), 1, 4)
    fmt = (sten.KeepAll(), ColumnGroupedNMTensor, sten.KeepAll(), ColumnGroupedNMTensor)
    W = sten.SparseParameterWrapper(t, grad_fmt=fmt)
    x = torch.randn(6, 36, dtype=dtype, requires_grad=True)
    y = F.linear(x, W)
    gy = torch.randn_like(y)
    y.backward(gy)
    xr, wr = x.detach().double().requires_grad_(), t.to_dense().double().requires_grad_()
    F.linear(xr, wr).backward(gy.double())
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=3e-2, atol=3e-2)
    assert x.grad.dtype == dtype and W.grad.wrapped_tensor.dtype == dtype
    torch.testing.assert_close(x.grad.double(), xr.grad, **tol)
    torch.testing.assert_close(W.grad.wrapped_tensor.to_dense().double(), wr.grad * t.mask(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sparsifying_under_a_float64_default_dtype(dtype):
    """``torch.set_default_dtype(torch.float64)`` made the pattern assignment mix its float32 scores with
    default-dtype scratch tensors: "expected scalar type Double but found Float", for any weight."""
    w = torch.randn(8, 24, generator=torch.Generator().manual_seed(0)).to(dtype)
    expected = sten.sparsify(ColumnGroupedNMSparsifier(2, 4), w, ColumnGroupedNMTensor).to_dense()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = sten.sparsify(ColumnGroupedNMSparsifier(2, 4), w, ColumnGroupedNMTensor)
    finally:
        torch.set_default_dtype(previous)
    assert got.dtype == dtype
    torch.testing.assert_close(got.to_dense(), expected, rtol=0, atol=0)
