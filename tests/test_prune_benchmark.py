"""``benchmarks/prune_lm.py --quick`` (docs/pruning.md) runs end to end in seconds.

The quick models are too small and too briefly trained for the methods' ranking to be
stable; this checks that every setting runs and prunes exactly what it says.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sklearn", reason="scikit-learn is needed for load_digits (the test extra)")

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("prune_lm", ROOT / "benchmarks" / "prune_lm.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_quick_run(tmp_path, capsys):
    bench = _bench()
    threads = torch.get_num_threads()
    try:
        result = bench.main(["--quick", "--json", str(tmp_path / "out.json")])
    finally:
        torch.set_num_threads(threads)
    lm, digits = result["lm"], result["digits"]
    grouped = bool(bench.grouped_layouts())  # sten_nm installed: the grouped-format rows too
    assert [(r["method"], r["pattern"]) for r in lm["rows"]] == [
        ("dense", "dense"), ("magnitude", "50%"), ("wanda", "50%"), ("sparsegpt", "50%"),
        ("magnitude", "2:4"), ("wanda", "2:4"), ("sparsegpt", "2:4"), ("wanda (one pass)", "50%"),
        ("wanda (one pass)", "2:4"), ("sparsegpt (one pass)", "50%"), ("sparsegpt (one pass)", "2:4")] + (
        [(method, f"2:4 {suffix}") for suffix in ("grouped", "row-grouped") for method in ("magnitude", "wanda", "sparsegpt")]
        if grouped else [])
    assert sum(r["pattern"] in ("1:4 grouped", "1:4 row-grouped") for r in digits["rows"]) == (6 if grouped else 0)
    for r in lm["rows"]:
        assert math.isfinite(r["perplexity"]) and 1.0 < r["perplexity"] < 256.0
        assert r["sparsity"] == pytest.approx(0.0 if r["method"] == "dense" else 0.5, abs=1e-3)
    for r in digits["rows"]:
        expected = {"dense": 0.0, "50%": 0.5, "2:4": 0.5, "75%": 0.75, "1:4": 0.75}[r["pattern"].split(" ")[0]]
        # zero weights; SparseGPT zeroes the weights of inputs never seen (blank pixels) even where kept
        # grouped n:m of the 10-row output layer: its last block of 4 rows has 2 padding rows,
        # so a column keeps 0, 1 or 2 of the real ones there (slightly off the nominal density)
        # and every column stores n of m, so a dead input's (SparseGPT sets its weights to 0)
        # kept slots hold zeros (more zero weights than the nominal density; plain n:m along
        # the inputs puts them in the pruned slots instead)
        is_grouped = r["pattern"].endswith(" grouped")  # ColumnGroupedNMTensor
        low = expected - (0.002 if is_grouped else 0.0)
        high = expected + (0.1 if is_grouped and r["method"] == "sparsegpt" else 0.01)
        assert low <= r["sparsity"] <= high and 0.0 <= r["accuracy"] <= 1.0
    check = lm["layout_check"]
    if check is not None:  # sten_nm installed: the NMTensor model computes what the dense-with-zeros one does
        assert check["layouts"] == ["NMTensor"]
        assert check["perplexity_layout"] == pytest.approx(check["perplexity_dense_zeros"], rel=1e-5)
    out = capsys.readouterr().out
    assert "| sparsegpt | 2:4 |" in out and (tmp_path / "out.json").exists()
