"""One-shot calibrated pruning (issue #17): Wanda, SparseGPT and magnitude through
``sten.prune`` and as sparsifiers on their own.

Every result is checked against a dense reference: SparseGPT against a line-by-line
port of the paper's reference ``fasterprune``, Wanda against its score computed by
hand, ``prune`` against the sparsifiers applied layer by layer.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import sten_core as sten
from sten_core.model.sparsifiers import kept_count  # the documented rounding (its own cases: test_sparsifiers)
from sten_core.training.pruning import (
    InputHessian,
    InputNorms,
    SparseGPTSparsifier,
    WandaSparsifier,
    input_hessian,
    input_norms,
    sparsegpt,
)
from sten_core.training.pruning.oneshot import forward_order
from sten_core.training.schedule import stored_mask
from sten_core.training.scores import MissingInputError, sparsify_with


def correlated_inputs(n: int, features: int, seed: int = 0) -> torch.Tensor:
    """Calibration inputs with correlated features and a few large ones (as in LLMs)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(features, features, generator=g) * 0.3
    x = torch.randn(n, features, generator=g) @ mix + torch.randn(n, features, generator=g)
    x[:, :: max(1, features // 5)] *= 8.0
    return x


def reference_fasterprune(W, H, sparsity, prunen=0, prunem=0, blocksize=128, percdamp=0.01):
    """The paper's reference ``SparseGPT.fasterprune`` (IST-DASLab/sparsegpt), transcribed;
    the one change: the unstructured threshold index is ``numel * sparsity - 1`` so a
    block prunes exactly ``numel * sparsity`` (the original prunes one more)."""
    W = W.clone().float()
    H = H.clone()
    rows, columns = W.shape
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    damp = percdamp * torch.mean(torch.diag(H))
    diag = torch.arange(columns)
    H[diag, diag] += damp
    H = torch.linalg.cholesky(H)
    H = torch.cholesky_inverse(H)
    Hinv = torch.linalg.cholesky(H, upper=True)
    for i1 in range(0, columns, blocksize):
        i2 = min(i1 + blocksize, columns)
        count = i2 - i1
        W1 = W[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        if prunen == 0:
            tmp = W1 ** 2 / (torch.diag(Hinv1).reshape((1, -1))) ** 2
            thresh = torch.sort(tmp.flatten())[0][int(tmp.numel() * sparsity) - 1]
            mask1 = tmp <= thresh
        else:
            mask1 = torch.zeros_like(W1) == 1
        for i in range(count):
            w = W1[:, i]
            d = Hinv1[i, i]
            if prunen != 0 and i % prunem == 0:
                tmp = W1[:, i:(i + prunem)] ** 2 / (torch.diag(Hinv1)[i:(i + prunem)].reshape((1, -1))) ** 2
                mask1.scatter_(1, i + torch.topk(tmp, prunen, dim=1, largest=False)[1], True)
            q = w.clone()
            q[mask1[:, i]] = 0
            Q1[:, i] = q
            err1 = (w - q) / d
            W1[:, i:] -= err1.unsqueeze(1).matmul(Hinv1[i, i:].unsqueeze(0))
            Err1[:, i] = err1
        W[:, i1:i2] = Q1
        W[:, i2:] -= Err1.matmul(Hinv[i1:i2, i2:])
    return W


def rel_error(w: torch.Tensor, w_hat: torch.Tensor, x: torch.Tensor) -> float:
    """``‖WX − ŴX‖ / ‖WX‖`` over calibration inputs ``x`` (``[N, in]``)."""
    w, w_hat, x = w.detach(), w_hat.detach(), x.detach()
    return float(((w - w_hat) @ x.t()).norm() / (w @ x.t()).norm())


# -- statistics ----------------------------------------------------------------------

def test_statistics_match_dense_formulas():
    x = torch.randn(3, 5, 7)
    flat = x.reshape(-1, 7).double()
    torch.testing.assert_close(input_norms(x), flat.norm(dim=0).float())
    torch.testing.assert_close(input_hessian(x), (2 * flat.t() @ flat / 15).float())
    # batch by batch equals all at once
    norms, hess = InputNorms(7), InputHessian(7)
    for part in x:
        norms.update(part)
        hess.update(part)
    torch.testing.assert_close(norms.result(), input_norms(x))
    torch.testing.assert_close(hess.result(), input_hessian(x))
    with pytest.raises(ValueError, match="last dim 7"):
        norms.update(torch.randn(2, 6))


# -- SparseGPT against the reference -----------------------------------------------------

@pytest.mark.parametrize("pattern", [None, (2, 4), (1, 4), (4, 8)])
@pytest.mark.parametrize("blocksize", [128, 16])
def test_sparsegpt_equals_reference_port(pattern, blocksize):
    torch.manual_seed(0)
    x = correlated_inputs(512, 64)
    w = torch.randn(24, 64)
    h = input_hessian(x)
    if pattern is None:
        ref = reference_fasterprune(w, h, 0.5, blocksize=blocksize)
        values, keep = sparsegpt(w, h, fraction=0.5, blocksize=blocksize)
    else:
        n, m = pattern
        ref = reference_fasterprune(w, h, 0, m - n, m, blocksize=blocksize)
        values, keep = sparsegpt(w, h, n=n, m=m, blocksize=blocksize)
    torch.testing.assert_close(values, ref, rtol=0, atol=0)
    assert torch.equal(keep, ref != 0)


def test_sparsegpt_with_uncorrelated_inputs_is_magnitude_pruning():
    # H = c·I: H⁻¹ is diagonal, the saliency is w² up to a constant and nothing is updated
    w = torch.randn(8, 32)
    h = 3.0 * torch.eye(32)
    values, keep = sparsegpt(w, h, n=2, m=4)
    assert torch.equal(keep, sten.PerBlockFractionSparsifier(2, 4).mask(w))
    torch.testing.assert_close(values, w * keep)
    values, keep = sparsegpt(w, h, fraction=0.75, blocksize=32)
    assert torch.equal(keep, sten.ScalarFractionSparsifier(0.75).mask(w))


def test_sparsegpt_keeps_everything_at_zero_sparsity_and_zeroes_dead_inputs():
    x = torch.randn(100, 6)
    x[:, 2] = 0.0  # an input never seen
    w = torch.randn(4, 6)
    values, keep = sparsegpt(w, input_hessian(x), fraction=0.0)
    assert keep.all()
    expected = w.clone()
    expected[:, 2] = 0.0
    torch.testing.assert_close(values, expected)


def test_sparsegpt_float64_and_errors():
    w = torch.randn(4, 8, dtype=torch.float64)
    values, _ = sparsegpt(w, input_hessian(torch.randn(50, 8)), n=2, m=4)
    assert values.dtype == torch.float64
    with pytest.raises(ValueError, match=r"hessian must be \[8, 8\]"):
        sparsegpt(w, torch.eye(7), fraction=0.5)
    with pytest.raises(ValueError, match="not positive definite"):
        sparsegpt(w, -torch.eye(8), fraction=0.5)


# -- reconstruction error: SparseGPT < Wanda, magnitude -----------------------------------

class TinyMLP(torch.nn.Module):
    def __init__(self, features: int = 48, hidden: int = 96, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = torch.nn.Linear(features, hidden)
        self.fc2 = torch.nn.Linear(hidden, hidden)
        self.fc3 = torch.nn.Linear(hidden, 10)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


@pytest.mark.parametrize("kwargs", [{"sparsity": 0.5}, {"pattern": (2, 4)}], ids=["50%", "2:4"])
def test_sparsegpt_reconstructs_best_on_a_tiny_model(kwargs):
    dense = TinyMLP()
    x = correlated_inputs(1024, 48, seed=1)
    batches = list(x.split(128))
    # each layer's input on the dense model (the inputs every method is compared on)
    acts = {}
    hooks = [getattr(dense, n).register_forward_pre_hook(lambda m, a, n=n: acts.__setitem__(n, a[0]))
             for n in ("fc1", "fc2", "fc3")]
    dense(x)
    for h in hooks:
        h.remove()
    errors = {}
    for method in ("magnitude", "wanda", "sparsegpt"):
        pruned = sten.prune(copy.deepcopy(dense), batches, method, sequential=False, **kwargs)
        errors[method] = {}
        for name in ("fc1", "fc2", "fc3"):
            w, w_hat = getattr(dense, name).weight.detach(), getattr(pruned, name).weight.detach()
            assert int((w_hat != 0).sum()) == w.numel() // 2  # the same density for every method
            errors[method][name] = rel_error(w, w_hat, acts[name])
    for name in ("fc1", "fc2", "fc3"):
        assert errors["sparsegpt"][name] < errors["wanda"][name], errors
        assert errors["sparsegpt"][name] < errors["magnitude"][name], errors
    # on inputs with a few large features Wanda beats magnitude too (its premise)
    assert errors["wanda"]["fc1"] < errors["magnitude"]["fc1"], errors


# -- masks honour the pattern -----------------------------------------------------------

def _check_nm(keep: torch.Tensor, n: int, m: int) -> None:
    rows, cols = keep.shape
    full = cols // m * m
    groups = keep[:, :full].reshape(rows, -1, m).sum(-1)
    assert bool((groups == n).all()), groups
    if full < cols:
        assert bool((keep[:, full:].sum(-1) == min(n, cols - full)).all())


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 12), cols=st.integers(1, 40), nm=st.sampled_from([(1, 2), (2, 4), (1, 4), (3, 4), (4, 8), (2, 3)]),
       blocksize=st.sampled_from([1, 4, 7, 128]), seed=st.integers(0, 2**16))
def test_nm_masks_are_exact(rows, cols, nm, blocksize, seed):
    n, m = nm
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    x = torch.randn(4 * cols + 8, cols, generator=g)
    for sp, extra in ((WandaSparsifier(n=n, m=m), {"input_norm": input_norms(x)}),
                      (SparseGPTSparsifier(n=n, m=m, blocksize=blocksize), {"hessian": input_hessian(x)})):
        values, keep = sp.prune(w, **extra)
        _check_nm(keep, n, m)
        assert not bool(values[~keep].any())


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 12), cols=st.integers(1, 40), fraction=st.floats(0.0, 1.0),
       blocksize=st.sampled_from([1, 5, 16, 128]), seed=st.integers(0, 2**16))
