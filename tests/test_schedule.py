"""SparsityScheduler, schedules and sparsifiers with extra inputs (issue #8)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_core.training.schedule import GradualPruning, OneShot, PruneRegrow, SparsityScheduler, layout_from_mask
from sten_core.training.scores import MissingInputError, MovementSparsifier, ScoreSparsifier, TaylorSparsifier, sparsify_with

warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    x, y = batch(i)
    F.cross_entropy(model(x), y).backward()
    opt.step()


def zhu_gupta(t: int, si: float, sf: float, t0: int, t1: int, every: int) -> float:
    t = min(max(t, t0), t1)
    if t < t1:
        t = t0 + (t - t0) // every * every
    return sf + (si - sf) * (1 - (t - t0) / (t1 - t0)) ** 3


# -- schedules -------------------------------------------------------------------------

def test_gradual_pruning_is_the_cubic_schedule():
    s = GradualPruning(0.1, 0.8, start=10, end=50, every=5)
    for t in range(70):
        assert s.sparsity(t) == pytest.approx(zhu_gupta(t, 0.1, 0.8, 10, 50, 5))
    assert [t for t in range(70) if s.updates(t)] == list(range(10, 51, 5))


def test_one_shot_and_prune_regrow_schedules():
    s = OneShot(0.7, step=3)
    assert [s.sparsity(t) for t in range(5)] == [0, 0, 0, 0.7, 0.7]
    assert [t for t in range(10) if s.updates(t)] == [3]
    r = PruneRegrow(0.9, drop_fraction=0.4, start=0, end=40, every=10)
    assert [t for t in range(60) if r.updates(t)] == [10, 20, 30]
    assert r.drop_fraction_at(20) == pytest.approx(0.2 * (1 + math.cos(math.pi / 2)))
    assert PruneRegrow(0.5, decay="constant", end=10, every=2).drop_fraction_at(6) == 0.3


@pytest.mark.parametrize("make, match", [
    (lambda: GradualPruning(0.0, 1.0, 0, 10), r"final sparsity must be in \[0, 1\)"),
    (lambda: GradualPruning(0.0, -0.1, 0, 10), r"final sparsity must be in \[0, 1\)"),
    (lambda: GradualPruning(0.0, 0.9, 10, 10), "step range is empty"),
    (lambda: GradualPruning(0.0, 0.9, 10, 3), "step range is empty"),
    (lambda: GradualPruning(0.5, 0.2, 0, 10), "must be >= initial"),
    (lambda: GradualPruning(0.0, 0.9, 0, 10, every=0), "every must be >= 1"),
    (lambda: OneShot(1.0), r"sparsity must be in \[0, 1\)"),
    (lambda: PruneRegrow(1.5), r"sparsity must be in \[0, 1\)"),
    (lambda: PruneRegrow(0.9, start=5, end=5), "step range is empty"),
    (lambda: PruneRegrow(0.9, drop_fraction=2.0), "drop_fraction"),
])
def test_bad_schedules(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_scheduler_arguments():
    model = mlp()
    sched = SparsityScheduler(model)
    with pytest.raises(ValueError, match="unknown weight 'nope'"):
        sched.add("nope", OneShot(0.5))
    with pytest.raises(TypeError, match="schedule must be a Schedule"):
        sched.add("0.weight", 0.5)
    with pytest.raises(TypeError, match="layout must be a layout class"):
        sched.add("0.weight", OneShot(0.5), layout="csr")
    with pytest.raises(TypeError, match="sparsifier must be a sparsifier instance"):
        sched.add("0.weight", OneShot(0.5), sparsifier=sten.ScalarFractionSparsifier)
    with pytest.raises(TypeError, match="model must be"):
        SparsityScheduler(object())


# -- gradients needed before any backward -----------------------------------------------------

def test_gradient_sparsifier_before_backward_is_a_clear_error():
    model = mlp()
    sched = SparsityScheduler(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"needs the gradient of '0.weight'.*after loss.backward\(\)"):
        sched.add("0.weight", OneShot(0.5), sparsifier=TaylorSparsifier(0.5))
    assert "0.weight" not in sched.entries and not isinstance(model[0].weight, sten.SparseTensorWrapper)
    with pytest.raises(MissingInputError, match=r"TaylorSparsifier needs 'grad'.*backward\(\)"):
        TaylorSparsifier(0.5).mask(torch.ones(3))
    with pytest.raises(MissingInputError, match="MovementSparsifier needs 'score'"):
        sten.sparsify(MovementSparsifier(0.5), torch.ones(4), sten.CsrTensor)
    sb = sten.SparsityBuilder(mlp())
    sb.set_weight("0.weight", TaylorSparsifier(0.5), out_format=sten.CsrTensor)
    with pytest.raises(MissingInputError, match="needs 'grad'"):
        sb.get_sparse_model()
    with pytest.raises(TypeError, match="does not take"):
        TaylorSparsifier(0.5).bind(score=torch.ones(3))


# -- exact sparsity at every step, weights equal to a masked dense reference -------------

@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CooTensor, sten.CscTensor])
def test_gradual_pruning_exact_sparsity_and_dense_reference(layout):
    model, ref = mlp(), mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    sched = SparsityScheduler(model, opt)
    schedules = {"0.weight": GradualPruning(0.0, 0.8, start=2, end=14, every=3),
                 "2.weight": GradualPruning(0.25, 0.6, start=0, end=9, every=2)}
    for name, s in schedules.items():
        sched.add(name, s, layout=layout)
    for i in range(18):
        for name, s in schedules.items():
            w = model.get_parameter(name)
            want = round(w.numel() * (1 - zhu_gupta(sched.step_count, s.initial, s.final, s.start, s.end, s.every)))
            assert type(w.wrapped_tensor) is layout
            assert w.wrapped_tensor.nnz == want == sched.nnz(name) == sched.target_nnz(name)
            mask = sched.mask(name)
            with torch.no_grad():
                ref.get_parameter(name).mul_(mask)
            torch.testing.assert_close(w.to_dense(), ref.get_parameter(name).detach(), rtol=1e-5, atol=1e-6)
            assert torch.equal(w.to_dense() != 0, mask & (w.to_dense() != 0))
        train_step(model, opt, i)
        train_step(ref, ref_opt, i)
        sched.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert sched.sparsity("0.weight") == pytest.approx(1 - round(192 * 0.2) / 192)


def test_masks_only_shrink_under_pruning_and_keep_parameter_identity():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = SparsityScheduler(model, opt)
    sched.add("0.weight", GradualPruning(0.0, 0.9, start=0, end=8, every=1))
    param = model[0].weight
    assert any(p is param for p in opt.param_groups[0]["params"])
    prev = sched.mask("0.weight")
    for i in range(10):
        train_step(model, opt, i)
        sched.step()
        opt.zero_grad()
        assert model[0].weight is param
        now = sched.mask("0.weight")
        assert not (now & ~prev).any()
        buf = opt.state[param]["momentum_buffer"]
        assert not buf[~now].any()  # dense momentum: zero where dropped
        prev = now


def test_masked_dense_layout_is_kept_sparse_after_each_step():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = SparsityScheduler(model, opt)
    sched.add("0.weight", OneShot(0.75), layout=torch.Tensor)
    assert type(model[0].weight) is torch.nn.Parameter
    for i in range(4):
        train_step(model, opt, i)
        sched.step()
        opt.zero_grad()
        w = model[0].weight.detach()
        assert int((w != 0).sum()) <= 48 and not w[~sched.mask("0.weight")].any()
        assert not opt.state[model[0].weight]["exp_avg"][~sched.mask("0.weight")].any()


def test_layout_from_mask_keeps_zero_values():
    dense = torch.tensor([[0.0, 2.0], [3.0, 0.0]])
    mask = torch.tensor([[True, True], [False, False]])
    for layout in (sten.CsrTensor, sten.CscTensor, sten.CooTensor):
        obj = layout_from_mask(layout, dense, mask)
        assert obj.nnz == 2
        torch.testing.assert_close(obj.to_dense(), dense * mask)


# -- prune and regrow: optimizer state does not leak -----------------------------------------

@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
], ids=["adamw", "sgd-momentum"])
def test_prune_regrow_state_does_not_leak(make_opt):
    model = mlp()
    opt = make_opt(model.parameters())
    sched = SparsityScheduler(model, opt)
    sched.add("0.weight", PruneRegrow(0.75, drop_fraction=0.5, start=0, end=30, every=2, decay="constant"))
    w = model[0].weight
    keep = round(w.numel() * 0.25)
    ever_dropped = torch.zeros(w.shape, dtype=torch.bool)
    regrown_after_drop = 0
    for i in range(12):
        train_step(model, opt, i)
        old = sched.mask("0.weight")
        grad = w.grad.clone()
        dense_before = w.to_dense()
        steps_before = opt.state[w].get("step")
        steps_before = None if steps_before is None else steps_before.clone()
        sched.step()
        new = sched.mask("0.weight")
        assert w.wrapped_tensor.nnz == keep == sched.nnz("0.weight")
        if sched.entries["0.weight"].schedule.updates(sched.step_count):
            grown, dropped = new & ~old, old & ~new
            assert int(grown.sum()) == int(dropped.sum()) == round(0.5 * keep)
            # dropped: the smallest magnitudes; grown: the largest gradients among the not-kept
            assert dense_before.abs()[dropped].max() <= dense_before.abs()[old & new].min()
            assert grad.abs()[grown].min() >= grad.abs()[~old & ~new].max()
            regrown_after_drop += int((grown & ever_dropped).sum())
            ever_dropped |= dropped
            assert not w.to_dense()[grown].any()
            for key, value in opt.state[w].items():
                if key == "step":
                    assert torch.equal(value, steps_before)  # the counter stays
                    continue
                dense = value.to_dense() if isinstance(value, sten.SparseTensorWrapper) else value
                assert not dense[grown].any(), key
                assert not dense[~new].any(), key
                if isinstance(value, sten.SparseTensorWrapper):
                    assert value.wrapped_tensor.same_pattern(w.wrapped_tensor)
            torch.testing.assert_close(w.to_dense()[old & new], dense_before[old & new])
        opt.zero_grad()
    assert regrown_after_drop > 0  # positions were dropped and later regrown: they started from zero


def regrow_once(model: torch.nn.Module, opt: torch.optim.Optimizer, layout: type | None = None) -> torch.Tensor:
    """Three training steps of a PruneRegrow schedule on ``0.weight`` (one regrowth, at the
    third); the mask of the positions it regrew."""
    sched = SparsityScheduler(model, opt)
    kwargs = {} if layout is None else {"layout": layout}
    sched.add("0.weight", PruneRegrow(0.75, drop_fraction=0.5, start=0, end=30, every=3, decay="constant"), **kwargs)
    for i in range(3):
        train_step(model, opt, i)
        old = sched.mask("0.weight")
        sched.step()
        opt.zero_grad()
    return sched.mask("0.weight") & ~old


def test_regrown_adamw_step_matches_fresh_state():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    grown = regrow_once(model, opt)
    w = model[0].weight
    x, y = batch(50)
    F.cross_entropy(model(x), y).backward()
    g = w.grad.clone()
    opt.step()
    t = 4
    b1, b2, eps, lr = 0.9, 0.999, 1e-8, 1e-2
    m_hat = (1 - b1) * g / (1 - b1 ** t)
    v_hat = (1 - b2) * g * g / (1 - b2 ** t)
    expected = -lr * m_hat / (v_hat.sqrt() + eps)
    torch.testing.assert_close(w.to_dense()[grown], expected[grown], rtol=1e-4, atol=1e-7)


def test_prune_regrow_needs_a_gradient():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = SparsityScheduler(model, opt)
    sched.add("0.weight", PruneRegrow(0.5, start=0, end=10, every=1))
    with pytest.raises(ValueError, match="needs the gradient of '0.weight'"):
        sched.step()


# -- score sparsifiers: initial sparsifier and under the scheduler ------------------------

def test_taylor_as_initial_sparsifier_and_under_scheduler():
    model = mlp()
    x, y = batch(0)
    F.cross_entropy(model(x), y).backward()
    w, g = model[0].weight.detach().clone(), model[0].weight.grad.clone()
    want = (w * g).abs().reshape(-1).topk(round(w.numel() * 0.3)).indices
    expect = torch.zeros(w.numel(), dtype=torch.bool)
    expect[want] = True
    expect = expect.view(w.shape)
    sb = sten.SparsityBuilder(model)
    sb.set_weight("0.weight", TaylorSparsifier(0.7).bind(grad=g), out_format=sten.CsrTensor)
    sparse = sb.get_sparse_model()
    torch.testing.assert_close(sparse[0].weight.to_dense(), w * expect)

    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = SparsityScheduler(model, opt)
    sched.add("0.weight", OneShot(0.7, step=1), sparsifier=TaylorSparsifier(0.7))
    assert sched.nnz("0.weight") == w.numel()
    opt.step()
    sched.step()
    assert torch.equal(sched.mask("0.weight"), expect)
    torch.testing.assert_close(model[0].weight.to_dense(), w * expect)


def test_movement_accumulates_score_under_scheduler():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = SparsityScheduler(model, opt)
    sched.add("0.weight", OneShot(0.5, step=3), sparsifier=MovementSparsifier(0.5))
    w = model[0].weight
    score = torch.zeros(w.shape)
    for i in range(3):
        x, y = batch(i)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        score -= w.to_dense() * w.grad  # scores read the weights after the optimizer step
        sched.step()
        opt.zero_grad()
    torch.testing.assert_close(sched.entries["0.weight"].score, score)
    flat = score.reshape(-1)
    expect = torch.zeros(flat.numel(), dtype=torch.bool)
    expect[flat.topk(flat.numel() // 2).indices] = True
    assert torch.equal(sched.mask("0.weight"), expect.view(w.shape))
    assert w.wrapped_tensor.nnz == w.numel() // 2
    # as an initial sparsifier, with the score bound by hand
    sb = sten.SparsityBuilder(mlp())
    sb.set_weight("0.weight", MovementSparsifier(0.5).bind(score=score), out_format=sten.CooTensor)
    dense0 = sb.model[0].weight.detach()
    torch.testing.assert_close(sb.get_sparse_model()[0].weight.to_dense(), dense0 * expect.view(w.shape))


class FisherSparsifier(ScoreSparsifier):
    """A user's score: the accumulated squared gradient times weight (diagonal Fisher)."""

    needs = ("score", "step")

    def score(self, tensor, score=None, step=None):
        return score / max(step, 1)

    def score_increment(self, tensor, grad):
        return (tensor * grad) ** 2


