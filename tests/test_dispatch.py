"""Dispatch: exact → hook → conversion → fallback, warnings, errors, cache,
pattern forms, backward specs. Each test registers a fake layout of its own
and removes every registration afterwards."""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch

import sten_core as sten
from fake_layouts import DenseCopyLayout
from sten_core import dispatch

T = torch.Tensor
OWNER = "test-dispatch"
DENSE_SPEC = (sten.KeepAll(), T, sten.KeepAll(), T)


class FakeLayout(DenseCopyLayout):
    """A layout that stores a dense copy (enough to see what ran)."""


class OtherFake(FakeLayout):
    """A second layout, convertible to ``FakeLayout`` losslessly."""


class ThirdFake(FakeLayout):
    """Converts to ``FakeLayout`` only through ``OtherFake``."""


@pytest.fixture
def events():
    """Registrations tagged with OWNER, an observer, clean global state after."""
    sten.plugins.ensure_loaded()
    dispatch.reset_warnings()
    seen: list[dict] = []

    def on_op(event: dict) -> None:  # operator calls only (not sparsifiers, conversions)
        if event["kind"] == "op":
            seen.append(event)

    dispatch.add_observer(on_op)
    try:
        with sten.registry.owner(OWNER):
            yield seen
    finally:
        dispatch.remove_observer(on_op)
        sten.registry.remove_owner(OWNER)
        sten.plugins.unregister_plugin("test-dispatch-hook")
        sten.set_dispatch_failure("warn")
        dispatch.reset_warnings()


def add(*args, **kwargs):
    """``torch.add`` with its output spec stated (dense, keep all)."""
    return sten.sparsified_op(torch.add, out_fmt=DENSE_SPEC)(*args, **kwargs)


def wrap(layout: type, x: torch.Tensor, **kw) -> sten.SparseTensorWrapper:
    return sten.SparseTensorWrapper(layout.from_dense(x), **kw)


def plans(seen: list[dict], direction: str = "fwd") -> list[str]:
    return [e["plan"] for e in seen if e["key"].direction == direction]


def dispatch_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, sten.DispatchWarning)]


def xy():
    torch.manual_seed(0)
    return torch.randn(4, 5), torch.randn(4, 5)


def register_add(layouts=(FakeLayout, FakeLayout), calls=None, tag="impl"):
    @sten.register_fwd_op_impl(operator=torch.add, inp=layouts, out=[(sten.KeepAll, T)])
    def add_impl(ctx, inputs, output_sparsifiers):
        if calls is not None:
            calls.append((tag, [type(getattr(i, "wrapped_tensor", i)) for i in inputs[:2]]))
        a, b = (i.to_dense() if isinstance(i, sten.SparseTensorWrapper) else i for i in inputs[:2])
        alpha = inputs[2] if len(inputs) > 2 and inputs[2] is not None else 1
        return torch.add(a, b, alpha=alpha)

    return add_impl


def hook_plugin(calls: list, layouts=(FakeLayout, FakeLayout)) -> types.ModuleType:
    module = types.ModuleType("test_dispatch_hook")

    @sten.hookimpl
    def sten_resolve_op(key):
        if key.direction == "fwd" and key.op is torch.add and key.inp == layouts:
            def generic(ctx, inputs, output_sparsifiers):
                calls.append(("hook", None))
                return torch.add(inputs[0].to_dense(), inputs[1].to_dense())

            return generic
        return None

    module.sten_resolve_op = sten_resolve_op
    return module


# -- resolution order -----------------------------------------------------------------

def test_exact_implementation_runs(events):
    calls = []
    register_add(calls=calls)
    a, b = xy()
    with warnings.catch_warnings():
        warnings.simplefilter("error", sten.DispatchWarning)
        out = add(wrap(FakeLayout, a), wrap(FakeLayout, b))
    assert type(out) is torch.Tensor and torch.equal(out, a + b)
    assert calls == [("impl", [FakeLayout, FakeLayout])]
    assert plans(events) == ["impl"]
    assert events[0]["key"].inp == (FakeLayout, FakeLayout) and events[0]["seconds"] >= 0


