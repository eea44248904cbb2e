"""Benchmark of the cuda24 plugin against dense cuBLAS and torch's own sparse kernels, in one command.

    python plugins/sten_cuda24/benchmarks/bench_cuda24.py OUT_DIR [--quick] [--only linear,prune,...]

Writes ``OUT_DIR/bench_cuda24.json`` (every measurement plus the environment)
and ``OUT_DIR/bench_cuda24.md`` (tables), and prints one JSON line per row as it
goes. Sections (``--only`` picks some):

``linear``   2:4 ``F.linear`` (cuSPARSELt and CUTLASS, and through STen's dispatch)
             vs dense ``F.linear`` (cuBLAS) in bf16 and fp16: 4096², 8192² (8192³ is
             the issue's target, >= 1.2x), BERT-base/large FFN and Llama-2-7B /
             Llama-3-8B FFN shapes.
``wgrad``    the 2:4 weight gradient: dense GEMM + gather vs the fused sampled
             Triton kernel (``triton_sdd24``), and the per-step operand refresh
             (``backends.sync``) vs rebuilding the operand.
``prune``    2:4 pruning of [14336, 4096] and [8192, 8192]: our Triton and nvcc kernels
             vs ``torch._cslt_compress`` (compress only), ``to_sparse_semi_structured``
             (CUTLASS and cuSPARSELt, compress only), torch's
             ``_sparse_semi_structured_tile`` (prune + compress) and a ``torch.topk`` prune.
``block``    block-sparse 90 % with 64x64 blocks (and 128x128) on 8192³: our Triton kernel
             (forward, input gradient, sampled weight gradient) vs dense and
             ``torch.sparse._triton_ops.bsr_dense_mm`` (target >= 3x dense at 8192³ and
             faster than ``bsr_dense_mm``).
``train``    one training step (forward, backward, SGD step) of a GPT-2-small-size MLP
             stack (12 x [768 -> 3072 -> 768], 8 x 1024 tokens, bf16) with 2:4 weights
             (row-wise and transposable) and 75 % 64x64 block-sparse weights vs dense.
``compile``  ``torch.compile(fullgraph=True)`` vs eager for a 4-layer stack of the same MLP:
             inference forward and training step, dense and sparse weights (the
             ``sten_cuda24::...`` custom operators; graph breaks counted, compiled output
             checked against eager).

Times are medians of CUDA-event timings after warm-up (ms); speed-ups are
dense / sparse from the same run. Every sparse result is checked against the
dense one (max abs error recorded).

``--device cpu --tiny`` runs every section on tiny shapes on the CPU (Triton
kernels under ``TRITON_INTERPRET=1``): a dry run of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

SECTIONS = ("linear", "wgrad", "prune", "block", "train", "compile")
DEVICE = "cuda"
LINEAR_SHAPES = [  # (name, N = out_features, K = in_features)
    ("4096^2", 4096, 4096),
    ("8192^2", 8192, 8192),
    ("BERT-base FFN up", 3072, 768),
    ("BERT-base FFN down", 768, 3072),
    ("BERT-large FFN up", 4096, 1024),
    ("BERT-large FFN down", 1024, 4096),
    ("Llama-2-7B FFN up/gate", 11008, 4096),
    ("Llama-2-7B FFN down", 4096, 11008),
    ("Llama-3-8B FFN up/gate", 14336, 4096),
    ("Llama-3-8B FFN down", 4096, 14336),
]


def timeit(fn: Callable[[], Any], warmup: int = 5, reps: int = 20) -> float:
    """Median CUDA-event time of ``fn`` in ms (wall clock for the CPU dry run)."""
    for _ in range(warmup):
        fn()
    if DEVICE != "cuda":
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
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


def _guard(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as error:  # keep going; record why
        return f"error: {type(error).__name__}: {str(error)[:300]}"


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _emit(rows: list, row: dict) -> None:
    rows.append(row)
    print(json.dumps(row), flush=True)


# -- 2:4 linear ------------------------------------------------------------------------

def bench_linear(tokens_list: list[int], shapes: list[tuple[str, int, int]], dtypes: list[torch.dtype], reps: int) -> list[dict]:
    import sten_core as sten
    from sten_cuda24 import _compat, backends, sparsify_24

    rows: list[dict] = []
    for dtype in dtypes:
        for name, n, k in shapes:
            w24 = sparsify_24(torch.randn(n, k, device=DEVICE, dtype=dtype))
            w_pruned = w24.to_dense()
            wrapped = sten.SparseTensorWrapper(w24)
            for t in tokens_list:
                x = torch.randn(t, k, device=DEVICE, dtype=dtype)
                ref = F.linear(x, w_pruned)
                row: dict[str, Any] = {"shape": name, "N": n, "K": k, "tokens": t, "dtype": str(dtype).replace("torch.", "")}
                row["dense_ms"] = timeit(lambda: F.linear(x, w_pruned), reps=reps)
                row["dense_tflops"] = 2 * t * n * k / row["dense_ms"] / 1e9
                for backend, ok in (("cusparselt", _compat.has_cusparselt()), ("cutlass", _compat.has_cutlass())):
                    if not ok:
                        row[f"{backend}_ms"] = "unavailable"
                        continue
                    got = _guard(lambda: backends.linear(x, w24, backend=backend))  # prepare + alg search outside timing
                    if isinstance(got, str):
                        row[f"{backend}_ms"] = got
                        continue
                    row[f"{backend}_max_abs_err"] = _err(got, ref)
                    row[f"{backend}_ms"] = _guard(lambda: timeit(lambda: backends.linear(x, w24, backend=backend), reps=reps))
                    if isinstance(row[f"{backend}_ms"], float):
                        row[f"{backend}_speedup"] = row["dense_ms"] / row[f"{backend}_ms"]
                got = _guard(lambda: F.linear(x, wrapped))
                if not isinstance(got, str):
                    row["dispatch_max_abs_err"] = _err(got, ref)
                    row["dispatch_ms"] = timeit(lambda: F.linear(x, wrapped), reps=reps)
                    row["dispatch_speedup"] = row["dense_ms"] / row["dispatch_ms"]
                _emit(rows, row)
    return rows


# -- 2:4 weight gradient and operand refresh ----------------------------------------------

def bench_wgrad(shapes: list[tuple[str, int, int]], tokens: int, reps: int) -> list[dict]:
    from sten_cuda24 import _compat, backends, sparsify_24

    rows: list[dict] = []
    for name, n, k in shapes:
        w = sparsify_24(torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16))
        g = torch.randn(tokens, n, device=DEVICE, dtype=torch.bfloat16)
        x = torch.randn(tokens, k, device=DEVICE, dtype=torch.bfloat16)
        row: dict[str, Any] = {"shape": name, "N": n, "K": k, "tokens": tokens, "dtype": "bfloat16"}
        ref = w.gather(g.t() @ x)
        row["dense_gemm_ms"] = timeit(lambda: g.t() @ x, reps=reps)
        row["dense_gemm_gather_ms"] = timeit(lambda: w.gather(g.t() @ x), reps=reps)

        def sampled() -> torch.Tensor:
            from sten_cuda24.triton_sdd24 import sdd24

            return sdd24(g, x, w)

        got = _guard(sampled)
        if isinstance(got, str):
            row["sampled_ms"] = got
        else:
            row["sampled_max_abs_err"] = _err(got, ref)
            row["sampled_ms"] = timeit(sampled, reps=reps)
            row["sampled_speedup_vs_gemm_gather"] = row["dense_gemm_gather_ms"] / row["sampled_ms"]
        backend = _compat.semi_structured_backend() if DEVICE == "cuda" else "cutlass"  # CPU dry run: the pure-tensor CUTLASS operand
        if backend is not None:
            cpu_prep = backends.build(w, backend) if DEVICE != "cuda" else None
            if cpu_prep is None:
                backends.prepare(w, backend)

            def step_and_sync() -> None:
                w.values().add_(1e-3)
                if cpu_prep is not None:
                    backends.sync(cpu_prep, w)
                else:
                    backends.prepare(w.with_values(w.values()), backend)

            def step_and_rebuild() -> None:
                w.values().add_(1e-3)
                backends.build(w.with_values(w.values().clone()), backend)

            row["backend"] = backend
            row["refresh_in_place_ms"] = _guard(lambda: timeit(step_and_sync, reps=reps))
            prep = cpu_prep or w._cache.get(("prepared", backend), (None, None))[1]
            row["refresh_kind"] = getattr(prep, "refresh", None)
            row["rebuild_operand_ms"] = _guard(lambda: timeit(step_and_rebuild, reps=reps))
        _emit(rows, row)
    return rows


# -- pruning ------------------------------------------------------------------------------

def bench_prune(shapes: list[tuple[int, int]], reps: int) -> list[dict]:
    from sten_cuda24 import _compat, encoding
    from sten_cuda24.triton_sparsify24 import sparsify24

    rows: list[dict] = []
    for n, k in shapes:
        w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16)
        pruned = sparsify24(w, write_dense=True)[2]
        row: dict[str, Any] = {"N": n, "K": k, "dtype": "bfloat16"}

        def topk_prune() -> torch.Tensor:
            g = w.reshape(n, k // 4, 4)
            idx = g.abs().topk(2, dim=-1, sorted=False).indices
            return torch.zeros_like(g).scatter_(-1, idx, g.gather(-1, idx)).reshape(n, k)

        row["ours_triton_prune_compress_ms"] = _guard(lambda: timeit(lambda: sparsify24(w), reps=reps))
        row["ours_triton_prune_compress_dense_ms"] = _guard(lambda: timeit(lambda: sparsify24(w, write_dense=True), reps=reps))
        if _compat.nvcc_path() is not None:
            from sten_cuda24.cuda_lib import sparsify24_cuda

            row["ours_nvcc_rows_ms"] = _guard(lambda: timeit(lambda: sparsify24_cuda(w), reps=reps))
            row["ours_nvcc_transposable_ms"] = _guard(lambda: timeit(lambda: sparsify24_cuda(w, transposable=True), reps=reps))
        else:
            row["ours_nvcc_rows_ms"] = "nvcc not found"
        row["torch_topk_prune_ms"] = _guard(lambda: timeit(topk_prune, reps=reps))
        row["torch_topk_prune_plus_our_compress_ms"] = _guard(lambda: timeit(lambda: encoding.compress(topk_prune(), strict=False), reps=reps))
        if _compat.has_cusparselt():
            row["torch_cslt_compress_only_ms"] = _guard(lambda: timeit(lambda: torch._cslt_compress(pruned), reps=reps))
        from torch.sparse import SparseSemiStructuredTensor, to_sparse_semi_structured

        for force_cutlass in (True, False):
            label = "cutlass" if force_cutlass else "cusparselt"

            def convert() -> Any:
                SparseSemiStructuredTensor._FORCE_CUTLASS = force_cutlass
                return to_sparse_semi_structured(pruned)

            row[f"torch_to_sparse_semi_structured_{label}_ms"] = _guard(lambda: timeit(convert, reps=reps))
        SparseSemiStructuredTensor._FORCE_CUTLASS = False
        tile = getattr(torch, "_sparse_semi_structured_tile", None)
        if tile is not None:
            row["torch_semi_structured_tile_prune_compress_ms"] = _guard(lambda: timeit(lambda: tile(w), reps=reps))
        for key in [c for c in row if c.endswith("_ms") and not c.startswith("ours_triton_prune_compress_ms")]:
            if isinstance(row[key], float) and isinstance(row["ours_triton_prune_compress_ms"], float):
                row[key.replace("_ms", "_over_ours")] = row[key] / row["ours_triton_prune_compress_ms"]
        _emit(rows, row)
    return rows


# -- block sparse ----------------------------------------------------------------------------

def bench_block(size: int, configs: list[tuple[int, float]], reps: int) -> list[dict]:
    import sten_core as sten
    from sten_cuda24 import BlockSparseTensor
    from sten_cuda24.triton_bsr import bsr_linear, bsr_sdd

    rows: list[dict] = []
    m = n = k = size
    for block, density in configs:
        w_dense = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16)
        layout = sten.sparsify(sten.BlockwiseFractionSparsifier(1 - density, (block, block)), w_dense, BlockSparseTensor).wrapped_tensor
        w_pruned = layout.to_dense()
        x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
        g = torch.randn(m, n, device=DEVICE, dtype=torch.bfloat16)
        row: dict[str, Any] = {"M": m, "N": n, "K": k, "block": block, "density": layout.density, "dtype": "bfloat16"}
        row["dense_fwd_ms"] = timeit(lambda: F.linear(x, w_pruned), reps=reps)
        row["ours_fwd_max_abs_err"] = _guard(lambda: _err(bsr_linear(x, layout), F.linear(x, w_pruned)))
        row["ours_fwd_ms"] = _guard(lambda: timeit(lambda: bsr_linear(x, layout), reps=reps))
        wt = layout.transposed()
        row["dense_grad_input_ms"] = timeit(lambda: g @ w_pruned, reps=reps)
        row["ours_grad_input_ms"] = _guard(lambda: timeit(lambda: bsr_linear(g, wt), reps=reps))
        row["dense_grad_weight_ms"] = timeit(lambda: g.t() @ x, reps=reps)
        row["ours_grad_weight_sampled_ms"] = _guard(lambda: timeit(lambda: bsr_sdd(g, x, layout), reps=reps))

        def torch_bsr() -> float:
            from torch.sparse._triton_ops import bsr_dense_mm

            bsr = layout.to_torch_bsr()
            xt = x.t().contiguous()
            bsr_dense_mm(bsr, xt)
            return timeit(lambda: bsr_dense_mm(bsr, xt), reps=reps)  # W @ x^T, the same product transposed

        row["torch_bsr_dense_mm_fwd_ms"] = _guard(torch_bsr)
        for key in ("fwd", "grad_input"):
            if isinstance(row.get(f"ours_{key}_ms"), float):
                row[f"ours_{key}_speedup_vs_dense"] = row[f"dense_{key}_ms"] / row[f"ours_{key}_ms"]
        if isinstance(row.get("ours_grad_weight_sampled_ms"), float):
            row["ours_grad_weight_speedup_vs_dense"] = row["dense_grad_weight_ms"] / row["ours_grad_weight_sampled_ms"]
        if isinstance(row["torch_bsr_dense_mm_fwd_ms"], float) and isinstance(row.get("ours_fwd_ms"), float):
            row["ours_fwd_speedup_vs_bsr_dense_mm"] = row["torch_bsr_dense_mm_fwd_ms"] / row["ours_fwd_ms"]
        _emit(rows, row)
    return rows


# -- training step ------------------------------------------------------------------------------

def _mlp_stack(layers: int, d: int, ffn: int, kind: str) -> tuple[torch.nn.Module, list]:
    import sten_core as sten
    from sten_cuda24 import BlockSparseTensor, Sparse24Sparsifier, Sparse24Tensor

    blocks = torch.nn.ModuleList()
    params = []
    for _ in range(layers):
        up = torch.nn.Linear(d, ffn, device=DEVICE, dtype=torch.bfloat16)
        down = torch.nn.Linear(ffn, d, device=DEVICE, dtype=torch.bfloat16)
        for lin in (up, down):
            if kind == "dense":
                continue
            if kind == "bsr75":
                cls, sp = BlockSparseTensor, sten.BlockwiseFractionSparsifier(0.75, (64, 64))
            else:
                cls, sp = Sparse24Tensor, Sparse24Sparsifier(transposable=kind == "24t")
            w = sten.sparsify(sp, lin.weight.detach(), cls).wrapped_tensor
            lin.weight = sten.SparseParameterWrapper(w, grad_fmt=(sten.KeepAll(), cls, sten.KeepAll(), cls))
        blocks.append(torch.nn.ModuleList([up, down]))
        params += list(up.parameters()) + list(down.parameters())

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = blocks

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            for up, down in self.blocks:
                h = h + down(F.gelu(up(h)))
            return h

    return Stack(), params


def bench_train(layers: int, d: int, ffn: int, tokens: int, reps: int) -> list[dict]:
    rows: list[dict] = []
    x = torch.randn(tokens, d, device=DEVICE, dtype=torch.bfloat16)
    dense_ms = None
    for kind in ("dense", "24", "24t", "bsr75"):
        row: dict[str, Any] = {"model": f"{layers} x MLP [{d} -> {ffn} -> {d}]", "tokens": tokens, "weights": kind, "dtype": "bfloat16"}

        def run() -> dict:
            torch.manual_seed(0)
            model, params = _mlp_stack(layers, d, ffn, kind)
            opt = torch.optim.SGD(params, lr=1e-4, momentum=0.9)

            def step() -> None:
                opt.zero_grad(set_to_none=True)
                model(x).float().square().mean().backward()
                opt.step()

            losses = []
            for _ in range(3):
                step()
                with torch.no_grad():
                    losses.append(float(model(x).float().square().mean()))
            return {"ms": timeit(step, warmup=3, reps=reps), "loss_after_warmup": losses[-1]}

        got = _guard(run)
        if isinstance(got, str):
            row["step_ms"] = got
        else:
            row["step_ms"] = got["ms"]
            row["loss_after_3_steps"] = got["loss_after_warmup"]
            if kind == "dense":
                dense_ms = got["ms"]
            elif dense_ms:
                row["speedup_vs_dense"] = dense_ms / got["ms"]
        _emit(rows, row)
    return rows


def bench_compile(layers: int, d: int, ffn: int, tokens: int, reps: int) -> list[dict]:
    """Compiled (fullgraph) vs eager: inference forward and one training step, per weight kind."""
    rows: list[dict] = []
    x = torch.randn(tokens, d, device=DEVICE, dtype=torch.bfloat16)
    for kind in ("dense", "24", "24t", "bsr75"):
        row: dict[str, Any] = {"model": f"{layers} x MLP [{d} -> {ffn} -> {d}]", "tokens": tokens, "weights": kind}

        def run() -> dict:
            torch._dynamo.reset()
            torch.manual_seed(0)
            model, params = _mlp_stack(layers, d, ffn, kind)
            compiled = torch.compile(model, fullgraph=True)
            out: dict[str, Any] = {}
            with torch.no_grad():
                out["graph_breaks"] = torch._dynamo.explain(model)(x).graph_break_count
                torch._dynamo.reset()
                t0 = time.perf_counter()
                want, got = model(x), compiled(x)
                out["compile_fwd_s"] = time.perf_counter() - t0
                out["max_err_compiled_vs_eager"] = _err(got, want)
                out["eager_fwd_ms"] = timeit(lambda: model(x), reps=reps)
                out["compiled_fwd_ms"] = timeit(lambda: compiled(x), reps=reps)
            opt = torch.optim.SGD(params, lr=1e-4)

            def step(fn: Any) -> Callable[[], None]:
                def one() -> None:
                    opt.zero_grad(set_to_none=True)
                    fn(x).float().square().mean().backward()
                    opt.step()
                return one

            out["eager_step_ms"] = timeit(step(model), warmup=3, reps=reps)
            out["compiled_step_ms"] = timeit(step(compiled), warmup=3, reps=reps)
            out["fwd_compiled_over_eager"] = out["compiled_fwd_ms"] / out["eager_fwd_ms"]
            out["step_compiled_over_eager"] = out["compiled_step_ms"] / out["eager_step_ms"]
            return out

        got = _guard(run)
        if isinstance(got, str):
            row["error"] = got
        else:
            row.update(got)
        _emit(rows, row)
    return rows


# -- report -----------------------------------------------------------------------------------------

def environment(quick: bool) -> dict:
    from sten_cuda24 import _compat

    env: dict[str, Any] = {**_compat.describe(), "python": sys.version.split()[0], "quick": quick, "host": platform.node()}
    try:
        import triton

        env["triton_version"] = triton.__version__
    except Exception:
        env["triton_version"] = None
    try:
        env["cusparselt_version"] = torch.backends.cusparselt.version()
    except Exception:
        env["cusparselt_version"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env["gpu"] = {"name": p.name, "sm_count": p.multi_processor_count, "memory_gib": round(p.total_memory / 2**30, 1),
                      "capability": f"{p.major}.{p.minor}"}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,power.limit", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        env["nvidia_smi"] = out.stdout.strip()
    except Exception as error:
        env["nvidia_smi"] = f"unavailable: {error}"
    env["cpu"] = platform.processor() or platform.machine()
    env["loadavg"] = os.getloadavg()
    return env


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"
    return str(v)


def to_markdown(result: dict) -> str:
    lines = ["# sten_cuda24 benchmark", "", "```", json.dumps(result["env"], indent=1), "```", ""]
    titles = {"linear": "2:4 F.linear vs dense cuBLAS (ms; speed-up = dense / sparse)",
              "wgrad": "2:4 weight gradient and per-step operand refresh (ms)",
              "prune": "2:4 pruning and compression (ms; *_over_ours = theirs / ours)",
              "block": "Block-sparse vs dense and torch bsr_dense_mm (ms)",
              "train": "Training step of an MLP stack (ms)",
              "compile": "torch.compile(fullgraph=True) vs eager (ms; ratio = compiled / eager)"}
    for key, title in titles.items():
        rows = result.get(key) or []
        if not rows:
            continue
        cols: list[str] = []
        for r in rows:
            cols += [c for c in r if c not in cols]
        lines += [f"## {title}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions (smoke run)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run (needs --tiny)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (with --device cpu: checks the script runs)")
    args = parser.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {SECTIONS}")
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cpu":
        if not args.tiny:
            parser.error("--device cpu is a dry run: add --tiny")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        print("bench_cuda24: needs a CUDA GPU; none available", file=sys.stderr)
        return 2
    import sten_core

    sten_core.plugins.manager.ensure_loaded()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    reps = 2 if args.tiny else 5 if args.quick else args.reps
    started = time.time()
    result: dict[str, Any] = {"env": environment(args.quick)}
    out_json = args.out_dir / "bench_cuda24.json"

    def save() -> None:  # after every section, so a time-out still leaves the finished ones
        result["env"]["wall_s"] = time.time() - started
        out_json.write_text(json.dumps(result, indent=1))
        (args.out_dir / "bench_cuda24.md").write_text(to_markdown(result))

    tiny = [("tiny", 64, 128)]
    if "linear" in only:
        shapes = tiny if args.tiny else LINEAR_SHAPES[:1] if args.quick else LINEAR_SHAPES
        tokens = [32] if args.tiny else [4096] if args.quick else [4096, 8192, 16384]
        dtypes = [torch.bfloat16] if args.quick else [torch.bfloat16, torch.float16]
        result["linear"] = bench_linear(tokens, shapes, dtypes, reps)
        save()
    if "wgrad" in only:
        shapes = tiny if args.tiny else LINEAR_SHAPES[:1] if args.quick else [LINEAR_SHAPES[i] for i in (0, 1, 2, 8)]
        result["wgrad"] = bench_wgrad(shapes, 32 if args.tiny else 4096 if args.quick else 8192, reps)
        save()
    if "prune" in only:
        result["prune"] = bench_prune([(64, 128)] if args.tiny else [(4096, 4096)] if args.quick else [(14336, 4096), (8192, 8192)], reps)
        save()
    if "block" in only:
        configs = [(64, 0.1)] if args.quick else [(64, 0.1), (128, 0.1), (64, 0.25)]
        result["block"] = bench_block(256 if args.tiny else 2048 if args.quick else 8192, configs, reps)
        save()
    if "train" in only:
        if args.tiny:
            result["train"] = bench_train(1, 64, 128, 64, reps)
        else:
            result["train"] = bench_train(2 if args.quick else 12, 768, 3072, 2048 if args.quick else 8192, reps)
        save()
    if "compile" in only:
        if args.tiny:
            result["compile"] = bench_compile(1, 64, 128, 64, reps)
        else:
            result["compile"] = bench_compile(2 if args.quick else 4, 768, 3072, 2048 if args.quick else 8192, reps)
        save()
    save()
    print(f"wrote {out_json} and {args.out_dir / 'bench_cuda24.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
