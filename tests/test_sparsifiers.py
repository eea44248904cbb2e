"""Sparsifiers of the paper's Table 1: property tests against the dense reference.

Every built-in sparsifier is applied into every built-in layout through
``sten.sparsify(sp, dense, Layout)``; the result must equal ``dense * mask``.
Shapes include the edge sizes 0, 1 and odd sizes; dtypes float32, float64, bfloat16.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sten_core as sten
from sten_core.model.sparsifiers import kept_count  # the documented rounding (its own cases below)

LAYOUTS = (torch.Tensor, sten.DenseTensor, sten.CooTensor, sten.CsrTensor, sten.CscTensor)
ANY_DIM_LAYOUTS = (torch.Tensor, sten.DenseTensor, sten.CooTensor)
DTYPES = (torch.float32, torch.float64, torch.bfloat16)
PROFILE = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])

sizes = st.sampled_from([0, 1, 2, 3, 5, 7, 8, 13])
shapes_2d = st.tuples(sizes, sizes)
shapes_any = st.one_of(st.tuples(sizes), shapes_2d, st.tuples(sizes, sizes, sizes))
fractions = st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.7, 0.9, 1.0]) | st.floats(0.0, 1.0)


def make(shape: tuple, dtype: torch.dtype, seed: int, ties: bool) -> torch.Tensor:
    """A test input; ``ties`` gives small integers (many equal magnitudes, zeros)."""
    g = torch.Generator().manual_seed(seed)
    if ties:
        x = torch.randint(-3, 4, shape, generator=g).to(torch.float64)
    else:
        x = torch.randn(shape, generator=g, dtype=torch.float64)
    return x.to(dtype)


def dense_of(result: torch.Tensor) -> torch.Tensor:
    return result.to_dense() if isinstance(result, sten.SparseTensorWrapper) else result


def check_into_layout(sp: sten.Sparsifier, x: torch.Tensor, layout: type, mask: torch.Tensor) -> None:
    """``sparsify(sp, x, layout)`` is ``x * mask`` in ``layout`` with the true metadata."""
    result = sten.sparsify(sp, x, layout)
    if layout is torch.Tensor:
        assert type(result) is torch.Tensor
    else:
        assert isinstance(result, sten.SparseTensorWrapper)
        assert type(result.wrapped_tensor) is layout
        assert result.shape == x.shape and result.dtype == x.dtype
    expected = x * mask
    got = dense_of(result)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert torch.equal(got, expected)


def layouts_for(x: torch.Tensor) -> tuple:
    return LAYOUTS if x.dim() == 2 else ANY_DIM_LAYOUTS


# -- kinds -------------------------------------------------------------------------

@pytest.mark.parametrize(
    "sparsifier, kind",
    [
        (sten.KeepAll(), "streaming"),
        (sten.RandomFractionSparsifier(0.5), "streaming"),
        (sten.ScalarThresholdSparsifier(0.1), "streaming"),
        (sten.ScalarFractionSparsifier(0.5), "materializing"),
        (sten.BlockwiseFractionSparsifier(0.5, (2, 2)), "materializing"),
        (sten.PerBlockFractionSparsifier(2, 4), "blocking"),
        (sten.SameFormatSparsifier(torch.ones(2)), "streaming"),
    ],
)
def test_kind_matches_table_1(sparsifier, kind):
    assert sparsifier.kind == kind
    assert type(sparsifier).kind == kind


# -- KeepAll ---------------------------------------------------------------------

@PROFILE
@given(shape=shapes_any, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16), ties=st.booleans())
def test_keep_all_keeps_everything(shape, dtype, seed, ties):
    x = make(shape, dtype, seed, ties)
    for layout in layouts_for(x):
        check_into_layout(sten.KeepAll(), x, layout, torch.ones_like(x, dtype=torch.bool))


# -- RandomFractionSparsifier -------------------------------------------------------------

@PROFILE
@given(shape=shapes_any, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16), fraction=fractions)
def test_random_fraction_is_dense_times_its_mask(shape, dtype, seed, fraction):
    x = make(shape, dtype, seed, ties=False)
    sp = sten.RandomFractionSparsifier(fraction)
    for layout in layouts_for(x):
        torch.manual_seed(seed)
        mask = sp.mask(x)
        assert mask.dtype == torch.bool and mask.shape == x.shape
        torch.manual_seed(seed)
        check_into_layout(sp, x, layout, mask)


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_random_fraction_drops_about_fraction(fraction):
    torch.manual_seed(1)
    x = torch.rand(300, 300) + 1.0  # no zeros
    out = sten.sparsify(sten.RandomFractionSparsifier(fraction), x, torch.Tensor)
    dropped = (out == 0).double().mean().item()
    # 90 000 Bernoulli draws: 5 standard deviations is below 0.01
    assert abs(dropped - fraction) < 0.01
    kept = out != 0
    assert torch.equal(out[kept], x[kept])


# -- ScalarThresholdSparsifier -----------------------------------------------------------

@PROFILE
@given(shape=shapes_any, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16),
       ties=st.booleans(), threshold=st.sampled_from([0.0, 0.5, 1.0, 2.0, 100.0]))
def test_scalar_threshold_keeps_magnitudes_at_least_threshold(shape, dtype, seed, ties, threshold):
    x = make(shape, dtype, seed, ties)
    sp = sten.ScalarThresholdSparsifier(threshold)
    mask = x.abs() >= threshold
    assert torch.equal(sp.mask(x), mask)
    for layout in layouts_for(x):
        check_into_layout(sp, x, layout, mask)


# -- ScalarFractionSparsifier -------------------------------------------------------------

def check_top_magnitudes(x: torch.Tensor, mask: torch.Tensor, keep: int) -> None:
    """``mask`` keeps exactly ``keep`` values and none is smaller than a dropped one."""
    assert int(mask.sum()) == keep
    mags = x.abs().double().reshape(-1)
    flat = mask.reshape(-1)
    if 0 < keep < mags.numel():
        assert mags[flat].min() >= mags[~flat].max()


@PROFILE
@given(shape=shapes_any, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16),
       ties=st.booleans(), fraction=fractions)
def test_scalar_fraction_keeps_exact_count_of_largest(shape, dtype, seed, ties, fraction):
    x = make(shape, dtype, seed, ties)
    sp = sten.ScalarFractionSparsifier(fraction)
    mask = sp.mask(x)
    keep = kept_count(x.numel(), fraction)
    check_top_magnitudes(x, mask, keep)
    assert torch.equal(sp.mask(x.clone()), mask), "same input twice must give the same mask"
    for layout in layouts_for(x):
        check_into_layout(sp, x, layout, mask)


def test_scalar_fraction_breaks_ties_deterministically():
    x = torch.tensor([[1.0, -1.0, 1.0, 1.0], [2.0, 1.0, -1.0, 0.5]])
    sp = sten.ScalarFractionSparsifier(0.5)  # keeps 4 of 8: the 2.0 and three of the six 1s
    first = sp.mask(x)
    assert int(first.sum()) == 4 and bool(first[1, 0])
    for _ in range(3):
        assert torch.equal(sp.mask(x), first)
    assert torch.equal(sp.mask(x.to(torch.float64)), first)


def test_scalar_fraction_nnz_in_layouts():
    torch.manual_seed(0)
    x = torch.randn(30, 20)
    for layout in LAYOUTS[2:]:
        w = sten.sparsify(sten.ScalarFractionSparsifier(0.9), x, layout)
        assert w.wrapped_tensor.nnz == 60


# -- BlockwiseFractionSparsifier -----------------------------------------------------------

block_shapes = st.one_of(st.tuples(st.integers(1, 4)), st.tuples(st.integers(1, 4), st.integers(1, 4)))


@PROFILE
@given(shape=st.one_of(shapes_2d, st.tuples(sizes, sizes, sizes)), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16), ties=st.booleans(), fraction=fractions, block=block_shapes)
def test_blockwise_fraction_keeps_whole_blocks(shape, dtype, seed, ties, fraction, block):
    x = make(shape, dtype, seed, ties)
    sp = sten.BlockwiseFractionSparsifier(fraction, block)
    mask = sp.mask(x)
    assert mask.shape == x.shape and mask.dtype == torch.bool

    nb = len(block)
    lead, tail = x.shape[: x.dim() - nb], x.shape[x.dim() - nb:]
    counts = [math.ceil(s / b) for s, b in zip(tail, block)]
    n_blocks = math.prod(lead) * math.prod(counts)
    keep = kept_count(n_blocks, fraction)

    # walk the blocks (partial ones at the edges): constant mask inside each
    kept_scores, dropped_scores = [], []
    n_lead = math.prod(lead)
    xs = x.abs().double().reshape(n_lead, *tail)
    ms = mask.reshape(n_lead, *tail)
    for lead_i in range(xs.shape[0]):
        for idx in _block_indices(counts):
            sl = tuple(slice(i * b, (i + 1) * b) for i, b in zip(idx, block))
            piece = ms[lead_i][sl]
            assert piece.numel() > 0
            assert bool(piece.all()) or not bool(piece.any()), "a block is kept or dropped whole"
            (kept_scores if bool(piece.all()) else dropped_scores).append(xs[lead_i][sl].sum().item())
    assert len(kept_scores) == keep
    if kept_scores and dropped_scores:
        assert min(kept_scores) >= max(dropped_scores) - 1e-3 * max(1.0, max(dropped_scores))
    assert torch.equal(sp.mask(x.clone()), mask)
    for layout in layouts_for(x):
        check_into_layout(sp, x, layout, mask)


def _block_indices(counts: list[int]):
    if not counts:
        yield ()
        return
    for i in range(counts[0]):
        for rest in _block_indices(counts[1:]):
            yield (i,) + rest


def test_blockwise_fraction_partial_edge_block():
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0, 9.0]])
    # blocks of 2 along the last dim: [1,1] [1,1] [9]: the partial edge block wins
    mask = sten.BlockwiseFractionSparsifier(2 / 3, (1, 2)).mask(x)
    assert mask.tolist() == [[False, False, False, False, True]]


# -- PerBlockFractionSparsifier (n:m) ----------------------------------------------------

@PROFILE
@given(shape=st.one_of(st.tuples(sizes), shapes_2d, st.tuples(sizes, sizes, sizes)),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16), ties=st.booleans(),
       nm=st.integers(1, 8).flatmap(lambda m: st.tuples(st.integers(0, m), st.just(m))))
def test_per_block_keeps_n_largest_of_every_m(shape, dtype, seed, ties, nm):
    n, m = nm
    x = make(shape, dtype, seed, ties)
    sp = sten.PerBlockFractionSparsifier(n, m)
    mask = sp.mask(x)
    assert mask.shape == x.shape and mask.dtype == torch.bool
    k = x.shape[-1]
    n_rows = math.prod(x.shape[:-1])
    rows_x = x.abs().double().reshape(n_rows, k)
    rows_m = mask.reshape(n_rows, k)
    for r in range(rows_x.shape[0]):
        for start in range(0, k, m):
            g_x, g_m = rows_x[r, start:start + m], rows_m[r, start:start + m]
            assert int(g_m.sum()) == min(n, g_x.numel())
            if g_m.any() and (~g_m).any():
                assert g_x[g_m].min() >= g_x[~g_m].max()
    for layout in layouts_for(x):
        check_into_layout(sp, x, layout, mask)


def test_per_block_example():
    x = torch.tensor([[1.0, -4.0, 2.0, 3.0, 0.5, -0.1]])
    mask = sten.PerBlockFractionSparsifier(2, 4).mask(x)
    assert mask.tolist() == [[False, True, False, True, True, True]]


# -- SameFormatSparsifier --------------------------------------------------------------

@PROFILE
@given(shape=shapes_2d, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16),
       ref_layout=st.sampled_from(LAYOUTS[1:]))
def test_same_format_keeps_the_reference_positions(shape, dtype, seed, ref_layout):
    ref_dense = make(shape, dtype, seed, ties=True)  # many zeros
    ref = sten.sparsify(sten.KeepAll(), ref_dense, ref_layout)
    x = make(shape, dtype, seed + 1, ties=False) + 10.0  # no zeros anywhere
    x = x.to(dtype)
    sp = sten.SameFormatSparsifier(ref)
    # the stored positions: every one for DenseTensor, the nonzeros otherwise
    mask = torch.ones_like(x, dtype=torch.bool) if ref_layout is sten.DenseTensor else ref_dense != 0
    assert torch.equal(sp.mask(x), mask)
    result = sten.sparsify(sp, x, ref_layout)
    assert type(result.wrapped_tensor) is ref_layout
    assert torch.equal(result.to_dense(), x * mask)
    for layout in LAYOUTS:  # values always follow the reference
        assert torch.equal(dense_of(sten.sparsify(sp, x, layout)), x * mask)


@pytest.mark.parametrize("layout", [L for L in LAYOUTS if L is not sten.CsrTensor])  # the reference is CSR
def test_same_format_honours_out_format(layout):
    ref = sten.sparsify(sten.ScalarFractionSparsifier(0.5), torch.randn(4, 6), sten.CsrTensor)
    result = sten.sparsify(sten.SameFormatSparsifier(ref), torch.randn(4, 6), layout)
    got = result.wrapped_tensor if isinstance(result, sten.SparseTensorWrapper) else result
    assert type(got) is layout


def test_same_format_with_dense_reference():
    ref = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    x = torch.tensor([[5.0, 6.0], [7.0, 8.0]])
    out = sten.sparsify(sten.SameFormatSparsifier(ref), x, torch.Tensor)
    assert torch.equal(dense_of(out), x * (ref != 0))


# -- paper helpers -------------------------------------------------------------------

@PROFILE
@given(shape=shapes_any, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16), frac=fractions)
def test_random_mask_sparsify(shape, dtype, seed, frac):
    x = make(shape, dtype, seed, ties=False)
    torch.manual_seed(seed)
    out = sten.random_mask_sparsify(x, frac=frac)
    torch.manual_seed(seed)
    mask = sten.RandomFractionSparsifier(frac).mask(x)
    assert type(out) is torch.Tensor and out.dtype == dtype
    assert torch.equal(out, x * mask)


def test_random_mask_sparsify_extremes():
    x = torch.rand(50, 50) + 1
    assert torch.equal(sten.random_mask_sparsify(x, frac=0.0), x)
    assert torch.equal(sten.random_mask_sparsify(x, frac=1.0), torch.zeros_like(x))


@PROFILE
@given(shape=shapes_any, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16),
       frac=st.sampled_from([0.0, 0.3, 0.5, 0.7, 0.9, 1.0]))
def test_scalar_mask_sparsify(shape, dtype, seed, frac):
    """The original STen's semantics: the ceil(frac * numel) smallest magnitudes are zeroed."""
    x = make(shape, dtype, seed, ties=False)
    out = sten.scalar_mask_sparsify(x, frac)
    assert type(out) is torch.Tensor and out.dtype == dtype
    n = x.numel()
    # the reference: the n - ceil(frac * n) largest magnitudes (ties: the earliest), i.e. the
    # original's "ascending rank >= frac * n" (float rounding of frac * n aside)
    kept = n - math.ceil(round(frac * n, 9))
    order = torch.argsort(-x.detach().reshape(-1).abs().double(), stable=True)
    keep = torch.zeros(n, dtype=torch.bool)
    keep[order[:kept]] = True
    assert torch.equal(out, x * keep.view(x.shape))