def test_user_score_sparsifier_registration_and_dispatch():
    calls = []

    @sten.register_sparsifier_implementation(sparsifier=FisherSparsifier, inp=torch.Tensor, out=sten.CsrTensor)
    def fisher_to_csr(sparsifier, tensor, grad_fmt=None):
        calls.append(sorted(sparsifier.inputs))
        mask = sparsifier.mask(tensor)
        return sten.SparseTensorWrapper(layout_from_mask(sten.CsrTensor, tensor, mask), grad_fmt=grad_fmt)

    t, s = torch.randn(6, 6), torch.rand(6, 6)
    out = sparsify_with(FisherSparsifier(0.5), t, sten.CsrTensor, score=s, step=3)
    assert calls == [["score", "step"]]
    flat = s.reshape(-1)
    expect = torch.zeros(36, dtype=torch.bool)
    expect[flat.topk(18).indices] = True
    torch.testing.assert_close(out.to_dense(), t * expect.view(6, 6))
    # under the scheduler
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = SparsityScheduler(model, opt)
    sched.add("0.weight", GradualPruning(0.0, 0.5, start=0, end=4, every=2), sparsifier=FisherSparsifier(0.5))
    for i in range(5):
        train_step(model, opt, i)
        sched.step()
        opt.zero_grad()
        assert model[0].weight.wrapped_tensor.nnz == sched.target_nnz("0.weight")
    assert sched.sparsity("0.weight") == 0.5