def test_hook_runs_when_no_exact_implementation(events):
    calls = []
    assert sten.plugins.register_plugin(hook_plugin(calls), name="test-dispatch-hook")
    a, b = xy()
    out = add(wrap(FakeLayout, a), wrap(FakeLayout, b))
    assert torch.equal(out, a + b)
    assert calls == [("hook", None)] and plans(events) == ["generic"]


def test_exact_beats_hook(events):
    calls = []
    sten.plugins.register_plugin(hook_plugin(calls), name="test-dispatch-hook")
    register_add(calls=calls)
    a, b = xy()
    add(wrap(FakeLayout, a), wrap(FakeLayout, b))
    assert [c[0] for c in calls] == ["impl"] and plans(events) == ["impl"]


def test_conversion_runs_when_no_implementation_or_hook(events):
    calls = []
    register_add(calls=calls)
    sten.registry.register_conversion(OtherFake, FakeLayout, lambda x: FakeLayout(x.data))
    a, b = xy()
    with warnings.catch_warnings():
        warnings.simplefilter("error", sten.DispatchWarning)
        out = add(wrap(OtherFake, a), wrap(FakeLayout, b))
    assert torch.equal(out, a + b)
    assert calls == [("impl", [FakeLayout, FakeLayout])], "the inputs were converted first"
    assert plans(events) == ["convert"]


def test_conversion_path_of_several_steps(events):
    calls = []
    register_add(calls=calls)
    sten.registry.register_conversion(ThirdFake, OtherFake, lambda x: OtherFake(x.data))
    sten.registry.register_conversion(OtherFake, FakeLayout, lambda x: FakeLayout(x.data))
    a, b = xy()
    out = add(wrap(ThirdFake, a), wrap(ThirdFake, b))
    assert torch.equal(out, a + b) and calls == [("impl", [FakeLayout, FakeLayout])]
    assert plans(events) == ["convert"]


def test_hook_beats_conversion(events):
    calls = []
    register_add(calls=calls)
    sten.registry.register_conversion(OtherFake, FakeLayout, lambda x: FakeLayout(x.data))
    sten.plugins.register_plugin(hook_plugin(calls, (OtherFake, OtherFake)), name="test-dispatch-hook")
    a, b = xy()
    add(wrap(OtherFake, a), wrap(OtherFake, b))
    assert [c[0] for c in calls] == ["hook"] and plans(events) == ["generic"]


def test_fallback_warns_once_per_key(events):
    a, b = xy()
    sub = sten.sparsified_op(torch.sub, out_fmt=DENSE_SPEC)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out1 = add(wrap(FakeLayout, a), wrap(FakeLayout, b))
        out2 = add(wrap(FakeLayout, b), wrap(FakeLayout, a))
        out3 = sub(wrap(FakeLayout, a), wrap(FakeLayout, b))
    assert torch.equal(out1, a + b) and torch.equal(out2, a + b) and torch.equal(out3, a - b)
    text = dispatch_warnings(record)
    assert len(text) == 2, text  # add once, sub once
    assert "torch.add" in text[0] and "FakeLayout" in text[0]
    assert "@sten.register_fwd_op_impl(operator=torch.add, inp=(FakeLayout, FakeLayout)" in text[0]
    assert "torch.sub" in text[1]
    assert plans(events) == ["fallback"] * 3


def test_fallback_sparsifies_outputs(events):
    a, b = xy()
    add = sten.sparsified_op(torch.add, out_fmt=(sten.KeepAll(), T, sten.ScalarFractionSparsifier(0.5), sten.CsrTensor))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        out = add(wrap(FakeLayout, a), wrap(FakeLayout, b))
    assert type(out.wrapped_tensor) is sten.CsrTensor
    ref = (a + b) * sten.ScalarFractionSparsifier(0.5).mask(a + b)
    assert torch.equal(out.to_dense(), ref)


def test_raise_mode_names_op_layouts_and_decorator(events):
    sten.set_dispatch_failure("raise")
    a, b = xy()
    with pytest.raises(sten.DispatchError) as info:
        add(wrap(FakeLayout, a), b)
    text = str(info.value)
    assert "torch.add" in text and "FakeLayout" in text
    assert "@sten.register_fwd_op_impl(operator=torch.add, inp=(FakeLayout, torch.Tensor), out=[(KeepAll, torch.Tensor)])" in text
    sten.set_dispatch_failure("warn")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert torch.equal(add(wrap(FakeLayout, a), b), a + b)
    assert len(dispatch_warnings(record)) == 1