# -- sparsifier objects ------------------------------------------------------------------

def test_sparsifier_equality_and_repr():
    assert sten.ScalarFractionSparsifier(0.5) == sten.ScalarFractionSparsifier(0.5)
    assert sten.ScalarFractionSparsifier(0.5) != sten.ScalarFractionSparsifier(0.6)
    assert hash(sten.PerBlockFractionSparsifier(2, 4)) == hash(sten.PerBlockFractionSparsifier(2, 4))
    assert repr(sten.PerBlockFractionSparsifier(2, 4)) == "PerBlockFractionSparsifier(n=2, m=4)"
    assert sten.BlockwiseFractionSparsifier(0.5, 4).block_shape == (4,)


# -- NaN, inf, ties and exact magnitudes -----------------------------------------------

NAN, INF = float("nan"), float("inf")
MAGNITUDE_SPARSIFIERS = [sten.ScalarFractionSparsifier(0.5), sten.BlockwiseFractionSparsifier(0.5, (1, 2)),
                         sten.PerBlockFractionSparsifier(2, 4), sten.ScalarThresholdSparsifier(1.5)]


@pytest.mark.parametrize("sparsifier", MAGNITUDE_SPARSIFIERS, ids=repr)
def test_nan_counts_as_the_largest_magnitude(sparsifier):
    """A NaN weight is kept (where it shows), and the kept count stays the documented one:
    the fraction sparsifiers kept fewer values than documented (NaN never ranked), so with
    as many NaNs as values to keep they kept nothing."""
    x = torch.tensor([[NAN, 1.0, 2.0, 3.0, NAN, 4.0, 0.5, 0.25]])
    mask = sparsifier.mask(x)
    assert bool(mask[0, 0]) and bool(mask[0, 4])
    if hasattr(sparsifier, "fraction"):
        assert int(mask.sum()) == 4


