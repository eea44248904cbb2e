"""In-place writes into wrappers that are not weights (temporaries, sparse intermediates) give
dense torch's values and gradients; weights, and optimizer state inside a step, keep their
pattern (``sten_core.dispatch.writes.writes_exactly``)."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_core.dispatch.optimizer_steps import in_optimizer_step
from sten_core.model.tensor import densify
from sten_scipy import ScipyCscTensor, ScipyCsrTensor

GROWING = [sten.CsrTensor, sten.CooTensor, sten.CscTensor, ScipyCsrTensor]

UPDATES = {
    "add_(1)": lambda h, x, g: h.add_(1.0),
    "add_(x)": lambda h, x, g: h.add_(x),
    "+= x": lambda h, x, g: h.__iadd__(x),
    "mul_(x)": lambda h, x, g: h.mul_(x),
    "clamp_(min)": lambda h, x, g: h.clamp_(min=0.1),
    "exp_()": lambda h, x, g: h.exp_(),
    "sigmoid_()": lambda h, x, g: h.sigmoid_(),
    "div_(same pattern)": lambda h, x, g: h.div_(g),
    "pow_(same pattern)": lambda h, x, g: h.pow_(g),
    "copy_(x)": lambda h, x, g: h.copy_(x),
    "fill_(2)": lambda h, x, g: h.fill_(2.0),
    "h[0] = 3": lambda h, x, g: h.__setitem__(0, 3.0),
    "out= add": lambda h, x, g: torch.add(x, 1.0, out=h),
    "foreach add_": lambda h, x, g: torch._foreach_add_([h], [x]),
}


def masked(shape, seed):
    torch.manual_seed(seed)
    return torch.randn(*shape) * (torch.rand(*shape) > 0.5)


NOT_RECORDED = {"out= add", "foreach add_"}
"""Writes autograd does not record into a tensor that requires grad (torch raises, dense too)."""


@pytest.mark.parametrize("layout", GROWING, ids=lambda c: c.__name__)
@pytest.mark.parametrize(("update", "grad"), [(u, g) for u in UPDATES for g in (True, False)
                                              if not (g and u in NOT_RECORDED)])
def test_an_update_of_a_temporary_is_dense_torchs(layout, update, grad):
    """``h = w * 2`` of a sparse weight, updated in place: the values (and, under autograd, the
    weight's and the operand's gradients) of dense torch on ``w.to_dense()``. They were kept at
    ``h``'s stored positions (``h.add_(1)``: 1 missing everywhere else; ``h.exp_()``: 0 for 1)."""
    base = masked((4, 6), 0)
    x0 = torch.randn(4, 6)
    results = []
    for sparse in (True, False):
        w = sten.SparseParameterWrapper(layout.from_dense(base)) if sparse else torch.nn.Parameter(base.clone())
        x = x0.clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad), warnings.catch_warnings():
            warnings.simplefilter("ignore", sten.DispatchWarning)
            warnings.filterwarnings("error", ".*positions it does not store", sten.DispatchWarning)
            h = w * 2
            g = (w * 1.5).abs()   # (a wrapper of w's pattern; dense: zero where w is)
            UPDATES[update](h, x, g)
            values = densify(h).detach().clone()
            if grad:
                (h * torch.arange(24.0).view(4, 6)).sum().backward()
        results.append((values, densify(w.grad) if grad and w.grad is not None else None, x.grad))
    (v, gw, gx), (rv, rgw, rgx) = results
    torch.testing.assert_close(v, rv, equal_nan=True)
    if grad:
        torch.testing.assert_close(gw, rgw, equal_nan=True)
        torch.testing.assert_close(gx, rgx)


