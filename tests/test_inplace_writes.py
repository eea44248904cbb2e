"""In-place writes into wrappers that no in-place implementation handles: ``out=``,
``w[i] = v``, ``inplace=True``, the tensor lists of ``_foreach_*_`` and of the fused
optimizer kernels. Each runs on dense copies and lands in the wrappers it wrote at their
stored positions (the pattern is kept, as for ``add_``); before, only a first argument that
was itself a wrapper was written back, so these writes were lost without an error (Adamax
divided by a state that stayed 0; foreach / fused optimizers left sparse weights as they were).
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_core import dispatch
from sten_core.model.tensor import densify
from sten_nm import ColumnGroupedNMTensor, NMTensor
from sten_scipy import ScipyCsrTensor

LAYOUTS = [sten.DenseTensor, sten.CooTensor, sten.CsrTensor, sten.CscTensor, NMTensor, ColumnGroupedNMTensor,
           ScipyCsrTensor]


def sparse_dense(shape=(6, 8), seed=0):
    torch.manual_seed(seed)
    return torch.randn(*shape) * (torch.rand(*shape) > 0.4)


def wrap(layout, d, parameter=False):
    cls = sten.SparseParameterWrapper if parameter else sten.SparseTensorWrapper
    return cls(layout.from_dense(d.clone()))


def kept(w):
    """The positions the wrapper stores (its writes can reach), as a dense mask."""
    layout = w.wrapped_tensor
    return layout.with_values(torch.ones_like(layout.values())).to_dense() != 0


WRITES = {
    "out= maximum": lambda w, b: torch.maximum(w, b, out=w),
    "out= add": lambda w, b: torch.add(w, b, out=w),
    "out= mul of others": lambda w, b: torch.mul(b, 2.0, out=w),
    "setitem row": lambda w, b: w.__setitem__((0, slice(None)), 7.0),
    "setitem mask": lambda w, b: w.__setitem__(w > 0.5, 0.0),
    "relu inplace=True": lambda w, b: F.relu(w, inplace=True),
    "foreach mul_": lambda w, b: torch._foreach_mul_([w], 2.0),
    "foreach add_ list": lambda w, b: torch._foreach_add_([w], [b]),
    "foreach zero_": lambda w, b: torch._foreach_zero_([w]),
}


HOLDS_ANY_PATTERN = {sten.DenseTensor, sten.CooTensor, sten.CsrTensor, sten.CscTensor, ScipyCsrTensor}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", list(WRITES))
@pytest.mark.parametrize("parameter", [True, False], ids=["weight", "temporary"])
def test_write_lands_at_the_stored_positions_of_a_weight_and_everywhere_in_a_temporary(layout, name, parameter):
    """A weight keeps its pattern; a temporary takes dense torch's result, its pattern grown to
    hold it, where its layout can hold any pattern (an n:m one keeps its pattern, warned)."""
    d = sparse_dense()
    w = wrap(layout, d, parameter)
    mask = kept(w)
    before = w.to_dense().clone()
    ref, b = before.clone(), torch.full(d.shape, 0.75)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        WRITES[name](ref, b)
        got = WRITES[name](w, b)
    expected = ref if not parameter and layout in HOLDS_ANY_PATTERN else torch.where(mask, ref, before)
    torch.testing.assert_close(w.to_dense(), expected)
    if name.startswith("out="):
        assert got is w   # as torch: out= returns its target
    if not torch.equal(expected, before):
        assert not torch.equal(w.to_dense(), before)


def test_a_wrapper_only_read_by_a_foreach_call_is_not_written():
    """Only what the op changed is written back: a wrapper it merely reads keeps its
    version (a saved copy of it stays valid for backward)."""
    w = wrap(sten.CsrTensor, sparse_dense())
    acc = torch.zeros(6, 8)
    version = w._version
    with dispatch.quiet_fallbacks():
        out = torch._foreach_add_([acc], [w])
    assert out[0] is acc   # as torch: the list of its targets
    torch.testing.assert_close(acc, w.to_dense())
    assert w._version == version


def test_two_wrappers_in_one_list_are_both_written():
    a, b = wrap(sten.CsrTensor, sparse_dense(seed=1)), wrap(NMTensor, sparse_dense(seed=2))
    da, db = a.to_dense().clone(), b.to_dense().clone()
    with dispatch.quiet_fallbacks():
        out = torch._foreach_mul_([a, b], 3.0)
    assert out[0] is a and out[1] is b
    torch.testing.assert_close(a.to_dense(), 3 * da)
    torch.testing.assert_close(b.to_dense(), 3 * db)


OPTIMIZERS = {
    "Adamax": lambda p: torch.optim.Adamax(p, lr=0.05),
    "Adam foreach": lambda p: torch.optim.Adam(p, lr=0.05, foreach=True),
    "Adam fused": lambda p: torch.optim.Adam(p, lr=0.05, fused=True),
    "AdamW fused": lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1, fused=True),
    "SGD momentum foreach": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=True),
    "RMSprop foreach": lambda p: torch.optim.RMSprop(p, lr=0.01, foreach=True),
}


@pytest.mark.parametrize("layout", [sten.CsrTensor, NMTensor, ScipyCsrTensor], ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_steps_match_the_dense_masked_reference(layout, name):
    """Three steps of each optimizer on a sparse weight against the same optimizer on a dense
    weight whose gradient is masked to the pattern (what a sparse weight can learn)."""
    torch.manual_seed(0)
    W = wrap(layout, sparse_dense(), parameter=True)
    mask = kept(W)
    Wd = torch.nn.Parameter(W.to_dense().detach().clone())
    opt, optd = OPTIMIZERS[name]([W]), OPTIMIZERS[name]([Wd])
    for step in range(3):
        x = torch.randn(5, 8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            F.linear(x, W).square().sum().backward()
            opt.step()
            opt.zero_grad()
        F.linear(x, Wd).square().sum().backward()
        Wd.grad.mul_(mask)
        optd.step()
        optd.zero_grad()
        torch.testing.assert_close(W.to_dense(), Wd.detach(), rtol=1e-4, atol=1e-5, msg=f"step {step}")
    assert torch.isfinite(F.linear(torch.randn(2, 8), W)).all()


def test_clip_grad_norm_foreach_clips_a_sparse_gradient():
    W = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(sparse_dense()),
                                    grad_fmt=(sten.KeepAll(), sten.CsrTensor, sten.KeepAll(), sten.CsrTensor))
    F.linear(torch.randn(3, 8), W).square().sum().backward()
    with dispatch.quiet_fallbacks():
        torch.nn.utils.clip_grad_norm_([W], 0.01, foreach=True)
    assert W.grad.to_dense().norm().item() == pytest.approx(0.01, rel=1e-4)


def test_a_foreach_write_into_wrappers_under_autograd_raises_instead_of_being_lost():
    a = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(sparse_dense()), requires_grad=True)
    before = a.to_dense().clone()
    with dispatch.quiet_fallbacks(), pytest.raises(RuntimeError, match="torch.no_grad"):
        torch._foreach_mul_([a], 2.0)
    assert torch.equal(a.to_dense(), before)
    with torch.no_grad(), dispatch.quiet_fallbacks():
        torch._foreach_mul_([a], 2.0)
    torch.testing.assert_close(a.to_dense(), 2 * before)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: c.__name__)
def test_out_into_a_dense_tensor_from_wrapper_inputs(layout):
    w = wrap(layout, sparse_dense())
    b = torch.full((6, 8), 0.5)
    out = torch.empty(0)
    with dispatch.quiet_fallbacks():
        got = torch.add(w, b, out=out)
    assert got is out
    torch.testing.assert_close(out, w.to_dense() + b)


@pytest.mark.parametrize("layout", [sten.CsrTensor, NMTensor, ScipyCsrTensor], ids=lambda c: c.__name__)
@pytest.mark.parametrize("init", ["constant_", "zeros_", "normal_", "uniform_", "kaiming_uniform_", "xavier_normal_"])
def test_nn_init_on_a_sparse_parameter_fills_its_stored_positions(layout, init):
    """nn.init passes the tensor by keyword and runs under no_grad itself: on a parameter
    that requires grad it fills the stored positions (it raised an IndexError, or the
    leaf-in-place error, before)."""
    torch.manual_seed(0)
    W = wrap(layout, sparse_dense(), parameter=True)
    mask, before = kept(W), W.to_dense().clone()
    fn = getattr(torch.nn.init, init)
    with dispatch.quiet_fallbacks():
        out = fn(W, 0.25) if init == "constant_" else fn(W)
    assert out is W and W.requires_grad
    after = W.to_dense()
    assert (after[~mask] == 0).all() and not torch.equal(after, before)
    if init == "constant_":
        assert (after[mask] == 0.25).all()


def _grad_of(W, x):
    F.linear(x, W).sum().backward()


RESPARSIFIED = (sten.KeepAll(), torch.Tensor, sten.ScalarFractionSparsifier(0.75), sten.CsrTensor)


def test_two_backward_calls_accumulate_gradients_of_different_patterns():
    """Autograd's ``grad += new`` on a re-sparsified gradient (a new pattern each backward):
    the sum of both, as one backward of the summed loss gives (the new gradient's values
    outside the old pattern were dropped before)."""
    torch.manual_seed(0)
    d = sparse_dense((8, 8))
    x1, x2 = torch.randn(3, 8), torch.randn(3, 8)

    def fresh():
        return sten.SparseParameterWrapper(sten.CsrTensor.from_dense(d), grad_fmt=RESPARSIFIED)

    grads = []
    for x in (x1, x2):
        W = fresh()
        _grad_of(W, x)
        grads.append(W.grad.to_dense())
    assert not torch.equal(grads[0] != 0, grads[1] != 0)   # the case: different patterns
    W = fresh()
    _grad_of(W, x1)
    _grad_of(W, x2)
    assert isinstance(W.grad, sten.SparseTensorWrapper) and isinstance(W.grad.wrapped_tensor, sten.CsrTensor)
    torch.testing.assert_close(W.grad.to_dense(), grads[0] + grads[1])


def test_accumulating_into_a_layout_that_cannot_hold_the_sum_warns():
    """An n:m .grad cannot store the union of two n:m patterns: the sum is kept at .grad's
    positions, and said (a lossy step), not dropped silently."""
    torch.manual_seed(0)
    W = sten.SparseParameterWrapper(NMTensor.from_dense(torch.randn(8, 8), 2, 4))
    x = torch.randn(3, 8)
    _grad_of(W, x)
    new = W.grad.clone()                                     # this backward's gradient (dense, the default)
    W.grad = sten.SparseTensorWrapper(NMTensor.from_dense(torch.randn(8, 8), 2, 4))
    before = W.grad.to_dense().clone()
    dispatch.reset_warnings()
    with pytest.warns(sten.DispatchWarning, match="Lossy gradient accumulation"):
        _grad_of(W, x)
    torch.testing.assert_close(W.grad.to_dense(), torch.where(before != 0, before + new, torch.zeros(())))


@pytest.mark.parametrize("layout", [sten.CooTensor, sten.CsrTensor, sten.DenseTensor])
def test_embedding_max_norm_renormalises_the_sparse_weight(layout):
    """``nn.Embedding(max_norm=...)`` renormalises the looked-up rows of its weight in place
    inside an out-of-place call (``embedding_renorm_`` in ``F.embedding``): the dense path ran it
    on a copy and the stored weight kept its norms (2.73 where dense gives 1.0), so training
    drifted from the dense model. The copy's change is now written back at the stored positions."""
    torch.manual_seed(0)
    w = torch.randn(10, 8) * 2 * (torch.rand(10, 8) > 0.5)
    idx = torch.tensor([[1, 2, 3], [3, 7, 1]])
    e = torch.nn.Embedding(10, 8, max_norm=1.0)
    e.weight = sten.SparseParameterWrapper(layout.from_dense(w))
    r = torch.nn.Embedding(10, 8, max_norm=1.0)
    r.weight.data = w.clone()
    opt, ref = torch.optim.SGD(e.parameters(), lr=0.1), torch.optim.SGD(r.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        for _ in range(2):
            for model, o in ((e, opt), (r, ref)):
                o.zero_grad()
                model(idx).square().sum().backward()
                o.step()
    stored = layout.from_dense(w).to_dense() != 0 if layout is not sten.DenseTensor else torch.ones_like(w, dtype=torch.bool)
    torch.testing.assert_close(e.weight.to_dense(), r.weight.detach() * stored)


def test_the_dense_path_runs_under_inference_mode():
    """The dense path compares its copies' version counters to find writes (as
    ``embedding_renorm_``'s); inference tensors have none, and every fallback call under
    ``torch.inference_mode()`` raised "Inference tensors do not track version counter"."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 4)).eval()
    sb = sten.SparsityBuilder(model)
    sb.set_weight("0.weight", sten.ScalarFractionSparsifier(0.7), out_format=sten.CsrTensor)
    sb.set_interm("1.gelu", inline_sparsifier=sten.ScalarThresholdSparsifier(0.1), out_format=sten.CooTensor)
    sparse = sb.get_sparse_model()
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        with torch.no_grad():
            expected = sparse(x)
        with torch.inference_mode():
            got = sparse(x)
        torch.testing.assert_close(got, expected)
        e = torch.nn.Embedding(4, 3, max_norm=1.0)
        e.weight = sten.SparseParameterWrapper(sten.CooTensor.from_dense(torch.full((4, 3), 2.0)))
        with torch.inference_mode():
            e(torch.tensor([1]))
        torch.testing.assert_close(e.weight.to_dense()[1].norm(), torch.tensor(1.0), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(e.weight.to_dense()[0], torch.full((3,), 2.0))


VIEW_WRITES = {
    "w[0][1] = v": lambda t: t[0].__setitem__(1, 55.0),
    "w[0].fill_": lambda t: t[0].fill_(2.0),
    "w.narrow().zero_()": lambda t: t.narrow(0, 2, 1).zero_(),
    "w.view(-1)[i] = v": lambda t: t.view(-1).__setitem__(15, -1.0),
    "w.T[0].mul_": lambda t: t.T[0].mul_(3.0),
    "w.view_as(x).copy_": lambda t: t.view_as(torch.empty(4, 4)).copy_(torch.full((4, 4), 7.0)),
    "w.unbind()[1].add_": lambda t: t.unbind(0)[1].add_(1.0),
    "torch.add(.., out=w[3])": lambda t: torch.add(torch.ones(4), 1.0, out=t[3]),
}


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CooTensor, sten.CscTensor, sten.DenseTensor])
@pytest.mark.parametrize("write", VIEW_WRITES)
@pytest.mark.parametrize("parameter", [True, False], ids=["weight", "temporary"])
def test_writes_through_a_view_of_a_wrapper_reach_it(layout, write, parameter):
    """``w[0]``, ``w.view(-1)``, ``w.narrow(...)`` ran on the wrapper's dense copy, so writes
    through them changed the copy and were lost (every layout but DenseTensor): now, as for
    writes into the wrapper itself, they land at a weight's stored positions, and everywhere
    in a temporary."""
    base = torch.arange(1.0, 17.0).view(4, 4) * (torch.arange(16).view(4, 4) % 3 != 0)
    w = wrap(layout, base, parameter)
    dense = base.clone()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        VIEW_WRITES[write](w)
    VIEW_WRITES[write](dense)
    stored = base != 0 if layout is not sten.DenseTensor and parameter else torch.ones(4, 4, dtype=torch.bool)
    assert type(w.wrapped_tensor) is layout
    torch.testing.assert_close(w.to_dense(), dense * stored)


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CooTensor])
def test_a_write_through_a_view_that_lands_off_the_pattern_is_warned(layout):
    """Values written through a view at positions a weight does not store are dropped (the
    pattern is kept), which dense torch would keep: a DispatchWarning says how many. A write that lands on stored positions (or NaN where NaN is stored) says nothing."""
    base = torch.tensor([[1.0, 0.0], [float("nan"), 2.0]])
    w = wrap(layout, base, parameter=True)
    with torch.no_grad(), pytest.warns(sten.DispatchWarning, match=r"wrote 1 value\(s\) at positions it does not store"):
        w.diagonal().add_(0.0)  # the diagonal is stored
        w[0].fill_(5.0)                   # (0, 1) is not stored
    torch.testing.assert_close(w.to_dense(), torch.tensor([[5.0, 0.0], [float("nan"), 2.0]]), equal_nan=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", ".*positions it does not store", sten.DispatchWarning)
        w.diagonal().mul_(2.0)
        w[1].fill_(float("nan"))
    torch.testing.assert_close(w.to_dense(), torch.tensor([[10.0, 0.0], [float("nan"), float("nan")]]), equal_nan=True)


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CooTensor])
def test_creation_ops_of_a_weight_that_requires_grad_have_no_history(layout):
    """``zeros_like(w)`` of a weight that requires grad requires no grad, as torch's (it was recorded
    by autograd, so ``mask[rows] = 1`` on it took the autograd path of in-place writes); with
    ``requires_grad=True`` it is a leaf that does."""
    w = sten.SparseTensorWrapper(layout.from_dense(torch.eye(3)), requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        made = [torch.zeros_like(w), torch.ones_like(w), torch.empty_like(w), torch.full_like(w, 2.0),
                torch.rand_like(w), w.new_zeros(2)]
        leaf = torch.zeros_like(w, requires_grad=True)
    assert [t.requires_grad for t in made] == [False] * len(made)
    assert all(t.grad_fn is None for t in made)
    assert leaf.requires_grad and leaf.is_leaf


def test_an_assignment_into_a_temporary_lands_everywhere_and_into_a_weight_is_warned():
    """``mask = zeros_like(w); mask[rows] = 1`` (``prune.ln_structured``'s mask) sets whole rows,
    as on a dense tensor: it kept ``w``'s pattern, dropping the ones at unstored positions with a
    warning. The same assignment into the weight keeps its pattern and warns; updates of a
    weight's stored values (``add_`` of a dense tensor, as an optimizer's step) stay silent."""
    w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(3)), requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        mask = torch.zeros_like(w)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*positions it does not store", sten.DispatchWarning)
        mask[[0, 2]] = 1
    torch.testing.assert_close(mask.to_dense(), torch.tensor([[1.0, 1, 1], [0, 0, 0], [1, 1, 1]]))
    with torch.no_grad(), pytest.warns(sten.DispatchWarning, match=r"__setitem__ .* wrote 4 value\(s\) at positions"):
        w[[0, 2]] = 3
    torch.testing.assert_close(w.to_dense(), torch.diag(torch.tensor([3.0, 1.0, 3.0])))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", ".*positions it does not store", sten.DispatchWarning)
        w.add_(torch.ones(3, 3))
    torch.testing.assert_close(w.to_dense(), torch.diag(torch.tensor([4.0, 2.0, 4.0])))


def test_an_orthogonal_parametrization_of_a_sparse_weight_gives_dense_torchs():
    """``parametrizations.orthogonal`` builds its identity in ``zeros_like(weight)`` and writes
    its diagonal through a view: a temporary, which now takes it (the diagonal was dropped, with
    a warning, and the weight it gave was not dense torch's)."""
    torch.manual_seed(0)
    d = torch.randn(6, 6) * (torch.rand(6, 6) > 0.4) + torch.eye(6)
    lin, ref = torch.nn.Linear(6, 6, bias=False), torch.nn.Linear(6, 6, bias=False)
    lin.weight = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(d))
    with torch.no_grad():
        ref.weight.copy_(d)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        warnings.filterwarnings("error", ".*positions it does not store", sten.DispatchWarning)
        torch.nn.utils.parametrizations.orthogonal(lin, "weight")
        got = densify(lin.weight)
    torch.nn.utils.parametrizations.orthogonal(ref, "weight")
    torch.testing.assert_close(got, ref.weight)


