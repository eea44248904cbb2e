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


def test_regrown_adamw_step_matches_fresh_state():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = SparsityScheduler(model, opt)
    sched.add("0.weight", PruneRegrow(0.75, drop_fraction=0.5, start=0, end=30, every=3, decay="constant"))
    w = model[0].weight
    for i in range(3):
        train_step(model, opt, i)
        old = sched.mask("0.weight")
        sched.step()
        opt.zero_grad()
    grown = sched.mask("0.weight") & ~old
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
