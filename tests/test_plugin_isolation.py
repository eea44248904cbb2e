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