def test_orthogonal_init_writes_a_sparse_weight():
    """``nn.init.orthogonal_`` writes through ``w.view_as(q)``: it left sparse weights unchanged."""
    torch.manual_seed(0)
    base = torch.randn(6, 6)
    lin = torch.nn.Linear(6, 6)
    lin.weight = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(base))
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        torch.nn.init.orthogonal_(lin.weight)
    torch.manual_seed(1)
    ref = torch.nn.init.orthogonal_(torch.empty(6, 6))
    assert not torch.equal(lin.weight.to_dense(), base)
    torch.testing.assert_close(lin.weight.to_dense(), ref * (base != 0))


def test_a_view_of_a_wrapper_computes_like_a_tensor():
    w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(3)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        row = w[1]
        out = row * 2 + torch.ones(3)
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out, torch.tensor([1.0, 3.0, 1.0]))
    torch.testing.assert_close(row.sum(), torch.tensor(1.0))


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CooTensor, sten.DenseTensor])
@pytest.mark.parametrize("op", ["w * nan", "w * inf", "w / 0", "w / nan", "w * inf-tensor", "w / 2", "w * 3"])
def test_out_of_place_mul_and_div_give_dense_torchs_non_finite_values(layout, op):
    """``w * nan`` and ``w / 0`` ran on the stored values, leaving 0 at the unstored positions
    where dense torch gives NaN."""
    run = {"w * nan": lambda t: t * float("nan"), "w * inf": lambda t: t * float("inf"), "w / 0": lambda t: t / 0,
           "w / nan": lambda t: t / float("nan"), "w * inf-tensor": lambda t: t * torch.full((2, 4), float("inf")),
           "w / 2": lambda t: t / 2, "w * 3": lambda t: 3 * t}[op]
    d = torch.tensor([[1.0, 0.0, 2.0, 0.0], [0.0, -3.0, 0.0, 4.0]])
    w = sten.SparseTensorWrapper(layout.from_dense(d))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        got = run(w)
    if op in ("w / 2", "w * 3"):  # finite: still on the stored values, the layout kept
        assert type(got.wrapped_tensor) is layout
    got = got.to_dense() if isinstance(got, sten.SparseTensorWrapper) else got
    torch.testing.assert_close(got, run(d), equal_nan=True)


