"""Plugin loading edge cases (issue #13): concurrent first use, strict mode with
several plugins, misspelled hooks, a failing ``sten_plugin_info``, two layouts
with one class name, and ``STEN_PLUGINS`` naming a plugin that is not installed.

Installed entry points are replaced by fake ones (objects with ``name`` and
``load()``); every test restores the real plugins afterwards."""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import threading
import time
import types
import warnings

import pytest
import torch

import sten_core as sten
from fake_layouts import DenseCopyLayout
from sten_core.tools import cli
from sten_core.plugins.manager import PluginLoadError, PluginLoadWarning


class FakeEntryPoint:
    def __init__(self, name: str, load):
        self.name = name
        self._load = load

    def load(self):
        return self._load()


def layout_class(name: str, module: str) -> type:
    """A fresh ``DenseCopyLayout`` subclass named ``name`` in module ``module``."""
    return type(name, (DenseCopyLayout,), {"__module__": module, "__qualname__": name})


def plugin_module(name: str, layouts=(), info=None, extra_hooks=None) -> types.ModuleType:
    module = types.ModuleType(name)

    @sten.hookimpl
    def sten_register(registry):
        for cls in layouts:
            registry.register_layout(cls)

    module.sten_register = sten_register
    if info is not None:
        module.sten_plugin_info = sten.hookimpl(info)
    for hook_name, fn in (extra_hooks or {}).items():
        setattr(module, hook_name, sten.hookimpl(fn))
    return module


@contextlib.contextmanager
def installed(monkeypatch, entry_points, **env):
    """Reload plugins as if only ``entry_points`` were installed, with ``env``."""
    with monkeypatch.context() as m:
        for var in ("STEN_PLUGINS", "STEN_DISABLE_PLUGINS", "STEN_STRICT_PLUGINS"):
            m.delenv(var, raising=False)
        for var, value in env.items():
            m.setenv(var, value)
        m.setattr(importlib.metadata, "entry_points", lambda group=None: list(entry_points))
        sten.plugins.reset()
        try:
            yield
        finally:
            sten.plugins.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginLoadWarning)
        sten.plugins.ensure_loaded()  # the real plugins again


def test_second_thread_waits_until_loading_has_finished(monkeypatch):
    started, release = threading.Event(), threading.Event()
    Slow = layout_class("SlowLayout", "slow_pkg.layouts")

    def slow_load():
        started.set()
        release.wait(10)
        return plugin_module("slow", layouts=[Slow])

    seen: dict = {}
    with installed(monkeypatch, [FakeEntryPoint("slow", slow_load)]):
        loader = threading.Thread(target=sten.plugins.ensure_loaded)
        loader.start()
        assert started.wait(10)

        def user():
            sten.plugins.ensure_loaded()
            seen["layouts"] = set(sten.registry.layouts)

        other = threading.Thread(target=user)
        other.start()
        time.sleep(0.3)  # the other thread asks while the slow plugin still loads
        assert "layouts" not in seen, "ensure_loaded returned while another thread was still loading"
        release.set()
        loader.join(10)
        other.join(10)
        assert "SlowLayout" in seen["layouts"] and "CsrTensor" in seen["layouts"]


def test_strict_mode_loads_the_other_plugins_then_raises(monkeypatch):
    Good = layout_class("AfterBrokenLayout", "good_pkg.layouts")

    def broken_load():
        raise ImportError("no module named broken_dep")

    eps = [FakeEntryPoint("broken", broken_load), FakeEntryPoint("good", lambda: plugin_module("good", [Good]))]
    with installed(monkeypatch, eps, STEN_STRICT_PLUGINS="1"):
        with pytest.raises(PluginLoadError, match="broken.*broken_dep"):
            sten.plugins.ensure_loaded()
        assert sten.registry.layout("AfterBrokenLayout") is Good, "the plugin after the broken one was loaded"
        assert "broken" in sten.plugins.failed
        sten.plugins.ensure_loaded()  # loaded: no second error, nothing reloaded
        names = {row["name"]: row for row in sten.plugins.plugin_report()}
        assert names["good"]["available"] and not names["broken"]["available"]