@example(rows=2, cols=10, fraction=0.95, blocksize=1, seed=0)  # 10 * (1 - 0.95) is a half in decimal
def test_unstructured_density_is_exact(rows, cols, fraction, blocksize, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    x = torch.randn(4 * cols + 8, cols, generator=g)
    _, keep = SparseGPTSparsifier(fraction, blocksize=blocksize).prune(w, hessian=input_hessian(x))
    assert int(keep.sum()) == kept_count(rows * cols, fraction)  # per layer, like magnitude
    _, keep = WandaSparsifier(fraction).prune(w, input_norm=input_norms(x))
    assert bool((keep.sum(1) == kept_count(cols, fraction)).all())  # per output row


def test_wanda_scores_by_hand():
    w = torch.tensor([[1.0, -2.0, 3.0, 0.5], [4.0, 1.0, -1.0, 2.0]])
    norms = torch.tensor([1.0, 2.0, 0.1, 10.0])
    # |W|·‖X‖: [[1, 4, .3, 5], [4, 2, .1, 20]]
    assert WandaSparsifier(0.5).mask(w, input_norm=norms).tolist() == [[False, True, False, True], [True, False, False, True]]
    assert WandaSparsifier(n=1, m=2).mask(w, input_norm=norms).tolist() == [[False, True, False, True], [True, False, False, True]]
    assert WandaSparsifier(0.25).mask(w, input_norm=norms).tolist() == [[True, True, False, True], [True, True, False, True]]


# -- the sparsifiers on their own ------------------------------------------------------

@pytest.mark.parametrize("layout", [torch.Tensor, sten.CsrTensor, sten.CooTensor, sten.CscTensor])
def test_sparsifiers_through_sparsify_builder_and_sparsify_with(layout):
    torch.manual_seed(0)
    x = correlated_inputs(256, 16)
    layer = torch.nn.Linear(16, 8)
    w = layer.weight.detach()
    for sp, name, value in ((SparseGPTSparsifier(n=2, m=4), "hessian", input_hessian(x)),
                            (WandaSparsifier(0.5), "input_norm", input_norms(x))):
        expected, keep = sp.prune(w, **{name: value})
        out = sten.sparsify(sp.bind(**{name: value}), w, layout)
        got = out if layout is torch.Tensor else out.to_dense()
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        if layout is not torch.Tensor:
            assert type(out.wrapped_tensor) is layout
            assert torch.equal(stored_mask(out), keep)  # exactly the mask, kept zeros included
        out = sparsify_with(sp, w, layout, **{name: value})
        torch.testing.assert_close(out if layout is torch.Tensor else out.to_dense(), expected, rtol=0, atol=0)
        model = torch.nn.Sequential(layer)
        sb = sten.SparsityBuilder(model)
        sb.set_weight("0.weight", sp.bind(**{name: value}), out_format=layout)
        sparse = sb.get_sparse_model()
        got = sparse[0].weight
        torch.testing.assert_close(got.to_dense() if layout is not torch.Tensor else got.detach(), expected, rtol=0, atol=0)


def test_missing_and_wrong_inputs_are_named():
    w = torch.randn(4, 8)
    with pytest.raises(MissingInputError, match="'hessian'.*input_hessian"):
        SparseGPTSparsifier(0.5).mask(w)
    with pytest.raises(MissingInputError, match="'input_norm'.*input_norms"):
        sten.sparsify(WandaSparsifier(0.5), w, sten.CsrTensor)
    with pytest.raises(TypeError, match="does not take grad"):
        WandaSparsifier(0.5).bind(grad=w)
    with pytest.raises(ValueError, match=r"input_norm must have shape \(8,\)"):
        WandaSparsifier(0.5).mask(w, input_norm=torch.ones(7))
    with pytest.raises(ValueError, match="2-D"):
        WandaSparsifier(0.5).mask(torch.randn(8), input_norm=torch.ones(8))
    with pytest.raises(TypeError, match="give fraction or n and m, not both"):
        WandaSparsifier(0.5, n=2, m=4)
    with pytest.raises(TypeError, match="give both n and m"):
        SparseGPTSparsifier(n=2)
    with pytest.raises(ValueError, match="1 <= n <= m"):
        SparseGPTSparsifier(n=5, m=4)
    with pytest.raises(ValueError, match="percdamp"):
        SparseGPTSparsifier(0.5, percdamp=-1)
    with pytest.raises(ValueError, match="blocksize"):
        SparseGPTSparsifier(0.5, blocksize=0)


def test_sparsifier_equality_and_repr():
    assert SparseGPTSparsifier(n=2, m=4) == SparseGPTSparsifier(n=2, m=4).bind(hessian=torch.eye(4))
    assert SparseGPTSparsifier(n=2, m=4) != SparseGPTSparsifier(0.5)
    assert "n=2" in repr(WandaSparsifier(n=2, m=4)) and WandaSparsifier(n=2, m=4).pattern == (2, 4)


# -- prune(): layer by layer ---------------------------------------------------------

def test_prune_is_sequential_layer_by_layer():
    """Layer 2 is calibrated on layer 1's pruned outputs: prune() equals the
    sparsifiers applied by hand in that order."""
    model = TinyMLP(seed=3)
    x = correlated_inputs(512, 48, seed=2)
    batches = list(x.split(100))  # uneven last batch
    by_hand = copy.deepcopy(model)
    with torch.no_grad():
        inp = x
        for name in ("fc1", "fc2", "fc3"):
            layer = getattr(by_hand, name)
            values, _ = SparseGPTSparsifier(n=2, m=4).prune(layer.weight, hessian=input_hessian(inp))
            layer.weight.copy_(values)
            inp = layer(inp).relu()
    pruned = sten.prune(model, batches, "sparsegpt", pattern=(2, 4))
    assert pruned is model
    for name in ("fc1", "fc2", "fc3"):
        torch.testing.assert_close(getattr(pruned, name).weight, getattr(by_hand, name).weight, rtol=1e-4, atol=1e-5)
        assert isinstance(getattr(pruned, name).weight, torch.nn.Parameter)


class SharedInput(torch.nn.Module):
    """q, k, v read the same tensor; o reads their combination."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        return self.o(self.q(x) * self.k(x) + self.v(x))


def test_layers_reading_one_input_are_calibrated_together():
    model = SharedInput()
    groups, once = forward_order(model, torch.randn(3, 8), dict((n, getattr(model, n)) for n in "qkvo"))
    assert groups == [["q", "k", "v"], ["o"]] and once
    x = torch.randn(64, 8)
    ref = copy.deepcopy(model)
    pruned = sten.prune(model, [x], "wanda", sparsity=0.5, out_format=sten.CsrTensor)
    norms = input_norms(x)
    for name in "qkv":
        expected, _ = WandaSparsifier(0.5).prune(getattr(ref, name).weight, input_norm=norms)
        torch.testing.assert_close(getattr(pruned, name).weight.to_dense(), expected)
    with torch.no_grad():
        o_in = pruned.q(x) * pruned.k(x) + pruned.v(x)  # o is calibrated on the pruned q, k, v
    expected, _ = WandaSparsifier(0.5).prune(ref.o.weight, input_norm=input_norms(o_in))
    torch.testing.assert_close(pruned.o.weight.to_dense(), expected)


def test_a_layer_called_twice_gets_both_calls():
    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(6, 6)

        def forward(self, x):
            return self.fc(torch.tanh(self.fc(x)))

    model = Twice()
    x = torch.randn(40, 6)
    with torch.no_grad():
        both = torch.cat([x, torch.tanh(model.fc(x))])
    expected, _ = SparseGPTSparsifier(0.5).prune(model.fc.weight, hessian=input_hessian(both))
    sten.prune(model, [x], "sparsegpt", sparsity=0.5)
    torch.testing.assert_close(model.fc.weight.detach(), expected)


def test_batches_as_tuples_and_dicts_and_layers_called_by_keyword():
    class KeywordCall(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(6, 4)

        def forward(self, x, scale=1.0):
            return self.fc(input=x * scale)

    x = torch.randn(30, 6)
    for batches, seen in (([(x, 2.0)], 2 * x), ([{"x": x, "scale": 3.0}], 3 * x), ([x], x)):
        model = KeywordCall()
        expected, _ = SparseGPTSparsifier(0.5).prune(model.fc.weight, hessian=input_hessian(seen))
        sten.prune(model, batches, "sparsegpt", sparsity=0.5)
        torch.testing.assert_close(model.fc.weight.detach(), expected)


def test_prune_layers_selection_and_magnitude_needs_no_data():
    model = TinyMLP()
    w3 = model.fc3.weight.detach().clone()
    sten.prune(model, method="magnitude", sparsity=0.75, layers=["fc1", "fc2"], out_format=sten.CooTensor)
    assert model.fc1.weight.wrapped_tensor.nnz == round(model.fc1.weight.numel() * 0.25)
    assert torch.equal(model.fc3.weight, w3)
    model = TinyMLP()
    sten.prune(model, [torch.randn(4, 48)], "wanda", sparsity=0.5, layers=lambda name, mod: mod.out_features > 10)
    assert torch.equal(model.fc3.weight, w3) and int((model.fc2.weight == 0).sum()) == 96 * 48


def test_prune_bad_input_names_the_argument():
    model = TinyMLP()
    x = [torch.randn(4, 48)]
    with pytest.raises(ValueError, match="method must be one of"):
        sten.prune(model, x, "obs", sparsity=0.5)
    with pytest.raises(TypeError, match="exactly one of sparsity"):
        sten.prune(model, x, "wanda")
    with pytest.raises(TypeError, match="exactly one of sparsity"):
        sten.prune(model, x, "wanda", sparsity=0.5, pattern=(2, 4))
    with pytest.raises(TypeError, match="pattern must be a pair"):
        sten.prune(model, x, "wanda", pattern=2)
    with pytest.raises(ValueError, match="sparsity must be in"):
        sten.prune(model, x, "magnitude", sparsity=1.5)
    with pytest.raises(ValueError, match="layers: no submodule 'fc9'"):
        sten.prune(model, x, "wanda", sparsity=0.5, layers=["fc9"])
    with pytest.raises(TypeError, match="only nn.Linear"):
        sten.prune(torch.nn.Sequential(torch.nn.ReLU()), x, "wanda", sparsity=0.5, layers=["0"])
    with pytest.raises(ValueError, match="needs calibration_batches"):
        sten.prune(model, None, "sparsegpt", sparsity=0.5)
    with pytest.raises(TypeError, match="wrap it in a list"):
        sten.prune(model, torch.randn(4, 48), "wanda", sparsity=0.5)
    with pytest.raises(ValueError, match="is empty"):
        sten.prune(model, [], "wanda", sparsity=0.5)
    with pytest.raises(TypeError, match="out_format must be a layout class"):
        sten.prune(model, x, "wanda", sparsity=0.5, out_format="csr")
    with pytest.raises(ValueError, match="fc2, fc3 did not run"):
        sten.prune(SkipsFc2(), x, "wanda", sparsity=0.5)
    sparse = sten.prune(TinyMLP(), method="magnitude", sparsity=0.5, out_format=sten.CsrTensor)
    with pytest.raises(TypeError, match="already sparse"):
        sten.prune(sparse, x, "wanda", sparsity=0.5)


class SkipsFc2(TinyMLP):
    def forward(self, x):
        return torch.relu(self.fc1(x))


def test_prune_restores_training_mode_and_progress_only_when_asked(capsys):
    model = TinyMLP()
    model.train()
    sten.prune(model, [torch.randn(8, 48)], "wanda", sparsity=0.5)
    assert model.training
    assert capsys.readouterr().err == ""  # stderr is not a terminal under pytest
    sten.prune(TinyMLP(), [torch.randn(8, 48)], "sparsegpt", sparsity=0.5, progress=True)
    err = capsys.readouterr().err
    assert "3/3" in err and "fc3" in err


# -- the result loads and trains on ----------------------------------------------------

def test_pruned_model_loads_and_trains_on_keeping_its_sparsity():
    torch.manual_seed(0)
    x = correlated_inputs(256, 48)
    y = torch.randint(0, 10, (256,))
    model = sten.prune(TinyMLP(), list(x.split(64)), "sparsegpt", pattern=(2, 4), out_format=sten.CsrTensor)
    masks = {n: stored_mask(p).clone() for n, p in model.named_parameters() if isinstance(p, sten.SparseTensorWrapper)}
    assert len(masks) == 3
    for keep in masks.values():
        _check_nm(keep, 2, 4)

    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf)  # the default torch.load (weights_only=True)
    fresh = sten.prune(TinyMLP(seed=9), method="magnitude", pattern=(2, 4), out_format=sten.CsrTensor)
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)

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
        assert type(w.wrapped_tensor) is sten.CsrTensor
        assert torch.equal(stored_mask(w), keep)  # the optimizer kept the pattern
        assert not bool(w.to_dense()[~keep].any())


# -- plugin layouts (skipped with the reason where the plugin is not installed) ---------

def test_nm_layouts_of_sten_nm():
    sten_nm = pytest.importorskip("sten_nm", reason="the sten_nm plugin is not installed")
    torch.manual_seed(0)
    x = correlated_inputs(256, 32)
    for n, m in ((2, 4), (1, 4), (4, 8)):
        model = TinyMLP(features=32, hidden=64)
        sten.prune(model, [x], "sparsegpt", pattern=(n, m), out_format=sten_nm.NMTensor)
        w = model.fc2.weight.wrapped_tensor
        assert type(w) is sten_nm.NMTensor and (w.n, w.m) == (n, m)
        _check_nm(w.to_dense() != 0, n, m)
    # the grouped formats pick each method's grouped sparsifier (tested in plugins/sten_nm/tests/test_pruning.py)
    for layout in (sten_nm.GroupedNMTensor, sten_nm.ColumnGroupedNMTensor):
        model = sten.prune(TinyMLP(features=32, hidden=64), [x], "wanda", pattern=(2, 4), out_format=layout)
        assert type(model.fc2.weight.wrapped_tensor) is layout


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
def test_a_sparsity_into_an_nm_layout_is_refused_before_anything_changes(method):
    """Magnitude pruning to 50 % into ``NMTensor`` re-pruned the unstructured mask to 2:4 (27 of
    the 32 values kept) with only a warning; Wanda and SparseGPT raised "nm_compress: the mask
    keeps more than n of some group of m". Each now raises the documented ValueError, saying to
    ask for the pattern, before any weight is replaced."""
    sten_nm = pytest.importorskip("sten_nm", reason="the sten_nm plugin is not installed")
    torch.manual_seed(0)
    model = TinyMLP(features=32, hidden=64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"NMTensor cannot store the mask .* ask for its pattern \(pattern=\(n, m\)"):
        sten.prune(model, [correlated_inputs(64, 32)], method, sparsity=0.5, out_format=sten_nm.NMTensor)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    sten.prune(model, [correlated_inputs(64, 32)], method, pattern=(2, 4), out_format=sten_nm.NMTensor)
    _check_nm(model.fc1.weight.to_dense() != 0, 2, 4)


@pytest.mark.parametrize("method", ["magnitude", "wanda", "sparsegpt"])
def test_a_nan_weight_prunes_into_csr_as_into_dense(method):
    """A NaN weight made Wanda and SparseGPT into CsrTensor fail with "CsrTensor cannot store the
    mask ... (e.g. CsrTensor ...)": the stored check compared NaN with NaN."""
    torch.manual_seed(0)
    x = correlated_inputs(64, 32)
    dense, csr = TinyMLP(features=32, hidden=64), TinyMLP(features=32, hidden=64)
    with torch.no_grad():
        dense.fc1.weight[3, 5] = float("nan")
    csr.load_state_dict(dense.state_dict())
    sten.prune(dense, [x], method, sparsity=0.5, layers=["fc1"])
    sten.prune(csr, [x], method, sparsity=0.5, layers=["fc1"], out_format=sten.CsrTensor)
    torch.testing.assert_close(csr.fc1.weight.to_dense(), dense.fc1.weight.detach(), equal_nan=True)


def test_float64_calibration_statistics_stay_float64():
    x = torch.randn(16, 8, dtype=torch.float64)
    assert input_hessian(x).dtype == torch.float64 and input_hessian(x.float()).dtype == torch.float32
    norms = InputNorms(8)
    norms.update(x)
    assert norms.result().dtype == torch.float64
    torch.testing.assert_close(input_hessian(x), 2 * x.t() @ x / 16)


def test_sparse24_layout_of_sten_cuda24():
    sten_cuda24 = pytest.importorskip("sten_cuda24", reason="the sten_cuda24 plugin is not installed")
    torch.manual_seed(0)
    x = correlated_inputs(256, 32)
    model = TinyMLP(features=32, hidden=64)
    ref = sten.prune(TinyMLP(features=32, hidden=64), [x], "wanda", pattern=(2, 4))
    sten.prune(model, [x], "wanda", pattern=(2, 4), out_format=sten_cuda24.Sparse24Tensor)
    assert type(model.fc2.weight.wrapped_tensor) is sten_cuda24.Sparse24Tensor
    torch.testing.assert_close(model.fc2.weight.to_dense(), ref.fc2.weight.detach(), rtol=0, atol=0)


def test_wanda_zeroes_a_pruned_inf_or_nan_weight():
    """``dense * keep`` left NaN where Wanda pruned an inf (``inf * 0``), which no sparse layout stores."""
    from sten_core.training.pruning import WandaSparsifier

    w = torch.tensor([[float("inf"), float("nan"), float("inf"), 4.0]])
    wanda = WandaSparsifier(0.75).bind(input_norm=torch.ones(4))
    values, keep = wanda.prune(w)
    assert keep.sum() == 1 and not values[~keep].isnan().any() and (values[~keep] == 0).all()
    assert torch.equal(sten.sparsify(wanda, w, sten.CsrTensor).to_dense().isnan(), values.isnan())


@pytest.mark.parametrize("row", [[1e-300, 2e-300, 3e-300, 4e-300], [1e39, 2e39, 3e39, 4e39],
                                 [1.0, 1.0 + 1e-12, 0.5, 0.25]], ids=["underflow", "overflow", "close"])
def test_wanda_ranks_a_float64_weight_in_float64(row):
    """Scores were float32: values under 1e-38 or over 3e38, or 1e-12 apart, tied, and the first kept."""
    from sten_core.training.pruning import WandaSparsifier

    w = torch.tensor([row], dtype=torch.float64)
    norm = torch.ones(4, dtype=torch.float64)
    expected = sten.ScalarFractionSparsifier(0.5).mask(w)  # unit norms: Wanda is per-row magnitude
    assert torch.equal(WandaSparsifier(0.5).mask(w, input_norm=norm), expected)
    assert WandaSparsifier(n=1, m=2).mask(w[:, :2], input_norm=norm[:2]).tolist() == [[False, True]]
