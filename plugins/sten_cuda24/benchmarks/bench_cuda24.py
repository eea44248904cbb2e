"""Benchmark of the cuda24 plugin against dense cuBLAS, in one command.

    python plugins/sten_cuda24/benchmarks/bench_cuda24.py OUT_DIR [--quick]

Writes ``OUT_DIR/bench_cuda24.json`` (every measurement plus the environment)
and ``OUT_DIR/bench_cuda24.md`` (tables). Measures, in bf16:

1. 2:4 ``F.linear`` (cuSPARSELt and CUTLASS) vs dense ``F.linear`` for tokens
   4096..16384 and (N, K) in (4096, 4096), (14336, 4096), (4096, 14336);
2. block-sparse 90 % with 64x64 blocks on 8192^3: our Triton kernel vs dense
   and torch's ``bsr_dense_mm``;
3. 2:4 pruning of a [14336, 4096] weight: our Triton and nvcc kernels vs a
   ``torch.topk``-based pruning (+ compression).

Times are medians of CUDA-event timings after warm-up (ms).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F


def timeit(fn: Callable[[], Any], warmup: int = 5, reps: int = 20) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _guard(fn: Callable[[], float]) -> float | str:
    try:
        return fn()
    except Exception as error:  # keep going; record why
        return f"error: {type(error).__name__}: {str(error)[:200]}"


def bench_24(tokens_list: list[int], shapes: list[tuple[int, int]], reps: int) -> list[dict]:
    from sten_cuda24 import _compat, backends, sparsify_24

    rows = []
    for n, k in shapes:
        w_dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        w24 = sparsify_24(w_dense)
        w_pruned = w24.to_dense()
        for t in tokens_list:
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            row: dict[str, Any] = {"N": n, "K": k, "tokens": t}
            row["dense_ms"] = timeit(lambda: F.linear(x, w_pruned), reps=reps)
            for backend, ok in (("cusparselt", _compat.has_cusparselt()), ("cutlass", _compat.has_cutlass())):
                if not ok:
                    row[f"{backend}_ms"] = "unavailable"
                    continue
                backends.linear(x, w24, backend=backend)  # prepare + alg search outside timing
                row[f"{backend}_ms"] = _guard(lambda: timeit(lambda: backends.linear(x, w24, backend=backend), reps=reps))
                if isinstance(row[f"{backend}_ms"], float):
                    row[f"{backend}_speedup"] = row["dense_ms"] / row[f"{backend}_ms"]
                    err = (backends.linear(x, w24, backend=backend).float() - F.linear(x, w_pruned).float()).abs().max().item()
                    row[f"{backend}_max_abs_err"] = err
            flops = 2 * t * n * k
            row["dense_tflops"] = flops / row["dense_ms"] / 1e9
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def bench_block(size: int, density: float, block: int, reps: int) -> dict:
    import sten_core as sten
    from sten_cuda24 import BlockSparseTensor
    from sten_cuda24.triton_bsr import bsr_linear

    m = n = k = size
    w_dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    layout = sten.sparsify(sten.BlockwiseFractionSparsifier(1 - density, (block, block)), w_dense, BlockSparseTensor).wrapped_tensor
    w_pruned = layout.to_dense()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    row: dict[str, Any] = {"M": m, "N": n, "K": k, "block": block, "density": layout.density}
    row["dense_ms"] = timeit(lambda: F.linear(x, w_pruned), reps=reps)
    row["triton_bsr_ms"] = _guard(lambda: timeit(lambda: bsr_linear(x, layout), reps=reps))
    row["triton_bsr_max_abs_err"] = _guard(lambda: (bsr_linear(x, layout).float() - F.linear(x, w_pruned).float()).abs().max().item())

    def torch_bsr() -> float:
        from torch.sparse._triton_ops import bsr_dense_mm

        bsr = layout.to_torch_bsr()
        xt = x.t().contiguous()
        return timeit(lambda: bsr_dense_mm(bsr, xt), reps=reps)  # W @ x^T, the same product transposed

    row["torch_bsr_dense_mm_ms"] = _guard(torch_bsr)
    print(json.dumps(row), flush=True)
    return row


def bench_prune(n: int, k: int, reps: int) -> dict:
    from sten_cuda24 import encoding
    from sten_cuda24.cuda_lib import sparsify24_cuda
    from sten_cuda24.triton_sparsify24 import sparsify24

    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)

    def topk_prune() -> tuple:
        g = w.reshape(n, k // 4, 4)
        idx = g.abs().topk(2, dim=-1, sorted=False).indices
        pruned = torch.zeros_like(g).scatter_(-1, idx, g.gather(-1, idx)).reshape(n, k)
        return encoding.compress(pruned, strict=False)

    def topk_mask_only() -> torch.Tensor:
        g = w.reshape(n, k // 4, 4)
        idx = g.abs().topk(2, dim=-1, sorted=False).indices
        return torch.zeros_like(g).scatter_(-1, idx, g.gather(-1, idx))

    row: dict[str, Any] = {"N": n, "K": k, "dtype": "bf16"}
    row["topk_prune_and_compress_ms"] = _guard(lambda: timeit(topk_prune, reps=reps))
    row["topk_prune_only_ms"] = _guard(lambda: timeit(topk_mask_only, reps=reps))
    row["triton_sparsify24_ms"] = _guard(lambda: timeit(lambda: sparsify24(w), reps=reps))
    row["triton_sparsify24_plus_dense_ms"] = _guard(lambda: timeit(lambda: sparsify24(w, write_dense=True), reps=reps))
    row["nvcc_rows_ms"] = _guard(lambda: timeit(lambda: sparsify24_cuda(w), reps=reps))
    row["nvcc_transposable_ms"] = _guard(lambda: timeit(lambda: sparsify24_cuda(w, transposable=True), reps=reps))
    print(json.dumps(row), flush=True)
    return row


def _fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def to_markdown(result: dict) -> str:
    lines = ["# sten_cuda24 benchmark", "", "```", json.dumps(result["env"], indent=1), "```", ""]
    for title, key in (("2:4 F.linear vs dense (bf16, ms)", "sparse24_linear"),
                       ("Block-sparse 64x64 vs dense and bsr_dense_mm (bf16, ms)", "block_sparse"),
                       ("2:4 pruning kernels vs torch.topk (bf16, ms)", "pruning")):
        rows = result[key] if isinstance(result[key], list) else [result[key]]
        if not rows:
            continue
        cols = list(rows[0].keys())
        lines += [f"## {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions (smoke run)")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cuda24: needs a CUDA GPU; none available", file=sys.stderr)
        return 2
    from sten_cuda24 import _compat

    args.out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    reps = 5 if args.quick else args.reps
    tokens = [4096] if args.quick else [4096, 8192, 16384]
    shapes = [(4096, 4096)] if args.quick else [(4096, 4096), (14336, 4096), (4096, 14336)]
    started = time.time()
    result: dict[str, Any] = {"env": {**_compat.describe(), "python": sys.version.split()[0], "quick": args.quick}}
    try:
        import triton

        result["env"]["triton_version"] = triton.__version__
    except Exception:
        result["env"]["triton_version"] = None
    result["sparse24_linear"] = bench_24(tokens, shapes, reps)
    result["block_sparse"] = bench_block(2048 if args.quick else 8192, 0.1, 64, reps)
    result["pruning"] = bench_prune(14336, 4096, reps)
    result["env"]["wall_s"] = time.time() - started
    (args.out_dir / "bench_cuda24.json").write_text(json.dumps(result, indent=1))
    (args.out_dir / "bench_cuda24.md").write_text(to_markdown(result))
    print(f"wrote {args.out_dir / 'bench_cuda24.json'} and {args.out_dir / 'bench_cuda24.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
