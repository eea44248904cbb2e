"""Compiled training of sparse weights whose gradient is re-sparsified (a new pattern per
step, ``sten_core.dispatch.compiled_regrad``): no graph breaks, eager's gradients (layout,
pattern, values), eager's accumulation and optimizer steps."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_core.dispatch.compiled_regrad import CompiledDenseGrad
from sten_core.dispatch.sparsifier_dispatch import apply_grad_spec
from sten_core.dispatch.traceable import traceable, trains_compiled
from sten_core.testing import compiled_training_grads, sgd_steps_eager_and_compiled

KEEP, SF = sten.KeepAll(), sten.ScalarFractionSparsifier(0.5)
FORMATS = {
    "dense-to-csr": (KEEP, torch.Tensor, KEEP, sten.CsrTensor),
    "external-fraction-csr": (KEEP, torch.Tensor, SF, sten.CsrTensor),
    "inline-fraction-csr": (SF, sten.CsrTensor, KEEP, sten.CsrTensor),
    "fraction-to-coo": (KEEP, torch.Tensor, SF, sten.CooTensor),
}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)  # eager's dense fallbacks for some formats
        yield
    torch._dynamo.reset()


def mlp(grad_fmt, layout=sten.CsrTensor, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 8))
    sb = sten.SparsityBuilder(model)
    for name in ("0.weight", "2.weight"):
        sb.set_weight(name, sten.ScalarFractionSparsifier(0.5), out_format=layout)
        sb.set_weight_grad(name, *grad_fmt)
    return sb.get_sparse_model()


def dense(value):
    return value.to_dense() if isinstance(value, sten.SparseTensorWrapper) else value


def assert_same_sparse_grad(got, want):
    """Same wrapper layout, same pattern (stored positions), values equal."""
    assert isinstance(got, sten.SparseTensorWrapper) and isinstance(want, sten.SparseTensorWrapper)
    assert type(got.wrapped_tensor) is type(want.wrapped_tensor)
    assert torch.equal(dense(got) != 0, dense(want) != 0)
    torch.testing.assert_close(dense(got), dense(want))


@pytest.mark.parametrize("fmt", list(FORMATS), ids=list(FORMATS))
@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CscTensor])
def test_resparsified_gradients_compile_whole_with_eager_gradients(layout, fmt):
    grad_fmt = FORMATS[fmt]
    model = mlp(grad_fmt, layout)
    assert all(traceable(model[i].weight) and trains_compiled(model[i].weight) for i in (0, 2))
    x = torch.randn(2, 3, 24, requires_grad=True)
    run = compiled_training_grads(model, x)
    assert run["graph_breaks"] == 0, run["reasons"]
    want, got = run["eager"], run["compiled"]
    for i in (0, 2):
        assert_same_sparse_grad(got[i], want[i])
        assert type(got[i].wrapped_tensor) is grad_fmt[3]
    for g, w in zip(got, want):
        torch.testing.assert_close(dense(g), dense(w))
    torch.testing.assert_close(run["compiled_out"], run["eager_out"])
    # the dense model's gradients through the format are eager's (and so compiled's): a format
    # naming a layout without sparsifying ("dense-to-csr") holds them at the stored positions
    w0, w2 = (model[i].weight.to_dense().detach().requires_grad_(True) for i in (0, 2))
    rx = x.detach().clone().requires_grad_(True)
    F.linear(torch.relu(F.linear(rx, w0, model[0].bias.detach())), w2, model[2].bias.detach()).square().sum().backward()
    for i, ref in ((0, w0.grad), (2, w2.grad)):
        spec = sten.OutputSpec.coerce(grad_fmt)
        torch.testing.assert_close(dense(got[i]), dense(apply_grad_spec(ref, spec, model[i].weight)))
    torch.testing.assert_close(got[-1], rx.grad)


def test_the_compiled_gradient_is_converted_before_accumulation():
    """Three backward calls without zeroing: eager accumulates each re-sparsified gradient into
    the first one's wrapper (its pattern); compiled does exactly the same."""
    grads = []
    for compile_it in (False, True):
        torch._dynamo.reset()
        model = mlp(FORMATS["external-fraction-csr"])
        step = torch.compile(model, fullgraph=True) if compile_it else model
        torch.manual_seed(5)
        for _ in range(3):
            step(torch.randn(4, 24)).square().sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for want, got in zip(*grads):
        if isinstance(want, sten.SparseTensorWrapper):
            assert_same_sparse_grad(got, want)
            assert not isinstance(got.wrapped_tensor, CompiledDenseGrad)
        torch.testing.assert_close(dense(got), dense(want))


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_steps_with_resparsified_gradients_follow_eager(momentum):
    fmt = FORMATS["external-fraction-csr"]

    def run(compile_it):
        torch._dynamo.reset()
        model = mlp(fmt, seed=3)
        step = torch.compile(model, fullgraph=True) if compile_it else model
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
        torch.manual_seed(1)
        for _ in range(3):
            opt.zero_grad()
            step(torch.randn(6, 24)).square().sum().backward()
            opt.step()
        return model

    eager, compiled = run(False), run(True)
    for e, c in zip(eager.parameters(), compiled.parameters()):
        assert type(c) is type(e)
        if isinstance(e, sten.SparseTensorWrapper):
            assert type(c.wrapped_tensor) is type(e.wrapped_tensor) is sten.CsrTensor
        torch.testing.assert_close(dense(c).detach(), dense(e).detach())
    assert not torch.equal(dense(eager[0].weight).detach(), dense(mlp(fmt, seed=3)[0].weight).detach())
    if momentum == 0.0:  # the kit's helper (zero_grad, loss, SGD) gives the same
        kit = sgd_steps_eager_and_compiled(lambda: mlp(fmt, seed=3), lambda: torch.randn(6, 24))
        for e, c in zip(*(m.parameters() for m in kit)):
            torch.testing.assert_close(dense(c).detach(), dense(e).detach())


