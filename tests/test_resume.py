"""Resuming sparse training: the model, the optimizer and the ``SparsityScheduler``
(with a score sparsifier's running score) saved mid-run and loaded with the
default ``torch.load`` give the same masks and the same loss curve as an
uninterrupted run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_core.training.schedule import GradualPruning, OneShot, PruneRegrow, SparsityScheduler
from sten_core.training.scores import MovementSparsifier, TaylorSparsifier

STEPS, SPLIT = 10, 5


def make_run(seed: int):
    """A fresh model, AdamW and scheduler, configured identically (weights from ``seed``)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 24),
                                torch.nn.ReLU(), torch.nn.Linear(24, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = SparsityScheduler(model, opt)
    sched.add("0.weight", GradualPruning(0.0, 0.8, start=0, end=8, every=2), layout=sten.CsrTensor)
    sched.add("2.weight", GradualPruning(0.0, 0.7, start=1, end=7, every=3), layout=sten.CooTensor,
              sparsifier=MovementSparsifier(0.5))
    sched.add("4.weight", PruneRegrow(0.5, drop_fraction=0.3, start=0, end=9, every=2), layout=sten.CsrTensor)
    return model, opt, sched


def batch(step: int):
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(32, 20, generator=gen), torch.randint(0, 4, (32,), generator=gen)


def train(model, opt, sched, steps):
    record = []
    for step in steps:
        x, y = batch(step)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        record.append((loss.item(), {name: sched.mask(name) for name in sched.entries}))
    return record


def test_resume_gives_the_same_masks_and_losses(tmp_path):
    reference = train(*make_run(0), range(STEPS))

    model, opt, sched = make_run(0)
    first = train(model, opt, sched, range(SPLIT))
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()},
               tmp_path / "ckpt.pt")
    del model, opt, sched

    ckpt = torch.load(tmp_path / "ckpt.pt")  # weights_only=True, the default
    model, opt, sched = make_run(123)  # other initial weights: everything must come from the checkpoint
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    sched.load_state_dict(ckpt["scheduler"])
    assert sched.step_count == SPLIT
    second = train(model, opt, sched, range(SPLIT, STEPS))

    resumed = first + second
    assert [loss for loss, _ in resumed] == [loss for loss, _ in reference]
    for step, ((_, masks), (_, ref_masks)) in enumerate(zip(resumed, reference)):
        for name in ref_masks:
            assert torch.equal(masks[name], ref_masks[name]), f"{name} at step {step}"
    # the masks did move after the split (the test exercises the schedules)
    assert not torch.equal(reference[SPLIT - 1][1]["0.weight"], reference[-1][1]["0.weight"])
    assert not torch.equal(reference[SPLIT - 1][1]["2.weight"], reference[-1][1]["2.weight"])
    assert not torch.equal(reference[SPLIT - 1][1]["4.weight"], reference[-1][1]["4.weight"])
    for name in ref_masks:
        param = model.get_parameter(name)
        assert torch.equal(param.to_dense() != 0, (param.to_dense() != 0) & reference[-1][1][name])


def test_without_the_scheduler_state_the_schedule_starts_over():
    model, opt, sched = make_run(0)
    train(model, opt, sched, range(SPLIT))
    _, _, fresh = make_run(0)
    assert fresh.step_count == 0 and sched.step_count == SPLIT
    fresh.load_state_dict(sched.state_dict())
    assert fresh.step_count == SPLIT and torch.equal(fresh.entries["2.weight"].score, sched.entries["2.weight"].score)
    assert fresh.entries["0.weight"].history == sched.entries["0.weight"].history


def test_mismatched_configuration_is_named():
    model, opt, sched = make_run(0)
    state = sched.state_dict()
    other = SparsityScheduler(model)
    other.add("0.weight", OneShot(0.5), layout=sten.CsrTensor)
    with pytest.raises(ValueError, match="saved but not added here: 2.weight, 4.weight"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="'0.weight': the checkpoint's schedule is GradualPruning"):
        other.load_state_dict({"step_count": 3, "entries": {"0.weight": state["entries"]["0.weight"]}})
    other.load_state_dict(state, strict=False)  # takes what matches
    assert torch.equal(other.mask("0.weight"), sched.mask("0.weight"))
    with pytest.raises(ValueError, match="state_dict must be a SparsityScheduler.state_dict"):
        other.load_state_dict({"entries": {}})


def test_score_sparsifier_state_dict_round_trips_through_torch_load(tmp_path):
    sp = TaylorSparsifier(0.25).bind(grad=torch.arange(4.0))
    torch.save(sp.state_dict(), tmp_path / "sp.pt")
    again = TaylorSparsifier(0.9)
    again.load_state_dict(torch.load(tmp_path / "sp.pt"))
    w = torch.tensor([1.0, -1.0, 1.0, 1.0])
    assert again.fraction == 0.25 and torch.equal(again.mask(w), sp.mask(w))
    with pytest.raises(ValueError, match="binds score, which TaylorSparsifier does not take"):
        again.load_state_dict({"fraction": 0.5, "inputs": {"score": torch.ones(4)}})
