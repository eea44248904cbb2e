"""Optimizer steps on a sparse weight: one ``opt.step()`` of six ``torch.optim`` optimizers on a
2048x2048 ``CsrTensor`` weight at 10 %, with the default (dense) gradient and with one kept in the
weight's layout, 1 torch thread. Prints one JSON object: the median step time in ms of each
(optimizer, gradient format) and the stored values of its sparse state (the weight's count when
the state keeps its pattern).

Run it from two checkouts one after the other, alternating, to compare them (this machine's
noise is larger than most differences):

    python benchmarks/bench_optimizer_steps.py
"""

from __future__ import annotations

import json
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

import sten_core as sten

SIZE, STEPS = 2048, 9
OPTIMIZERS = {
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-3),
    "SGD+momentum": lambda p: torch.optim.SGD(p, lr=1e-3, momentum=0.9),
    "RMSprop+momentum": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.9),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=1e-3),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-3),
}
GRAD_FORMATS = {"none": None, "pattern-keeping": (sten.KeepAll(), sten.CsrTensor, sten.KeepAll(), sten.CsrTensor)}


def step_times(base: torch.Tensor, x: torch.Tensor) -> dict:
    """``{"<optimizer> | <grad format>": median ms, "... | state nnz": [values per sparse state]}``."""
    results = {}
    for fmt_name, fmt in GRAD_FORMATS.items():
        for name, make in OPTIMIZERS.items():
            w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(base), grad_fmt=fmt)
            opt = make([w])
            F.linear(x, w).sum().backward()
            times = []
            for _ in range(STEPS):
                started = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - started)
            results[f"{name} | {fmt_name}"] = round(statistics.median(times[2:]) * 1e3, 2)
            state = [v for v in opt.state[w].values() if isinstance(v, sten.SparseTensorWrapper)]
            results[f"{name} | {fmt_name} | state nnz"] = [getattr(v.wrapped_tensor, "nnz", None) for v in state]
    return results


def main() -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = torch.randn(SIZE, SIZE) * (torch.rand(SIZE, SIZE) > 0.9)
    print(json.dumps(step_times(base, torch.randn(64, SIZE))))


if __name__ == "__main__":
    main()
