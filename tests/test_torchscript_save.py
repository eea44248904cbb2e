"""TorchScript and sparse weights: scripting and freezing run correctly; saving a scripted
module that holds sparse tensors raises a clear error (it used to kill the process with a
segmentation fault); the dense model a docs recipe makes from it scripts, saves and loads."""

import io
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import sten_core as sten


def _sparse_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Sequential(torch.nn.Linear(8, 4)))
    builder = sten.SparsityBuilder()
    builder.set_weight(name="2.0.weight", initial_sparsifier=sten.ScalarFractionSparsifier(0.5),
                       out_format=sten.CsrTensor)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return builder.get_sparse_model(model).eval()


def test_scripted_and_frozen_sparse_modules_match_eager():
    model = _sparse_model()
    x = torch.randn(3, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scripted = torch.jit.script(model)
        frozen = torch.jit.freeze(torch.jit.script(model))
        torch.testing.assert_close(scripted(x), model(x))
        torch.testing.assert_close(frozen(x), model(x))


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("target", ["buffer", "path"])
def test_saving_a_scripted_sparse_module_is_a_clear_error(tmp_path, frozen, target):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = torch.jit.script(_sparse_model())
        if frozen:
            module = torch.jit.freeze(module)
    where = io.BytesIO() if target == "buffer" else str(tmp_path / "m.pt")
    with pytest.raises(NotImplementedError, match=r"torch.jit.save .* sparse tensors .* is a CsrTensor"):
        torch.jit.save(module, where)
    if frozen:
        return
    with pytest.raises(NotImplementedError, match="'2.0.weight' is a CsrTensor"):
        torch.jit.save(module, io.BytesIO())


def test_save_is_refused_in_a_fresh_process():
    """The segfault killed the interpreter, so check it where a crash is a return code."""
    code = textwrap.dedent("""
        import io, warnings, torch, sten_core as sten
        warnings.simplefilter("ignore")
        m = torch.nn.Linear(4, 4)
        m.weight = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.eye(4)))
        try:
            torch.jit.save(torch.jit.script(m), io.BytesIO())
        except NotImplementedError:
            print("refused")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    assert done.returncode == 0 and done.stdout.strip() == "refused", done.stderr[-2000:]


def test_dense_scripted_modules_and_the_densified_model_still_save():
    model = _sparse_model()
    dense = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Sequential(torch.nn.Linear(8, 4)))
    dense.load_state_dict(sten.densify_state_dict(model.state_dict()))
    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(dense.eval()), buf)
    buf.seek(0)
    loaded = torch.jit.load(buf)
    x = torch.randn(3, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(loaded(x), model(x))


def test_install_wraps_each_method_once():
    from sten_core.model import jit_save

    before = {name: getattr(torch.jit.RecursiveScriptModule, name) for name in jit_save.SAVE_METHODS
              if hasattr(torch.jit.RecursiveScriptModule, name)}
    jit_save.install()
    after = {name: getattr(torch.jit.RecursiveScriptModule, name) for name in before}
    assert before == after and all(getattr(f, "__sten_guard__", False) for f in after.values())
