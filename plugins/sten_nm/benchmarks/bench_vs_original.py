"""sten_nm's n:m layouts beside the original STen's grouped n:m kernel, in one process.

``F.linear(x[B, K], W[N, K])`` without bias, fp32, under ``torch.no_grad()``; rows: dense
torch, our exact ``NMTensor`` (n:m along K), our ``ColumnGroupedNMTensor`` (the paper's
format: n:m along N, column groups per pattern), our 16-row ``GroupedNMTensor`` and the
original STen's grouped n:m (``sten.GroupedNMSparsifier(n, m, g)``, n:m along N) at the
best of several ``g``. Every row is checked against ``x @ W_kept.T`` (its own mask, dense)
before it is timed.

Run (both packages in one venv, see ``/work/shared/ORIGINAL-STEN.md`` or docs/nm.md)::

    python plugins/sten_nm/benchmarks/bench_vs_original.py [--quick] [--out FILE]

Without the original installed (``import sten`` fails) its rows are left out and the
output says so. Times are medians of interleaved rounds (order rotated every round);
speed-ups are per-round ratios to dense, then their median. Σ|W| kept is given relative
to the dense weight and relative to exact n:m along the same axis as the layout.

Example (a small, fast run)::

    python bench_vs_original.py --quick --shapes 768x768 --patterns 2:4 --orig-g 8
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import tempfile
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import sten_core
from sten_core.machine import cpu_model, load_average
from sten_nm import ColumnGroupedNMTensor, GroupedNMTensor, NMTensor, _kernel, tuning

DENSE = "dense torch"
EXACT = "ours: NMTensor (exact n:m along K)"
PAPER = "ours: ColumnGroupedNMTensor (paper format)"
GROUP16 = "ours: GroupedNMTensor (16 rows share a pattern)"
ORIG = "original STen grouped n:m"


# ----------------------------------------------------------------- the original --
class Original:
    """The original STen (package ``sten``), its known faults worked around:
    a bias-less ``F.linear`` registered with its own decorator (its built-in one needs a
    bias and mis-reads a contiguous input), ``py-cpuinfo`` called once, not per weight,
    and its compile caches in a scratch directory."""

    def __init__(self, workdir: str):
        import numpy as np
        np.set_printoptions(legacy="1.25")   # dace's code generation on numpy 2
        import sten as osten
        from sten.grouped_nm import grouped_nm_tensor as gnt
        from sten.grouped_nm import sten_impls

        if hasattr(gnt, "cpuinfo"):
            gnt.cpuinfo.get_cpu_info = functools.lru_cache(maxsize=1)(gnt.cpuinfo.get_cpu_info)
        osten.set_dispatch_failure("raise")
        self.sten = osten
        self.workdir = workdir
        self.kernel = gnt.cpuinfo.get_cpu_info()["flags"]
        self.kernel = "avx512" if "avx512f" in self.kernel else "avx2"
        mul = sten_impls.sparse_dense_mul_dispatch

        @osten.register_fwd_op_impl(operator=F.linear, inp=(torch.Tensor, osten.GroupedNMTensor),
                                    out=[(osten.KeepAll, torch.Tensor)])
        def _linear_no_bias(ctx, inputs, output_sparsifiers):
            x, w = inputs
            t = w.wrapped_tensor
            DM, DK = t.nm_strides["dense_shape"]
            x2 = x.reshape(-1, x.shape[-1])
            # x2.t() is B of the product W @ B; the dispatcher reads its transposition
            # from the strides (trans_b = not contiguous), so pass trans_b=False.
            y = mul(t.nm_strides, DM, DK, t.val, t.idx, x2.t(), trans_a=False, trans_b=False,
                    trans_c=True)
            return y.reshape(*x.shape[:-1], -1)[..., :DM]

    @contextlib.contextmanager
    def _in_workdir(self):
        old = os.getcwd()
        os.chdir(self.workdir)
        try:
            yield
        finally:
            os.chdir(old)

    def weight(self, W: torch.Tensor, n: int, m: int, g: int):
        """The wrapped weight and its dense masked copy."""
        with self._in_workdir():   # its conversion compiles into ./.compile_cache
            t = self.sten.GroupedNMTensor.from_dense(W, n, m, sparse_dim=0, group_size=g, group_dim=1)
            return self.sten.SparseTensorWrapper.wrapped_from_dense(t, W, None), t.to_dense()

    def linear(self, x: torch.Tensor, w) -> Callable[[], torch.Tensor]:
        def run():
            with self._in_workdir():
                return F.linear(x, w)
        return run

    def first_call(self, fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float]:
        """Run once (it compiles on the first call per shape); the output and the seconds."""
        t = time.perf_counter()
        with contextlib.redirect_stderr(open(os.devnull, "w")):
            y = fn()
        return y, time.perf_counter() - t


def load_original(workdir: str) -> tuple[Optional[Original], str]:
    try:
        os.makedirs(workdir, exist_ok=True)   # --orig-workdir may name a folder not made yet
        return Original(workdir), ""
    except Exception as e:   # not installed or broken: report and go on without it
        return None, f"{type(e).__name__}: {e}"


# ------------------------------------------------------------------------ timing --
def median_time(fn: Callable[[], object], reps: int) -> float:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def interleaved(fns: dict[str, Callable[[], object]], rounds: int, reps: int) -> dict[str, list[float]]:
    """Per-round median time of each function; the order is rotated every round."""
    names = list(fns)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for k in order:
            times[k].append(median_time(fns[k], reps))
    return times


def kept(masked: torch.Tensor, W: torch.Tensor) -> float:
    return float(masked.abs().sum() / W.abs().sum())


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def parse_pairs(s: str, sep: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in p.split(sep)) for p in s.split(",") if p]  # type: ignore[misc]


# -------------------------------------------------------------------------- main --
def paper_order(N: int, K: int, n: int, m: int, B: int, threads: int) -> str:
    """The paper-format forward's loop order that tuning chose for this case (``stream`` /
    ``tiled``; ``STEN_NM_CG_VARIANT`` or stream with tuning off)."""
    if not tuning.enabled():
        return {"2": "tiled"}.get(os.environ.get("STEN_NM_CG_VARIANT", "1"), "stream") + " order, untuned"
    k = tuning.key("cg_fwd", N, K, n, m, True, B, "float32", threads, _kernel.isa())
    return f"{tuning.choices().get(k, {}).get('choice', '?')} order"


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--shapes", default="3072x768,768x3072", help="W shapes NxK, comma separated")
    ap.add_argument("--patterns", default="2:4,1:4,2:8,1:10")
    ap.add_argument("--orig-g", default="4,8,16,32", help="the original's group sizes to try")
    ap.add_argument("--g", type=int, default=None, help="ColumnGroupedNMTensor g (default: its own choice)")
    ap.add_argument("--no-original", action="store_true", help="leave the original out")
    ap.add_argument("--orig-workdir", default=None, help="scratch dir for the original's compile caches")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="3 rounds x 3 repeats")
    ap.add_argument("--out", default=None, help="also write the report (markdown) here")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.reps = 3, 3
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    B = args.batch
    lines: list[str] = []

    def out(s: str = "") -> None:
        lines.append(s)
        print(s, flush=True)

    orig, why = (None, "left out (--no-original)") if args.no_original else load_original(
        args.orig_workdir or tempfile.mkdtemp(prefix="sten-orig-"))
    gs = [int(g) for g in args.orig_g.split(",") if g]

    out("# sten_nm beside the original STen: `F.linear(x, W)`, no bias")
    out()
    out(f"CPU {cpu_model()}; our kernel ISA {_kernel.isa()} ({_kernel.threading_mode()[0]}); "
        f"torch {torch.__version__} (CPU capability {torch.backends.cpu.get_cpu_capability()}); "
        f"threads {args.threads} (`torch.set_num_threads`, our kernels and the original's OpenMP); "
        f"{os.cpu_count()} CPUs; fp32; x [{B}, K]; load average (1/5/15 min) at start {load_average()}.")
    out(f"Medians of {args.rounds} interleaved rounds x {args.reps} repeats (order rotated each round); "
        f"speed-up = median over rounds of (dense time / row time) of that round. NMTensor tuning "
        f"(kernel or decompress + dense GEMM, `sten_nm.tuning`; the paper format's loop order): "
        f"{'on' if tuning.enabled() else 'off'}.")
    if orig is None:
        out(f"Original STen: not measured ({why}); its rows are omitted.")
    else:
        out(f"Original STen: package `sten` (spcl/sten), its {orig.kernel} kernel (DaCe-generated, "
            f"compiled on the first call per shape: that time is not in the figures), best g of {gs}.")
    out("Σ|W| kept: relative to dense / relative to exact n:m along the layout's own axis "
        "(K for NMTensor and GroupedNMTensor, N for the paper format and the original).")
    out()
    out("| W [N,K] | n:m | row | time ms | speed-up vs dense | Σ\\|W\\| kept / dense | / exact n:m | max rel. err |")
    out("|---|---|---|---:|---:|---:|---:|---:|")
    summary: list[str] = []
    with torch.no_grad():
        for N, K in parse_pairs(args.shapes, "x"):
            x = torch.randn(B, K)
            W = torch.randn(N, K)
            for n, m in parse_pairs(args.patterns, ":"):
                exact_k = kept(NMTensor.from_dense(W, n, m, dim=1).to_dense(), W)
                exact_n = kept(NMTensor.from_dense(W, n, m, dim=0).to_dense(), W)
                t_exact = NMTensor.from_dense(W, n, m)
                t_paper = ColumnGroupedNMTensor.from_dense(W, n, m, g=args.g)
                t_g16 = GroupedNMTensor.from_dense(W, n, m)
                rows: dict[str, tuple[Callable[[], torch.Tensor], torch.Tensor, float]] = {
                    DENSE: (lambda: F.linear(x, W), W, 1.0),
                }
                for name, t, ax in ((EXACT, t_exact, exact_k), (PAPER, t_paper, exact_n), (GROUP16, t_g16, exact_k)):
                    w = sten_core.SparseTensorWrapper(t)
                    rows[name] = (functools.partial(F.linear, x, w), t.to_dense(), ax)
                compile_s, failed = [], []
                if orig is not None:
                    for g in gs:
                        try:
                            w, masked = orig.weight(W, n, m, g)
                            fn = orig.linear(x, w)
                            _, s = orig.first_call(fn)
                        except Exception as e:   # e.g. its code generator rejects the shape
                            failed.append(f"g={g} fails ({type(e).__name__})")
                            continue
                        compile_s.append(s)
                        rows[f"{ORIG} g={g}"] = (fn, masked, exact_n)
                errs = {}
                for name, (fn, masked, _) in rows.items():
                    fn()   # warm-up (tuning, caches)
                    errs[name] = rel_err(fn(), x @ masked.t())
                    if errs[name] > 1e-4:
                        raise SystemExit(f"{name} {N}x{K} {n}:{m}: wrong result (max rel. err {errs[name]:.2e})")
                times = interleaved({k: v[0] for k, v in rows.items()}, args.rounds, args.reps)
                td = times[DENSE]
                med = {k: statistics.median(v) for k, v in times.items()}
                speed = {k: statistics.median(d / t for d, t in zip(td, v)) for k, v in times.items()}
                show = [k for k in rows if not k.startswith(ORIG)]
                best = None
                if any(k.startswith(ORIG) for k in rows):
                    best = min((k for k in rows if k.startswith(ORIG)), key=lambda k: med[k])
                    show.append(best)
                for k in show:
                    _, masked, ax = rows[k]
                    kd = kept(masked, W)
                    label = k + (f" (g={t_paper.g}, {paper_order(N, K, n, m, B, args.threads)})" if k == PAPER else "")
                    out(f"| {N}x{K} | {n}:{m} | {label} | {med[k] * 1e3:.2f} | {speed[k]:.2f}x | {kd:.3f} | "
                        f"{kd / ax:.3f} | {errs[k]:.1e} |")
                if best is not None:
                    others = ", ".join([f"g={k.split('g=')[1]}: {speed[k]:.2f}x" for k in rows if k.startswith(ORIG)]
                                       + failed)
                    ratio = speed[PAPER] / speed[best]
                    summary.append(f"| {N}x{K} | {n}:{m} | {speed[EXACT]:.2f}x | {speed[PAPER]:.2f}x | "
                                   f"{speed[GROUP16]:.2f}x | {speed[best]:.2f}x ({best.split('g=')[1]}) | "
                                   f"**{ratio:.2f}x** | {others}; first call {max(compile_s):.1f} s |")
                else:
                    summary.append(f"| {N}x{K} | {n}:{m} | {speed[EXACT]:.2f}x | {speed[PAPER]:.2f}x | "
                                   f"{speed[GROUP16]:.2f}x | - | - | {', '.join(failed) or '-'} |")
    out()
    out("Summary (speed-up vs dense; paper format vs original = the ratio of those two speed-ups):")
    out()
    out("| W [N,K] | n:m | exact NMTensor | paper format | 16-row grouped | original (best g) | "
        "paper format vs original | original at each g |")
    out("|---|---|---:|---:|---:|---:|---:|---|")
    for s in summary:
        out(s)
    out()
    out(f"Load average (1/5/15 min) at the end: {load_average()}.")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