def test_sparsifier_fallback_raises_with_decorator_text(events):
    class MySparsifier:
        pass

    sten.set_dispatch_failure("raise")
    with pytest.raises(sten.DispatchError, match="register_sparsifier_implementation") as info:
        sten.sparsify(MySparsifier(), torch.ones(2, 2), FakeLayout)
    assert "MySparsifier" in str(info.value) and "FakeLayout" in str(info.value)


def test_set_dispatch_failure_rejects_unknown_mode():
    with pytest.raises(ValueError, match="mode"):
        sten.set_dispatch_failure("ignore")


# -- cache ------------------------------------------------------------------------------

def test_second_call_hits_the_cache(events, monkeypatch):
    register_add()
    resolved = []
    original = dispatch.plan.resolve

    def counting(key):
        resolved.append(key)
        return original(key)

    monkeypatch.setattr(dispatch.plan, "resolve", counting)
    a, b = xy()
    wa, wb = wrap(FakeLayout, a), wrap(FakeLayout, b)
    add(wa, wb)
    key = events[-1]["key"]
    assert dispatch.plan_of(key) is not None and dispatch.plan_of(key).kind == "impl"
    n = len(resolved)
    add(wa, wb)
    add(wb, wa)
    assert len(resolved) == n, "repeated calls resolve nothing"
    sten.registry.register_conversion(ThirdFake, FakeLayout, lambda x: FakeLayout(x.data))
    assert dispatch.plan_of(key) is None, "a registration clears the cache"


def test_plain_call_uses_registered_dense_output_implementation(events):
    """A call without an output spec: a registered (KeepAll, Tensor) implementation
    comes before the generic (hook) ones."""
    calls = []
    register_add(calls=calls)
    a, b = xy()
    assert torch.equal(torch.add(wrap(FakeLayout, a), wrap(FakeLayout, b)), a + b)
    assert calls == [("impl", [FakeLayout, FakeLayout])] and plans(events) == ["impl"]
    for layout in (sten.DenseTensor, sten.CsrTensor):  # also before the built-in stored-values path
        register_add((layout, layout), calls, tag=layout.__name__)
        torch.add(wrap(layout, a), wrap(layout, b))
        assert calls[-1][0] == layout.__name__


def test_plain_call_fallback_warns(events):
    a, b = xy()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        torch.add(wrap(FakeLayout, a), wrap(FakeLayout, b))
    assert len(dispatch_warnings(record)) == 1
    warning = next(w for w in record if issubclass(w.category, sten.DispatchWarning))
    assert (warning.filename, warning.lineno) == (__file__, line), "the warning points at the user's call"


def test_fallback_warning_points_at_the_module_forward(events):
    a, b = xy()

    class Adds(torch.nn.Module):
        def forward(self, x, y):
            self.line = sys._getframe().f_lineno + 1
            return torch.add(x, y)

    model = Adds()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model(wrap(FakeLayout, a), wrap(FakeLayout, b))
    warning = next(w for w in record if issubclass(w.category, sten.DispatchWarning))
    assert (warning.filename, warning.lineno) == (__file__, model.line)


# -- pattern forms -----------------------------------------------------------------------

@pytest.mark.parametrize("layout", [T, FakeLayout])
def test_both_pattern_forms_match_add(events, layout):
    got = {}
    for form in ((layout, layout, None, None), (layout, layout)):
        @sten.register_fwd_op_impl(operator=torch.add, inp=form, out=tuple([(sten.KeepAll, T)]))
        def impl(ctx, inputs, output_sparsifiers, form=form):
            got[len(form)] = list(inputs)
            a, b = (sten.model.tensor.densify(i) for i in inputs[:2])
            return torch.add(a, b)

        a, b = xy()
        wa = a if layout is T else wrap(layout, a)
        wb = b if layout is T else wrap(layout, b)
        add = sten.sparsified_op(torch.add, out_fmt=DENSE_SPEC)
        out = add(wa, wb)
        assert torch.equal(out, a + b)
        sten.registry.remove_owner(OWNER)
    four, two = got[4], got[2]
    assert len(four) == 4 and four[2:] == [1, None]
    assert torch.equal(sten.model.tensor.densify(four[0]), a) and torch.equal(sten.model.tensor.densify(four[1]), b)
    assert len(two) == 2


