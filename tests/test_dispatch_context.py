"""The failure mode and the observers are per thread (context variables), the
plan kinds an Enum, and plugins contribute benchmark lines through a hook."""

from __future__ import annotations

import threading
import types
import warnings

import pytest
import torch

import sten_core as sten
from sten_core import plugin_api
from sten_core.tools.bench import layouts as bench_layouts


class _NoImpl:
    """A sparsifier class with no implementation: sparsifying with it falls back."""


def _fallback() -> None:
    sten.sparsify(_NoImpl(), torch.ones(2, 2), sten.CsrTensor)


def test_failure_mode_block_raises_inside_and_warns_outside():
    sten.dispatch.reset_warnings()
    with sten.dispatch.failure_mode("raise"):
        assert sten.dispatch.get_dispatch_failure() == "raise"
        with pytest.raises(sten.DispatchError):
            _fallback()
    assert sten.dispatch.get_dispatch_failure() == "warn"
    with pytest.warns(sten.DispatchWarning):
        _fallback()


def test_failure_mode_of_a_block_does_not_reach_other_threads():
    seen = []
    inside, done = threading.Event(), threading.Event()

    def other() -> None:
        inside.wait(5)
        seen.append(sten.dispatch.get_dispatch_failure())
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with sten.dispatch.failure_mode("raise"):
        inside.set()
        done.wait(5)
    thread.join(5)
    assert seen == ["warn"]


def test_failure_mode_rejects_unknown_modes():
    with pytest.raises(ValueError, match="mode must be 'warn' or 'raise'"):
        with sten.dispatch.failure_mode("ignore"):
            pass


def test_observers_see_only_their_own_threads_calls():
    mine, theirs = [], []
    w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(3)))

    def other() -> None:
        with sten.dispatch.observed(theirs.append):
            torch.mm(w, torch.ones(3, 1))

    with sten.dispatch.observed(mine.append):
        thread = threading.Thread(target=other)
        thread.start()
        thread.join(5)
        torch.mm(w, torch.ones(3, 2))
    assert len(mine) == 1 and len(theirs) == 1
    assert mine[0]["plan"] == "impl" and sten.dispatch.observers.active() == ()


def test_plan_kinds_are_an_enum_that_reads_as_its_name():
    kind = sten.dispatch.PlanKind.FALLBACK
    assert kind == "fallback" and str(kind) == "fallback"
    assert {k.value for k in sten.dispatch.PlanKind} == {"impl", "generic", "convert", "native", "fallback",
                                                          "identity"}


def _bench_plugin(raising: bool = False) -> types.ModuleType:
    module = types.ModuleType("bench_plugin")

    @plugin_api.hookimpl
    def sten_bench_layouts(register):
        if raising:
            raise RuntimeError("no lines today")
        register(plugin_api.BenchLayout("mine", "my layout", "CooTensor", plugin_api.ScalarFractionSparsifier,
                                        pattern=lambda s: "mine"))

    module.sten_bench_layouts = sten_bench_layouts
    return module


def test_a_plugin_contributes_bench_lines_through_the_hook():
    assert plugin_api.register_plugin(_bench_plugin(), name="test-bench-lines")
    try:
        names = [layout.name for layout in bench_layouts.known()]
        assert names[0] == "dense" and "torch_csr" in names and names[-1] == "mine"
        assert bench_layouts.by_name("mine").pattern_at(0.5) == "mine"
        assert bench_layouts.layout_class(bench_layouts.by_name("mine")) is sten.CooTensor
    finally:
        plugin_api.unregister_plugin("test-bench-lines")
    assert "mine" not in [layout.name for layout in bench_layouts.known()]


def test_a_raising_bench_hook_is_skipped_with_a_warning():
    assert plugin_api.register_plugin(_bench_plugin(raising=True), name="test-bench-raises")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            names = [layout.name for layout in bench_layouts.known()]
        assert "torch_csr" in names
        assert any("test-bench-raises" in str(w.message) and "no lines today" in str(w.message) for w in caught)
    finally:
        plugin_api.unregister_plugin("test-bench-raises")


def test_check_tensor_names_the_argument_and_what_was_expected():
    with pytest.raises(TypeError, match="weight must be a torch.Tensor, got list"):
        plugin_api.check_tensor([1.0], "weight")
    with pytest.raises(TypeError, match=r"F.linear: x must have dtype float32, got torch.int64"):
        plugin_api.check_tensor(torch.ones(2, dtype=torch.long), "x", dtypes=(torch.float32,), where="F.linear")
    with pytest.raises(ValueError, match="x must be 2 or 3-D, got shape"):
        plugin_api.check_tensor(torch.ones(2), "x", ndim=(2, 3))
    with pytest.raises(ValueError, match="must be on cuda"):
        plugin_api.check_tensor(torch.ones(2), "x", device_type="cuda")


def test_protocol_checks_are_cached_per_class_and_agree_with_isinstance():
    layout = sten.CsrTensor.from_dense(torch.eye(2))
    for protocol in (plugin_api.StoredValues, plugin_api.StateTensors, plugin_api.DenseConvertible):
        assert plugin_api.implements(layout, protocol) == isinstance(layout, protocol)
    assert plugin_api.implements(layout, plugin_api.StateTensors)
    assert not plugin_api.implements(object(), plugin_api.StateTensors)