def test_misspelled_hook_fails_to_load_naming_the_hook(monkeypatch):
    module = types.ModuleType("typo")

    @sten.hookimpl
    def sten_regster(registry):  # the typo
        raise AssertionError("never called")

    module.sten_regster = sten_regster
    try:
        with pytest.warns(PluginLoadWarning, match="sten_regster.*did you mean 'sten_register'"):
            assert not sten.plugins.register_plugin(module, name="typo")
        assert not sten.plugins.get_plugin_manager().has_plugin("typo")
        assert "sten_regster" in sten.plugins.failed["typo"]
    finally:
        sten.plugins.unregister_plugin("typo")
        sten.plugins.failed.pop("typo", None)


def _raising_info():
    raise RuntimeError("driver query failed")


def test_failing_plugin_info_is_reported_not_raised(monkeypatch, capsys):
    Probe = layout_class("ProbeLayout", "probe_pkg.layouts")
    eps = [FakeEntryPoint("probe", lambda: plugin_module("probe", [Probe], info=_raising_info))]
    with installed(monkeypatch, eps):
        rows = {row["name"]: row for row in sten.plugins.plugin_report()}
        assert rows["probe"]["available"] is False
        assert "sten_plugin_info() raised RuntimeError: driver query failed" in rows["probe"]["reason"]
        assert rows["probe"]["layouts"] == ["ProbeLayout"]
        assert cli.main(["plugins"]) == 0  # `sten plugins`
        printed = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
        assert printed["probe"]["available"] is False
        # `sten bench` asks the same report for each layout's availability
        from sten_core.tools.bench.layouts import _owner_info

        assert _owner_info()["ProbeLayout"][1] is False


def test_two_plugins_with_one_layout_class_name(monkeypatch, tmp_path):
    First = layout_class("TwinLayout", "first_pkg.layouts")
    Second = layout_class("TwinLayout", "second_pkg.layouts")
    First.state_tensors = lambda self: (self.data,)
    First.from_state_tensors = classmethod(lambda cls, tensors, shape: cls(tensors[0]))
    eps = [FakeEntryPoint("first", lambda: plugin_module("first", [First])),
           FakeEntryPoint("second", lambda: plugin_module("second", [Second]))]
    with installed(monkeypatch, eps):
        with pytest.warns(PluginLoadWarning) as record:
            sten.plugins.ensure_loaded()
        message = " ".join(str(w.message) for w in record)
        assert "'second'" in message and "TwinLayout" in message
        assert "first_pkg.layouts.TwinLayout" in message and "second_pkg.layouts.TwinLayout" in message
        assert sten.registry.layout("TwinLayout") is First, "the first registration is not overwritten"
        # a checkpoint of the first plugin's layout loads as that layout
        w = sten.SparseTensorWrapper(First.from_dense(torch.arange(6.0).view(2, 3)))
        buf = io.BytesIO()
        torch.save({"w": w}, buf)
        buf.seek(0)
        back = torch.load(buf, weights_only=True)["w"]
        assert type(back.wrapped_tensor) is First and torch.equal(back.to_dense(), w.to_dense())


def test_registering_one_class_twice_is_fine():
    Same = layout_class("SameTwiceLayout", "same_pkg.layouts")
    try:
        sten.registry.register_layout(Same)
        sten.registry.register_layout(Same)
        assert sten.registry.layout("SameTwiceLayout") is Same
        Other = layout_class("SameTwiceLayout", "other_pkg.layouts")
        with pytest.raises(ValueError, match="name='<package>.SameTwiceLayout'"):
            sten.registry.register_layout(Other)
        sten.registry.register_layout(Other, name="other_pkg.SameTwiceLayout")
        assert sten.registry.layout("other_pkg.SameTwiceLayout") is Other
    finally:
        for name in ("SameTwiceLayout", "other_pkg.SameTwiceLayout"):
            sten.registry.layouts.pop(name, None)
            sten.registry._owners.pop(("layouts", name), None)


