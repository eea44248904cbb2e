"""The side-by-side benchmark script runs without the original STen (its rows left out,
said so) and checks every row against the dense reference before timing it."""

import importlib.util
import pathlib

import torch

from conftest import requires_kernel

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_vs_original.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_vs_original", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@requires_kernel
def test_runs_without_the_original(tmp_path, capsys):
    out = tmp_path / "report.md"
    threads = torch.get_num_threads()
    try:  # the script sets torch's thread count for the process: give it back to the other tests
        _load().main(["--no-original", "--shapes", "40x48", "--patterns", "2:4,1:4", "--batch", "9",
                      "--rounds", "1", "--reps", "1", "--threads", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    text = out.read_text()
    assert "Original STen: not measured (left out (--no-original))" in text
    assert "| 40x48 | 2:4 | ours: ColumnGroupedNMTensor (paper format) (g=" in text
    assert "original STen grouped n:m g=" not in text
    assert text.count("| 40x48 |") == 2 * 4 + 2   # 4 rows per case + 2 summary rows


def test_the_original_workdir_is_made_when_missing(tmp_path):
    """``--orig-workdir`` naming a folder not made yet: the original is set up there (or left
    out because it is not installed), not failed with FileNotFoundError."""
    workdir = tmp_path / "not" / "made"
    orig, why = _load().load_original(str(workdir))
    assert workdir.is_dir()
    assert "FileNotFoundError" not in why