DATA_WRITES = {  # (write, undo): gradcheck's pattern (perturb an entry through x.data, restore it)
    "w.data.mul_(2)": (lambda d, keep: d.mul_(2.0), lambda d, keep: d.div_(2.0)),
    "w.data[0] = 1": (lambda d, keep: d.__setitem__(0, 1.0), lambda d, keep: d.__setitem__(0, keep[0])),
    "w.data.copy_(t)": (lambda d, keep: d.copy_(torch.full(tuple(d.shape), 3.0)), lambda d, keep: d.copy_(keep)),
}
DATA_LOSSES = {
    "sin": lambda w: torch.sin(w).sum(),
    "pow": lambda w: w.pow(2).sum(),
    "to_dense() ** 2": lambda w: (w.to_dense() ** 2).sum(),
    "w * w": lambda w: (w * w).sum(),
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("write", DATA_WRITES)
@pytest.mark.parametrize("loss", DATA_LOSSES)
def test_writes_through_data_between_forward_and_backward(layout, write, loss):
    """Dense torch does not bump the version counter for writes through ``t.data``. A
    ``DenseTensor``'s dense form was its own storage, saved by ``sin`` / ``pow``: a write through
    ``w.data`` bumped it, and backward raised "modified by an inplace operation" (so ``gradcheck``
    failed on DenseTensor wrappers). Now each write lands in ``w`` at its stored positions,
    ``w``'s version stays, and backward gives dense torch's gradient."""
    d = sparse_dense()
    w = sten.SparseTensorWrapper(layout.from_dense(d.clone()), requires_grad=True)
    ref = w.to_dense().detach().clone().requires_grad_()
    do, undo = DATA_WRITES[write]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        out, ref_out = DATA_LOSSES[loss](w), DATA_LOSSES[loss](ref)
        keep, ref_keep = w.to_dense().detach().clone(), ref.detach().clone()
        do(w.data, keep)
        do(ref.data, ref_keep)
        torch.testing.assert_close(w.to_dense().detach(), ref.detach() * kept(w))
        undo(w.data, keep)
        undo(ref.data, ref_keep)
        out.backward()
        ref_out.backward()
    assert w._version == ref._version == 0
    torch.testing.assert_close(w.to_dense().detach(), ref.detach())
    at = kept(w) if isinstance(w.grad, sten.SparseTensorWrapper) else True  # a sparse gradient: at w's positions
    torch.testing.assert_close(densify(w.grad), ref.grad * at)


@pytest.mark.parametrize("loss", ["w * x", "sin(w * x)"])
def test_a_write_through_data_of_a_frozen_weight_does_not_break_backward(loss):
    """A frozen wrapper whose dense form is its own storage (here a layout without the
    stored-values protocol, so the product runs densely) saved for ``x``'s gradient."""
    from fake_layouts import DenseCopyLayout

    w = sten.SparseTensorWrapper(DenseCopyLayout.from_dense(torch.full((3, 3), 2.0)))
    x = torch.randn(3, 3, requires_grad=True)
    ref = x.detach().clone().requires_grad_()
    f = (lambda a, b: (a * b).sum()) if loss == "w * x" else (lambda a, b: torch.sin(a * b).sum())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        out = f(w, x)
        w.data.mul_(2.0)
        out.backward()
    f(torch.full((3, 3), 2.0), ref).backward()
    torch.testing.assert_close(x.grad, ref.grad)
    torch.testing.assert_close(w.to_dense(), torch.full((3, 3), 4.0))


@pytest.mark.parametrize("layout", [sten.DenseTensor, sten.CsrTensor, sten.CooTensor, sten.CscTensor])
def test_assigning_data_is_no_in_place_change(layout):
    """``w.data = t`` bumped ``w``'s version, so a backward that held ``w`` raised; dense torch
    keeps the version, and its backward reads the new values: so does the wrapper's."""
    torch.manual_seed(0)
    start, new = torch.randn(4, 4), torch.randn(4, 4)
    ref = start.clone().requires_grad_()
    w = sten.SparseTensorWrapper(layout.from_dense(start.clone()), requires_grad=True)
    ref_out, out = (ref * ref).sum(), (w * w).sum()
    ref.data = new.clone()
    w.data = new.clone()
    ref_out.backward()
    out.backward()
    assert w._version == ref._version == 0
    assert type(w.wrapped_tensor) is layout
    torch.testing.assert_close(densify(w.grad), ref.grad)


def test_a_real_in_place_write_after_forward_still_raises():
    """What the fix must keep: an in-place change of ``w`` itself (not through ``.data``) while
    a backward holds it raises, as in dense torch."""
    w = sten.SparseTensorWrapper(sten.DenseTensor.from_dense(torch.randn(3, 3)), requires_grad=True)
    out = (w * w).sum()
    with torch.no_grad():
        w.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


SHAPE_CHANGES = {
    "t_": lambda t: t.t_(),
    "transpose_": lambda t: t.transpose_(0, 1),
    "unsqueeze_": lambda t: t.unsqueeze_(0),
    "as_strided_": lambda t: t.as_strided_((8, 6), (1, 8)),
    "aten.t_": lambda t: torch.ops.aten.t_(t),
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", list(SHAPE_CHANGES))
def test_an_in_place_shape_change_of_a_wrapper_raises_and_leaves_it_whole(layout, name):
    """``w.t_()`` of a ``DenseTensor`` wrapper transposed its layout while the wrapper kept its
    shape (``w @ v`` then used two shapes); other layouts raised torch's bare "expanded size"."""
    d = sparse_dense()
    w = wrap(layout, d)
    before = w.to_dense().clone()
    with pytest.raises(RuntimeError, match=r"would change the shape of a .* wrapper in place \(shape \(6, 8\)\)"):
        SHAPE_CHANGES[name](w)
    assert tuple(w.shape) == (6, 8) and tuple(w.wrapped_tensor.shape) == (6, 8)
    torch.testing.assert_close(w.to_dense(), before)
    torch.testing.assert_close(densify(w @ torch.ones(8)), before @ torch.ones(8))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("parameter", [True, False], ids=["weight", "temporary"])
def test_views_see_and_keep_later_writes_into_the_wrapper(layout, parameter):
    """A view of a wrapper is a view of a dense copy taken when it was made: after ``w.mul_(10)``
    it read the old values, and a write through it wrote the whole old copy back (the ``mul_(10)``
    undone everywhere); of two views each written, only the second write was kept."""
    d = sparse_dense()
    w = wrap(layout, d, parameter)
    mask = kept(w).float()
    grows = not parameter and layout in HOLDS_ANY_PATTERN
    with torch.no_grad():
        row = w[0]
        w.mul_(10)
        torch.testing.assert_close(torch.as_tensor(row.detach().clone()), 10 * d[0] * mask[0])
        row.mul_(2)
        top, bottom = w[1], w[2]
        top.mul_(3)
        bottom.add_(1)
    want = 10 * d * mask
    want[0] *= 2
    want[1] *= 3
    want[2] += 1 if grows else mask[2]       # (a weight: added at the stored positions only)
    torch.testing.assert_close(w.to_dense(), want)


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CooTensor, NMTensor, ScipyCsrTensor], ids=lambda c: c.__name__)
def test_nn_init_of_slices_of_a_sparse_parameter_writes_it(layout):
    """``torch.nn.init.constant_(p[:2], 5.0)`` (a fused weight's halves initialised one by one)
    changed a dense copy and was lost without a word: ``nn.init`` hands the view to
    ``__torch_function__`` by keyword and writes under ``no_grad``."""
    p = wrap(layout, torch.ones(4, 8), parameter=True)
    mask = kept(p).float()
    torch.nn.init.constant_(p[:2], 5.0)
    torch.nn.init.constant_(p[2:], 7.0)
    torch.testing.assert_close(p.to_dense(), torch.cat([5 * mask[:2], 7 * mask[2:]]))
    with pytest.raises(RuntimeError, match="writes in place through a view of a sparse wrapper that requires grad"):
        p[:1].mul_(2)   # under grad mode: still refused


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: c.__name__)
def test_views_under_autograd_read_the_parameter_after_an_optimizer_step(layout):
    """A view made under autograd (``w[1:]``, ``w.view(-1)`` of a parameter: a ``GradView``) read
    the values the parameter had when the view was made: kept across ``opt.step()`` it computed
    with the old weights, silently, where a view of a dense parameter reads the new ones. Its
    gradients still reach the parameter."""
    d = sparse_dense()
    w = wrap(layout, d, parameter=True)
    ref = torch.nn.Parameter(w.to_dense().detach().clone())
    mask = kept(w)
    views, ref_views = (w[1:], w.view(-1)), (ref[1:], ref.view(-1))
    opt, ref_opt = torch.optim.SGD([w], lr=0.5), torch.optim.SGD([ref], lr=0.5)
    for _ in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = views[0].sum() * 2 + views[1].pow(2).sum()
        ref_loss = ref_views[0].sum() * 2 + ref_views[1].pow(2).sum()
        torch.testing.assert_close(loss, ref_loss)
        loss.backward()
        ref_loss.backward()
        grad = densify(w.grad) if isinstance(w.grad, sten.SparseTensorWrapper) else w.grad
        torch.testing.assert_close(grad * mask, ref.grad * mask)
        ref.grad.mul_(mask)   # (the sparse step updates the stored positions only)
        opt.step()
        ref_opt.step()
    torch.testing.assert_close(torch.as_tensor(views[0].detach().clone()), ref[1:].detach())


