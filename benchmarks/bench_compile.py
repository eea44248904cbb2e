"""torch.compile vs eager for a BERT-base encoder layer (``sten bench``'s model),
inference, with dense and ``CsrTensor`` Linear weights at each sparsity.

Prints a markdown table (median forward time, ratio to dense eager, graph
breaks) headed by the CPU model, kernel ISA, thread count and load average.

    python benchmarks/bench_compile.py                      # 50 % and 90 %, 1 thread
    python benchmarks/bench_compile.py --sparsities 0.5,0.9 --threads 2 --reps 20
    python benchmarks/bench_compile.py --size tiny --reps 3  # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import torch

import sten_core as sten
from sten_core.tools.bench.machine import cpu_model, load_average
from sten_core.tools.bench.models import bert_case


def sparse_copy(case, sparsity: float) -> torch.nn.Module:
    """The case's model with every Linear weight in ``CsrTensor`` (magnitude pruning)."""
    sb = sten.SparsityBuilder(case.model)
    for name in case.weights:
        sb.set_weight(name, sten.ScalarFractionSparsifier(sparsity), out_format=sten.CsrTensor)
    model = sb.get_sparse_model()
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def median_ms(fn, x, reps: int, warmup: int) -> float:
    with torch.no_grad():
        for _ in range(warmup):
            fn(x)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn(x)
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def graph_breaks(model, x) -> int:
    torch._dynamo.reset()
    with torch.no_grad():
        count = torch._dynamo.explain(model)(x).graph_break_count
    torch._dynamo.reset()
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sparsities", default="0.5,0.9", help="comma-separated fractions of zeros")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--size", default="base", choices=["base", "tiny"])
    args = parser.parse_args(argv)
    try:
        sparsities = [float(s) for s in args.sparsities.split(",")]
    except ValueError:
        parser.error(f"--sparsities must be comma-separated numbers, got {args.sparsities!r}")
    if any(not 0 <= s < 1 for s in sparsities):
        parser.error(f"--sparsities must be in [0, 1), got {args.sparsities!r}")
    if args.threads < 1 or args.reps < 1 or args.warmup < 0:
        parser.error("--threads and --reps must be >= 1, --warmup >= 0")
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")

    case = bert_case(batch=args.batch, seq_len=args.seq_len, size=args.size)
    (x,) = case.inputs
    for p in case.model.parameters():
        p.requires_grad_(False)
    rows = []

    def measure(label: str, model: torch.nn.Module) -> None:
        breaks = graph_breaks(model, x)
        eager = median_ms(model, x, args.reps, args.warmup)
        torch._dynamo.reset()
        compiled_model = torch.compile(model)
        with torch.no_grad():
            want, got = model(x), compiled_model(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # the compiled model computes the same
        compiled = median_ms(compiled_model, x, args.reps, args.warmup)
        rows.append((label, eager, compiled, breaks))

    measure("dense", case.model)
    for s in sparsities:
        measure(f"CsrTensor {s:.0%}", sparse_copy(case, s))

    base = rows[0][1]
    print(f"# torch.compile vs eager: {case.description}, inference")
    print()
    print(f"CPU: {cpu_model()}; kernel ISA: {torch.backends.cpu.get_cpu_capability()}; threads: {args.threads}; "
          f"torch {torch.__version__}; load average before/after: {load_at_start} / {load_average()}; "
          f"median of {args.reps} runs after {args.warmup} warm-up runs")
    print()
    print("| weights | eager ms | compiled ms | compiled / eager | eager / dense eager | compiled / dense eager "
          "| graph breaks |")
    print("|---|---|---|---|---|---|---|")
    for label, eager, compiled, breaks in rows:
        print(f"| {label} | {eager:.2f} | {compiled:.2f} | {compiled / eager:.2f} | {eager / base:.2f} "
              f"| {compiled / base:.2f} | {breaks} |")
    return 0


load_at_start = load_average()

if __name__ == "__main__":
    sys.exit(main())