def test_a_fraction_with_more_nans_than_it_keeps_keeps_only_nans():
    x = torch.tensor([NAN, 1.0, NAN, 3.0, NAN, 4.0, 0.5, NAN])
    assert sten.ScalarFractionSparsifier(0.75).mask(x).tolist() == [True, False, True] + [False] * 5


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_dropped_nan_or_inf_is_stored_as_zero(layout):
    """``sparsify`` multiplied by the mask: a dropped NaN stayed NaN and a dropped inf became
    NaN (``inf * 0``), so ``F.linear`` through the weight returned NaN where dense gives numbers."""
    x = torch.tensor([[INF, 1.0, -INF, 2.0], [NAN, 3.0, 0.5, 4.0]])
    sparsifier = sten.SameFormatSparsifier(torch.tensor([[0.0, 1.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0]]))
    for sp in (sten.RandomFractionSparsifier(1.0), sparsifier):
        mask = sp.mask(x)
        got = dense_of(sten.sparsify(sp, x, layout))
        assert torch.equal(got, torch.where(mask, x, 0.0)) and not got.isnan().any()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_per_block_ties_keep_the_lower_index_in_every_layout(layout):
    """``nm_keep_mask`` took ``torch.topk``'s order for ties (the higher indices), while the
    n:m layouts keep the lower ones: the pattern depended on the layout."""
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0]], dtype=torch.bfloat16)
    kept = dense_of(sten.sparsify(sten.PerBlockFractionSparsifier(2, 4), x, layout)) != 0
    assert kept.tolist() == [[True, True, False, False, True, True, False, False]]