# -- n:m layouts (where sten_nm is installed) --------------------------------------------------

def test_gradual_pruning_into_nm_layout():
    sten_nm = pytest.importorskip("sten_nm")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 8), torch.nn.ReLU(), torch.nn.Linear(8, 5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = SparsityScheduler(model, opt)
    sched.add("0.weight", GradualPruning(0.1, 0.9, start=0, end=8, every=2), layout=sten_nm.NMTensor,
              sparsifier=sten_nm.NMSparsifier(1, 10))
    w = model[0].weight
    for i in range(10):
        s = zhu_gupta(sched.step_count, 0.1, 0.9, 0, 8, 2)
        n = round(10 * (1 - s))
        assert type(w.wrapped_tensor) is sten_nm.NMTensor and w.wrapped_tensor.n == n
        assert w.wrapped_tensor.nnz == 8 * 2 * n == sched.nnz("0.weight")
        x = torch.randn(4, 20)
        F.linear(x, w).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    assert sched.sparsity("0.weight") == pytest.approx(0.9)


# -- optimizer state on the weight's own pattern (layouts whose from_dense drops zeros) -------

def dead_unit_mlp(seed: int = 0) -> torch.nn.Module:
    """``mlp`` with 4 hidden units that never fire: their weight rows get exactly zero
    gradient, so their optimizer state holds exact zeros."""
    model = mlp(seed)
    with torch.no_grad():
        model[0].bias[:4] = -100.0
    return model


def masked_reference_step(ref: torch.nn.Module, opt: torch.optim.Optimizer, i: int, mask: torch.Tensor) -> None:
    """The dense reference of a sparse ``0.weight``: its gradient is zero off the mask."""
    x, y = batch(i)
    F.cross_entropy(ref(x), y).backward()
    ref[0].weight.grad.mul_(mask)
    opt.step()
    opt.zero_grad()


def remask_reference(ref: torch.nn.Module, opt: torch.optim.Optimizer, mask: torch.Tensor) -> None:
    """Drop the positions off ``mask`` from the dense reference's weight and state."""
    w = ref[0].weight
    with torch.no_grad():
        w.mul_(mask)
        for value in opt.state[w].values():
            if isinstance(value, torch.Tensor) and value.shape == w.shape:
                value.mul_(mask)


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.Adam(p, lr=1e-2),
    lambda p: torch.optim.Rprop(p, lr=1e-2),
], ids=["adam", "rprop"])
@pytest.mark.parametrize("layout_name", ["ScipyCsrTensor", "ScipyCscTensor"])
def test_state_keeps_the_weight_pattern_with_layouts_that_drop_zeros(layout_name, make_opt):
    """sten_scipy's ``from_dense`` keeps only nonzeros: the state used to be rebuilt with
    ``from_dense(state * mask)``, losing the positions whose state is exactly 0 (a dead unit's
    Adam moments, Rprop's ``prev``). Adam then gave NaN weights, Rprop drifted from the dense
    reference. Now every state tensor has the weight's pattern and the run is the reference."""
    layout = getattr(pytest.importorskip("sten_scipy"), layout_name)
    model, ref = dead_unit_mlp(), dead_unit_mlp()
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    sched = SparsityScheduler(model, opt)
    sched.add("0.weight", GradualPruning(0.0, 0.75, start=0, end=4, every=2), layout=layout)
    w, mask = model[0].weight, sched.mask("0.weight")
    for i in range(7):
        train_step(model, opt, i)
        masked_reference_step(ref, ref_opt, i, mask)
        sched.step()
        opt.zero_grad()
        mask = sched.mask("0.weight")
        remask_reference(ref, ref_opt, mask)
        assert w.wrapped_tensor.nnz == sched.target_nnz("0.weight") == int(mask.sum())
        torch.testing.assert_close(w.to_dense(), ref[0].weight.detach(), rtol=1e-5, atol=1e-6)
        for key, value in opt.state[w].items():
            if key == "step":
                continue
            if isinstance(value, sten.SparseTensorWrapper):  # (Rprop's step_size is full_like the dense grad)
                assert type(value.wrapped_tensor) is layout and value.wrapped_tensor.same_pattern(w.wrapped_tensor), key
                value = value.to_dense()
            torch.testing.assert_close(value[mask], ref_opt.state[ref[0].weight][key][mask], rtol=1e-5, atol=1e-7)
    assert sched.sparsity("0.weight") == 0.75 and not w.to_dense().isnan().any()


