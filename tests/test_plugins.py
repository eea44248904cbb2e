"""Plugins: registered without installing, failures reported and undone, strict
mode, a throw-away plugin package installed for real into a temp venv, the
environment variables and the ``sten plugins`` command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import types
import warnings
from pathlib import Path

import pytest
import torch

import sten_core as sten
from fake_layouts import DenseCopyLayout
from sten_core.plugins.manager import PluginLoadError, PluginLoadWarning

T = torch.Tensor
ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


class PluginLayout(DenseCopyLayout):
    """The fake plugin's layout."""


class HalfLayout(PluginLayout):
    """Registered by the broken plugin before it fails."""


def make_plugin(name: str, calls: list) -> types.ModuleType:
    module = types.ModuleType(name)

    @sten.hookimpl
    def sten_register(registry):
        registry.register_layout(PluginLayout)

        def mul_impl(ctx, inputs, output_sparsifiers):
            calls.append("plugin mul")
            return inputs[0].to_dense() * inputs[1]

        registry.register_fwd_op_impl(torch.mul, (PluginLayout, T), [(sten.KeepAll, T)], mul_impl)

    @sten.hookimpl
    def sten_plugin_info():
        return {"name": name, "version": "9.9", "available": True, "reason": None}

    module.sten_register = sten_register
    module.sten_plugin_info = sten_plugin_info
    return module


def make_broken_plugin(name: str) -> types.ModuleType:
    module = types.ModuleType(name)

    @sten.hookimpl
    def sten_register(registry):
        registry.register_layout(HalfLayout)
        raise RuntimeError("boom in sten_register")

    module.sten_register = sten_register
    return module


@pytest.fixture
def cleanup():
    names: list[str] = []
    yield names
    for name in names:
        sten.plugins.unregister_plugin(name)
        sten.plugins.failed.pop(name, None)
    sten.dispatch.reset_warnings()


def test_fake_plugin_registered_without_installing(cleanup):
    calls: list = []
    cleanup.append("test-fake")
    assert sten.plugins.register_plugin(make_plugin("test-fake", calls), name="test-fake")
    assert sten.registry.layout("PluginLayout") is PluginLayout
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    w = sten.SparseTensorWrapper(PluginLayout.from_dense(x))
    mul = sten.sparsified_op(torch.mul, out_fmt=(sten.KeepAll(), T, sten.KeepAll(), T))
    with warnings.catch_warnings():
        warnings.simplefilter("error", sten.DispatchWarning)
        out = mul(w, y)
    assert torch.equal(out, x * y) and calls == ["plugin mul"]
    row = next(r for r in sten.plugins.plugin_report() if r["name"] == "test-fake")
    assert row["layouts"] == ["PluginLayout"] and row["version"] == "9.9" and row["available"]
    assert "sten_register" in row["hooks"]
    # sparsifiers reach the plugin's layout through from_dense
    s = sten.sparsify(sten.ScalarFractionSparsifier(0.5), x, PluginLayout)
    assert torch.equal(s.to_dense(), x * sten.ScalarFractionSparsifier(0.5).mask(x))
    sten.plugins.unregister_plugin("test-fake")
    with pytest.raises(ValueError, match="PluginLayout"):
        sten.registry.layout("PluginLayout")


def test_broken_plugin_is_reported_skipped_and_undone(cleanup):
    calls: list = []
    cleanup += ["test-broken", "test-good"]
    with pytest.warns(PluginLoadWarning, match="test-broken") as record:
        assert not sten.plugins.register_plugin(make_broken_plugin("test-broken"), name="test-broken")
    assert "boom in sten_register" in str(record[0].message)
    assert "HalfLayout" not in sten.registry.layouts, "partial registrations are removed"
    assert not sten.plugins.get_plugin_manager().has_plugin("test-broken")
    assert "test-broken" in sten.plugins.failed
    row = next(r for r in sten.plugins.plugin_report() if r["name"] == "test-broken")
    assert row["available"] is False and "boom" in row["reason"]
    # the others keep working
    assert sten.plugins.register_plugin(make_plugin("test-good", calls), name="test-good")
    w = sten.SparseTensorWrapper(PluginLayout.from_dense(torch.ones(2, 2)))
    mul = sten.sparsified_op(torch.mul, out_fmt=(sten.KeepAll(), T, sten.KeepAll(), T))
    assert torch.equal(mul(w, torch.full((2, 2), 3.0)), torch.full((2, 2), 3.0))
    assert calls == ["plugin mul"]
    x = torch.randn(4, 4)
    assert torch.equal(sten.convert(sten.convert(x, sten.CsrTensor), torch.Tensor), x)


def test_strict_plugins_turns_failure_into_error(cleanup, monkeypatch):
    cleanup.append("test-strict")
    monkeypatch.setenv("STEN_STRICT_PLUGINS", "1")
    with pytest.raises(PluginLoadError, match="test-strict"):
        sten.plugins.register_plugin(make_broken_plugin("test-strict"), name="test-strict")
    assert "HalfLayout" not in sten.registry.layouts


# -- a real plugin package in a temp venv ---------------------------------------------

PYPROJECT = """
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "sten-throwaway"
version = "0.0.7"

[project.entry-points.sten]
throwaway = "sten_throwaway.plugin"
throwaway_bad = "sten_throwaway_bad.plugin"

[tool.setuptools]
packages = ["sten_throwaway", "sten_throwaway_bad"]
"""

GOOD_PLUGIN = """
import torch
import sten_core


class ThrowawayLayout:
    def __init__(self, data):
        self.data = data

    @classmethod
    def from_dense(cls, tensor):
        return cls(tensor.detach().clone())

    def to_dense(self):
        return self.data


@sten_core.hookimpl
def sten_register(registry):
    registry.register_layout(ThrowawayLayout)
"""