def test_per_block_ties_match_the_nm_layouts():
    sten_nm = pytest.importorskip("sten_nm")
    x = torch.randint(-2, 3, (8, 16)).float()
    want = sten.PerBlockFractionSparsifier(2, 4).mask(x)
    assert torch.equal(sten.sparsify(sten.PerBlockFractionSparsifier(2, 4), x, sten_nm.NMTensor).wrapped_tensor.mask(), want)
    assert torch.equal(sten_nm.NMSparsifier(2, 4).mask(x), want)


def test_block_sums_keep_float64_precision():
    """Blocks were summed in float32: blocks differing below its precision tied."""
    x = torch.tensor([[2.0 ** 24, 2.0 ** 24 + 1.0]], dtype=torch.float64)
    assert sten.BlockwiseFractionSparsifier(0.5, (1, 1)).mask(x).tolist() == [[False, True]]


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.int64, torch.bool])
def test_magnitudes_of_integers_are_exact(dtype):
    """|-128| of an int8 wrapped to -128 (pruned first); large int64s lost precision in float32."""
    if dtype is torch.bool:
        x = torch.tensor([True, False, True, False])
        assert sten.ScalarFractionSparsifier(0.5).mask(x).tolist() == [True, False, True, False]
        return
    big = {torch.int8: -128, torch.int32: -(2 ** 31), torch.int64: 2 ** 40 + 1}[dtype]
    second = {torch.int8: 127, torch.int32: 2 ** 31 - 1, torch.int64: 2 ** 40}[dtype]
    x = torch.tensor([second, 1, big, 0], dtype=dtype)
    assert sten.ScalarFractionSparsifier(0.75).mask(x).tolist() == [False, False, True, False]


