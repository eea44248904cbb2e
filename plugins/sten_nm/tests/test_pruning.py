"""One-shot pruning (magnitude, Wanda, SparseGPT) into the paper's grouped n:m formats,
``ColumnGroupedNMTensor`` and the 16-row ``GroupedNMTensor`` (issue #17).

The pattern is checked by an independent counter (:func:`check_grouped`), the selection
against the layout's own magnitude path, SparseGPT against its diagonal-Hessian limit
and by reconstruction error, the pruned model against dense with the same weights.
"""

from __future__ import annotations

import copy
import io
import itertools
import math

import pytest
import torch

import sten_core as sten
from sten_core.training.pruning import WandaSparsifier, input_hessian, input_norms
from sten_core.training.schedule import stored_mask
from sten_nm import ColumnGroupedNMSparsifier, ColumnGroupedNMTensor, GroupedNMSparsifier, GroupedNMTensor
from sten_nm.column_grouped import default_g
from sten_nm.grouped_tensor import greedy_row_groups
from sten_nm.pruning import (ColumnGroupedSparseGPTSparsifier, ColumnGroupedWandaSparsifier, GroupedSparseGPTSparsifier,
                             GroupedWandaSparsifier, grouped_pruning_sparsifier, pruning_sparsifier)

METHODS = ("magnitude", "wanda", "sparsegpt")


