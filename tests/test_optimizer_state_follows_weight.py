"""Optimizer state when the optimizer's list or the weight's pattern changes under it, checked
against the masked dense twin (the same mask, the gradient restricted to it).

- A weight's pattern (or layout: CSR given a COO value) changed between steps (``w.data = new``,
  ``load_state_dict`` of another pattern: the regrowth the training guide describes) left state
  made before on the old pattern: Adam's regrown weights never moved, RMSprop's were divided by ``eps`` (~1e18). The
  state now follows the weight's pattern (``dispatch.state_patterns``). Dense state (SGD's momentum
  of the dense gradient, Adagrad's ``sum``, Rprop's ``step_size``) held junk at the regrown
  positions: they now start at the optimizer's initial state (``fresh_state``).
- Fused optimizers (``fused=True``) with two sparse weights read each weight's state against the
  *other* weight: the state grew to every position and every step warned "dropped".
- ``sparsify_model_and_optimizer_inplace`` and ``SparsityScheduler`` replaced the optimizer's
  parameter list, while LBFGS steps the list it kept: the sparse weight never changed.
"""

import io
import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_core.model.masks import stored_mask

sten_nm = pytest.importorskip("sten_nm")

OPTIMIZERS = {
    "Adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=0.01),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=0.01),
    "Adam foreach": lambda p: torch.optim.Adam(p, lr=0.01, foreach=True),
    # dense state: SGD's momentum of the dense gradient (junk off the pattern), Adagrad's and Rprop's
    # state from full_like (their regrown positions start at the optimizer's initial value, not 0)
    "SGD momentum": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
    "SGD momentum fused": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, fused=True),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.1),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=0.01),
}


def _regrown(dense: torch.Tensor, mask: torch.Tensor, layout: type) -> tuple[torch.Tensor, torch.Tensor]:
    """``dense`` with four unstored positions of ``mask`` (two per row of the first two rows) now
    stored at 0.5, as ``layout`` holds it; and the new mask."""
    if layout is sten_nm.NMTensor:   # (a new 2:4 pattern: each row's first group takes its pruned two)
        d = dense.clone()
        d[:, :4] = torch.where(mask[:, :4], 0.0, 5.0)
        new = sten.sparsify(sten_nm.NMSparsifier(2, 4), d, layout)
        return new.to_dense(), new.to_dense() != 0
    new = mask.clone()
    free = (~mask).nonzero()[:4]
    new[free[:, 0], free[:, 1]] = True
    return torch.where(mask, dense, torch.where(new, 0.5, 0.0)), new


DENSE_STATE = {"SGD momentum", "SGD momentum fused", "Adagrad", "Rprop"}
"""Their state is dense: it holds no pattern, so one loaded from a checkpoint of another pattern
into a new optimizer cannot be told apart (sparse state carries its pattern: "optimizer reloaded")."""
CASES = [(name, how) for name in OPTIMIZERS
         for how in ("data", "load_state_dict", "optimizer reloaded", "data in another layout")
         if not (how == "optimizer reloaded" and name in DENSE_STATE)]


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CooTensor, sten_nm.NMTensor],
                         ids=["CsrTensor", "CooTensor", "NMTensor"])
@pytest.mark.parametrize("name,how", CASES, ids=[f"{n}-{h}" for n, h in CASES])
def test_state_follows_a_weight_whose_pattern_changed(name, layout, how):
    torch.manual_seed(0)
    start = torch.randn(6, 8)
    sparsifier = sten_nm.NMSparsifier(2, 4) if layout is sten_nm.NMTensor else sten.ScalarFractionSparsifier(0.5)
    w = sten.SparseParameterWrapper(sten.sparsify(sparsifier, start, layout).wrapped_tensor)
    twin = torch.nn.Parameter(w.to_dense().detach().clone())
    opt, twin_opt = OPTIMIZERS[name]([w]), OPTIMIZERS[name]([twin])
    x, y = torch.randn(5, 8), torch.randn(5, 6)
    mask = w.to_dense() != 0

    def steps(count):
        for _ in range(count):
            for p, o in ((w, opt), (twin, twin_opt)):
                o.zero_grad()
                F.mse_loss(F.linear(x, p), y).backward()
                if p is twin:
                    p.grad.mul_(mask)
                o.step()
            with torch.no_grad():   # (positions the new pattern dropped: the twin's state there still moves it)
                twin.mul_(mask)

    steps(2)
    dense, mask = _regrown(w.detach().to_dense(), mask, layout)
    new = sten.sparsify(sten.KeepAll(), dense, layout)
    if how == "data":
        w.data = new
    elif how == "data in another layout":   # (the weight takes it: its state follows into it too)
        w.data = sten.sparsify(sten.KeepAll(), dense, sten.CooTensor if layout is sten.CsrTensor else sten.CsrTensor)
    else:
        holder = torch.nn.Module()
        holder.weight = w
        holder.load_state_dict({"weight": new})
    if how == "optimizer reloaded":   # state saved before the change, loaded after it
        buffer = io.BytesIO()
        torch.save(opt.state_dict(), buffer)
        opt = OPTIMIZERS[name]([w])
        buffer.seek(0)
        opt.load_state_dict(torch.load(buffer, weights_only=True))
    with torch.no_grad():
        twin.copy_(dense)
    assert torch.equal(w.to_dense() != 0, mask)
    steps(3)
    torch.testing.assert_close(w.detach().to_dense(), twin.detach(), rtol=1e-5, atol=1e-6)
    for value in opt.state[w].values():   # on the weight's pattern, in its layout
        if isinstance(value, sten.SparseTensorWrapper):
            assert torch.equal(stored_mask(value), stored_mask(w))
            assert type(value.wrapped_tensor) is type(w.wrapped_tensor)