def test_four_form_receives_keyword_arguments_in_signature_order(events):
    got = []

    @sten.register_fwd_op_impl(operator=torch.add, inp=(FakeLayout, FakeLayout, None, None), out=[(sten.KeepAll, T)])
    def impl(ctx, inputs, output_sparsifiers):
        got.append(inputs)
        input, other, alpha, out = inputs
        return torch.add(input.to_dense(), other.to_dense(), alpha=alpha)

    a, b = xy()
    res = add(wrap(FakeLayout, a), other=wrap(FakeLayout, b), alpha=3)
    assert torch.allclose(res, a + 3 * b)
    assert got[0][2:] == [3, None]


# -- all-dense calls -------------------------------------------------------------------

def test_all_dense_keep_all_runs_the_original_op(events):
    a, b = xy()
    add = sten.sparsified_op(torch.add, out_fmt=DENSE_SPEC)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = add(a, b, alpha=2)
    assert type(out) is torch.Tensor and torch.equal(out, torch.add(a, b, alpha=2))
    assert plans(events) == ["native"]


def test_all_dense_keep_all_backward_has_no_warning(events):
    a, b = (t.requires_grad_() for t in xy())
    add = sten.sparsified_op(torch.mul, out_fmt=DENSE_SPEC, grad_out_fmt=DENSE_SPEC)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sten.DispatchWarning)
        add(a, b).sum().backward()
    assert torch.equal(a.grad, b.detach()) and torch.equal(b.grad, a.detach())


# -- backward ----------------------------------------------------------------------------