def test_a_random_sparsifier_draws_as_eager_for_one_weight():
    """RandomFractionSparsifier draws from torch's generator in the backward, eagerly and
    (in the weight's hook) compiled, at the same point: one such weight gets eager's pattern.
    (With several, the order in which autograd accumulates the compiled gradients may differ
    from eager's backward order, so their draws are swapped: docs/compile.md.)"""
    fmt = (KEEP, torch.Tensor, sten.RandomFractionSparsifier(0.5), sten.CsrTensor)
    grads = []
    for compile_it in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        lin = torch.nn.Linear(24, 8)
        lin.weight = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(lin.weight.detach()), grad_fmt=fmt)
        step = torch.compile(lin, fullgraph=True) if compile_it else lin
        torch.manual_seed(5)
        for _ in range(2):
            step(torch.randn(4, 24)).square().sum().backward()
        grads.append(lin.weight.grad)
    assert_same_sparse_grad(grads[1], grads[0])


def test_eager_gradients_of_a_weight_used_twice_are_unchanged():
    """The hook converts only a compiled step's gradient: eagerly, a weight used twice in one step
    still gets the sum of its two re-sparsified gradients (a plain tensor when their patterns differ)."""
    fmt = FORMATS["external-fraction-csr"]
    spec = sten.OutputSpec.coerce(fmt)
    torch.manual_seed(0)
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.randn(6, 6)), grad_fmt=fmt)
    assert traceable(w)
    x = torch.randn(3, 6)
    F.linear(F.linear(x, w).relu(), w).square().sum().backward()
    d = w.to_dense().detach().requires_grad_(True)
    h = F.linear(x, d).relu()
    ga = torch.autograd.grad(F.linear(h.detach(), d).square().sum(), d)[0]
    hd = h.detach().requires_grad_(True)
    gh = torch.autograd.grad(F.linear(hd, d.detach()).square().sum(), hd)[0]
    gb = torch.autograd.grad(h, d, gh)[0]
    torch.testing.assert_close(dense(w.grad), dense(sten.dispatch.apply_spec(ga, spec)) + dense(sten.dispatch.apply_spec(gb, spec)))


def test_a_weight_used_twice_in_a_compiled_step_is_refused_not_silently_summed():
    """Compiled, the two uses' gradients are summed inside the graph before the hook sees them,
    so the step cannot give eager's sum of two re-sparsified gradients: it must fail loudly
    (it once returned the dense, not re-sparsified, gradient). Eager is unaffected."""
    fmt = FORMATS["external-fraction-csr"]
    torch.manual_seed(0)
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.randn(6, 6)), grad_fmt=fmt)
    x = torch.randn(3, 6)
    step = torch.compile(lambda w, x: F.linear(F.linear(x, w).relu(), w).square().sum())
    with pytest.raises(Exception, match="used more than once in one compiled step"):
        step(w, x).backward()
    assert w.grad is None


