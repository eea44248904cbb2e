"""A short demo: sparsify an MLP's weights, train a few steps, show the dispatch.

Run with ``sten demo``.
"""

from __future__ import annotations

import collections

import torch


def run_demo(steps: int = 5) -> None:
    import sten_core as sten
    from sten_core import dispatch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    sb = sten.SparsityBuilder(model)
    for name in ("0.weight", "2.weight"):
        sb.set_weight(name, initial_sparsifier=sten.ScalarFractionSparsifier(0.9), out_format=sten.CsrTensor)
    sparse = sb.get_sparse_model()
    optimizer = torch.optim.AdamW(sparse.parameters(), lr=1e-2)
    x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
    counts: collections.Counter = collections.Counter()
    dispatch.observers.append(lambda e: counts.update([(e["key"].describe(), e["plan"])]))
    try:
        with sten.dispatch.quiet_fallbacks():
            for step in range(steps):
                loss = torch.nn.functional.cross_entropy(sparse(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                print(f"step {step}: loss {loss.item():.4f}")
    finally:
        dispatch.observers.pop()
    for name, p in sparse.named_parameters():
        layout = getattr(p, "wrapped_tensor", None)
        kind = type(layout).__name__ if layout is not None else "dense"
        nnz = layout.nnz if layout is not None else p.numel()
        print(f"{name:10s} {kind:12s} nnz {nnz}/{p.numel()}")
    print("dispatched (calls, plan, key):")
    for (key, plan), n in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(f"  {n:4d}  {plan:8s}  {key}")
