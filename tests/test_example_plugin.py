"""The plugin tutorial's example package installs with pip and its layout works.

``examples/sten_example_plugin`` is installed into a fresh virtual environment
(that sees this interpreter's packages: torch, sten_core), then a separate
Python in that environment finds the plugin through its entry point, uses its
``BitmaskTensor`` layout with ``SparsityBuilder``, runs forward and backward,
and checks every result against the dense reference.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import venv

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "sten_example_plugin"

SCRIPT = textwrap.dedent(
    """
    import json, warnings
    import torch
    import sten_core as sten

    warnings.simplefilter("error", sten.DispatchWarning)  # any dense fallback fails the test
    sten.set_dispatch_failure("raise")
    from sten_example_plugin import BitmaskTensor, RowTopKSparsifier

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    sb = sten.SparsityBuilder(model)
    sb.set_weight("0.weight", initial_sparsifier=sten.ScalarFractionSparsifier(0.75), out_format=BitmaskTensor)
    sb.set_weight("2.weight", initial_sparsifier=RowTopKSparsifier(8), tmp_format=BitmaskTensor,
                  out_format=BitmaskTensor)
    sb.set_weight_grad("2.weight", tmp_format=BitmaskTensor, out_format=BitmaskTensor)
    sparse = sb.get_sparse_model()
    w0, w2 = sparse[0].weight, sparse[2].weight

    # the dense reference: the same weights, densified
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    with torch.no_grad():
        for i, w in ((0, w0), (2, w2)):
            ref[i].weight.copy_(w.to_dense())
            ref[i].bias.copy_(sparse[i].bias)
    x = torch.randn(6, 16, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    y, yr = sparse(x), ref(xr)
    torch.testing.assert_close(y, yr)
    g = torch.randn_like(yr)
    y.backward(g)
    yr.backward(g)
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w0.grad, ref[0].weight.grad)                 # dense weight gradient
    keep2 = w2.wrapped_tensor.mask()
    torch.testing.assert_close(w2.grad.to_dense(), ref[2].weight.grad * keep2)  # kept positions only
    torch.testing.assert_close(sparse[2].bias.grad, ref[2].bias.grad)

    # one optimizer step keeps the layout and the pattern
    keep0 = w0.wrapped_tensor.mask().clone()
    before = w0.to_dense().clone()
    torch.optim.AdamW(sparse.parameters(), lr=0.01).step()
    after = sparse[0].weight
    moved = (after.to_dense() - before)[keep0].abs().max().item()

    # the state dict saves and loads with weights_only=True (state_tensors / from_state_tensors)
    import io
    buffer = io.BytesIO()
    torch.save(sparse.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["0.weight"]
    reloaded = type(loaded.wrapped_tensor).__name__ == "BitmaskTensor" and torch.equal(loaded.to_dense(), after.to_dense())

    info = [row for row in sten.plugins.plugin_report() if row["name"] == "example"]
    print(json.dumps({
        "module": __import__("sten_example_plugin").__file__,
        "layout": type(w0.wrapped_tensor).__name__,
        "nnz": [w0.wrapped_tensor.nnz, w2.wrapped_tensor.nnz],
        "grad_layout": type(w2.grad.wrapped_tensor).__name__,
        "after_layout": type(after.wrapped_tensor).__name__,
        "same_pattern": bool(torch.equal(after.wrapped_tensor.mask(), keep0)),
        "zeros_stay_zero": bool((after.to_dense()[~keep0] == 0).all()),
        "moved": moved,
        "reloaded": bool(reloaded),
        "info": info,
    }))
    """
)


def _make_venv(path: pathlib.Path) -> pathlib.Path:
    """A venv that also sees this interpreter's site-packages (torch, sten_core, pip)."""
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(path)
    python = path / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    site_dir = pathlib.Path(out.stdout.strip())
    # This interpreter may itself be a venv, which --system-site-packages does not reach:
    # add its site-packages (processing their .pth files, e.g. editable sten_core) after the venv's own.
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    lines = [f"import site; site.addsitedir({p!r})" for p in sorted(ours)]
    (site_dir / "zz_parent_env.pth").write_text("\n".join(lines) + "\n")
    return python


def test_example_plugin_installs_and_its_layout_is_used(tmp_path: pathlib.Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    python = _make_venv(tmp_path / "venv")
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index",
         "--disable-pip-version-check", "-q", str(source)],
        capture_output=True, text=True, timeout=180,
    )
    assert install.returncode == 0, install.stdout + install.stderr

    run = subprocess.run([str(python), "-c", SCRIPT], capture_output=True, text=True, timeout=180,
                         cwd=tmp_path, env={**_clean_env(), "STEN_STRICT_PLUGINS": "0"})
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])

    assert str(tmp_path / "venv") in result["module"]  # the installed copy, not the source tree
    assert result["layout"] == "BitmaskTensor"
    assert result["nnz"] == [128, 32]  # 25 % of 32x16; 8 per row of 4x32
    assert result["grad_layout"] == "BitmaskTensor"
    assert result["after_layout"] == "BitmaskTensor"
    assert result["same_pattern"] and result["zeros_stay_zero"]
    assert result["moved"] > 0  # AdamW did update the kept values
    assert result["reloaded"]
    (info,) = result["info"]
    assert info["available"] is True and info["version"] == "0.1.0"
    assert info["layouts"] == ["BitmaskTensor"]
    assert set(info["hooks"]) == {"sten_register", "sten_plugin_info"}


def _clean_env() -> dict:
    """The environment without variables that would select or block plugins."""
    skip = {"STEN_PLUGINS", "STEN_DISABLE_PLUGINS", "PYTHONPATH", "PYTHONHOME"}
    return {k: v for k, v in os.environ.items() if k not in skip}