def test_backward_with_grad_out_fmt_and_parameter_grad_fmt(events):
    torch.manual_seed(0)
    a_dense, b = torch.randn(4, 6), torch.randn(6, 3, requires_grad=True)
    grad_fmt = (sten.KeepAll(), T, sten.ScalarFractionSparsifier(0.5), sten.CooTensor)
    a = wrap(FakeLayout, a_dense, requires_grad=True, grad_fmt=grad_fmt)
    threshold = sten.ScalarThresholdSparsifier(0.5)
    mm = sten.sparsified_op(torch.mm, out_fmt=DENSE_SPEC, grad_out_fmt=((sten.KeepAll(), T, threshold, T),))
    g = torch.randn(4, 3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        y = mm(a, b)
        assert torch.allclose(y, a_dense @ b.detach(), atol=1e-6)
        y.backward(g)
    g_sparse = g * threshold.mask(g)  # the per-output grad_out_fmt ran
    ref_a = g_sparse @ b.detach().t()
    ref_a = ref_a * sten.ScalarFractionSparsifier(0.5).mask(ref_a)  # the parameter's grad_fmt ran
    assert isinstance(a.grad, sten.SparseTensorWrapper) and type(a.grad.wrapped_tensor) is sten.CooTensor
    assert torch.allclose(a.grad.to_dense(), ref_a, atol=1e-5)
    assert torch.allclose(b.grad, a_dense.t() @ g_sparse, atol=1e-5)
    # the forward fell back (and said so); its backward is the dense op's own autograd
    assert any("(fwd)" in t and "torch.mm" in t for t in dispatch_warnings(record))
    assert plans(events, "fwd") == ["fallback"] and plans(events, "bwd") == []


def test_backward_implementation_runs(events):
    torch.manual_seed(1)
    a_dense, b = torch.randn(4, 6), torch.randn(6, 3, requires_grad=True)
    a = wrap(FakeLayout, a_dense, requires_grad=True)
    ran = []

    @sten.register_fwd_op_impl(operator=torch.mm, inp=(FakeLayout, T), out=[(sten.KeepAll, T)])
    def mm_fwd(ctx, inputs, output_sparsifiers):
        x, y = inputs[:2]
        ctx.save_for_backward(x.to_dense(), y)
        ran.append("fwd")
        return x.to_dense() @ y

    @sten.register_bwd_op_impl(operator=torch.mm, grad_out=(T,), grad_inp=((sten.KeepAll, T), (sten.KeepAll, T)),
                               inp=(FakeLayout, T))
    def mm_bwd(ctx, grad_outputs, input_sparsifiers):
        x, y = ctx.saved_tensors
        (g,) = grad_outputs
        ran.append("bwd")
        return g @ y.t(), x.t() @ g

    g = torch.randn(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sten.DispatchWarning)
        torch.mm(a, b).backward(g)
    assert ran == ["fwd", "bwd"]
    assert plans(events, "fwd") == ["impl"] and plans(events, "bwd") == ["impl"]
    assert torch.allclose(a.grad, g @ b.detach().t(), atol=1e-6)
    assert torch.allclose(b.grad, a_dense.t() @ g, atol=1e-6)


# -- sparsifier dispatch ----------------------------------------------------------------------

def test_sparsifier_implementation_is_used_and_cached(events):
    class HalfSparsifier:
        pass

    calls = []

    @sten.register_sparsifier_implementation(sparsifier=HalfSparsifier, inp=T, out=FakeLayout)
    def half(sparsifier, tensor, grad_fmt=None):
        calls.append(grad_fmt)
        return sten.SparseTensorWrapper(FakeLayout(tensor * 0.5))

    x = torch.randn(3, 3)
    w = sten.sparsify(HalfSparsifier(), x, FakeLayout)
    assert type(w.wrapped_tensor) is FakeLayout and torch.equal(w.to_dense(), x * 0.5)
    key = sten.OpKey("sparsifier", HalfSparsifier, (T,), FakeLayout)
    assert key in dispatch.sparsifier_dispatch._plans
    sten.sparsify(HalfSparsifier(), x, FakeLayout)
    assert len(calls) == 2


def test_sparsifier_fallback_warns_once(events):
    class Unknown:
        pass

    x = torch.randn(3, 3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        w1 = sten.sparsify(Unknown(), x, FakeLayout)
        w2 = sten.sparsify(Unknown(), x, FakeLayout)
    assert torch.equal(w1.to_dense(), x) and torch.equal(w2.to_dense(), x)
    text = dispatch_warnings(record)
    assert len(text) == 1 and "Unknown" in text[0] and "FakeLayout" in text[0]


def test_fast_path_keys_on_layouts_and_grad():
    """Repeated implicit calls reuse the plan by argument kinds, never across layouts,
    and a wrapper that needs a gradient still records the autograd node."""
    x = torch.randn(5, 4)
    w = torch.randn(3, 4) * (torch.rand(3, 4) > 0.5)
    for _ in range(2):  # the second round takes the cached path
        for layout in (sten.CsrTensor, sten.CooTensor, sten.CscTensor):
            ws = sten.SparseTensorWrapper(layout.from_dense(w))
            torch.testing.assert_close(torch.nn.functional.linear(x, ws), x @ w.T, rtol=1e-5, atol=1e-6)
    wp = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(w))
    out = torch.nn.functional.linear(x, wp)
    assert out.grad_fn is not None
    out.sum().backward()
    torch.testing.assert_close(wp.grad, torch.ones(5, 3).T @ x, rtol=1e-5, atol=1e-5)
    assert sten.dispatch.entry._fast
    sten.registry.register_conversion(sten.DenseTensor, sten.CsrTensor, lambda d: sten.CsrTensor.from_dense(d.data))
    try:
        assert not sten.dispatch.entry._fast, "a registration clears the fast cache"
    finally:
        sten.registry.conversions.pop((sten.DenseTensor, sten.CsrTensor), None)
        sten.registry._owners.pop(("conversions", (sten.DenseTensor, sten.CsrTensor)), None)
        sten.dispatch.clear_caches()


# -- fast paths (no observers: the general path would run otherwise) -----------------

@pytest.fixture
def quiet():
    """Registrations tagged with OWNER and no observer, so cached calls take the fast paths."""
    sten.plugins.ensure_loaded()
    token = dispatch.observers._observers.set(())
    try:
        with sten.registry.owner(OWNER):
            yield
    finally:
        dispatch.observers._observers.reset(token)
        sten.registry.remove_owner(OWNER)
        sten.plugins.unregister_plugin("test-dispatch-hook")
        dispatch.reset_warnings()


def register_add_bwd(calls=None):
    @sten.register_bwd_op_impl(operator=torch.add, grad_out=(T,), grad_inp=((sten.KeepAll, T), (sten.KeepAll, T)),
                               inp=(FakeLayout, FakeLayout))
    def add_bwd(ctx, grad_outputs, input_sparsifiers):
        if calls is not None:
            calls.append([getattr(i, "requires_grad", None) for i in ctx.inputs[:2]])
        g = grad_outputs[0]
        return g, g * ctx.inputs[2]


def fast_keys(op=torch.add) -> list[tuple]:
    return [k for k in dispatch.entry._fast if k[0] is op]


def test_fast_implicit_call_matches_dense_and_is_cached(quiet):
    calls = []
    register_add((FakeLayout, FakeLayout, None), calls=calls)  # the implementation receives alpha
    a, b = xy()
    wa, wb = wrap(FakeLayout, a), wrap(FakeLayout, b)
    outs = [torch.add(wa, wb) for _ in range(3)]
    assert fast_keys() == [(torch.add, None, FakeLayout, FakeLayout)]
    assert len(calls) == 3
    for out in outs:
        assert type(out) is torch.Tensor
        torch.testing.assert_close(out, a + b)
    # arguments the kinds do not cover take the general path, with the same result
    torch.testing.assert_close(torch.add(wa, wb, alpha=2), a + 2 * b)
    assert len(fast_keys()) == 1


def test_fast_explicit_spec_matches_dense(quiet):
    register_add()
    a, b = xy()
    wa, wb = wrap(FakeLayout, a), wrap(FakeLayout, b)
    dense_add = sten.sparsified_op(torch.add, out_fmt=DENSE_SPEC)
    half = sten.ScalarFractionSparsifier(0.5)
    csr_add = sten.sparsified_op(torch.add, out_fmt=(sten.KeepAll(), T, half, sten.CsrTensor))
    expected_csr = sten.sparsify(half, a + b, sten.CsrTensor).to_dense()
    for _ in range(3):
        out = dense_add(wa, wb)
        assert type(out) is torch.Tensor
        torch.testing.assert_close(out, a + b)
        sparse = csr_add(wa, wb)
        assert type(sparse.wrapped_tensor) is sten.CsrTensor
        torch.testing.assert_close(sparse.to_dense(), expected_csr)
    pairs = {k[1] for k in fast_keys()}
    assert pairs == {((sten.KeepAll, T),)}, "both specs share one key shape: (KeepAll, Tensor) inline"


def test_fast_autograd_values_and_gradients(quiet):
    calls = []
    register_add((FakeLayout, FakeLayout, None))
    register_add_bwd(calls)
    a, b = xy()
    for round_ in range(3):  # the first call resolves; the next ones take the fast record path
        wa, wb = wrap(FakeLayout, a, requires_grad=True), wrap(FakeLayout, b, requires_grad=True)
        out = torch.add(wa, wb)
        assert out.grad_fn is not None
        torch.testing.assert_close(out, a + b)
        (out * out).sum().backward()
        torch.testing.assert_close(wa.grad, 2 * (a + b))
        torch.testing.assert_close(wb.grad, 2 * (a + b))
    assert fast_keys() == [(torch.add, None, FakeLayout, FakeLayout)]
    assert calls == [[False, False]] * 3, "backward implementations see detached inputs"


def test_fast_autograd_reuses_inputs_and_mixes_dense(quiet):
    """A wrapper used in many recorded calls, with a dense tensor that needs grad."""
    @sten.register_fwd_op_impl(operator=torch.add, inp=(FakeLayout, T), out=[(sten.KeepAll, T)])
    def add_impl(ctx, inputs, output_sparsifiers):
        assert not inputs[0].requires_grad and not inputs[1].requires_grad
        return torch.add(inputs[0].to_dense(), inputs[1])

    a, b = xy()
    wa = wrap(FakeLayout, a, requires_grad=True)
    bg = b.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)  # dense backward fallback
        loss = sum((torch.add(wa, bg) * k).sum() for k in (1.0, 2.0, 3.0))
        loss.backward()
    torch.testing.assert_close(wa.grad, torch.full_like(a, 6.0))
    torch.testing.assert_close(bg.grad, torch.full_like(b, 6.0))
    with torch.no_grad():  # nothing is recorded: the general path detaches
        out = torch.add(wa, bg)
    assert out.grad_fn is None
    torch.testing.assert_close(out, a + b)


