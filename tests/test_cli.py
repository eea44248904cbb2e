"""The ``sten`` command: ``plugins``, ``bench`` and ``explain`` (in-process with
tiny shapes; one subprocess run checks exit code 2 without a traceback)."""

import csv
import json
import os
import subprocess
import sys

import pytest
import torch

from sten_core.tools.bench.layouts import nm_for_sparsity
from sten_core.tools.bench.options import parse_sparsities
from sten_core.tools.cli import main

TINY_LINEAR = ["bench", "linear", "--shape", "24x16", "--tokens", "8", "--repeats", "1", "--no-progress"]


def test_plugins_lists_builtin(capsys):
    assert main(["plugins"]) == 0
    rows = json.loads(capsys.readouterr().out)
    builtin = next(r for r in rows if r["name"] == "builtin")
    assert builtin["available"] and "CsrTensor" in builtin["layouts"]
    assert all({"name", "available", "reason"} <= set(r) for r in rows)


def test_bench_linear_writes_table_csv_json_png(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main([*TINY_LINEAR, "--layouts", "dense,torch_csr,torch_coo", "--sparsities", "50,90", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "median ms" in text and "speed-up" in text and "threads" in text
    assert f"plot: {out / 'linear.png'}" in text
    assert (out / "linear.png").stat().st_size > 1000
    rows = json.loads((out / "linear.json").read_text())["results"]
    assert [(r["layout"], r["sparsity"]) for r in rows] == [
        ("dense", 0.0), ("torch_csr", 0.5), ("torch_csr", 0.9), ("torch_coo", 0.5), ("torch_coo", 0.9)]
    for r in rows:
        assert r["threads"] == torch.get_num_threads()
        assert r["fallback_keys"] == 0 and r["median_ms"] > 0
        if r["layout"] == "dense":
            assert r["speedup"] == pytest.approx(1.0) and r["weight_density"] == 1.0
        else:  # every sparse result was checked against the dense layer holding the same weights
            assert r["max_rel_err"] < 1e-5
            assert r["weight_density"] == pytest.approx(1 - r["sparsity"], abs=1 / (24 * 16))
    with open(out / "linear.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)


def test_bench_nm_maps_sparsity_to_pattern(tmp_path, capsys):
    pytest.importorskip("sten_nm")
    from sten_core.tools.bench.layouts import availability, by_name

    if not availability(by_name("nm"), "cpu")[0]:
        pytest.skip(availability(by_name("nm"), "cpu")[1])
    rc = main([*TINY_LINEAR, "--layouts", "nm", "--sparsities", "75", "--out", str(tmp_path)])
    assert rc == 0
    (row,) = json.loads((tmp_path / "linear.json").read_text())["results"]
    assert row["pattern"] == "1:4" and row["weight_density"] == pytest.approx(0.25)
    assert row["max_rel_err"] < 1e-5 and row["speedup"] is None  # no dense row asked for


def test_nm_for_sparsity():
    assert [nm_for_sparsity(s) for s in (0.5, 0.6, 0.75, 0.8, 0.9, 0.95)] == [
        (2, 4), (2, 5), (1, 4), (1, 5), (1, 10), (1, 20)]


def test_parse_sparsities():
    assert parse_sparsities("90, 50,0.75,50") == [0.5, 0.75, 0.9]


def test_bench_bert_layer_tiny(tmp_path, capsys):
    pytest.importorskip("transformers")
    rc = main(["bench", "--layouts", "dense,csr", "--sparsities", "90", "--size", "tiny", "--batch", "1", "--seq-len", "4",
               "--repeats", "1", "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "bert_layer.json").read_text())["results"]
    assert [r["layout"] for r in rows] == ["dense", "torch_csr"]
    assert rows[1]["max_rel_err"] < 1e-4 and rows[1]["fallback_keys"] == 0
    assert rows[1]["weight_density"] == pytest.approx(0.1, abs=1e-4)
    assert (tmp_path / "bert_layer.png").exists()


@pytest.mark.parametrize("args, message", [
    (["--layouts", "dense,bogus"], "unknown layout 'bogus'; valid choices: dense, torch_coo"),
    (["--layouts", "2:4"], "layout '2:4' is not available on cpu"),
    (["--sparsities", "150"], "'150' is out of range"),
    (["--sparsities", "half"], "'half' is not a number"),
    (["--threads", "0"], "--threads: '0' is not a positive integer"),
    (["--device", "tpu"], "unknown device 'tpu'; valid choices: auto, cpu, cuda"),
    (["--shape", "3x"], "--shape: expected OUTxIN"),
])
def test_bench_bad_input_exit_2(args, message, tmp_path, capsys):
    if args == ["--layouts", "2:4"] and torch.cuda.is_available():
        args = ["--layouts", "2:4", "--device", "cpu"]
    assert main([*TINY_LINEAR, "--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sten: error: ") and message in err and err.count("\n") == 1
    assert not any(tmp_path.iterdir())  # nothing ran


def test_bad_input_in_a_subprocess_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sten_core.tools.cli", "bench", "--layouts", "nope",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown layout 'nope'" in lines[0] and "valid choices" in lines[0]


def test_explain_builtin_example(capsys):
    pytest.importorskip("transformers")
    assert main(["explain", "bert", "--size", "tiny", "--batch", "1", "--seq-len", "4"]) == 0
    text = capsys.readouterr().out
    assert "linear_sparse_sparse_fwd" in text and "output.dense" in text  # the paper's A.1, built in
    assert "0 dense fallbacks" in text


FACTORY = '''
import torch, sten_core as sten

def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    sb = sten.SparsityBuilder(model)
    sb.set_weight("0.weight", initial_sparsifier=sten.ScalarFractionSparsifier(0.5), out_format=sten.CsrTensor)
    return sb.get_sparse_model(), torch.randn(4, 8)

def not_a_pair():
    return 3
'''


def test_explain_user_factory_json(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_factory_mod.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["explain", "my_factory_mod:make", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    (row,) = rows
    assert row["plan"] == "impl" and row["calls"] == 1 and row["sites"] == {"0": 1}
    assert main(["explain", "my_factory_mod:not_a_pair"]) == 2
    assert "must return (model, inputs)" in capsys.readouterr().err


@pytest.mark.parametrize("spec, message", [
    ("no_such_module_xyz:make", "cannot import 'no_such_module_xyz'"),
    ("nocolon", "expected a built-in example (bert) or module:factory"),
    ("os:no_such_factory", "os has no callable 'no_such_factory'"),
])
def test_explain_bad_model_exit_2(spec, message, capsys):
    assert main(["explain", spec]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_bench_bert_wrapper_exists():
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_bert.py")
    assert "main([\"bench\"" in open(path).read()


class _BrokenLayout:
    """A registered layout whose construction fails: its bench row fails, the rest run."""

    @classmethod
    def from_dense(cls, tensor):
        raise RuntimeError("cannot build BrokenLayout")

    def to_dense(self):
        raise RuntimeError("unreachable")


class _BrokenPlugin:
    import sten_core as _sten

    @_sten.hookimpl
    def sten_register(self, registry):
        registry.register_layout(_BrokenLayout, "BrokenLayout")


def test_failing_layout_is_reported_and_exit_1(tmp_path, capsys):
    import sten_core as sten

    sten.plugins.register_plugin(_BrokenPlugin(), name="test_cli_broken")
    try:
        rc = main([*TINY_LINEAR, "--layouts", "dense,BrokenLayout", "--sparsities", "50", "--out", str(tmp_path)])
    finally:
        sten.plugins.unregister_plugin("test_cli_broken")
    assert rc == 1
    text = capsys.readouterr().out
    assert "failed: RuntimeError: set_weight('weight'" in text and "cannot build BrokenLayout" in text
    rows = json.loads((tmp_path / "linear.json").read_text())["results"]
    assert rows[0]["median_ms"] > 0 and rows[1]["median_ms"] is None


def test_threads_list_gives_rows_per_thread_count(tmp_path, capsys):
    before = torch.get_num_threads()
    rc = main([*TINY_LINEAR, "--layouts", "dense,csr", "--sparsities", "50", "--threads", "1,2",
               "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "linear.json").read_text())["results"]
    assert [(r["layout"], r["threads"]) for r in rows] == [
        ("dense", 1), ("torch_csr", 1), ("dense", 2), ("torch_csr", 2)]
    assert torch.get_num_threads() == before  # restored


def test_bench_out_that_is_a_file_or_cannot_be_made_fails_before_running(tmp_path, capsys):
    """``--out`` naming an existing file (or a path that cannot be made) failed with a traceback
    after the whole benchmark had run, its table never printed."""
    afile = tmp_path / "models.py"
    afile.write_text("")
    assert main([*TINY_LINEAR, "--out", str(afile)]) == 2
    assert "is a file; give a directory" in capsys.readouterr().err
    assert main([*TINY_LINEAR, "--out", str(afile / "sub")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sten: error: --out") and "cannot make the directory" in err and err.count("\n") == 1
