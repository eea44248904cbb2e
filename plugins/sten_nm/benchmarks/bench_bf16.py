"""bf16 vs fp32 stored values, exact NMTensor forward (``F.linear(x [B, K], W)``), the
kernel only (tuning off), BERT shapes, one run, medians of turns (fp32 and bf16 timed alternately); bf16 values are widened per block
of rows in the kernel (``nm_gather_bf16w``), fp32 ones read as they are.

    python benchmarks/bench_bf16.py [--threads 2] [--batch 1024] [--reps 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ["STEN_NM_TUNE"] = "0"

import torch  # noqa: E402

from sten_nm import NMTensor, _kernel, nm_linear  # noqa: E402


def interleaved(fns, reps: int) -> list[float]:
    """Median ms of each function, timed in turns (load changes hit all alike)."""
    for fn in fns:
        fn()
    ts = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            ts[i].append(time.perf_counter() - t)
    return [statistics.median(t) * 1e3 for t in ts]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from bench_cg_backward import cpu_model

    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"CPU {cpu_model()}, ISA {_kernel.isa()}, {a.threads} threads, B={a.batch}, load {load}")
    print("| W [N,K] | n:m | fp32 values ms | bf16 values ms | bf16 x and values (bf16 out) ms | bf16 vs fp32 | bf16 x vs fp32 |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for N, K in ((3072, 768), (768, 3072)):
        for n, m in ((2, 4), (1, 10)):
            torch.manual_seed(0)
            w = torch.randn(N, K)
            t32 = NMTensor.from_dense(w, n, m)
            t16 = NMTensor.from_dense(w.bfloat16(), n, m)
            x = torch.randn(a.batch, K)
            xb = x.bfloat16()
            f32, b16, bb = interleaved([lambda: nm_linear(x, t32), lambda: nm_linear(x, t16),
                                        lambda: nm_linear(xb, t16)], a.reps)
            print(f"| {N}x{K} | {n}:{m} | {f32:.1f} | {b16:.1f} | {bb:.1f} | {f32 / b16:.2f}x | {f32 / bb:.2f}x |")


if __name__ == "__main__":
    main()