def test_prune_regrow_with_a_layout_that_drops_zeros_matches_csr():
    """Regrown weights start at 0, which ``ScipyCsrTensor.from_dense`` drops: PruneRegrow failed
    with "configure a sparsifier whose structure it holds". It now stores the regrown zeros and
    trains as the CSR run does."""
    sten_scipy = pytest.importorskip("sten_scipy")
    runs = {}
    for layout in (sten.CsrTensor, sten_scipy.ScipyCsrTensor):
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = SparsityScheduler(model, opt)
        sched.add("0.weight", PruneRegrow(0.75, drop_fraction=0.3, start=0, end=20, every=2), layout=layout)
        masks = []
        for i in range(9):
            train_step(model, opt, i)
            sched.step()
            opt.zero_grad()
            w = model[0].weight
            assert w.wrapped_tensor.nnz == 48 == sched.nnz("0.weight")
            masks.append(sched.mask("0.weight"))
        state = {k: v.to_dense() for k, v in opt.state[w].items() if k != "step"}
        runs[layout] = (masks, w.to_dense(), state)
    (m1, w1, s1), (m2, w2, s2) = runs.values()
    assert all(torch.equal(a, b) for a, b in zip(m1, m2)) and not torch.equal(m1[0], m1[-1])
    torch.testing.assert_close(w2, w1, rtol=1e-6, atol=1e-7)
    for key in s1:
        torch.testing.assert_close(s2[key], s1[key], rtol=1e-6, atol=1e-9)