class Block(torch.nn.Module):
    """A residual block written as torchvision's ``BasicBlock`` is: ``out += identity``, in-place ReLU."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 16)
        self.fc2 = torch.nn.Linear(16, 16)

    def forward(self, x):
        identity = x
        out = F.relu(self.fc1(x), inplace=True)
        out = self.fc2(out)
        out += identity
        return F.relu(out, inplace=True)


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CooTensor], ids=lambda c: c.__name__)
@pytest.mark.parametrize("mode", ["train", "no_grad", "inference_mode"])
def test_a_residual_added_in_place_to_a_sparse_intermediate(layout, mode):
    """``set_interm`` makes ``fc2``'s output sparse; ``out += identity`` then adds the residual
    at every position, as the dense block does (it was added at the stored positions only, so
    the block dropped its input wherever the intermediate was zero: silently)."""
    torch.manual_seed(0)
    dense = Block()
    sb = sten.SparsityBuilder(dense)
    sb.set_interm("fc2.linear", inline_sparsifier=sten.KeepAll(), tmp_format=torch.Tensor,
                  external_sparsifier=sten.ScalarFractionSparsifier(0.5), out_format=layout)
    sparse = sb.get_sparse_model()
    x = torch.randn(8, 16)

    def reference(inp):
        h = dense.fc2(F.relu(dense.fc1(inp)))
        keep = torch.zeros_like(h).view(-1)
        keep[h.detach().abs().view(-1).argsort(descending=True)[: h.numel() // 2]] = 1
        return F.relu(h.detach() * keep.view_as(h) + (h - h.detach()) + inp)   # (straight-through)

    context = {"train": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    with context(), warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        warnings.filterwarnings("error", ".*positions it does not store", sten.DispatchWarning)
        out = sparse(x.clone())
        want = reference(x.clone())
        if mode == "train":
            out.sum().backward()
            want.sum().backward()
    torch.testing.assert_close(densify(out).detach(), want.detach())
    if mode == "train":
        for name, p in sparse.named_parameters():
            torch.testing.assert_close(densify(p.grad), dict(dense.named_parameters())[name].grad)


def test_optimizer_state_keeps_the_weights_pattern_with_the_dense_gradient():
    """The default ``grad_fmt`` gives a dense gradient; Adam's and SGD's state keep the weight's
    pattern (their update inside the step reads them there only): O(nnz) memory, and the weight
    dense torch's masked update."""
    base = masked((8, 16), 1)
    for make in (lambda ps: torch.optim.Adam(ps, lr=0.01), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                 lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=True)):
        w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(base))
        ref = torch.nn.Parameter(base.clone())
        opt, ref_opt = make([w]), make([ref])
        for step in range(3):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
            for p, o in ((w, opt), (ref, ref_opt)):
                o.zero_grad()
                F.linear(x, p).pow(2).sum().backward()
            ref.grad.mul_(base != 0)
            opt.step()
            ref_opt.step()
        torch.testing.assert_close(w.to_dense(), ref.detach())
        for value in opt.state[w].values():
            if isinstance(value, sten.SparseTensorWrapper):
                assert value.wrapped_tensor.nnz == int((base != 0).sum())


def test_state_updated_by_hand_outside_a_step_is_a_temporary():
    """A momentum buffer updated in a training loop, not in an optimizer's step, takes the dense
    gradient everywhere (what the same loop on dense tensors holds)."""
    base = masked((4, 6), 2)
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(base))
    grad = torch.randn(4, 6)
    with torch.no_grad():
        buf = torch.zeros_like(w)
        buf.mul_(0.9).add_(grad)
    torch.testing.assert_close(buf.to_dense(), grad)


def test_a_step_that_raised_leaves_no_step_behind():
    """The post-hook does not run when a step raises: the next question finds that step gone."""
    w = torch.nn.Parameter(torch.ones(2))

    class Failing(torch.optim.SGD):
        @torch.no_grad()
        def step(self, closure=None):
            assert in_optimizer_step()
            raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        Failing([w], lr=0.1).step()
    with torch.no_grad():
        assert not in_optimizer_step()


@pytest.mark.parametrize("write", ["h = w * 1; h.add_(1)", "h = s * 1; h.add_(x), x requires grad"])
def test_writes_in_an_lbfgs_closure_are_exact(write):
    """LBFGS calls its closure (forward and backward, autograd on) inside its step: writes into
    temporaries there are exact. ``h.add_(x)`` with ``x`` requiring grad is recorded by autograd,
    whose in-place node runs with grad mode off: still no state update."""
    base = masked((4, 6), 3)
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(base))
    s = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(base))
    seen = []

    def closure():
        opt.zero_grad()
        if write.startswith("h = w"):
            h = w * 1.0
            h.add_(1.0)
        else:
            h = s * 1.0
            h.add_(torch.ones(4, 6, requires_grad=True))
        seen.append(densify(h).detach().clone())
        loss = F.linear(torch.ones(2, 6), w).sum() + (h * 1.0).pow(2).sum()
        loss.backward()
        return loss

    opt = torch.optim.LBFGS([w], max_iter=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        opt.step(closure)
    torch.testing.assert_close(seen[0], base + 1.0)


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CscTensor, sten.CooTensor, sten.DenseTensor],
                         ids=lambda c: c.__name__)
