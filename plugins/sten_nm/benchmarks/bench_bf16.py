"""bf16 vs fp32 stored values, exact NMTensor, GroupedNMTensor and ColumnGroupedNMTensor (the paper format) forward (``F.linear(x [B, K], W)``), the
kernel only (tuning off), BERT shapes, one run, medians of turns (fp32 and bf16 timed alternately); bf16 values are widened in
the kernel (exact n:m: per block of rows, ``nm_gather_bf16w``; grouped: in registers on AVX-512, per row group and chunk
elsewhere, ``nm_grouped_gather_bf16w``; paper format: per pattern and batch chunk), fp32 ones read as they are. bf16 x:
the paper format reads it in the kernel (``vdpbf16ps`` on AVX512_BF16 CPUs, ``STEN_NM_BF16_DOT=0`` turns it off;
widened while packing elsewhere), exact n:m widens it while packing its panel (``nm_gather_bf16wx``; its bf16
result rounded per unit of rows on the kernel's threads, ``nm_gather_bf16x_out16``), the 16-row grouped layout
while packing its 6-row micro-panels (``nm_grouped_gather_bf16wx``); the "x.float() first" column is that widening done by torch for every
layout (the previous path of the paper format and of exact n:m). ``--layout NMTensor`` times one layout. ``STEN_NM_ISA=avx2`` measures the AVX2 kernels.
``--tuned``: tuning on (as users run it), with a fresh cache in a temporary file, so each path runs in the loop order /
kernel the tuner picks for it (the paper format's tiled order, its tile-major packed weight for bf16 values too).

    python benchmarks/bench_bf16.py [--threads 2] [--batch 1024] [--reps 7] [--cpu-time] [--layout NMTensor] [--tuned]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

if "--tuned" in sys.argv:   # before sten_nm is imported: a fresh tuning cache of this run's own
    os.environ["STEN_NM_TUNE"] = "1"
    os.environ["STEN_NM_TUNE_CACHE"] = os.path.join(tempfile.mkdtemp(prefix="bench_bf16_"), "tuning.json")
else:
    os.environ["STEN_NM_TUNE"] = "0"

import torch  # noqa: E402

from sten_core.machine import cpu_model, load_average  # noqa: E402
from sten_nm import ColumnGroupedNMTensor, GroupedNMTensor, NMTensor, _bf16x, _kernel, grouped_linear, nm_linear  # noqa: E402
from sten_nm.column_grouped_ops import column_grouped_linear  # noqa: E402

from _timing import in_turns  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--layout", action="append", help="only these layouts (class names; repeatable)")
    ap.add_argument("--cpu-time", action="store_true", help="CPU time of the process (less sensitive to load)")
    ap.add_argument("--tuned", action="store_true", help="tuning on, fresh cache (default: off, the kernels' defaults)")
    a = ap.parse_args()
    clock = time.process_time if a.cpu_time else time.perf_counter
    torch.set_num_threads(a.threads)
    print(f"CPU {cpu_model()}, ISA {_kernel.isa()}{' + AVX512_BF16 (vdpbf16ps)' if _bf16x.bf16_dot() else ''}, {a.threads} threads, B={a.batch}, load {load_average()}, "
          f"{'CPU' if a.cpu_time else 'wall'} time, tuning {'on (fresh cache)' if a.tuned else 'off'}")
    print("| layout | W [N,K] | n:m | fp32 values ms | bf16 values ms | bf16 x and values (bf16 out) ms | "
          "bf16 x, x.float() first ms | bf16 vs fp32 | bf16 x vs fp32 | bf16 x vs x.float() first |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for N, K in ((3072, 768), (768, 3072)):
        for n, m in ((2, 4), (1, 10)):
            torch.manual_seed(0)
            w = torch.randn(N, K)
            x = torch.randn(a.batch, K)
            xb = x.bfloat16()
            for name, cls, fn in (("NMTensor", NMTensor, nm_linear), ("GroupedNMTensor", GroupedNMTensor, grouped_linear),
                                  ("ColumnGroupedNMTensor", ColumnGroupedNMTensor, column_grouped_linear)):
                if a.layout and name not in a.layout:
                    continue
                t32 = cls.from_dense(w, n, m)
                t16 = cls.from_dense(w.bfloat16(), n, m)
                f32, b16, bb, bw = in_turns([lambda: fn(x, t32), lambda: fn(x, t16), lambda: fn(xb, t16),
                                             lambda: fn(xb.float(), t16).bfloat16()], a.reps, clock)
                print(f"| {name} | {N}x{K} | {n}:{m} | {f32:.1f} | {b16:.1f} | {bb:.1f} | {bw:.1f} | {f32 / b16:.2f}x | "
                      f"{f32 / bb:.2f}x | {bw / bb:.2f}x |")

if __name__ == "__main__":
    main()
