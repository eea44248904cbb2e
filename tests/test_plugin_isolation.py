"""One plugin never breaks another: overridden registrations come back when the
overriding plugin is removed (or fails half-way), a raising ``sten_resolve_op`` /
``sten_convert`` hook is reported once and skipped, the registry refuses
non-callable implementations, and a few argument checks around them."""

from __future__ import annotations

import math
import pathlib
import sys
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from fake_layouts import DenseCopyLayout
from sten_core import plugin_api as api
from sten_core.model.registry import OpKey, OverrideWarning, registry
from sten_core.model.tensor import densify
from sten_core.plugins.manager import PluginHookWarning, PluginLoadWarning

T = torch.Tensor
ROOT = pathlib.Path(__file__).resolve().parents[1]


class IsolationLayout(DenseCopyLayout):
    """A layout of the test plugins."""


class UnreachableLayout(DenseCopyLayout):
    """No conversion leads here: ``sten.convert`` asks the ``sten_convert`` hook."""


def plugin(name: str, **hooks) -> types.ModuleType:
    """A plugin module named ``name`` with the given hook implementations."""
    module = types.ModuleType(name)
    for hook_name, fn in hooks.items():
        setattr(module, hook_name, fn)
    return module


@pytest.fixture
def plugins():
    """Register test plugins; unregister them (and forget their failures) afterwards."""
    names: list[str] = []

    def register(name: str, **hooks) -> bool:
        names.append(name)
        return sten.plugins.register_plugin(plugin(name, **hooks), name=name)

    sten.plugins.ensure_loaded()
    yield register
    for name in reversed(names):
        sten.plugins.unregister_plugin(name)
        sten.plugins.failed.pop(name, None)
    sten.dispatch.reset_warnings()
    sten.set_dispatch_failure("warn")


def mul_impl(tag: str, calls: list):
    def impl(ctx, inputs, output_sparsifiers):
        calls.append(tag)
        return inputs[0].to_dense() * inputs[1]
    return impl


MUL_KEY = OpKey("fwd", torch.mul, (IsolationLayout, T), ((sten.KeepAll, T),))


def call_mul() -> torch.Tensor:
    w = sten.SparseTensorWrapper(IsolationLayout.from_dense(torch.ones(2, 2)))
    mul = sten.sparsified_op(torch.mul, out_fmt=(sten.KeepAll(), T, sten.KeepAll(), T))
    return mul(w, torch.full((2, 2), 3.0))


# -- B1: a removed or failed plugin takes away only what is its own ------------------------------------

def test_failed_plugin_restores_what_it_had_overridden(plugins):
    calls: list = []
    coo_to_csr = registry.conversions[(sten.CooTensor, sten.CsrTensor)]

    @api.hookimpl
    def first_register(registry):
        registry.register_layout(IsolationLayout)
        registry.register_fwd_op_impl(torch.mul, (IsolationLayout, T), [(sten.KeepAll, T)], mul_impl("first", calls))

    @api.hookimpl
    def bad_register(registry):
        registry.register_layout(sten.CsrTensor)  # the same class under its own name
        registry.register_conversion(sten.CooTensor, sten.CsrTensor, lambda c: sten.CsrTensor(c.data.to_sparse_csr()))
        registry.register_fwd_op_impl(torch.mul, (IsolationLayout, T), [(sten.KeepAll, T)], mul_impl("bad", calls))
        raise RuntimeError("bug half-way through sten_register")

    assert plugins("iso-first", sten_register=first_register)
    with pytest.warns(PluginLoadWarning, match="iso-bad"), pytest.warns(OverrideWarning, match="iso-bad"):
        assert not plugins("iso-bad", sten_register=bad_register)
    assert registry.layouts["CsrTensor"] is sten.CsrTensor and registry.owner_of("layouts", "CsrTensor") == "builtin"
    assert registry.conversions[(sten.CooTensor, sten.CsrTensor)] is coo_to_csr
    assert registry.owner_of("conversions", (sten.CooTensor, sten.CsrTensor)) == "builtin"
    assert registry.owner_of("impls", MUL_KEY) == "iso-first"
    assert torch.equal(call_mul(), torch.full((2, 2), 3.0)) and calls == ["first"]
    x = torch.randn(4, 4)  # the built-in CSR layout still works
    assert torch.equal(sten.convert(sten.convert(x, sten.CsrTensor), T), x)


