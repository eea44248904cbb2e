"""Paper-format (ColumnGroupedNMTensor) backward: the layout's own C kernels against the
previous path (exact n:m's kernels on Wᵀ via ``to_nm()``) and decompress + dense GEMMs, on
the BERT shapes, ``x [B, K]``, fp32. One run, medians, ratios vs the previous path.

    python benchmarks/bench_cg_backward.py [--threads 2] [--batch 1024] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sten_core.machine import cpu_model, load_average
from sten_nm import ColumnGroupedNMTensor, _kernel


def median_ms(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"CPU {cpu_model()}, ISA {_kernel.isa()}, {a.threads} threads, B={a.batch}, load {load_average()}")
    print("| W [N,K] | n:m | new gx ms | new gv ms | previous gx+gv ms | dense gx+gv ms | new vs previous | new vs dense |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for N, K in ((3072, 768), (768, 3072)):
        for n, m in ((2, 4), (1, 4), (1, 10)):
            torch.manual_seed(0)
            W = ColumnGroupedNMTensor.from_dense(torch.randn(N, K), n, m)
            x, gy = torch.randn(a.batch, K), torch.randn(a.batch, N)
            desc = W.desc()

            def new_gx():
                return _kernel.colgrouped_grad_input(desc, gy)

            def new_gv():
                return _kernel.colgrouped_grad_values(desc, gy, x)

            def previous():   # what the backward ran before: exact n:m's kernels on Wᵀ
                mat = W.to_nm().fp32().mat()
                return _kernel.gather(mat, gy), W.values_from_nm(_kernel.sddmm(mat, x, gy))

            def dense():
                return gy @ W.to_dense(), W.gather(gy.t() @ x)

            t_gx, t_gv = median_ms(new_gx, a.reps), median_ms(new_gv, a.reps)
            t_prev, t_dense = median_ms(previous, a.reps), median_ms(dense, a.reps)
            new = t_gx + t_gv
            print(f"| {N}x{K} | {n}:{m} | {t_gx:.1f} | {t_gv:.1f} | {t_prev:.1f} | {t_dense:.1f} | "
                  f"{t_prev / new:.2f}x | {t_dense / new:.2f}x |")


if __name__ == "__main__":
    main()
