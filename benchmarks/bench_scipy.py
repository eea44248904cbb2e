"""Benchmark: ``F.linear`` with a ``ScipyCsrTensor`` weight at BERT shapes.

Compares, per sparsity, the STen path ``F.linear(x, W)`` (W a
``SparseTensorWrapper`` of ``ScipyCsrTensor``) with dense torch
``F.linear(x, W_dense)`` and with calling scipy directly on the same arrays
(``x_np @ W_csr.T`` and ``(W_csr @ x_np.T).T``). All in one process,
interleaved (each repeat runs every method once, in rotating order), medians
reported. Inference (``torch.no_grad()``), float32.

    python benchmarks/bench_scipy.py                       # 50/70/90/95 %, markdown table
    python benchmarks/bench_scipy.py --sparsity 90 --repeats 5 --threads 1
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Callable

import numpy as np
import scipy
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_scipy import ScipyCsrTensor


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(sparsity: float, batch: int, in_f: int, out_f: int, repeats: int, bias: bool) -> dict:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, in_f, generator=gen)
    w_dense = torch.randn(out_f, in_f, generator=gen)
    w = sten.sparsify(sten.ScalarFractionSparsifier(sparsity / 100), w_dense, ScipyCsrTensor)
    w_masked = w.to_dense()
    b = torch.randn(out_f, generator=gen) if bias else None
    csr, x_np = w.wrapped_tensor.data, x.numpy()
    b_np = b.numpy() if bias else None

    def ours() -> torch.Tensor:
        return F.linear(x, w, b)

    def dense() -> torch.Tensor:
        return F.linear(x, w_masked, b)

    def scipy_rmatmul() -> np.ndarray:  # the natural spelling: x @ W.T
        y = x_np @ csr.T
        return y + b_np if bias else y

    def scipy_matmul() -> np.ndarray:  # the same product as ours: (W @ x.T).T
        y = (csr @ x_np.T).T
        return y + b_np if bias else y

    methods = {"sten": ours, "dense torch": dense, "scipy x@W.T": scipy_rmatmul, "scipy (W@x.T).T": scipy_matmul}
    with torch.no_grad():
        ref = dense()
        for name, fn in methods.items():  # warm-up and check
            out = fn()
            torch.testing.assert_close(torch.as_tensor(np.asarray(out)), ref, rtol=1e-3, atol=1e-3, msg=name)
        times: dict[str, list[float]] = {name: [] for name in methods}
        names = list(methods)
        for r in range(repeats):
            for name in names[r % len(names):] + names[: r % len(names)]:
                times[name].append(_time(methods[name]))
    med = {name: statistics.median(t) for name, t in times.items()}
    direct = min(med["scipy x@W.T"], med["scipy (W@x.T).T"])
    # per repeat: STen against the faster direct spelling of the same repeat (robust to load drift)
    paired = statistics.median(s / min(a, b) for s, a, b in zip(times["sten"], times["scipy x@W.T"], times["scipy (W@x.T).T"]))
    return {"sparsity": sparsity, "nnz": w.wrapped_tensor.nnz, "median_s": med, "paired": paired,
            "ratio_vs_scipy": med["sten"] / direct, "ratio_vs_dense": med["sten"] / med["dense torch"]}


def dispatch_overhead_us(repeats: int = 2000) -> float:
    """Median cost of the STen path minus the direct scipy call at a tiny shape (µs)."""
    x = torch.randn(4, 8)
    w = sten.SparseTensorWrapper(ScipyCsrTensor.from_dense(torch.randn(6, 8)))
    csr, x_np = w.wrapped_tensor.data, x.numpy()
    with torch.no_grad():
        ours = [_time(lambda: F.linear(x, w)) for _ in range(repeats)]
        direct = [_time(lambda: (csr @ x_np.T).T) for _ in range(repeats)]
    return (statistics.median(ours) - statistics.median(direct)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sparsity", type=float, nargs="+", default=[50, 70, 90, 95], help="percent zeros")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--in-features", type=int, default=768)
    parser.add_argument("--out-features", type=int, default=3072)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--bias", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"F.linear x=[{args.batch}, {args.in_features}] W=[{args.out_features}, {args.in_features}] float32, "
          f"bias={args.bias}, {args.repeats} repeats (median); torch {torch.__version__} with "
          f"{torch.get_num_threads()} threads, scipy {scipy.__version__} (single-threaded kernel), "
          f"{platform.processor() or platform.machine()}, {torch.get_num_interop_threads()} interop threads\n")
    print("| sparsity | nnz | STen ScipyCsr (ms) | scipy x@W.T (ms) | scipy (W@x.T).T (ms) | dense torch (ms) "
          "| STen / direct scipy (medians) | STen / direct scipy (paired) | STen / dense |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in args.sparsity:
        r = run(s, args.batch, args.in_features, args.out_features, args.repeats, args.bias)
        m = {k: v * 1e3 for k, v in r["median_s"].items()}
        print(f"| {s:g} % | {r['nnz']} | {m['sten']:.1f} | {m['scipy x@W.T']:.1f} | {m['scipy (W@x.T).T']:.1f} "
              f"| {m['dense torch']:.1f} | {r['ratio_vs_scipy']:.3f} | {r['paired']:.3f} | {r['ratio_vs_dense']:.2f} |",
              flush=True)
    print(f"\nfixed dispatch overhead of the STen path (tiny shape, median): {dispatch_overhead_us():.0f} µs")


if __name__ == "__main__":
    main()
