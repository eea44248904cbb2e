"""A real training result (issue #8): an MLP on scikit-learn's bundled digits,
dense and at 90 % weight sparsity by gradual magnitude pruning into CSR.

Same code and seeds as ``python benchmarks/train_digits.py`` (docs/training.md).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("sklearn", reason="scikit-learn is needed for load_digits (the test extra)")

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("train_digits", ROOT / "benchmarks" / "train_digits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gradual_pruning_matches_dense_at_exact_sparsity():
    bench = _bench()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small matrices: one thread is fastest and robust on a busy machine
    try:
        dense = bench.train("dense")
        gmp = bench.train("gmp-csr", check_every_step=True)  # exact schedule nnz in CsrTensor at every step
    finally:
        torch.set_num_threads(threads)
    assert dense["accuracy"] > 0.95
    assert gmp["accuracy"] >= dense["accuracy"] - 0.03, (gmp["accuracy"], dense["accuracy"])
    model = gmp["model"]
    for name in bench.WEIGHTS:
        w = model.get_parameter(name)
        assert type(w.wrapped_tensor).__name__ == "CsrTensor"
        assert w.wrapped_tensor.nnz == round(w.numel() * 0.1)
        assert gmp["sparsity"][name] == pytest.approx(0.9, abs=1e-12)
    # the sparse model's output equals the dense computation with its weights
    x = torch.rand(5, 64)
    with torch.no_grad():
        ref = x
        for i, layer in enumerate((model.fc1, model.fc2, model.fc3)):
            ref = torch.nn.functional.linear(ref, layer.weight.to_dense(), layer.bias)
            ref = ref.relu() if i < 2 else ref
        torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)
