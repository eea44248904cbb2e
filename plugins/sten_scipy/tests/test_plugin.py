"""The plugin as a plugin: listed by ``sten plugins``, registered through the
hooks, removable without affecting the core."""

import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

import sten_core as sten
from sten_scipy import ScipyCsrTensor, plugin


def test_listed_and_available():
    rows = {row["name"]: row for row in sten.plugins.plugin_report()}
    assert "scipy" in rows
    row = rows["scipy"]
    assert row["available"] and row["version"] == "0.1.0"
    assert row["layouts"] == ["ScipyCscTensor", "ScipyCsrTensor"]
    assert {"sten_register", "sten_resolve_op", "sten_plugin_info"} <= set(row["hooks"])


def test_no_fallback_on_the_linear_path():
    plans = []
    sten.dispatch.add_observer(plans.append)
    try:
        w = sten.SparseParameterWrapper(ScipyCsrTensor.from_dense(torch.eye(4)))
        x = torch.randn(2, 4, requires_grad=True)
        F.linear(x, w, torch.zeros(4)).sum().backward()
    finally:
        sten.dispatch.remove_observer(plans.append)
    assert [p["plan"] for p in plans if p["key"].op is F.linear] == ["impl", "impl"]


def test_unregister_and_register_again():
    sten.plugins.unregister_plugin("scipy")
    try:
        assert "ScipyCsrTensor" not in sten.registry.layouts
        w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(3)))  # the core still works
        torch.testing.assert_close(F.linear(torch.ones(2, 3), w), torch.ones(2, 3))
    finally:
        assert sten.plugins.register_plugin(plugin, name="scipy")
    assert "ScipyCsrTensor" in sten.registry.layouts


def test_cli_lists_it_and_disabling_leaves_the_rest():
    """Run in a fresh interpreter (the installed entry point, or STEN_DISABLE_PLUGINS)."""
    code = ("import json, sten_core as sten; print(json.dumps(sorted(r['name'] for r in sten.plugins.plugin_report())))")
    env = dict(os.environ, STEN_DISABLE_PLUGINS="scipy")
    names = json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                      check=True).stdout)
    assert "scipy" not in names and "builtin" in names
    installed = any(ep.name == "scipy" for ep in __import__("importlib.metadata").metadata.entry_points(group="sten"))
    if installed:
        out = subprocess.run([sys.executable, "-m", "sten_core.tools.cli", "plugins"], capture_output=True, text=True, check=True)
        assert "scipy" in {row["name"] for row in json.loads(out.stdout)}