BAD_PLUGIN = """
import sten_core


class BadLayout:
    @classmethod
    def from_dense(cls, tensor):
        return cls()

    def to_dense(self):
        return None


@sten_core.hookimpl
def sten_register(registry):
    registry.register_layout(BadLayout)
    raise RuntimeError("throwaway_bad is broken")
"""

CHECK = """
import json, os, sys, warnings
import torch
import sten_core as sten
assert sten.plugins.loaded() is False, "no plugin is loaded at import"


def check():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        try:
            sten.plugins.ensure_loaded()
        except sten.plugins.PluginLoadError as error:
            return {"error": str(error)}
    report = {r["name"]: r for r in sten.plugins.plugin_report()}
    messages = [str(w.message) for w in record if issubclass(w.category, sten.plugins.PluginLoadWarning)]
    result = {"names": sorted(report), "layouts": sorted(sten.registry.layouts), "warnings": messages,
              "failed": sorted(sten.plugins.failed)}
    if "ThrowawayLayout" in sten.registry.layouts:
        layout = sten.registry.layout("ThrowawayLayout")
        w = sten.sparsify(sten.ScalarThresholdSparsifier(1.0), torch.tensor([[0.5, 2.0]]), layout)
        result["values"] = w.to_dense().tolist()
        result["version"] = report["throwaway"]["version"]
    return result


results = [check()]  # under the environment the process was started with
for extra in json.loads(sys.argv[1]):  # then each further environment, reloading the plugins
    for var in ("STEN_PLUGINS", "STEN_DISABLE_PLUGINS", "STEN_STRICT_PLUGINS"):
        os.environ.pop(var, None)
    os.environ.update(extra)
    sten.plugins.reset()
    results.append(check())
print("RESULT" + json.dumps(results))
"""


def _throwaway_venv(tmp_path: Path) -> Path:
    """A venv that sees this environment's packages, with the plugin package installed."""
    pkg = tmp_path / "pkg"
    for sub, code in (("sten_throwaway", GOOD_PLUGIN), ("sten_throwaway_bad", BAD_PLUGIN)):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
        (pkg / sub / "plugin.py").write_text(code)
    (pkg / "pyproject.toml").write_text(PYPROJECT)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    # the test environment is itself a venv: --system-site-packages would not show its
    # packages (torch, sten_core), so point the new venv at them
    new_site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   check=True, capture_output=True, text=True).stdout.strip())
    here_site = sysconfig.get_paths()["purelib"]
    (new_site / "zz_sten_test_parent.pth").write_text(f"import site; site.addsitedir({here_site!r})\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                    "--no-build-isolation", "--no-deps", "--no-index", str(pkg)],
                   check=True, capture_output=True, timeout=120)
    return venv


def _run_checks(python: Path, envs: list[dict]) -> list[dict]:
    """Run CHECK in a fresh process started with ``envs[0]``, then reloading with the others."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEN_")}
    env.update(envs[0])
    proc = subprocess.run([str(python), "-c", CHECK, json.dumps(envs[1:])], env=env, capture_output=True,
                          text=True, cwd="/", timeout=180)
    assert proc.returncode == 0, proc.stderr
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def test_installed_plugin_package_in_a_temp_venv(tmp_path):
    venv = _throwaway_venv(tmp_path)
    python = venv / "bin" / "python"
    both, disabled, only, strict = _run_checks(python, [
        {"STEN_PLUGINS": "throwaway,throwaway_bad"},
        {"STEN_DISABLE_PLUGINS": "throwaway_bad,nm,scipy,cuda24"},
        {"STEN_PLUGINS": "throwaway"},
        {"STEN_PLUGINS": "throwaway_bad", "STEN_STRICT_PLUGINS": "1"},
    ])
    # loaded from its entry point; the broken one is reported by name and skipped, undone
    assert "ThrowawayLayout" in both["layouts"] and "BadLayout" not in both["layouts"]
    assert both["values"] == [[0.0, 2.0]] and both["version"] == "0.0.7"
    assert len(both["warnings"]) == 1 and "throwaway_bad" in both["warnings"][0]
    assert "throwaway_bad is broken" in both["warnings"][0]
    assert both["failed"] == ["throwaway_bad"] and "throwaway" in both["names"]
    # STEN_DISABLE_PLUGINS blocks it: no warning
    assert "ThrowawayLayout" in disabled["layouts"] and disabled["warnings"] == []
    assert "throwaway_bad" not in disabled["names"] and "nm" not in disabled["names"]
    # STEN_PLUGINS loads only those (the built-in plugins are always there)
    assert only["names"] == ["builtin", "pruning", "throwaway"] and only["warnings"] == []
    # STEN_STRICT_PLUGINS: an error, not a warning
    assert "throwaway_bad" in strict["error"] and "throwaway_bad is broken" in strict["error"]


# -- the sten command -------------------------------------------------------------------

def test_sten_plugins_command_prints_json():
    sten_cmd = VENV_BIN / "sten"
    if not sten_cmd.exists():
        pytest.skip(f"console script not installed at {sten_cmd}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEN_")}
    env["STEN_PLUGINS"] = ""  # only the built-in plugin: quick and independent of what is installed
    proc = subprocess.run([str(sten_cmd), "plugins"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert isinstance(rows, list) and rows
    for row in rows:
        assert {"name", "version", "available", "reason", "layouts", "hooks"} <= set(row)
    builtin = next(r for r in rows if r["name"] == "builtin")
    assert builtin["available"] is True and builtin["version"] == sten.__version__
    assert {"CooTensor", "CscTensor", "CsrTensor", "DenseTensor"} <= set(builtin["layouts"])
    assert "sten_register" in builtin["hooks"]