def test_unknown_name_in_sten_plugins_is_reported(monkeypatch):
    Known = layout_class("KnownLayout", "known_pkg.layouts")
    eps = [FakeEntryPoint("known", lambda: plugin_module("known", [Known]))]
    with installed(monkeypatch, eps, STEN_PLUGINS="nosuch"):
        with pytest.warns(PluginLoadWarning, match="'nosuch'.*not installed.*installed plugins: builtin, known"):
            sten.plugins.ensure_loaded()
        assert "KnownLayout" not in sten.registry.layouts
    with installed(monkeypatch, eps, STEN_PLUGINS="nosuch,known", STEN_STRICT_PLUGINS="1"):
        with pytest.raises(PluginLoadError, match="'nosuch'"):
            sten.plugins.ensure_loaded()
        assert "KnownLayout" in sten.registry.layouts, "the valid name is still loaded"


def test_sten_plugins_lists_every_installed_plugin_with_why_it_is_off(monkeypatch, capsys):
    """``sten plugins`` promises every installed plugin, available or not, and why: a plugin that
    ``STEN_DISABLE_PLUGINS`` blocked or ``STEN_PLUGINS`` left out was missing from it."""
    eps = [FakeEntryPoint(name, lambda name=name: plugin_module(name, [layout_class(f"{name.title()}Layout", name)]))
           for name in ("alpha", "beta", "gamma")]
    with installed(monkeypatch, eps, STEN_DISABLE_PLUGINS="beta"):
        assert cli.main(["plugins"]) == 0
        rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
        assert rows["alpha"]["available"] and rows["alpha"]["layouts"] == ["AlphaLayout"]
        assert rows["beta"] == {"name": "beta", "version": None, "available": False,
                                "reason": "not loaded: STEN_DISABLE_PLUGINS names it", "layouts": [], "hooks": []}
    with installed(monkeypatch, eps, STEN_PLUGINS="gamma"):
        assert {row["name"] for row in sten.plugins.plugin_report()} == {"builtin", "pruning", "gamma"}  # loaded
        rows = {row["name"]: row for row in sten.plugins.plugin_report(skipped=True)}
        assert set(rows) == {"builtin", "pruning", "alpha", "beta", "gamma"}
        assert rows["gamma"]["available"]
        for name in ("alpha", "beta"):
            assert rows[name]["available"] is False
            assert rows[name]["reason"] == "not loaded: STEN_PLUGINS names only gamma"


@pytest.mark.parametrize("info, available, reason", [
    (lambda: {"name": "Fancy Plugin", "version": "2.0", "available": True, "reason": None}, True, None),
    (lambda: {"name": "fancy", "available": "yes"}, False, "sten_plugin_info() returned available='yes', not a bool"),
    (lambda: {"name": "fancy", "available": False}, False, "the plugin reports itself unavailable and gives no reason"),
], ids=["another name", "available not a bool", "unavailable without a reason"])
def test_sten_plugins_names_a_plugin_by_its_entry_point(monkeypatch, info, available, reason):
    """The name ``STEN_PLUGINS`` / ``STEN_DISABLE_PLUGINS`` take is the entry point's: a plugin
    whose ``sten_plugin_info()`` said another name was listed under that one (which selects
    nothing); ``"available": "yes"`` read as available, and an unavailable plugin could give no reason."""
    eps = [FakeEntryPoint("fancy", lambda: plugin_module("fancy", [layout_class("FancyLayout", "fancy")], info=info))]
    with installed(monkeypatch, eps):
        row = next(row for row in sten.plugins.plugin_report() if row["layouts"] == ["FancyLayout"])
    assert row["name"] == "fancy"
    assert row.get("reported_name") == ("Fancy Plugin" if available else None)
    assert (row["available"], row["reason"]) == (available, reason)