def test_a_wrapper_made_under_inference_mode_is_read_outside_it(layout):
    """A model's output computed under ``torch.inference_mode()`` is read after it: torch's CSR /
    CSC ``to_dense`` raised there (it writes its result in place, which an inference tensor
    refuses outside the mode)."""
    with torch.inference_mode():
        w = sten.SparseTensorWrapper(layout.from_dense(torch.eye(3)))
        doubled = w * 2
    torch.testing.assert_close(w.to_dense(), torch.eye(3))
    torch.testing.assert_close(densify(doubled), 2 * torch.eye(3))


def test_a_manual_step_through_an_alias_of_the_weight_keeps_its_pattern():
    """``p.data.sub_(lr * p.grad)`` and ``p.detach().add_(c)`` write the weight (an alias of its
    layout): its pattern is kept, as an optimizer's step keeps it."""
    base = masked((4, 6), 4)
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(base))
    F.linear(torch.randn(3, 6), w).pow(2).sum().backward()
    grad = w.grad.clone()
    with torch.no_grad():
        w.data.sub_(0.1 * grad)
        w.detach().add_(1.0)
    assert type(w.wrapped_tensor) is sten.CsrTensor and w.wrapped_tensor.nnz == int((base != 0).sum())
    torch.testing.assert_close(w.to_dense(), (base - 0.1 * grad + 1.0) * (base != 0))


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CooTensor, ScipyCsrTensor], ids=lambda c: c.__name__)
@pytest.mark.parametrize("view", ["h.t()", "h[1:3]", "h.view(-1)", "h[0]"])
def test_a_view_taken_before_an_in_place_write_under_autograd_raises(layout, view):
    """``v = h.t(); h.add_(d); v.sum().backward()``: the view (of a dense copy of ``h``) read the
    written values, but its gradients went to ``h`` as it was, so ``d`` got none, silently."""
    base = masked((4, 8), 5)
    x = torch.full((4, 8), 2.0, requires_grad=True)
    d = torch.ones(4, 8, requires_grad=True)
    h = sten.SparseTensorWrapper(layout.from_dense(base)) * x
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        v = {"h.t()": lambda: h.t(), "h[1:3]": lambda: h[1:3], "h.view(-1)": lambda: h.view(-1),
             "h[0]": lambda: h[0]}[view]()
        h.add_(d)
        with pytest.raises(RuntimeError, match="in-place|inplace"):
            v.sum().backward()


@pytest.mark.parametrize("layout", [ScipyCsrTensor, ScipyCscTensor], ids=lambda c: c.__name__)
def test_writes_through_a_scipy_transpose_reach_its_wrapper(layout):
    """scipy's ``w.t()`` is a wrapper over the same arrays: a write through it kept its pattern in
    a weight (and reaches the weight), warns what it drops in a temporary, and raises under
    autograd. Growing it wrote a new layout that the wrapper never saw (``W.t().add_(x)`` left
    ``W`` unchanged)."""
    base = masked((4, 8), 6)
    mask = base != 0
    w = sten.SparseParameterWrapper(layout.from_dense(base))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", ".*positions it does not store", sten.DispatchWarning)
        w.t().add_(torch.ones(8, 4))
    torch.testing.assert_close(w.to_dense(), (base + 1) * mask)
    h = sten.SparseTensorWrapper(layout.from_dense(base)) * 2
    with pytest.warns(sten.DispatchWarning, match="positions it does not store"):
        h.t().add_(torch.ones(8, 4))
    torch.testing.assert_close(h.to_dense(), (2 * base + 1) * mask)
    x = torch.ones(4, 8, requires_grad=True)
    g = sten.SparseTensorWrapper(layout.from_dense(base)) * x
    with pytest.raises(RuntimeError, match="view of a .* that requires grad"):
        g.t().add_(torch.ones(8, 4))