def test_fast_autograd_output_that_is_an_input(quiet):
    """An implementation returning its (detached) input: the output gets its own
    history, and the next call still sees an input without one."""
    seen = []

    @sten.register_fwd_op_impl(operator=torch.clone, inp=(FakeLayout,), out=[(sten.KeepAll, FakeLayout)])
    def clone_impl(ctx, inputs, output_sparsifiers):
        seen.append(inputs[0].requires_grad)
        return inputs[0]

    @sten.register_bwd_op_impl(operator=torch.clone, grad_out=(T,), grad_inp=((sten.KeepAll, T),), inp=(FakeLayout,))
    def clone_bwd(ctx, grad_outputs, input_sparsifiers):
        return (grad_outputs[0],)

    clone = sten.sparsified_op(torch.clone, out_fmt=(sten.KeepAll(), FakeLayout, sten.KeepAll(), FakeLayout))
    a, _ = xy()
    wa = wrap(FakeLayout, a, requires_grad=True)
    outs = [clone(wa) for _ in range(3)]
    assert seen == [False, False, False]
    assert len({id(o) for o in outs}) == 3 and all(o is not wa for o in outs)
    for out in outs:
        assert out.grad_fn is not None and type(out.wrapped_tensor) is FakeLayout
    sum(o.to_dense().sum() * 0 for o in outs)  # outputs are usable
    torch.autograd.backward([outs[0]], [torch.ones_like(a)])
    torch.testing.assert_close(wa.grad, torch.ones_like(a))