def test_sten_plugins_in_strict_mode_prints_the_report_then_fails(monkeypatch, capsys):
    """Under ``STEN_STRICT_PLUGINS=1`` a plugin that failed to load made ``sten plugins`` (the
    command that says why) end in a ``PluginLoadError`` traceback."""
    def broken_load():
        raise ImportError("no module named broken_dep")

    eps = [FakeEntryPoint("broken", broken_load)]
    with installed(monkeypatch, eps, STEN_STRICT_PLUGINS="1"):
        assert cli.main(["plugins"]) == 1
        out, err = capsys.readouterr()
    rows = {row["name"]: row for row in json.loads(out)}
    assert rows["builtin"]["available"] and rows["broken"]["available"] is False
    assert "failed to load: ImportError: no module named broken_dep" in rows["broken"]["reason"]
    assert err.startswith("sten: error: sten plugin 'broken' failed to load")


def test_a_user_registration_stays_in_force_over_plugins_registering_later():
    """Plugins load on the first dispatched call, so user code's ``sten.register_*`` usually
    runs before them: the plugin's registration of the same key went on top and the
    user's implementation never ran, silently."""
    from sten_core.model.registry import Registry

    reg = Registry()
    mine, theirs = (lambda x: "mine"), (lambda x: "theirs")
    reg.register_conversion(int, float, mine)
    with reg.owner("plugin"):
        reg.register_conversion(int, float, theirs)
    assert reg.conversions[(int, float)] is mine and reg.owner_of("conversions", (int, float)) == "user"
    reg.remove_owner("plugin")
    assert reg.conversions[(int, float)] is mine
    with reg.owner("plugin"):
        reg.register_conversion(int, float, theirs)
    again = lambda x: "again"  # noqa: E731
    reg.register_conversion(int, float, again)  # user code registering again wins as before
    assert reg.conversions[(int, float)] is again and reg.owner_of("conversions", (int, float)) == "user"


def test_a_user_implementation_registered_before_the_first_call_runs(tmp_path):
    script = tmp_path / "user_impl.py"
    script.write_text(
        "import torch, torch.nn.functional as F, sten_core as sten\n"
        "called = []\n"
        "@sten.register_fwd_op_impl(operator=F.linear, inp=(torch.Tensor, sten.CsrTensor), "
        "out=[(sten.KeepAll, torch.Tensor)])\n"
        "def my_linear(ctx, inputs, outs):\n"
        "    called.append(1)\n"
        "    return inputs[0] @ inputs[1].to_dense().t()\n"
        "w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(3)))\n"
        "F.linear(torch.ones(2, 3), w)\n"
        "assert called, 'the built-in F.linear ran instead'\n"
        "print('ok')\n")
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_register_plugin_does_not_replace_an_installed_plugin_silently():
    """A test plugin registered as "builtin" (or as an installed plugin's name: "nm") removed that
    plugin and everything it registered (``F.linear`` on an n:m weight quietly left its kernel);
    re-registering one's own plugin under its name (a notebook cell run again) still replaces it."""
    sten.plugins.ensure_loaded()
    mine = types.ModuleType("mine")
    with pytest.raises(ValueError, match=r"^name: a plugin named 'builtin' is installed and loaded "
                                         r"\(sten_core.builtin.plugin\).*unregister_plugin\('builtin'\) first"):
        sten.plugins.register_plugin(mine, name="builtin")
    assert "CsrTensor" in sten.registry.layouts
    try:
        assert sten.plugins.register_plugin(mine, name="test-mine")
        assert sten.plugins.register_plugin(types.ModuleType("mine-again"), name="test-mine")
        assert sten.plugins.get_plugin_manager().get_plugin("test-mine").__name__ == "mine-again"
    finally:
        sten.plugins.unregister_plugin("test-mine")