class NonzerosOnly(sten.Layout):
    """A layout without the stored-values protocol whose ``from_dense`` keeps nonzeros only."""

    def __init__(self, dense: torch.Tensor):
        self.index, self.vals, self._shape = dense.nonzero(), dense[dense != 0], dense.shape

    @classmethod
    def from_dense(cls, tensor: torch.Tensor) -> "NonzerosOnly":
        return cls(tensor.detach().clone())

    def to_dense(self) -> torch.Tensor:
        out = torch.zeros(self._shape, dtype=self.vals.dtype)
        out[tuple(self.index.t())] = self.vals
        return out

    @property
    def nnz(self) -> int:
        return self.vals.numel()


def test_prune_regrow_into_a_layout_that_cannot_store_zeros_names_the_cause():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = SparsityScheduler(model, opt)
    sched.add("0.weight", PruneRegrow(0.75, drop_fraction=0.3, start=0, end=20, every=2), layout=NonzerosOnly)
    train_step(model, opt, 0)
    sched.step()
    train_step(model, opt, 1)
    with pytest.raises(ValueError, match=r"layout NonzerosOnly cannot store '0.weight'.*dropping those whose value "
                                         r"is 0.*regrown weights start at 0.*stored-values protocol") as err:
        sched.step()
    assert "configure a sparsifier" not in str(err.value)


