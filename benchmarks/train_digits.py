"""Train a small MLP on scikit-learn's bundled ``load_digits`` dense and at 90 %
weight sparsity through ``SparsityScheduler`` (nothing is downloaded).

Variants: ``dense``; ``gmp-csr`` (gradual magnitude pruning 0 → 90 %, CSR);
``oneshot-csr`` (one-shot 90 % at step 0, CSR); ``rigl-csr`` (90 % prune-and-
regrow); with ``sten_nm`` installed also ``gmp-nm`` (9:10 → 1:10, ``NMTensor``)
and ``oneshot-nm`` (1:10 at step 0). All three weight matrices are scheduled;
biases stay dense.

Usage:
    python benchmarks/train_digits.py                 # all variants, a Markdown table
    python benchmarks/train_digits.py --variants dense gmp-csr --epochs 10
"""

from __future__ import annotations

import argparse
import time
import warnings
from typing import Any

import torch
import torch.nn.functional as F

import sten_core as sten
from sten_core.training.schedule import GradualPruning, OneShot, PruneRegrow, SparsityScheduler

HIDDEN = 200
SPARSITY = 0.9
WEIGHTS = ("fc1.weight", "fc2.weight", "fc3.weight")


def nm_available() -> bool:
    try:
        import sten_nm  # noqa: F401
    except Exception:
        return False
    return True


VARIANTS = ["dense", "gmp-csr", "oneshot-csr", "rigl-csr"] + (["gmp-nm", "oneshot-nm"] if nm_available() else [])


class MLP(torch.nn.Module):
    def __init__(self, hidden: int = HIDDEN):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, hidden)
        self.fc2 = torch.nn.Linear(hidden, hidden)
        self.fc3 = torch.nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def load_data(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """The 1797 digits (8x8, scaled to [0, 1]) split 80/20 with a fixed seed."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = len(x) // 5
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


def _nm_dim0_ok() -> bool:
    """Whether this sten_nm builds a dim-0 NMTensor from a mask (older builds check the mask's shape wrongly)."""
    from sten_nm import NMTensor

    try:
        NMTensor.from_dense(torch.ones(4, 2), n=1, m=2, dim=0, mask=torch.eye(4, 2, dtype=torch.bool))
    except ValueError:
        return False
    return True


def _schedules(variant: str, total: int) -> dict[str, tuple[Any, type, Any]]:
    """Per weight: (schedule, layout, sparsifier) of a variant."""
    if variant == "dense":
        return {}
    end = int(total * 0.6)
    if variant.endswith("-nm"):
        from sten_nm import NMSparsifier, NMTensor

        # fc1 is [200, 64]: its groups of 10 run along the 200 outputs (dim 0); the others along the inputs
        sparsifiers = {"fc1.weight": NMSparsifier(1, 10, dim=0 if _nm_dim0_ok() else 1), "fc2.weight": NMSparsifier(1, 10),
                       "fc3.weight": NMSparsifier(1, 10)}
        schedule = (GradualPruning(0.1, SPARSITY, start=0, end=end, every=max(1, end // 16))
                    if variant == "gmp-nm" else OneShot(SPARSITY))
        return {w: (schedule, NMTensor, sparsifiers[w]) for w in WEIGHTS}
    schedule = {
        "gmp-csr": GradualPruning(0.0, SPARSITY, start=0, end=end, every=max(1, end // 16)),
        "oneshot-csr": OneShot(SPARSITY),
        "rigl-csr": PruneRegrow(SPARSITY, drop_fraction=0.3, start=0, end=end, every=max(1, total // 20)),
    }[variant]
    return {w: (schedule, sten.CsrTensor, None) for w in WEIGHTS}


def train(variant: str = "dense", epochs: int = 30, batch: int = 64, lr: float = 3e-3, seed: int = 0,
          check_every_step: bool = False) -> dict[str, Any]:
    """Train one variant; returns test accuracy, final sparsity per weight and timing.

    ``check_every_step`` asserts after every step that each scheduled weight
    stores exactly the schedule's number of positions in its layout.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    torch.manual_seed(seed)
    xtr, ytr, xte, yte = load_data(seed)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    steps_per_epoch = -(-len(xtr) // batch)
    total = epochs * steps_per_epoch
    sched = SparsityScheduler(model, opt)
    plan = _schedules(variant, total)
    for name, (schedule, layout, sparsifier) in plan.items():
        sched.add(name, schedule, layout=layout, sparsifier=sparsifier)
    gen = torch.Generator().manual_seed(seed + 1)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's "sparse CSR is beta" note
        for _ in range(epochs):
            perm = torch.randperm(len(xtr), generator=gen)
            for i in range(0, len(xtr), batch):
                idx = perm[i:i + batch]
                loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
                loss.backward()
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                if check_every_step:
                    for name in plan:
                        _check(model, sched, name, plan[name][1])
        seconds = time.perf_counter() - start
        with torch.no_grad():
            acc = (model(xte).argmax(1) == yte).float().mean().item()
    return {
        "variant": variant, "accuracy": acc, "steps": total, "seconds": seconds,
        "sparsity": {name: sched.sparsity(name) for name in plan},
        "layouts": {name: type(model.get_parameter(name).wrapped_tensor).__name__ for name in plan},
        "model": model, "scheduler": sched, "optimizer": opt,
    }


def _check(model: torch.nn.Module, sched: SparsityScheduler, name: str, layout: type) -> None:
    w = model.get_parameter(name)
    stored = w.wrapped_tensor
    want = sched.target_nnz(name)
    if type(stored) is not layout or stored.nnz != want or sched.nnz(name) != want:
        raise AssertionError(f"{name} at step {sched.step_count}: {type(stored).__name__} nnz={stored.nnz}, "
                             f"schedule wants {want} in {layout.__name__}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # small matrices: one thread is fastest
    print(f"load_digits, MLP 64-{HIDDEN}-{HIDDEN}-10, AdamW lr 3e-3, batch 64, {args.epochs} epochs, seed {args.seed}")
    print("| variant | test accuracy | weight sparsity (fc1, fc2, fc3) | layout | steps | train s |")
    print("|---|---|---|---|---|---|")
    for variant in args.variants:
        r = train(variant, epochs=args.epochs, seed=args.seed)
        sp = ", ".join(f"{s:.4f}" for s in r["sparsity"].values()) or "0"
        layout = ", ".join(sorted(set(r["layouts"].values()))) or "dense"
        print(f"| {variant} | {r['accuracy'] * 100:.2f} % | {sp} | {layout} | {r['steps']} | {r['seconds']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