def test_other_products_of_a_resparsified_weight_say_why_they_cannot_train_compiled():
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.randn(6, 6)), grad_fmt=FORMATS["dense-to-csr"])
    with pytest.raises(Exception, match="whose grad_fmt re-sparsifies its gradient: only F.linear"):
        torch.compile(lambda w, x: (x @ w.t()).sum())(w, torch.randn(3, 6))


def test_a_masked_dense_gradient_format_keeps_the_eager_class():
    """A format that sparsifies but ends dense gives a plain tensor eagerly, which a hook cannot tell
    from a compiled step's: the weight stays the eager class (a graph break per call)."""
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.randn(6, 6)),
                                    grad_fmt=(SF, torch.Tensor, KEEP, torch.Tensor))
    assert not traceable(w)


def test_only_resparsified_trainable_wrappers_get_the_hook():
    """The hook is an eager cost (one Python call per backward): only weights whose format
    re-sparsifies carry it, and then once, whatever else changes."""
    layout = sten.CsrTensor.from_dense(torch.randn(6, 6))
    keep = sten.SparseParameterWrapper(layout, grad_fmt=(KEEP, sten.CsrTensor, KEEP, sten.CsrTensor))
    default = sten.SparseParameterWrapper(layout)
    frozen = sten.SparseParameterWrapper(layout, requires_grad=False, grad_fmt=FORMATS["dense-to-csr"])
    assert not any(w._backward_hooks for w in (keep, default, frozen))
    w = sten.SparseParameterWrapper(layout, grad_fmt=FORMATS["dense-to-csr"])
    assert len(w._backward_hooks) == 1
    w.grad_fmt = FORMATS["external-fraction-csr"]
    w.requires_grad_(False)
    w.requires_grad_(True)
    assert len(w._backward_hooks) == 1 and traceable(w)
    keep.grad_fmt = FORMATS["external-fraction-csr"]  # set afterwards: the hook comes with it
    assert len(keep._backward_hooks) == 1


@pytest.mark.parametrize("what", ["step", "forward and backward"])
def test_a_compiled_training_step_with_aot_autograd_matches_eager(what):
    """``torch.compile(step, backend="aot_eager")`` of forward, backward (and the optimizer's step):
    the backward calls the weight's gradient hook, which Dynamo compiled as a frame of its own
    and failed on (``'dict' object has no attribute 'node'``)."""
    results = []
    for compiled in (False, True):
        model = mlp(FORMATS["inline-fraction-csr"])
        opt = torch.optim.SGD(model.parameters(), lr=0.05)

        def forward_backward(x):
            loss = model(x).square().sum()
            loss.backward()
            return loss

        def step(x):
            opt.zero_grad()
            loss = forward_backward(x)
            opt.step()
            return loss

        run = step if what == "step" else forward_backward
        if compiled:
            run = torch.compile(run, backend="aot_eager")
        torch.manual_seed(1)
        for _ in range(3):
            x = torch.randn(5, 24)
            if what == "step":
                run(x)
            else:
                opt.zero_grad()
                run(x)
                opt.step()
        results.append(model)
    for (name, got), want in zip(results[1].named_parameters(), results[0].parameters()):
        torch.testing.assert_close(dense(got), dense(want), msg=name)
    assert_same_sparse_grad(results[1][0].weight.grad, results[0][0].weight.grad)


def test_a_resparsified_weight_takes_a_parametrization():
    """``register_parametrization`` swaps a traceable wrapper with ``torch.utils.swap_tensors``,
    which refuses a tensor with weak references: the gradient hook held one
    (``Cannot swap t1 because it has weakref associated with it``)."""
    model = mlp(FORMATS["inline-fraction-csr"])
    want = dense(model[0].weight).detach() * 2

    class Double(torch.nn.Module):
        def forward(self, w):
            return w * 2

    torch.nn.utils.parametrize.register_parametrization(model[0], "weight", Double())
    torch.testing.assert_close(dense(model[0].weight).detach(), want)
    model(torch.randn(3, 24)).square().sum().backward()
    assert model[0].parametrizations.weight.original.grad is not None