# -- regrown positions get the optimizer's fresh state ------------------------------------------

@pytest.mark.parametrize("make_opt, key, fresh", [
    (lambda p: torch.optim.Rprop(p, lr=1e-2), "step_size", 1e-2),
    (lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.1), "sum", 0.1),
], ids=["rprop", "adagrad"])   # (AdamW: test_regrown_adamw_step_matches_fresh_state; its step counter stays)
@pytest.mark.parametrize("layout", [sten.CsrTensor, torch.Tensor], ids=["csr", "masked-dense"])
def test_regrown_positions_start_with_fresh_optimizer_state(layout, make_opt, key, fresh):
    """Regrown positions had their state multiplied by 0: Rprop's step size became 0 (then
    its 1e-6 floor, so regrown weights barely moved), Adagrad's sum 0 instead of
    ``initial_accumulator_value``. Now they hold a new parameter's state, and their first
    step is a new parameter's first step."""
    model = mlp()
    opt = make_opt(model.parameters())
    grown = regrow_once(model, opt, layout)
    w = model[0].weight
    assert grown.any()
    state = opt.state[w][key]
    state = state.to_dense() if isinstance(state, sten.SparseTensorWrapper) else state
    torch.testing.assert_close(state[grown], torch.full_like(state[grown], fresh))
    x, y = batch(50)
    F.cross_entropy(model(x), y).backward()
    grad = (w.grad.to_dense() if isinstance(w.grad, sten.SparseTensorWrapper) else w.grad).clone()
    opt.step()
    new = torch.nn.Parameter(torch.zeros(w.shape))   # the dense reference: a new parameter, same gradient
    new_opt = make_opt([new])
    new.grad = grad
    new_opt.step()
    after = w.to_dense() if isinstance(w, sten.SparseTensorWrapper) else w.detach()
    torch.testing.assert_close(after[grown], new.detach()[grown], rtol=1e-5, atol=1e-8)
    assert after[grown].abs().max() > 1e-3


