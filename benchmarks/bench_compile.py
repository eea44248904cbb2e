"""torch.compile vs eager for a BERT-base encoder layer (``sten bench``'s model),
inference, with dense, ``CsrTensor`` and ``NMTensor`` (sten_nm) Linear weights at
each sparsity (n:m: 50 % is 2:4, 75 % 1:4, 90 % 1:10).

Prints a markdown table per thread count (median forward time, ratios to dense
eager and dense compiled, graph breaks) headed by the CPU model, kernel ISA and
load average.

    python benchmarks/bench_compile.py                      # 50 % and 90 %, 1 thread, csr and nm
    python benchmarks/bench_compile.py --sparsities 0.5,0.9 --threads 1,2 --reps 20
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
from sten_core.machine import cpu_model, load_average
from sten_core.tools.bench.models import bert_case


NM_PATTERNS = {0.5: (2, 4), 0.75: (1, 4), 0.9: (1, 10)}
"""The n:m pattern benchmarked for a fraction of zeros."""


def sparse_copy(case, sparsity: float, layout: str = "csr") -> torch.nn.Module:
    """The case's model with every Linear weight in ``CsrTensor`` (magnitude pruning)
    or, for ``layout="nm"``, in ``NMTensor`` with the pattern of ``NM_PATTERNS``."""
    sb = sten.SparsityBuilder(case.model)
    for name in case.weights:
        if layout == "nm":
            from sten_nm import NMSparsifier, NMTensor

            n, m = NM_PATTERNS[sparsity]
            sb.set_weight(name, NMSparsifier(n, m), out_format=NMTensor)
        else:
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
    parser.add_argument("--threads", default="1", help="comma-separated thread counts, e.g. 1,2")
    parser.add_argument("--layouts", default="csr,nm", help="comma-separated: csr, nm")
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
    try:
        threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        parser.error(f"--threads must be comma-separated integers, got {args.threads!r}")
    layouts = [name.strip() for name in args.layouts.split(",")]
    if any(name not in ("csr", "nm") for name in layouts):
        parser.error(f"--layouts: choose from csr, nm; got {args.layouts!r}")
    if "nm" in layouts and any(s not in NM_PATTERNS for s in sparsities):
        parser.error(f"--sparsities: n:m patterns exist for {sorted(NM_PATTERNS)}, got {args.sparsities!r}")
    if any(t < 1 for t in threads) or args.reps < 1 or args.warmup < 0:
        parser.error("--threads and --reps must be >= 1, --warmup >= 0")
    warnings.simplefilter("ignore")
    for t in threads:
        torch.set_num_threads(t)
        table(args, sparsities, layouts, t)
        print()
    return 0


def table(args: argparse.Namespace, sparsities: list[float], layouts: list[str], threads: int) -> None:
    """Measure and print one table (one thread count)."""
    load_before = load_average()

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
        for name in layouts:
            if name == "csr":
                measure(f"CsrTensor {s:.0%}", sparse_copy(case, s))
            else:
                n, m = NM_PATTERNS[s]
                measure(f"NMTensor {n}:{m} ({s:.0%})", sparse_copy(case, s, "nm"))

    base, base_compiled = rows[0][1], rows[0][2]
    print(f"# torch.compile vs eager: {case.description}, inference, {threads} thread(s)")
    print()
    print(f"CPU: {cpu_model()}; kernel ISA: {torch.backends.cpu.get_cpu_capability()}; threads: {threads}; "
          f"torch {torch.__version__}; load average before/after: {load_before} / {load_average()}; "
          f"median of {args.reps} runs after {args.warmup} warm-up runs")
    print()
    print("| weights | eager ms | compiled ms | compiled / eager | eager / dense eager | compiled / dense compiled "
          "| graph breaks |")
    print("|---|---|---|---|---|---|---|")
    for label, eager, compiled, breaks in rows:
        print(f"| {label} | {eager:.2f} | {compiled:.2f} | {compiled / eager:.2f} | {eager / base:.2f} "
              f"| {compiled / base_compiled:.2f} | {breaks} |")

if __name__ == "__main__":
    sys.exit(main())
