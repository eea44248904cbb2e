"""Benchmark of the sten_nm plugin: n:m F.linear against dense PyTorch and torch.sparse.

Run:  python benchmarks/bench_nm.py            (writes bench-out/bench_nm.md, prints it)
      python benchmarks/bench_nm.py --quick    (fewer repeats)

All ratios are measured in the same run, interleaved round by round, as medians
of the per-round medians; threads = 2 (``--threads``), fp32. GFLOP/s are given as
dense-equivalent (2*B*N*K / t) and effective (2*B*nnz / t).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

import sten_core as sten
from sten_nm import ColumnGroupedNMTensor, GroupedNMTensor, NMTensor, _kernel
from sten_nm import column_grouped_ops as cg_ops
from sten_nm import ops as nm_ops
from sten_nm import tuning
from sten_core.machine import cpu_model


def kept(layout_dense: torch.Tensor, W: torch.Tensor) -> float:
    """Σ|W| kept by a layout, relative to Σ|W| of the dense weight."""
    return float(layout_dense.abs().sum() / W.abs().sum())


def timeit(fn: Callable[[], object], reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def compare(fns: dict[str, Callable[[], object]], rounds: int, reps: int) -> dict[str, float]:
    """Median time of each function, interleaved over ``rounds`` rounds."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            times[k].append(timeit(f, reps))
    return {k: statistics.median(v) for k, v in times.items()}