@pytest.mark.parametrize("numel, fraction, kept", [(10, 0.95, 0), (15, 0.9, 2), (15, 0.7, 4), (25, 0.78, 6)])
def test_the_kept_count_rounds_the_exact_product_half_to_even(numel, fraction, kept):
    """``round(numel * (1 - fraction))`` was taken in binary floating point: 10 * (1 - 0.95) is
    0.5000000000000004 and kept 1, where the documented rule (a half rounds to even) keeps 0."""
    from sten_core.training.scores import TaylorSparsifier

    w = torch.arange(1.0, numel + 1)
    assert int(sten.ScalarFractionSparsifier(fraction).mask(w).sum()) == kept
    assert int(sten.BlockwiseFractionSparsifier(fraction, (1,)).mask(w).sum()) == kept
    assert int(TaylorSparsifier(fraction).mask(w, grad=torch.ones(numel)).sum()) == kept


@pytest.mark.parametrize("sparsifier", [sten.ScalarFractionSparsifier(0.5), sten.PerBlockFractionSparsifier(1, 2)])
def test_sparsifying_a_bool_tensor_keeps_bool(sparsifier):
    """``dense.where(mask, 0)``: the Python int 0 promoted a bool tensor to int64."""
    mask = torch.tensor([[True, False, True, True]])
    for layout in (torch.Tensor, sten.CooTensor, sten.CsrTensor):
        assert sten.sparsify(sparsifier, mask, layout).dtype == torch.bool
