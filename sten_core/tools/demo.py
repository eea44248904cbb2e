"""A short demo: sparsify an MLP's weights, train a few steps, show the dispatch.

Run with ``sten demo``.
"""

from __future__ import annotations

import collections

import torch

from sten_core.builtin.torch_layouts import CsrTensor
from sten_core.dispatch import observed, quiet_fallbacks
from sten_core.model.sparsifiers import ScalarFractionSparsifier
from sten_core.training.builder import SparsityBuilder


def run_demo(steps: int = 5) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    sb = SparsityBuilder(model)
    for name in ("0.weight", "2.weight"):
        sb.set_weight(name, initial_sparsifier=ScalarFractionSparsifier(0.9), out_format=CsrTensor)
    sparse = sb.get_sparse_model()
    optimizer = torch.optim.AdamW(sparse.parameters(), lr=1e-2)
    x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
    counts: collections.Counter = collections.Counter()
    with observed(lambda e: counts.update([(e["key"].describe(), e["plan"])])), quiet_fallbacks():
        for step in range(steps):
            loss = torch.nn.functional.cross_entropy(sparse(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            print(f"step {step}: loss {loss.item():.4f}")
    for name, p in sparse.named_parameters():
        layout = getattr(p, "wrapped_tensor", None)
        kind = type(layout).__name__ if layout is not None else "dense"
        nnz = layout.nnz if layout is not None else p.numel()
        print(f"{name:10s} {kind:12s} nnz {nnz}/{p.numel()}")
    print("dispatched (calls, plan, key):")
    for (key, plan), n in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(f"  {n:4d}  {plan:8s}  {key}")