def test_fresh_state_is_read_from_the_optimizer():
    from sten_core.training.schedule import fresh_state

    w = torch.nn.Parameter(torch.ones(3, 3))
    assert fresh_state(torch.optim.Rprop([w], lr=0.05), w)["step_size"].item() == pytest.approx(0.05)
    assert fresh_state(torch.optim.Adagrad([w], initial_accumulator_value=0.3), w)["sum"].item() == pytest.approx(0.3)
    assert fresh_state(torch.optim.AdamW([w], fused=True), w) == {"exp_avg": 0.0, "exp_avg_sq": 0.0}
    groups = torch.optim.Rprop([{"params": [w], "lr": 0.2}, {"params": [torch.nn.Parameter(torch.ones(2))]}], lr=0.1)
    assert fresh_state(groups, w)["step_size"].item() == pytest.approx(0.2)   # the parameter's own group


# -- structured sparsifiers: n:m targets and non-nested masks ------------------------------------

def test_nm_schedule_whose_target_rounds_to_n0_is_refused_at_add():
    sten_nm = pytest.importorskip("sten_nm")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    sched = SparsityScheduler(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"'0.weight' \(layout NMTensor, GradualPruning\(.*final=0.9.*\).*"
                                         r"cannot reach sparsity 0.9: .*= 0 of every 4.*highest sparsity is 0.75"):
        sched.add("0.weight", GradualPruning(0.25, 0.9, start=0, end=40, every=10), layout=sten_nm.NMTensor,
                  sparsifier=sten_nm.NMSparsifier(3, 4))
    assert "0.weight" not in sched.entries and type(model[0].weight) is torch.nn.Parameter
    sched.add("0.weight", GradualPruning(0.25, 0.75, start=0, end=40, every=10), layout=sten_nm.NMTensor,
              sparsifier=sten_nm.NMSparsifier(3, 4))   # 1:4 is the sparsest it holds


def test_grouped_nm_gradual_pruning_says_masks_are_not_nested():
    """Grouped n:m regroups rows for every n, so its next mask is not inside the last one:
    that was reported as "already sparser than 0.60" at 25 % sparsity."""
    sten_nm = pytest.importorskip("sten_nm")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = SparsityScheduler(model, opt)
    sched.add("0.weight", GradualPruning(0.25, 0.75, start=0, end=6, every=2), layout=sten_nm.GroupedNMTensor,
              sparsifier=sten_nm.GroupedNMSparsifier(3, 4))
    with pytest.raises(ValueError) as err:
        for _ in range(3):
            model(torch.randn(8, 32)).square().mean().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
    message = str(err.value)
    assert "already sparser" not in message and sched.sparsity("0.weight") == 0.25
    for part in ("'0.weight' (layout GroupedNMTensor", "GroupedNMSparsifier(n=2", "not nested", "OneShot"):
        assert part in message, message


def test_pruning_a_weight_already_sparser_than_the_schedule():
    model = sten.SparsityBuilder(mlp())
    model.set_weight("0.weight", sten.ScalarFractionSparsifier(0.75), out_format=sten.CsrTensor)
    model = model.get_sparse_model()
    with pytest.raises(ValueError, match=r"'0.weight' is already sparser than 0.5 \(keeps 48 of 192, the schedule 96\)"):
        SparsityScheduler(model).add("0.weight", OneShot(0.5))


# -- the sparsifier's own criterion under a schedule -------------------------------------

def one_layer(weight: torch.Tensor) -> torch.nn.Module:
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        layer.weight.copy_(weight)
    return torch.nn.Sequential(layer)


@pytest.mark.parametrize("sparsifier", [sten.ScalarThresholdSparsifier(0.1), sten.KeepAll()], ids=repr)
def test_a_sparsifier_without_a_sparsity_to_set_is_refused(sparsifier):
    """The schedule's sparsity was ignored: a threshold was applied to ranks 1..numel
    (keeping 6 of 16 where every |w| was below it) and KeepAll kept everything."""
    model = one_layer(torch.randn(4, 4))
    with pytest.raises(TypeError, match=r"weight '0.weight': a schedule sets the sparsity.*has neither"):
        SparsityScheduler(model).add("0.weight", OneShot(0.5), layout=torch.Tensor, sparsifier=sparsifier)
    assert type(model[0].weight) is torch.nn.Parameter