def correlated_inputs(n: int, features: int, seed: int = 0) -> torch.Tensor:
    """Inputs with correlated features and a few large ones (as in LLMs)."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(features, features, generator=gen) * 0.3
    x = torch.randn(n, features, generator=gen) @ mix + torch.randn(n, features, generator=gen)
    x[:, :: max(1, features // 5)] *= 8.0
    return x


def check_grouped(keep: torch.Tensor, n: int, m: int, g: int) -> None:
    """``keep`` ``[N, K]`` honours the grouped pattern: in every full block of ``m`` rows
    each column keeps exactly ``n`` rows, and in every full chunk of ``C(m, n) * g``
    columns each ``n``-subset of rows is kept by exactly ``g`` columns. The last
    (narrower) chunk: each subset by at most ``ceil(rest / C(m, n))`` columns; a last
    partial row block: at most ``n`` rows per column."""
    N, K = keep.shape
    subsets = {s: i for i, s in enumerate(itertools.combinations(range(m), n))}
    P = len(subsets)
    for q in range(0, N, m):
        block = keep[q:q + m]
        per_col = block.sum(0)
        if block.shape[0] == m:
            assert bool((per_col == n).all()), f"row block {q // m}: kept rows per column {per_col.tolist()}"
            owner = [subsets[tuple(torch.nonzero(block[:, k]).flatten().tolist())] for k in range(K)]
            for c0 in range(0, K, P * g):
                chunk = owner[c0:c0 + P * g]
                counts = [chunk.count(p) for p in range(P)]
                if len(chunk) == P * g:
                    assert counts == [g] * P, f"row block {q // m}, chunk at column {c0}: {counts}"
                else:
                    assert max(counts) <= math.ceil(len(chunk) / P), f"last chunk at column {c0}: {counts}"
        else:
            assert bool((per_col <= n).all())


def check_grouped16(keep: torch.Tensor, n: int, m: int) -> None:
    """``keep`` ``[N, K]`` honours the 16-row grouped n:m: every row keeps ``min(n, size)``
    of each group of ``m`` inputs, and the rows fall into ``ceil(N / 16)`` groups of at
    most 16 rows with one mask each."""
    N, K = keep.shape
    for c in range(0, K, m):
        per_row = keep[:, c:c + m].sum(1)
        assert bool((per_row == min(n, K - c)).all()), f"inputs {c}..: kept per row {per_row.tolist()}"
    _, counts = torch.unique(keep, dim=0, return_counts=True)
    assert sum(-(-int(c) // 16) for c in counts) == -(-N // 16), f"rows per distinct mask: {counts.tolist()}"


def check_pattern(layout: type, keep: torch.Tensor, n: int, m: int) -> None:
    if layout is ColumnGroupedNMTensor:
        check_grouped(keep, n, m, default_g(keep.shape[1], n, m))
    else:
        check_grouped16(keep, n, m)


def _weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def method_sparsifier(method: str, n: int, m: int, g, x: torch.Tensor):
    if method == "magnitude":
        return ColumnGroupedNMSparsifier(n, m, g)
    if method == "wanda":
        return ColumnGroupedWandaSparsifier(n, m, g).bind(input_norm=input_norms(x))
    return ColumnGroupedSparseGPTSparsifier(n, m, g, blocksize=16).bind(hessian=input_hessian(x))


# -- the masks honour the pattern ----------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape, nm, g", [
    ((8, 48), (2, 4), 4),       # two full chunks of 24
    ((8, 40), (2, 4), 4),       # a full chunk and a narrower one (16 columns)
    ((10, 30), (2, 4), None),   # rows not a multiple of m; g automatic (4)
    ((16, 20), (1, 4), 2),      # chunks of 8: 8, 8, 4
    ((8, 64), (2, 8), 2),       # 28 patterns, chunks of 56
    ((6, 7), (1, 2), 8),        # g larger than the columns allow: one narrow chunk
])
def test_masks_honour_the_grouped_pattern(method, shape, nm, g):
    n, m = nm
    w = _weight(*shape)
    x = correlated_inputs(128, shape[1])
    sp = method_sparsifier(method, n, m, g, x)
    stored = sten.sparsify(sp, w, ColumnGroupedNMTensor)
    t = stored.wrapped_tensor
    g_used = default_g(shape[1], n, m) if g is None else g
    assert type(t) is ColumnGroupedNMTensor and (t.n, t.m, t.g) == (n, m, g_used)
    check_grouped(t.mask(), n, m, g_used)
    keep = stored_mask(stored)
    check_grouped(keep, n, m, g_used)
    if method != "sparsegpt":  # the kept weights are the original ones, the rest 0
        assert torch.equal(stored.to_dense(), w * keep)
        assert torch.equal(sp.mask(w), keep)


def test_wanda_selects_by_weight_times_input_norm():
    """Wanda's grouped mask is the layout's own magnitude selection of ``|W| * ||X_j||``."""
    w = _weight(12, 48, seed=3)
    x = correlated_inputs(256, 48, seed=4)
    norms = input_norms(x)
    got = ColumnGroupedWandaSparsifier(2, 4, 4).mask(w, input_norm=norms)
    assert torch.equal(got, ColumnGroupedNMTensor.from_dense(w * norms[None], 2, 4, 4).mask())
    flat = ColumnGroupedWandaSparsifier(2, 4, 4).mask(w, input_norm=torch.ones(48))
    assert torch.equal(flat, ColumnGroupedNMSparsifier(2, 4, 4).mask(w))
    assert not torch.equal(got, flat)  # the large input features change the choice


def test_sparsegpt_with_a_diagonal_hessian_is_grouped_saliency_pruning():
    """With uncorrelated inputs (``H`` diagonal) no update reaches another column, so
    SparseGPT keeps the original weights and chooses by ``w² H_jj`` chunk by chunk,
    which must equal the whole-matrix grouped selection of that score."""
    w = _weight(8, 40, seed=5)
    diag = torch.linspace(0.5, 3.0, 40)
    values, keep = ColumnGroupedSparseGPTSparsifier(2, 4, 4, percdamp=0.0, blocksize=7).prune(
        w, hessian=torch.diag(diag))
    want = ColumnGroupedNMTensor.from_dense(w, 2, 4, 4, score=w.square() * diag[None]).mask()
    assert torch.equal(keep, want)
    torch.testing.assert_close(values, w * want, rtol=1e-6, atol=1e-6)


def test_sparsegpt_block_size_is_a_multiple_of_the_chunk():
    """Any lazy block size gives the same result (rounded up to whole chunks)."""
    w = _weight(8, 72, seed=6)
    h = input_hessian(correlated_inputs(512, 72, seed=7))
    results = [ColumnGroupedSparseGPTSparsifier(2, 4, 4, blocksize=b).prune(w, hessian=h) for b in (1, 24, 30, 128)]
    for values, keep in results[1:]:
        assert torch.equal(keep, results[0][1])
        torch.testing.assert_close(values, results[0][0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape, nm", [((32, 48), (2, 4)), ((40, 30), (2, 4)), ((20, 24), (1, 4)), ((16, 17), (2, 8))])
def test_masks_honour_the_16_row_grouped_pattern(method, shape, nm):
    n, m = nm
    w = _weight(*shape, seed=2)
    x = correlated_inputs(128, shape[1])
    sp = grouped_pruning_sparsifier(method, pattern=nm)
    sp = sp.bind(**({"input_norm": input_norms(x)} if method == "wanda" else {"hessian": input_hessian(x)})) \
        if method != "magnitude" else sp
    stored = sten.sparsify(sp, w, GroupedNMTensor)
    assert type(stored.wrapped_tensor) is GroupedNMTensor
    keep = stored_mask(stored)
    check_grouped16(keep, n, m)
    if method != "sparsegpt":
        assert torch.equal(stored.to_dense(), w * keep)
        assert torch.equal(sp.mask(w), keep)


def test_16_row_grouped_wanda_and_sparsegpt_select_by_their_scores():
    w = _weight(40, 48, seed=3)
    x = correlated_inputs(256, 48, seed=4)
    norms = input_norms(x)
    got = GroupedWandaSparsifier(2, 4).mask(w, input_norm=norms)
    assert torch.equal(got, GroupedNMTensor.from_dense(w * norms[None], 2, 4).mask())
    assert torch.equal(GroupedWandaSparsifier(2, 4).mask(w, input_norm=torch.ones(48)), GroupedNMSparsifier(2, 4).mask(w))
    # diagonal Hessian: rows grouped by |w| sqrt(h), each group's n of m by the summed w² h
    diag = torch.linspace(0.5, 3.0, 48)
    values, keep = GroupedSparseGPTSparsifier(2, 4, percdamp=0.0, blocksize=5).prune(w, hessian=torch.diag(diag))
    order = greedy_row_groups(w.abs() * diag.sqrt()[None], 2, 4)
    want = GroupedNMTensor._select(w, w.square() * diag[None], order, 2, 4).mask()
    assert torch.equal(keep, want)
    torch.testing.assert_close(values, w * want, rtol=1e-6, atol=1e-6)


# -- quality: SparseGPT reconstructs best ------------------------------------------------------

class TinyMLP(torch.nn.Module):
    def __init__(self, features: int = 48, hidden: int = 96, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = torch.nn.Linear(features, hidden)
        self.fc2 = torch.nn.Linear(hidden, hidden)
        self.fc3 = torch.nn.Linear(hidden, 12)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


@pytest.mark.parametrize("layout", [ColumnGroupedNMTensor, GroupedNMTensor])
def test_sparsegpt_reconstructs_best_in_the_grouped_pattern(layout):
    dense = TinyMLP()
    x = correlated_inputs(1024, 48, seed=1)
    acts = {}
    hooks = [getattr(dense, n).register_forward_pre_hook(lambda mod, a, n=n: acts.__setitem__(n, a[0]))
             for n in ("fc1", "fc2", "fc3")]
    with torch.no_grad():
        dense(x)
    for h in hooks:
        h.remove()
    errors = {}
    for method in METHODS:
        pruned = sten.prune(copy.deepcopy(dense), list(x.split(128)), method, pattern=(2, 4),
                            out_format=layout, sequential=False)
        errors[method] = {}
        for name in ("fc1", "fc2", "fc3"):
            w, w_hat = getattr(dense, name).weight.detach(), getattr(pruned, name).weight
            assert type(w_hat.wrapped_tensor) is layout
            check_pattern(layout, stored_mask(w_hat), 2, 4)
            w_hat = w_hat.to_dense().detach()
            assert int((w_hat != 0).sum()) == w.numel() // 2
            errors[method][name] = float(((w - w_hat) @ acts[name].t()).norm() / (w @ acts[name].t()).norm())
    for name in ("fc1", "fc2", "fc3"):
        assert errors["sparsegpt"][name] < errors["wanda"][name], errors
        assert errors["sparsegpt"][name] < errors["magnitude"][name], errors
    assert errors["wanda"]["fc1"] < errors["magnitude"]["fc1"], errors


# -- the pruned model ------------------------------------------------------------------------

@pytest.mark.parametrize("layout", [ColumnGroupedNMTensor, GroupedNMTensor])
@pytest.mark.parametrize("method", METHODS)
def test_pruned_model_equals_dense_model_with_the_masked_weights(method, layout):
    torch.manual_seed(0)
    x = correlated_inputs(256, 48)
    model = sten.prune(TinyMLP(), list(x.split(64)), method, pattern=(2, 4), out_format=layout)
    reference = TinyMLP()
    with torch.no_grad():
        for name in ("fc1", "fc2", "fc3"):
            w = getattr(model, name).weight
            assert type(w.wrapped_tensor) is layout
            getattr(reference, name).weight.copy_(w.to_dense())
            getattr(reference, name).bias.copy_(getattr(model, name).bias)
            if method != "sparsegpt":  # the original weights on the mask
                original = getattr(TinyMLP(), name).weight
                assert torch.equal(w.to_dense(), original * (w.to_dense() != 0))
        torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", [ColumnGroupedNMTensor, GroupedNMTensor])
def test_pruned_model_loads_from_a_state_dict_and_trains_on_in_its_pattern(layout):
    torch.manual_seed(0)
    x = correlated_inputs(256, 48)
    y = torch.randint(0, 12, (256,))
    model = sten.prune(TinyMLP(), list(x.split(64)), "sparsegpt", pattern=(2, 4), out_format=layout)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf)
    fresh = sten.prune(TinyMLP(seed=9), method="magnitude", pattern=(2, 4), out_format=layout)
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)
    masks = {n: stored_mask(p).clone() for n, p in fresh.named_parameters() if isinstance(p, sten.SparseTensorWrapper)}
    assert len(masks) == 3
    for name, keep in masks.items():
        assert torch.equal(keep, stored_mask(model.get_parameter(name)))

    opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = torch.nn.functional.cross_entropy(fresh(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    for name, keep in masks.items():
        w = fresh.get_parameter(name)
        assert type(w.wrapped_tensor) is layout
        assert torch.equal(stored_mask(w), keep)  # the gradient steps kept the pattern
        check_pattern(layout, stored_mask(w), 2, 4)


def test_pattern_with_g_and_through_the_builder():
    x = correlated_inputs(128, 48)
    model = sten.prune(TinyMLP(), [x], "wanda", pattern=(2, 4, 2), out_format=ColumnGroupedNMTensor)
    assert {getattr(model, n).weight.wrapped_tensor.g for n in ("fc1", "fc2", "fc3")} == {2}
    layer = torch.nn.Linear(48, 16)
    sb = sten.SparsityBuilder(layer)
    sb.set_weight("weight", ColumnGroupedSparseGPTSparsifier(2, 4).bind(hessian=input_hessian(x)),
                  out_format=ColumnGroupedNMTensor)
    sb.sparsify_model_and_optimizer_inplace()
    assert type(layer.weight.wrapped_tensor) is ColumnGroupedNMTensor
    check_grouped(layer.weight.to_dense() != 0, 2, 4, 8)


# -- bad input -------------------------------------------------------------------------------

def test_bad_input_names_the_argument():
    x = [correlated_inputs(64, 48)]
    with pytest.raises(ValueError, match="not sparsity"):
        sten.prune(TinyMLP(), x, "wanda", sparsity=0.5, out_format=ColumnGroupedNMTensor)
    with pytest.raises(TypeError, match="pattern must be"):
        sten.prune(TinyMLP(), x, "wanda", pattern=(2, 4, 1, 1), out_format=ColumnGroupedNMTensor)
    with pytest.raises(ValueError, match="g must be"):
        sten.prune(TinyMLP(), x, "wanda", pattern=(2, 4, 0), out_format=ColumnGroupedNMTensor)
    with pytest.raises(ValueError, match="method must be"):
        sten.prune(TinyMLP(), x, "obs", pattern=(2, 4), out_format=ColumnGroupedNMTensor)
    with pytest.raises(ValueError, match="patterns"):
        pruning_sparsifier("wanda", pattern=(8, 32))
    w = _weight(8, 24)
    not_grouped = torch.zeros(8, 24, dtype=torch.bool)
    not_grouped[:2] = True                  # every column keeps rows 0, 1: one pattern for all
    with pytest.raises(ValueError, match="mask is not a ColumnGroupedNMTensor"):
        ColumnGroupedNMTensor.from_dense(w, 2, 4, 4, mask=not_grouped)
    with pytest.raises(ValueError, match="score must be"):
        ColumnGroupedNMTensor.from_dense(w, 2, 4, 4, score=-w.abs())
    with pytest.raises(ValueError, match="score must be a tensor of the weight's shape"):
        ColumnGroupedNMTensor.from_dense(w, 2, 4, 4, score=w[:, :3])
    with pytest.raises(TypeError, match=r"pattern must be \(n, m\) for out_format=GroupedNMTensor"):
        sten.prune(TinyMLP(), x, "wanda", pattern=(2, 4, 2), out_format=GroupedNMTensor)
    with pytest.raises(ValueError, match="not sparsity"):
        sten.prune(TinyMLP(), x, "sparsegpt", sparsity=0.5, out_format=GroupedNMTensor)
    exact_nm = torch.zeros(32, 8, dtype=torch.bool)
    exact_nm[::2, :2] = True
    exact_nm[1::2, 2:4] = True
    exact_nm[:, 4:6] = True     # 16 rows of one mask, 16 of another: fits
    assert torch.equal(GroupedNMTensor.from_dense(_weight(32, 8), 2, 4, mask=exact_nm).mask(), exact_nm)
    exact_nm[0, 4:6] = False
    exact_nm[0, 6:8] = True     # a third mask for one row: 3 groups needed, 2 available
    with pytest.raises(ValueError, match="mask is not a GroupedNMTensor"):
        GroupedNMTensor.from_dense(_weight(32, 8), 2, 4, mask=exact_nm)
    # a plain (ungrouped) n:m sparsifier's mask does not fit the grouped layouts
    plain = WandaSparsifier(n=2, m=4).bind(input_norm=torch.ones(48))
    with pytest.raises(ValueError, match="mask is not a GroupedNMTensor"):
        sten.sparsify(plain, _weight(32, 48), GroupedNMTensor)
    with pytest.raises(ValueError, match="mask is not a ColumnGroupedNMTensor"):
        sten.sparsify(plain, _weight(32, 48), ColumnGroupedNMTensor)


def test_from_dense_with_a_mask_stores_zeros_off_the_mask():
    """A mask keeping fewer than the pattern's slots (a short last row block, dropped
    columns): the layout stores it with zeros in the extra slots, never the weight's values."""
    w = _weight(6, 8, seed=11) + 5.0                      # no zeros of its own
    keep = ColumnGroupedNMTensor.from_dense(w, 2, 4, 1).mask()
    keep[4] = False                                       # the last row block keeps 1 of its 2 real rows
    assert torch.equal(ColumnGroupedNMTensor.from_dense(w, 2, 4, 1, mask=keep).to_dense(), w * keep)
    keep16 = GroupedNMTensor.from_dense(w, 2, 4).mask()
    keep16[:, 0] = False
    assert torch.equal(GroupedNMTensor.from_dense(w, 2, 4, mask=keep16).to_dense(), w * keep16)