def test_an_alias_of_the_weight_never_grows_it():
    """``p.data.add_(g)`` with a sparse ``g`` of another pattern (a hand-written optimizer, an
    optimizer step without ``no_grad``) writes the weight: its pattern is kept (it grew, and the
    weight turned dense once its hand-kept state had grown)."""
    base = masked((8, 16), 7)
    other = masked((8, 16), 8)
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(base))
    g = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(other))
    with torch.no_grad():
        w.data.add_(g)
        w.detach().add_(torch.ones(8, 16))
    assert w.wrapped_tensor.nnz == int((base != 0).sum())
    torch.testing.assert_close(w.to_dense(), (base + other + 1) * (base != 0))


class HandWrittenAdam:
    """An optimizer that is no ``torch.optim.Optimizer``: its state is a temporary."""

    def __init__(self, params, lr=0.01):
        self.params, self.lr, self.state = list(params), lr, {}

    def step(self):
        for p in self.params:
            m = self.state.setdefault(p, torch.zeros_like(p))
            m.mul_(0.9).add_(p.grad, alpha=0.1)
            p.data.sub_(self.lr * m)


def test_a_hand_written_optimizer_keeps_the_weights_pattern():
    base = masked((8, 16), 9)
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(base))
    ref = torch.nn.Parameter(base.clone())
    opt, ref_opt = HandWrittenAdam([w]), HandWrittenAdam([ref])
    for step in range(3):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        for p in (w, ref):
            p.grad = None
            F.linear(x, p).pow(2).sum().backward()
        opt.step()
        ref_opt.step()
        with torch.no_grad():
            ref.mul_(base != 0)
    assert w.wrapped_tensor.nnz == int((base != 0).sum())
    torch.testing.assert_close(w.to_dense(), ref.detach())


def test_a_view_taken_before_a_write_under_no_grad_reads_it():
    """A write under ``no_grad`` is no part of the graph (dense torch's either): a view taken
    before it reads the written values, with the graph it had."""
    base = masked((4, 8), 11)
    results = []
    for sparse in (True, False):
        x = torch.full((4, 8), 2.0, requires_grad=True)
        h = (sten.SparseTensorWrapper(sten.CsrTensor.from_dense(base)) if sparse else base.clone()) * x
        v = h[1:3]
        with torch.no_grad():
            h.mul_(3)
        out = (v * torch.arange(16.0).view(2, 8)).sum()
        out.backward()
        results.append((out.detach(), x.grad))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])


@pytest.mark.parametrize("layout", [ScipyCsrTensor, ScipyCscTensor], ids=lambda c: c.__name__)
def test_copy_of_another_pattern_through_a_scipy_transpose_reaches_the_weight(layout):
    """``W.t().copy_(src)`` with a sparse ``src`` of another pattern: the view cannot take
    ``src``'s pattern (its arrays are ``W``'s), so ``W`` gets ``src``'s values at its stored
    positions, with a warning (the copy replaced the view's layout, and ``W`` never saw it)."""
    base, other = masked((4, 8), 12), masked((4, 8), 13)
    w = sten.SparseParameterWrapper(layout.from_dense(base))
    src = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(other.t().contiguous()))
    with torch.no_grad(), pytest.warns(sten.DispatchWarning, match="positions it does not store"):
        w.t().copy_(src)
    torch.testing.assert_close(w.to_dense(), other * (base != 0))


def test_a_sparse_buffer_loaded_from_a_dense_checkpoint_takes_its_values():
    """A buffer is no weight: ``load_state_dict`` (its ``copy_``) gives it the checkpoint's values
    exactly, its pattern grown (a frozen ``SparseParameterWrapper`` keeps its pattern instead)."""
    base, dense = masked((4, 6), 14), torch.randn(4, 6)
    module = torch.nn.Module()
    module.register_buffer("table", sten.SparseTensorWrapper(sten.CsrTensor.from_dense(base)))
    module.frozen = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(base), requires_grad=False)
    module.load_state_dict({"table": dense, "frozen": dense})
    torch.testing.assert_close(module.table.to_dense(), dense)
    torch.testing.assert_close(module.frozen.to_dense(), dense * (base != 0))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_type_as_keeps_the_device(device):
    w = sten.SparseParameterWrapper(sten.DenseTensor.from_dense(torch.ones(2, 3, device=device)))
    out = w.type_as(torch.zeros(5, dtype=torch.float16, device=device))
    assert out.dtype == torch.float16 and out.device.type == device