def test_blocks_are_pruned_by_their_summed_magnitude():
    """Blocks were scored by summed ranks: the block holding 100 was pruned for one summing to 4.6."""
    w = torch.tensor([[100.0, 0.01, 0.02, 0.03], [1.0, 1.1, 1.2, 1.3]])
    sparsifier = sten.BlockwiseFractionSparsifier(0.5, (1, 4))
    sched = SparsityScheduler(one_layer(w))
    sched.add("0.weight", OneShot(0.5), layout=torch.Tensor, sparsifier=sparsifier)
    assert torch.equal(sched.mask("0.weight"), sparsifier.mask(w))


def test_grouped_nm_under_a_schedule_is_the_sparsifiers_own_mask():
    sten_nm = pytest.importorskip("sten_nm")
    w = torch.randn(32, 32, generator=torch.Generator().manual_seed(1))
    for sparsifier, layout in ((sten_nm.GroupedNMSparsifier(2, 4), sten_nm.GroupedNMTensor),
                               (sten_nm.ColumnGroupedNMSparsifier(2, 4), sten_nm.ColumnGroupedNMTensor)):
        sched = SparsityScheduler(one_layer(w))
        sched.add("0.weight", OneShot(0.5), layout=layout, sparsifier=sparsifier)
        assert torch.equal(sched.mask("0.weight"), sparsifier.mask(w)), sparsifier


def test_random_pruning_keeps_the_scheduled_count():
    """RandomFractionSparsifier drew a keep-probability mask over ranks: 30 stored where the
    schedule (and the docs' nnz == target_nnz) says 32, and target_nnz itself drew random numbers."""
    torch.manual_seed(0)
    model = one_layer(torch.randn(8, 8))
    sched = SparsityScheduler(model)
    sched.add("0.weight", GradualPruning(0.25, 0.5, start=0, end=4, every=2), layout=sten.CooTensor,
              sparsifier=sten.RandomFractionSparsifier(0.9))
    for step in range(5):
        state = torch.get_rng_state()
        target = sched.target_nnz("0.weight")
        assert torch.equal(torch.get_rng_state(), state)
        assert sched.nnz("0.weight") == target == round(64 * (1 - GradualPruning(0.25, 0.5, 0, 4, 2).sparsity(step)))
        sched.step()


@pytest.mark.parametrize("name", ["0.weight", "0.bias"])
def test_a_weight_the_default_layout_cannot_hold_is_refused_at_add(name):
    model = torch.nn.Sequential(torch.nn.Conv1d(4, 4, 3))
    with pytest.raises(ValueError, match=rf"weight '{name}' has shape .* CsrTensor holds 2-D tensors only.*CooTensor"):
        SparsityScheduler(model).add(name, OneShot(0.5))
    sched = SparsityScheduler(model)
    sched.add(name, OneShot(0.5), layout=sten.CooTensor)
    assert sched.nnz(name) == round(model.get_parameter(name).numel() * 0.5)


@pytest.mark.parametrize(("name", "says"), [("buf", "names a buffer"), ("0", r"names a submodule \(Linear\).*'0.weight'"),
                                            ("0.in_features", "names an attribute of type int")])
def test_a_name_that_is_not_a_parameter_says_what_it_is(name, says):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.register_buffer("buf", torch.ones(2))
    for add in (lambda: SparsityScheduler(model).add(name, OneShot(0.5)),
                lambda: sten.SparsityBuilder(model).set_weight(name, sten.ScalarFractionSparsifier(0.5))):
        with pytest.raises(ValueError, match=rf"unknown weight '{name}': it {says}"):
            add()


def test_a_schedule_starting_dense_in_a_layout_that_cannot_hold_dense_says_so():
    """``OneShot(0.5, step=2)`` keeps every value until step 2, which ``NMTensor`` cannot hold: the
    error was nm_compress's "the mask keeps more than n of some group of m", nothing about why."""
    sten_nm = pytest.importorskip("sten_nm")
    model = torch.nn.Sequential(torch.nn.Linear(16, 8))
    scheduler = SparsityScheduler(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"NMTensor cannot store '0.weight' at sparsity 0: .*keeps every value until "
                                         r"it starts pruning.*start the schedule at step 0"):
        scheduler.add("0.weight", OneShot(0.5, step=2), layout=sten_nm.NMTensor,
                      sparsifier=sten_nm.NMSparsifier(2, 4, dim=1))