def test_last_registration_wins_and_removing_it_brings_back_the_previous(plugins):
    calls: list = []

    @api.hookimpl
    def first_register(registry):
        registry.register_layout(IsolationLayout)
        registry.register_fwd_op_impl(torch.mul, (IsolationLayout, T), [(sten.KeepAll, T)], mul_impl("first", calls))

    @api.hookimpl
    def second_register(registry):
        registry.register_fwd_op_impl(torch.mul, (IsolationLayout, T), [(sten.KeepAll, T)], mul_impl("second", calls))

    assert plugins("iso-first", sten_register=first_register)
    with pytest.warns(OverrideWarning, match="'iso-second' overrides the implementation fwd torch.mul.*'iso-first'"):
        assert plugins("iso-second", sten_register=second_register)
    call_mul()
    assert calls == ["second"], "the last registration wins"
    sten.plugins.unregister_plugin("iso-second")
    call_mul()
    assert calls == ["second", "first"], "the previous registration is back"
    assert registry.owner_of("impls", MUL_KEY) == "iso-first"
    sten.plugins.unregister_plugin("iso-first")
    assert MUL_KEY not in registry.impls and "IsolationLayout" not in registry.layouts


def test_a_plugin_overriding_only_a_forward_does_not_get_the_other_plugins_backward(plugins):
    """Plugin B replaces A's forward of ``F.linear`` but not its backward: A's backward reads what A's
    forward saved, so after B's forward the call takes the dense gradients, with a warning naming both."""

    def a_forward(ctx, inputs, output_sparsifiers):
        ctx.save_for_backward(inputs[0], inputs[1].wrapped_tensor.to_dense())
        return F.linear(inputs[0], inputs[1].wrapped_tensor.to_dense())

    def a_backward(ctx, grads, input_sparsifiers):
        x, w = ctx.saved_tensors  # what a_forward saved: B's forward saves nothing
        return grads[0] @ w, grads[0].t() @ x

    def b_forward(ctx, inputs, output_sparsifiers):
        return F.linear(inputs[0], inputs[1].wrapped_tensor.to_dense())

    @api.hookimpl
    def a_register(registry):
        registry.register_layout(IsolationLayout)
        registry.register_fwd_op_impl(F.linear, (T, IsolationLayout), [(sten.KeepAll, T)], a_forward)
        registry.register_bwd_op_impl(F.linear, (T,), [(sten.KeepAll, T), (sten.KeepAll, T)],
                                      (T, IsolationLayout), a_backward)

    @api.hookimpl
    def b_register(registry):
        registry.register_fwd_op_impl(F.linear, (T, IsolationLayout), [(sten.KeepAll, T)], b_forward)

    def gradients() -> tuple:
        dense = torch.randn(4, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        w = sten.SparseParameterWrapper(IsolationLayout.from_dense(dense))
        x = torch.linspace(-1, 1, 24, dtype=torch.float64).reshape(3, 8).requires_grad_()
        (F.linear(x, w) ** 2).sum().backward()
        x_ref, w_ref = x.detach().clone().requires_grad_(), dense.clone().requires_grad_()
        (F.linear(x_ref, w_ref) ** 2).sum().backward()
        return x.grad, densify(w.grad), x_ref.grad, w_ref.grad

    assert plugins("iso-a", sten_register=a_register)
    x_grad, w_grad, x_ref, w_ref = gradients()  # A's own pair
    torch.testing.assert_close(x_grad, x_ref)
    torch.testing.assert_close(w_grad, w_ref)
    with pytest.warns(OverrideWarning, match="iso-b"):
        assert plugins("iso-b", sten_register=b_register)
    with pytest.warns(sten.DispatchWarning, match=r"a_backward \(of 'iso-a'\), belongs to 'iso-a'.s forward, which "
                                                  r"'iso-b' overrides: the forward that ran is .*b_forward \(of 'iso-b'\)"):
        x_grad, w_grad, x_ref, w_ref = gradients()
    torch.testing.assert_close(x_grad, x_ref)
    torch.testing.assert_close(w_grad, w_ref)


def test_a_backward_registered_alone_follows_the_forward_in_force(plugins):
    """User code (or a plugin) giving only a backward, a custom gradient of a built-in forward, runs it:
    its owner registered no forward of its own for the key."""
    calls = []

    def forward(ctx, inputs, output_sparsifiers):
        ctx.save_for_backward(inputs[0], inputs[1].wrapped_tensor.to_dense())
        return F.linear(inputs[0], inputs[1].wrapped_tensor.to_dense())

    def backward(ctx, grads, input_sparsifiers):
        calls.append("custom")
        x, w = ctx.saved_tensors
        return grads[0] @ w, grads[0].t() @ x

    @api.hookimpl
    def forward_only(registry):
        registry.register_layout(IsolationLayout)
        registry.register_fwd_op_impl(F.linear, (T, IsolationLayout), [(sten.KeepAll, T)], forward)

    assert plugins("iso-forward", sten_register=forward_only)
    with registry.owner("iso-custom-gradient"):
        registry.register_bwd_op_impl(F.linear, (T,), [(sten.KeepAll, T), (sten.KeepAll, T)], (T, IsolationLayout),
                                      backward)
    try:
        w = sten.SparseParameterWrapper(IsolationLayout.from_dense(torch.eye(4)))
        with warnings.catch_warnings():
            warnings.simplefilter("error", sten.DispatchWarning)
            F.linear(torch.ones(2, 4), w).sum().backward()
        assert calls == ["custom"] and torch.equal(densify(w.grad), torch.full((4, 4), 2.0))
    finally:
        registry.remove_owner("iso-custom-gradient")


def test_registering_the_same_layout_again_keeps_its_owner(plugins):
    @api.hookimpl
    def again_register(registry):
        registry.register_layout(sten.CooTensor)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same class again: no override warning
        assert plugins("iso-again", sten_register=again_register)
    assert registry.owner_of("layouts", "CooTensor") == "builtin"
    row = next(r for r in sten.plugins.plugin_report() if r["name"] == "iso-again")
    assert row["layouts"] == []
    sten.plugins.unregister_plugin("iso-again")
    assert registry.layouts["CooTensor"] is sten.CooTensor


def test_overriding_the_core_or_from_user_code_does_not_warn_but_is_undone(plugins):
    coo_to_csr = registry.conversions[(sten.CooTensor, sten.CsrTensor)]
    mine = lambda c: sten.CsrTensor(c.data.to_sparse_csr())  # noqa: E731

    @api.hookimpl
    def core_register(registry):
        registry.register_conversion(sten.CooTensor, sten.CsrTensor, mine)

    with warnings.catch_warnings():
        warnings.simplefilter("error", OverrideWarning)
        assert plugins("iso-core", sten_register=core_register)
    assert registry.conversions[(sten.CooTensor, sten.CsrTensor)] is mine
    sten.plugins.unregister_plugin("iso-core")
    assert registry.conversions[(sten.CooTensor, sten.CsrTensor)] is coo_to_csr


# -- B2: a raising hook is reported once, naming the plugin, and skipped ---------------------------------

def test_raising_resolve_op_hook_is_skipped_with_one_warning(plugins):
    @api.hookimpl(tryfirst=True)
    def sten_resolve_op(key):
        return key.inp[5]  # a bug: IndexError for every key

    assert plugins("iso-buggy", sten_resolve_op=sten_resolve_op)
    csr = sten.sparsify(sten.ScalarFractionSparsifier(0.5), torch.randn(4, 8), sten.CsrTensor)
    with pytest.warns(PluginHookWarning, match=r"'iso-buggy'.*sten_resolve_op.*IndexError") as record:
        out = torch.abs(csr)  # the built-in element-wise rule still serves it
        torch.neg(csr)
    assert torch.equal(densify(out), csr.to_dense().abs())
    assert len([w for w in record if issubclass(w.category, PluginHookWarning)]) == 1, "reported once"
    # sparsifier dispatch asks the same hook
    w = sten.sparsify(sten.ScalarThresholdSparsifier(0.5), torch.randn(4, 8), sten.CooTensor)
    assert isinstance(w.wrapped_tensor, sten.CooTensor)


def test_resolve_op_answers_in_pluggy_order_past_a_raising_plugin(plugins):
    calls: list = []

    @api.hookimpl
    def earlier(key):
        return mul_impl("earlier", calls) if key.op is torch.mul and key.inp[:1] == (IsolationLayout,) else None

    @api.hookimpl
    def later(key):
        return mul_impl("later", calls) if key.op is torch.mul and key.inp[:1] == (IsolationLayout,) else None

    @api.hookimpl(tryfirst=True)
    def broken(key):
        raise RuntimeError("broken resolver")

    @api.hookimpl
    def layout_register(registry):
        registry.register_layout(IsolationLayout)

    assert plugins("iso-layout", sten_register=layout_register)
    assert plugins("iso-earlier", sten_resolve_op=earlier)
    assert plugins("iso-later", sten_resolve_op=later)
    assert plugins("iso-broken", sten_resolve_op=broken)
    with pytest.warns(PluginHookWarning, match="'iso-broken'.*broken resolver"):
        assert torch.equal(call_mul(), torch.full((2, 2), 3.0))
    assert calls == ["later"], "the last registered plugin answers first"


def test_raising_convert_hook_is_skipped_with_one_warning(plugins):
    @api.hookimpl
    def sten_convert(tensor, target):
        return tensor.no_such_attribute

    @api.hookimpl
    def layout_register(registry):
        registry.register_layout(UnreachableLayout)

    assert plugins("iso-convert", sten_convert=sten_convert, sten_register=layout_register)
    x = torch.randn(3, 4)
    csr = sten.convert(x, sten.CsrTensor)
    with pytest.warns(PluginHookWarning, match=r"'iso-convert'.*sten_convert.*AttributeError"):
        out = sten.convert(csr, UnreachableLayout)  # through dense, as without the hook
    assert type(out.wrapped_tensor) is UnreachableLayout and torch.equal(out.to_dense(), x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginHookWarning)  # once per plugin and hook
        sten.convert(csr, UnreachableLayout)


class HookedLayout(DenseCopyLayout):
    """A layout only a test plugin's ``sten_convert`` hook converts (to CSR)."""


def _linear_plans(weight: torch.Tensor) -> tuple[list, torch.Tensor, torch.Tensor]:
    """The plans of ``F.linear(x, w)`` with a ``HookedLayout`` weight, its output and the weight's gradient."""
    w = sten.SparseParameterWrapper(HookedLayout.from_dense(weight))
    x = torch.arange(12, dtype=weight.dtype).reshape(3, 4) / 10
    plans: list = []
    with sten.dispatch.observed(lambda event: plans.append(event["plan"])):
        y = F.linear(x, w)
    y.square().sum().backward()
    return plans, y, densify(w.grad)


@pytest.mark.parametrize("converts", ["to CSR", "only some tensors", "lossily"])
def test_dispatch_converts_through_the_sten_convert_hook(plugins, converts):
    """DESIGN.md's dispatch step 3: the conversions to a layout that has an implementation include the
    ``sten_convert`` hook's (they were asked by ``sten.convert`` only, so a layout reached through the hook
    alone ran dense). The hook is asked at the call, so a tensor it does not convert, or converts
    with a loss, takes the dense path instead (with a warning)."""
    @api.hookimpl
    def sten_register(registry):
        registry.register_layout(HookedLayout)

    @api.hookimpl
    def sten_convert(tensor, target):
        if not isinstance(tensor, HookedLayout) or target is not sten.CsrTensor:
            return None   # (the CSR implementation is not the only one F.linear reaches: the others are tried first)
        if converts == "only some tensors" and tensor.data.shape[0] == 5:
            return None
        dense = tensor.data.clamp(min=0) if converts == "lossily" else tensor.data
        return sten.CsrTensor.from_dense(dense)

    assert plugins("iso-hooked", sten_register=sten_register, sten_convert=sten_convert)
    weight = torch.tensor([[1.0, 0, -2, 0], [0, 3, 0, 0]], dtype=torch.float64)
    x = torch.arange(12, dtype=torch.float64).reshape(3, 4) / 10
    expected_grad = 2 * F.linear(x, weight).t() @ x
    if converts == "lossily":
        with pytest.warns(sten.DispatchWarning, match="Lossy conversion HookedLayout -> CsrTensor: the sten_convert hook"):
            plans, y, grad = _linear_plans(weight)
        assert plans == ["fallback"]
    else:
        plans, y, grad = _linear_plans(weight)
        assert plans == ["convert", "convert"], "the hook's conversion, then the CSR implementation"
    torch.testing.assert_close(y, F.linear(x, weight))
    torch.testing.assert_close(grad, expected_grad)
    if converts == "only some tensors":   # a weight the hook does not convert: dense, with the warning
        weight5 = torch.eye(5, 4, dtype=torch.float64)
        with pytest.warns(sten.DispatchWarning, match=r"the conversion HookedLayout -> CsrTensor refused these inputs"):
            plans, y, grad = _linear_plans(weight5)
        assert plans == ["fallback"]
        torch.testing.assert_close(y, F.linear(x, weight5))


@pytest.mark.parametrize("target", ["ScipyCsrTensor", None], ids=["a late candidate", "none"])
def test_the_sten_convert_hook_is_asked_for_every_candidate_on_a_keys_first_call_only(plugins, target):
    """Every implementation the hook might reach is tried on the first call (a cap of eight left the scipy
    layouts out); then the key keeps the one it served, or the dense path, and the hook is not asked for
    the others again (each call asked it up to eight times before going dense, 3.5x slower)."""
    pytest.importorskip("sten_scipy")
    asked = []

    @api.hookimpl
    def sten_register(registry):
        registry.register_layout(HookedLayout)

    @api.hookimpl
    def sten_convert(tensor, target):
        if not isinstance(tensor, HookedLayout):
            return None
        asked.append(target.__name__)
        return target.from_dense(tensor.data) if target.__name__ == wanted else None

    wanted = target
    assert plugins("iso-hooked-late", sten_register=sten_register, sten_convert=sten_convert)
    weight = torch.tensor([[1.0, 0, -2, 0], [0, 3, 0, 0]], dtype=torch.float64)
    x = torch.arange(12, dtype=torch.float64).reshape(3, 4) / 10
    w = sten.SparseTensorWrapper(HookedLayout.from_dense(weight))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        torch.testing.assert_close(F.linear(x, w), F.linear(x, weight))
    first = list(asked)
    assert len(first) > 8 and ("ScipyCsrTensor" in first) and (target is None or first[-1] == target)
    asked.clear()
    torch.testing.assert_close(F.linear(x, w), F.linear(x, weight))
    assert asked == ([target] if target else []), "the key's plan is settled"


class ConvertedLayout(DenseCopyLayout):
    """A layout a test plugin converts built-in COO tensors into, to run its cumsum."""


def cumsum_impl(ctx, inputs, output_sparsifiers):
    return torch.cumsum(inputs[0].to_dense(), inputs[1])


@pytest.mark.parametrize("conversion, says", [
    (lambda coo: ConvertedLayout.from_dense(coo.to_dense()[:, :, 0]), r"failed on these inputs.*IndexError"),
    (lambda coo: ConvertedLayout.from_dense(coo.to_dense().clamp(min=0)),
     r"Lossy conversion CooTensor -> ConvertedLayout.*registered by iso-conversion"),
], ids=["raises IndexError", "drops negatives"])
def test_a_plugins_broken_conversion_does_not_break_calls_on_built_in_tensors(plugins, conversion, says):
    """The dispatcher routed ``torch.cumsum`` of a built-in ``CooTensor`` through a plugin's
    ``CooTensor -> ConvertedLayout`` conversion to the plugin's cumsum: a conversion raising
    ``IndexError`` crashed the call (only ValueError, TypeError, ... counted as refusals) and a
    lossy one gave a wrong result without a word."""
    @api.hookimpl
    def sten_register(registry):
        registry.register_layout(ConvertedLayout)
        registry.register_conversion(sten.CooTensor, ConvertedLayout, conversion)
        registry.register_fwd_op_impl(torch.cumsum, (ConvertedLayout, None), [(sten.KeepAll, T)], cumsum_impl)

    assert plugins("iso-conversion", sten_register=sten_register)
    d = torch.tensor([[1.0, -2.0, 0.0], [0.0, 3.0, -4.0]])
    w = sten.SparseTensorWrapper(sten.CooTensor.from_dense(d))
    with pytest.warns(sten.DispatchWarning, match=says):
        torch.testing.assert_close(densify(torch.cumsum(w, 1)), torch.cumsum(d, 1))
    torch.testing.assert_close(densify(torch.cumsum(w, 1)), torch.cumsum(d, 1))  # and again, without the check


# -- B3: registrations check their arguments ------------------------------------------------------------

@pytest.mark.parametrize("register, argument", [
    (lambda: registry.register_fwd_op_impl(F.linear, (T, IsolationLayout), None, None), "impl"),
    (lambda: registry.register_bwd_op_impl(F.linear, (T,), None, (T, IsolationLayout), 3), "impl"),
    (lambda: registry.register_sparsifier_implementation(sten.KeepAll, T, IsolationLayout, None), "impl"),
    (lambda: registry.register_sparsifier_implementation(0.5, T, IsolationLayout, lambda sp, t: t), "sparsifier"),
    (lambda: registry.register_sparsifier_implementation("KeepAll", T, IsolationLayout, lambda sp, t: t),
     "sparsifier"),
    (lambda: registry.register_sparsifier_implementation(float, T, IsolationLayout, lambda sp, t: t), "sparsifier"),
    (lambda: registry.register_conversion(IsolationLayout, sten.CooTensor, None), "fn"),
    (lambda: registry.register_conversion(IsolationLayout, sten.CooTensor, lambda src, extra: src), "fn"),
    (lambda: registry.register_layout(IsolationLayout, name=123), "name"),
])
def test_registry_refuses_what_it_cannot_call(register, argument):
    before = (dict(registry.impls), dict(registry.conversions), dict(registry.layouts))
    with pytest.raises(TypeError, match=rf"^{argument}\b"):
        register()
    assert (registry.impls, registry.conversions, registry.layouts) == before


def test_plain_sparsifier_classes_still_register(plugins):
    class PlainSparsifier:  # the paper's sparsifiers need no base class
        pass

    @api.hookimpl
    def plain_register(registry):
        registry.register_layout(IsolationLayout)
        registry.register_sparsifier_implementation(PlainSparsifier(), T, IsolationLayout,
                                                    lambda sp, t: IsolationLayout.from_dense(t))
        registry.register_fwd_op_impl(torch.mul, (IsolationLayout, T), [(sten.KeepAll(), T)], mul_impl("x", []))

    assert plugins("iso-plain", sten_register=plain_register)
    with pytest.raises(TypeError, match="impl must be callable"):
        registry.register_fwd_op_impl(torch.add, (IsolationLayout, T), None, "not a function")


# -- B8, B9: explain finds the working directory's modules; clear argument errors ----------------------------

def test_explain_imports_a_module_from_the_working_directory(tmp_path, monkeypatch):
    from sten_core.tools.explain_targets import load_target

    (tmp_path / "iso_models_cwd.py").write_text(
        "import torch\n"
        "def make():\n"
        "    return torch.nn.Linear(4, 2), torch.randn(1, 4)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    path_before = list(sys.path)
    try:
        model, inputs = load_target("iso_models_cwd:make")
    finally:
        sys.modules.pop("iso_models_cwd", None)
    assert isinstance(model, torch.nn.Linear) and inputs[0].shape == (1, 4)
    assert sys.path == path_before, "the working directory is taken off sys.path again"


def test_convert_names_a_bad_target():
    w = sten.convert(torch.eye(3), sten.CooTensor)
    assert type(sten.convert(w, "CsrTensor").wrapped_tensor) is sten.CsrTensor  # a registered name
    with pytest.raises(ValueError, match=r"target: unknown layout 'csr'; known layouts: .*CsrTensor"):
        sten.convert(w, "csr")
    with pytest.raises(TypeError, match="target must be a layout class"):
        sten.convert(w, 3)
    with pytest.raises(TypeError, match="target must be a layout class"):
        sten.convert(w, int)


def test_threshold_sparsifier_refuses_nan():
    with pytest.raises(ValueError, match="threshold.*NaN"):
        sten.ScalarThresholdSparsifier(math.nan)


# -- C1: the guide matches the hook specs ------------------------------------------------------------------

def test_plugin_guide_counts_the_hooks_and_documents_precedence():
    from sten_core.plugins import hookspecs

    guide = (ROOT / "docs" / "guides" / "write-a-plugin.md").read_text()
    hooks = [n for n in dir(hookspecs) if n.startswith("sten_") and callable(getattr(hookspecs, n))]
    words = {4: "four", 5: "five", 6: "six"}
    assert f"these {words[len(hooks)]} hooks (`sten_core/plugins/hookspecs.py`)" in guide
    bench = guide.split("### `sten_bench_layouts`")[1].split("\n## ")[0]
    assert "register_conversion" not in bench, "the conversion bullet belongs to sten_register, not the bench hook"
    assert "the last registration wins while it exists" in guide and "PluginHookWarning" in guide


def test_the_warnings_a_plugin_filters_come_from_the_plugin_api():
    """A plugin imports ``sten_core.plugin_api`` only: the warnings it may want to filter in its
    tests (an override of another plugin's registration, a raising hook, a failed load) were not
    there, so filtering them meant importing the core's internal modules."""
    assert api.OverrideWarning is OverrideWarning
    assert api.PluginHookWarning is PluginHookWarning
    assert api.PluginLoadWarning is PluginLoadWarning
    names = {"OverrideWarning", "PluginHookWarning", "PluginLoadWarning", "DispatchWarning"}
    assert names <= set(api.__all__)
    api_doc = (ROOT / "docs" / "api.md").read_text()
    assert all(f"plugin_api.{name}" in api_doc for name in names)