def test_each_optimizer_holding_a_weight_moves_its_own_state():
    """Two optimizers of one weight (a wrapping optimizer, Lookahead's or ZeRO's, steps the one it
    wraps): each moves its own state. One record per weight let the first to step hide the change
    from the second, whose regrown positions then never moved."""
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.eye(2)))
    first, second = torch.optim.Adam([w], lr=0.1), torch.optim.Adam([w], lr=0.1)
    w.grad = torch.ones(2, 2)
    first.step()
    second.step()
    w.data = sten.sparsify(sten.KeepAll(), torch.ones(2, 2), sten.CsrTensor)
    w.grad = torch.ones(2, 2)
    first.step()
    second.step()
    for opt in (first, second):
        assert opt.state[w]["exp_avg"].wrapped_tensor.nnz == 4
    assert bool((w.detach().to_dense() != 1).all())   # every position moved


def test_state_that_follows_its_weight_shares_its_pattern():
    """The check before every step is O(1) again after the move: the state takes the weight's
    index tensors, as state made by ``zeros_like(w)`` has them."""
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.eye(4)))
    opt = torch.optim.Adam([w], lr=0.1)
    w.grad = torch.ones(4, 4)
    opt.step()
    w.data = sten.sparsify(sten.KeepAll(), torch.eye(4) + torch.eye(4).roll(1, 0), sten.CsrTensor)
    opt.step()
    state, weight = opt.state[w]["exp_avg"].wrapped_tensor, w.wrapped_tensor
    assert state.data.col_indices().data_ptr() == weight.data.col_indices().data_ptr()
    assert state.nnz == 8


@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.SGD])
def test_fused_optimizers_keep_each_weights_state_on_its_pattern(optimizer):
    torch.manual_seed(0)
    options = dict(lr=0.01, fused=True, **({"momentum": 0.9} if optimizer is torch.optim.SGD else {}))
    dense = [torch.randn(6, 8) * (torch.rand(6, 8) > 0.5) for _ in range(2)]
    ws = [sten.SparseParameterWrapper(sten.CsrTensor.from_dense(d)) for d in dense]
    twins = [torch.nn.Parameter(d.clone()) for d in dense]
    opt, twin_opt = optimizer(ws, **options), optimizer(twins, **options)
    x = torch.randn(5, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            for params, o in ((ws, opt), (twins, twin_opt)):
                o.zero_grad()
                sum(F.linear(x, p).pow(2).sum() for p in params).backward()
                if params is twins:
                    for p, d in zip(params, dense):
                        p.grad.mul_(d != 0)
                o.step()
    assert not [str(c.message) for c in caught if "dropped" in str(c.message)]
    for w, twin in zip(ws, twins):
        torch.testing.assert_close(w.detach().to_dense(), twin.detach())
        for value in opt.state[w].values():
            if isinstance(value, sten.SparseTensorWrapper):
                assert value.wrapped_tensor.nnz == w.wrapped_tensor.nnz


def _lbfgs_trains_the_sparse_weight(sparsify) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    x, y = torch.randn(5, 8), torch.randn(5, 6)
    sparsify(model, opt)
    weight = model[0].weight
    assert isinstance(weight, sten.SparseParameterWrapper)
    before = weight.detach().to_dense().clone()

    def closure():
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    opt.step(closure)
    assert any(p is weight for p in opt._params)
    assert not torch.equal(weight.detach().to_dense(), before)


def test_lbfgs_steps_the_weight_sparsify_model_and_optimizer_inplace_put_in():
    sb = sten.SparsityBuilder()
    sb.set_weight(name="0.weight", initial_sparsifier=sten.ScalarFractionSparsifier(0.5), out_format=sten.CsrTensor)
    _lbfgs_trains_the_sparse_weight(lambda model, opt: sb.sparsify_model_and_optimizer_inplace(model, opt))


def test_lbfgs_steps_the_weight_a_sparsity_scheduler_put_in():
    def schedule(model, opt):
        sten.SparsityScheduler(model, opt).add("0.weight", sten.OneShot(0.5), layout=sten.CsrTensor)

    _lbfgs_trains_the_sparse_weight(schedule)
