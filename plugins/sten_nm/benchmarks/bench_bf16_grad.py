"""bf16 grad_output read by the backward kernels (``sten_nm._bf16x.*_mixed``: gy, and x for the
values gradient, widened while the kernels pack them) vs the previous path (``gy.float()`` /
``x.float()`` in torch, then the float32-operand kernels), per layout, input gradient plus values
gradient, bf16 values, x and gy [B, *] bf16, BERT shapes; one run, both paths timed in turns,
medians. The two results are bit-identical (tests/test_bf16_grad_output.py).

    python benchmarks/bench_bf16_grad.py [--threads 1] [--batch 1024] [--reps 9] [--cpu-time]
"""

from __future__ import annotations

import argparse
import time

import torch

from sten_core.machine import cpu_model, load_average
from sten_nm import ColumnGroupedNMTensor, GroupedNMTensor, NMTensor, _bf16x, _kernel

from _timing import in_turns


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--cpu-time", action="store_true")
    a = ap.parse_args()
    clock = time.process_time if a.cpu_time else time.perf_counter
    torch.set_num_threads(a.threads)
    print(f"CPU {cpu_model()}, ISA {_kernel.isa()}, {a.threads} threads, B={a.batch}, load {load_average()}, "
          f"{'CPU' if a.cpu_time else 'wall'} time")
    print("| layout | W [N,K] | n:m | bf16 gy read in C ms | gy.float() first ms | speed-up |")
    print("|---|---|---|---:|---:|---:|")
    for N, K in ((3072, 768), (768, 3072)):
        for n, m in ((2, 4), (1, 10)):
            torch.manual_seed(0)
            w = torch.randn(N, K).bfloat16()
            gy = torch.randn(a.batch, N).bfloat16()
            x = torch.randn(a.batch, K).bfloat16()
            t = NMTensor.from_dense(w, n, m)
            R, C = t._rc()
            d = _kernel.mat(t._values.contiguous(), t.indices, R, C, n, m)
            g = GroupedNMTensor.from_dense(w, n, m)
            gd = _kernel.grouped(g._vals.contiguous(), g.indices, g.perm, N, K, n, m)
            c = ColumnGroupedNMTensor.from_dense(w, n, m)
            cd = c.desc()
            cases = {
                "NMTensor": (lambda: (_bf16x.tgather_mixed(d, gy), _bf16x.sddmm_mixed(d, gy, x)),
                             lambda: (_bf16x.tgather_bf16w(d, gy.float()), _kernel.sddmm(d, gy.float(), x.float()))),
                "GroupedNMTensor": (lambda: (_bf16x.grouped_tgather_mixed(gd, gy), _bf16x.grouped_sddmm_mixed(gd, gy, x)),
                                    lambda: (_bf16x.grouped_tgather_bf16w(gd, gy.float()),
                                             _kernel.grouped_sddmm(gd, gy.float(), x.float()))),
                "ColumnGroupedNMTensor": (lambda: (_bf16x.colgrouped_grad_input_mixed(cd, gy),
                                                   _bf16x.colgrouped_grad_values_mixed(cd, gy, x)),
                                          lambda: (_kernel.colgrouped_grad_input(cd, gy.float()),
                                                   _kernel.colgrouped_grad_values(cd, gy.float(), x.float()))),
            }
            for name, (new, old) in cases.items():
                tn, to = in_turns([new, old], a.reps, clock)
                print(f"| {name} | {N}x{K} | {n}:{m} | {tn:.1f} | {to:.1f} | {to / tn:.2f}x |")


if __name__ == "__main__":
    main()