def test_a_backward_reads_a_saved_view_as_the_forward_saw_it():
    """A view saved for a backward (``a * w.T[:3]``) and ``w`` changed before that backward: the
    backward's re-run read the view refreshed with the new weights (10x the gradient, silently).
    It reads what the forward saw, as before the views refreshed themselves."""
    torch.manual_seed(0)
    W = torch.randn(4, 4) * (torch.rand(4, 4) > 0.3)
    A = torch.randn(3, 4) * (torch.rand(3, 4) > 0.3)
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(W.clone()))
    a = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(A.clone()))
    with dispatch.quiet_fallbacks():
        out = a * w.T[:3]
        with torch.no_grad():
            w.mul_(10)
        out.sum().backward()
    grad = densify(a.grad) if isinstance(a.grad, sten.SparseTensorWrapper) else a.grad
    torch.testing.assert_close(grad * (A != 0), W.T[:3] * (A != 0))


def test_a_view_sees_a_write_into_scipy_values():
    """Scipy's ``values()`` is a fresh tensor over the scipy array at each call, so its version
    tells nothing: such views compare values, as all views did before."""
    w = sten.SparseTensorWrapper(ScipyCsrTensor.from_dense(torch.tensor([[1.0, 0.0], [-3.0, 1.5]])))
    with torch.no_grad(), dispatch.quiet_fallbacks():
        row = w[1]
        w.wrapped_tensor.values().mul_(10)
        torch.testing.assert_close(torch.as_tensor(row.clone()), torch.tensor([-30.0, 15.0]))


@pytest.mark.parametrize("convert", [int, lambda t: t.__index__()], ids=["int", "__index__"])
def test_python_conversions_of_an_element_are_not_writes(convert):
    """``Tensor.__int__``, ``__index__``, ``__invert__`` and ``__iter__`` were read as in-place
    calls (their names start with ``__i``): ``int(w[0, 0])`` of a parameter raised "writes in place
    through a view", and of a temporary bumped its version, so a later backward raised."""
    p = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.tensor([[2.5, 0.0], [0.0, 3.0]])))
    assert convert(p[0, 0].long()) == 2 and int(p[0, 0]) == 2
    h = p * 2
    loss = h.sum()
    with torch.no_grad():
        assert convert(h[0, 0].long()) == 5
    loss.backward()
    torch.testing.assert_close(densify(p.grad), torch.full((2, 2), 2.0))   # (the default dense gradient)
    for name in ("__int__", "__index__", "__invert__", "__iter__"):
        assert not dispatch.plan.is_inplace(getattr(torch.Tensor, name), {}), name
    for name in ("__iadd__", "__imul__", "__itruediv__", "__setitem__"):
        assert dispatch.plan.is_inplace(getattr(torch.Tensor, name), {}), name