def test_fast_cache_cleared_by_new_registration(quiet):
    """A registration made after a call was cached takes effect on the next call."""
    calls = []
    a, b = xy()
    wa, wb = wrap(FakeLayout, a), wrap(FakeLayout, b)
    with pytest.warns(sten.DispatchWarning):
        torch.add(wa, wb)  # no implementation yet: dense fallback, cached
    assert sten.plugins.register_plugin(hook_plugin(calls), name="test-dispatch-hook")
    torch.add(wa, wb)  # a plugin with only a resolve hook still clears the caches
    assert [c[0] for c in calls] == ["hook"]
    calls.clear()
    wa, wb = wrap(FakeLayout, a), wrap(FakeLayout, b)
    torch.add(wa, wb)
    torch.add(wa, wb)
    assert [c[0] for c in calls] == ["hook", "hook"] and fast_keys()
    register_add(calls=calls)  # an exact implementation comes before the hook
    assert not dispatch.entry._fast, "a registration clears the fast cache"
    torch.testing.assert_close(torch.add(wa, wb), a + b)
    torch.testing.assert_close(torch.add(wa, wb), a + b)
    assert [c[0] for c in calls] == ["hook", "hook", "impl", "impl"]


def test_fast_cache_never_crosses_layouts_and_observers_still_see_calls(quiet):
    calls = []
    register_add(calls=calls)
    register_add((OtherFake, OtherFake), calls=calls, tag="other")
    a, b = xy()
    for _ in range(2):
        torch.add(wrap(FakeLayout, a), wrap(FakeLayout, b))
        torch.add(wrap(OtherFake, a), wrap(OtherFake, b))
    assert [c[0] for c in calls] == ["impl", "other"] * 2
    seen: list[dict] = []
    dispatch.add_observer(seen.append)
    try:
        for _ in range(2):
            torch.add(wrap(FakeLayout, a), wrap(FakeLayout, b))
    finally:
        dispatch.remove_observer(seen.append)
    assert [e["plan"] for e in seen if e["kind"] == "op"] == ["impl", "impl"]