class _Ctx:
    def __init__(self, saved: tuple):
        self.saved_tensors = saved
        self.needs_input_grad = (True, True, False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--quick", action="store_true", help="fewer rounds and repeats")
    ap.add_argument("--out", default="bench-out/bench_nm.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rounds, reps = (2, 3) if args.quick else (3, 5)
    B = args.batch
    lines: list[str] = []

    def out(s: str = "") -> None:
        lines.append(s)
        print(s, flush=True)

    out("# sten_nm benchmark")
    out()
    out(f"Command: `python benchmarks/bench_nm.py{' --quick' if args.quick else ''}`; threads={args.threads} "
        f"(`torch.set_num_threads`), fp32, batch rows={B}, CPU {cpu_model()}, kernel ISA={_kernel.isa()} "
        f"({_kernel.threading_mode()[0]}), torch {torch.__version__} (CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}), {os.cpu_count()} CPUs, load average at start "
        f"{os.getloadavg()[0]:.1f}. Times are medians over {rounds} interleaved rounds x {reps} repeats. "
        f"NMTensor's kernel-or-decompress choice (sten_nm.tuning): {'on' if tuning.enabled() else 'off (STEN_NM_TUNE=0)'}.")
    out()
    out("## Forward `F.linear(x, W)`")
    out()
    out("Σ|W| kept: the weight magnitude each layout keeps, relative to dense (exact n:m along K for")
    out("NMTensor, along N for the paper format; the last table gives the ratios to exact n:m).")
    out()
    out("| W shape | pattern | layout | time ms | speed-up vs dense | GFLOP/s dense-eq | GFLOP/s effective | Σ\\|W\\| kept |")
    out("|---|---|---|---:|---:|---:|---:|---:|")
    patterns = [(2, 4), (1, 4), (2, 8), (1, 10)]
    kept_rows: list[str] = []
    for N, K in [(3072, 768), (768, 3072)]:
        x = torch.randn(B, K)
        W = torch.randn(N, K)
        flops = 2.0 * B * N * K
        for n, m in patterns:
            t_exact = NMTensor.from_dense(W, n, m)
            t_group = GroupedNMTensor.from_dense(W, n, m)
            t_paper = ColumnGroupedNMTensor.from_dense(W, n, m)
            kept_rows.append(f"| {N}x{K} | {n}:{m} | {t_group.kept_magnitude_ratio(W):.3f} | "
                             f"{t_paper.kept_magnitude_ratio(W):.3f} (g={t_paper.g}) |")
            kept_of = {"dense torch": 1.0, "NMTensor (exact n:m)": kept(t_exact.to_dense(), W),
                       "GroupedNMTensor": kept(t_group.to_dense(), W),
                       "ColumnGroupedNMTensor (paper format)": kept(t_paper.to_dense(), W)}
            we = sten.SparseTensorWrapper(t_exact)
            wg = sten.SparseTensorWrapper(t_group)
            wp = sten.SparseTensorWrapper(t_paper)
            fns = {
                "dense torch": lambda: F.linear(x, W),
                "NMTensor (exact n:m)": lambda: F.linear(x, we),
                "GroupedNMTensor": lambda: F.linear(x, wg),
                "ColumnGroupedNMTensor (paper format)": lambda: F.linear(x, wp),
            }
            if (n, m) == (1, 10):
                wd = t_exact.to_dense()
                coo = wd.to_sparse()
                csr = wd.to_sparse_csr()
                xt = x.t().contiguous()
                fns["torch.sparse COO"] = lambda: torch.sparse.mm(coo, xt).t()
                fns["torch.sparse CSR"] = lambda: torch.sparse.mm(csr, xt).t()
            res = compare(fns, rounds, reps)
            td = res["dense torch"]
            for name, t in res.items():
                eff = flops * n / m if name != "dense torch" else flops
                k = f"{kept_of[name]:.3f}" if name in kept_of else f"{kept_of['NMTensor (exact n:m)']:.3f}"
                out(f"| {N}x{K} | {n}:{m} | {name} | {t * 1e3:.1f} | {td / t:.2f}x | {flops / t / 1e9:.1f} | "
                    f"{eff / t / 1e9:.1f} | {k} |")
            if (n, m) == (1, 10):
                r = res
                out(f"| {N}x{K} | 1:10 | NMTensor vs COO / CSR | | {r['torch.sparse COO'] / r['NMTensor (exact n:m)']:.1f}x / "
                    f"{r['torch.sparse CSR'] / r['NMTensor (exact n:m)']:.1f}x | | | |")
                out(f"| {N}x{K} | 1:10 | Grouped vs COO / CSR | | {r['torch.sparse COO'] / r['GroupedNMTensor']:.1f}x / "
                    f"{r['torch.sparse CSR'] / r['GroupedNMTensor']:.1f}x | | | |")

    out()
    out("## Backward of `F.linear`: grad x and grad W (W's only at the kept positions)")
    out()
    out("Each gradient by the kernel or route tuning chose (kernel, dense GEMM route, scatter, exact n:m's")
    out("kernels for the paper format; the last table lists the choices).")
    out()
    out("| W shape | pattern | layout | time ms | speed-up vs dense | GFLOP/s dense-eq |")
    out("|---|---|---|---:|---:|---:|")
    for (N, K), (n, m) in [(s, p) for s in [(3072, 768), (768, 3072)] for p in [(2, 4), (1, 4), (1, 10)]]:
        x = torch.randn(B, K)
        W = torch.randn(N, K)
        gy = torch.randn(B, N)
        t_exact = NMTensor.from_dense(W, n, m)
        t_group = GroupedNMTensor.from_dense(W, n, m)
        t_paper = ColumnGroupedNMTensor.from_dense(W, n, m)
        ctx_e = _Ctx((x, sten.SparseTensorWrapper(t_exact), None))
        ctx_g = _Ctx((x, sten.SparseTensorWrapper(t_group), None))
        ctx_p = _Ctx((x, sten.SparseTensorWrapper(t_paper), None))
        fns = {
            "dense torch (gy@W, gy^T@x)": lambda: (gy @ W, gy.t() @ x),
            "NMTensor": lambda: nm_ops.linear_bwd_sparse(ctx_e, (gy,), [None, None]),
            "GroupedNMTensor": lambda: nm_ops.grouped_linear_bwd_sparse(ctx_g, (gy,), [None, None]),
            "ColumnGroupedNMTensor (paper format)": lambda: cg_ops.linear_bwd_sparse(ctx_p, (gy,), [None, None]),
        }
        res = compare(fns, rounds, reps)
        td = res["dense torch (gy@W, gy^T@x)"]
        for name, t in res.items():
            out(f"| {N}x{K} | {n}:{m} | {name} | {t * 1e3:.1f} | {td / t:.2f}x | {2 * 2.0 * B * N * K / t / 1e9:.1f} |")

    out()
    out("## Training step through STen autograd at 75 % (forward + backward, sparse weight grad)")
    out()
    out("| W shape | layout | time ms | speed-up vs dense |")
    out("|---|---|---:|---:|")
    for N, K in [(3072, 768)]:
        x = torch.randn(B, K, requires_grad=True)
        Wd = torch.randn(N, K, requires_grad=True)
        fmt_e = (sten.KeepAll(), NMTensor, sten.KeepAll(), NMTensor)
        fmt_g = (sten.KeepAll(), GroupedNMTensor, sten.KeepAll(), GroupedNMTensor)
        fmt_p = (sten.KeepAll(), ColumnGroupedNMTensor, sten.KeepAll(), ColumnGroupedNMTensor)
        we = sten.SparseParameterWrapper(NMTensor.from_dense(Wd.detach(), 1, 4), grad_fmt=fmt_e)
        wg = sten.SparseParameterWrapper(GroupedNMTensor.from_dense(Wd.detach(), 1, 4), grad_fmt=fmt_g)
        wp = sten.SparseParameterWrapper(ColumnGroupedNMTensor.from_dense(Wd.detach(), 1, 4), grad_fmt=fmt_p)

        def step(w):
            def run():
                F.linear(x, w).sum().backward()
                x.grad = None
                w.grad = None
            return run
        res = compare({"dense torch": step(Wd), "NMTensor": step(we), "GroupedNMTensor": step(wg),
                       "ColumnGroupedNMTensor (paper format)": step(wp)}, rounds, reps)
        td = res["dense torch"]
        for name, t in res.items():
            out(f"| {N}x{K} | {name} | {t * 1e3:.1f} | {td / t:.2f}x |")

    out()
    out("## Dense -> n:m conversion of a 3072x768 weight")
    out()
    out("| pattern | NMTensor.from_dense ms | GroupedNMTensor.from_dense ms (greedy grouping) | "
        "ColumnGroupedNMTensor.from_dense ms (balanced assignment) |")
    out("|---|---:|---:|---:|")
    W = torch.randn(3072, 768)
    for n, m in [(2, 4), (1, 10)]:
        res = compare({"e": lambda: NMTensor.from_dense(W, n, m),
                       "g": lambda: GroupedNMTensor.from_dense(W, n, m),
                       "p": lambda: ColumnGroupedNMTensor.from_dense(W, n, m)}, 1, 1)
        out(f"| {n}:{m} | {res['e'] * 1e3:.1f} | {res['g'] * 1e3:.1f} | {res['p'] * 1e3:.1f} |")

    out()
    out("## Grouped layouts: fraction of the weight magnitude kept, relative to exact n:m (random normal weights)")
    out()
    out("| W shape | pattern | GroupedNMTensor (16 rows share a pattern) / exact n:m along K | "
        "ColumnGroupedNMTensor (paper format) / exact n:m along N |")
    out("|---|---|---:|---:|")
    for line in kept_rows:
        out(line)

    if tuning.enabled():
        out()
        out("## Kernel or dense route (and other candidates), as chosen on this machine (sten_nm.tuning)")
        out()
        out("| key | choice | ms per candidate |")
        out("|---|---|---|")
        for k, v in sorted(tuning.choices().items()):
            if f"threads={args.threads}" in k:
                ms = ", ".join(f"{name} {t}" for name, t in sorted(v["ms"].items()))
                out(f"| {k} | {v['choice']} | {ms} |")

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"\nwritten to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
