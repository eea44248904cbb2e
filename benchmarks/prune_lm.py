"""One-shot pruning of two trained models by magnitude, Wanda and SparseGPT
(``sten.prune``), at 50 % unstructured and 2:4; nothing is downloaded.

With sten_nm installed, each method also prunes into the paper's grouped n:m format
(``ColumnGroupedNMTensor``, 2:4 along the output rows, columns in chunks where each of
the 6 row patterns owns ``g`` columns): the "2:4 grouped" rows; and into the 16-row
``GroupedNMTensor`` (rows in groups of 16 sharing one 2:4 mask along the inputs): the
"2:4 row-grouped" rows. Both are evaluated through the layout's own product.

1. A byte-level causal transformer language model trained on CPU on the Python
   standard library's own top-level source files (``sysconfig`` ``stdlib``,
   ``*.py``, sorted by name; every 10th file is the held-out split). Perplexity
   on the held-out bytes before and after pruning.
2. The MLP of ``benchmarks/train_digits.py`` trained dense on scikit-learn's
   bundled digits. Test accuracy before and after pruning.

Every attention and MLP linear layer is pruned; the embedding and the LM head
stay dense (as in the papers). Calibration: sequences from the training split.

Usage:
    python benchmarks/prune_lm.py                 # the full run (a few minutes), Markdown tables
    python benchmarks/prune_lm.py --quick         # a smoke test in seconds
    python benchmarks/prune_lm.py --json out.json # also the figures as JSON
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import sysconfig
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import sten_core as sten
from sten_core.machine import cpu_model

# (method, sparsity, pattern, sequential): sequential=False calibrates every layer on the dense model
SETTINGS = [("dense", None, None, True), ("magnitude", 0.5, None, True), ("wanda", 0.5, None, True),
            ("sparsegpt", 0.5, None, True), ("magnitude", None, (2, 4), True), ("wanda", None, (2, 4), True),
            ("sparsegpt", None, (2, 4), True), ("wanda", 0.5, None, False), ("wanda", None, (2, 4), False),
            ("sparsegpt", 0.5, None, False), ("sparsegpt", None, (2, 4), False)]

# the grouped n:m layouts of sten_nm: (label suffix, layout name), each pruned by every method
GROUPED = [("grouped", "ColumnGroupedNMTensor"), ("row-grouped", "GroupedNMTensor")]
METHODS = ("magnitude", "wanda", "sparsegpt")


def grouped_layouts() -> list[tuple[str, type]]:
    """``(label suffix, layout)`` of sten_nm's grouped n:m layouts; empty where sten_nm is not installed."""
    try:
        import sten_nm
    except Exception:
        return []
    return [(suffix, getattr(sten_nm, name)) for suffix, name in GROUPED]


@dataclass
class LMConfig:
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 512
    context: int = 128
    batch: int = 32
    steps: int = 600
    lr: float = 2e-3
    calib_sequences: int = 64
    eval_windows: int = 400
    seed: int = 0


QUICK = LMConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, context=32, batch=8, steps=30, lr=3e-3,
                 calib_sequences=8, eval_windows=16)


# -- data -----------------------------------------------------------------------------

def stdlib_text(max_bytes: int | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Train and held-out bytes of the standard library's top-level ``*.py`` files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise RuntimeError(f"no *.py files under the standard library directory {root}")
    train, held = bytearray(), bytearray()
    for i, path in enumerate(files):
        (held if i % 10 == 9 else train).extend(path.read_bytes())
    if max_bytes is not None:
        train, held = train[:max_bytes], held[: max_bytes // 4]
    info = {"stdlib": str(root), "files": len(files), "train_bytes": len(train), "heldout_bytes": len(held),
            "python": platform.python_version()}
    to_tensor = lambda b: torch.tensor(list(b), dtype=torch.long)  # noqa: E731
    return to_tensor(train), to_tensor(held), info


# -- the model ---------------------------------------------------------------------------

class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int, d_ff: int):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(d)
        self.q = torch.nn.Linear(d, d)
        self.k = torch.nn.Linear(d, d)
        self.v = torch.nn.Linear(d, d)
        self.o = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, d_ff)
        self.fc2 = torch.nn.Linear(d_ff, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        split = lambda y: y.view(b, t, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        att = F.scaled_dot_product_attention(split(self.q(h)), split(self.k(h)), split(self.v(h)), is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ByteLM(torch.nn.Module):
    """A small pre-LayerNorm causal transformer over bytes (vocabulary 256)."""

    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.embed = torch.nn.Embedding(256, cfg.d_model)
        self.pos = torch.nn.Parameter(torch.randn(cfg.context, cfg.d_model) * 0.02)
        self.blocks = torch.nn.ModuleList(Block(cfg.d_model, cfg.n_heads, cfg.d_ff) for _ in range(cfg.n_layers))
        self.ln = torch.nn.LayerNorm(cfg.d_model)
        self.head = torch.nn.Linear(cfg.d_model, 256)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def prunable(name: str, module: torch.nn.Module) -> bool:
    """Every linear layer of the blocks (not the LM head)."""
    return name.startswith("blocks.")


def random_windows(data: torch.Tensor, count: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(data) - length - 1, (count,), generator=gen)
    return torch.stack([data[s:s + length + 1] for s in starts.tolist()])


def train_lm(cfg: LMConfig, train: torch.Tensor, log: bool = True) -> tuple[ByteLM, float]:
    torch.manual_seed(cfg.seed)
    model = ByteLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=cfg.steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    start = time.perf_counter()
    for step in range(cfg.steps):
        batch = random_windows(train, cfg.batch, cfg.context, gen)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if log and (step % 100 == 0 or step == cfg.steps - 1):
            print(f"  step {step:5d}  loss {loss.item():.3f}  {time.perf_counter() - start:6.1f}s", flush=True)
    return model.eval(), time.perf_counter() - start


@torch.no_grad()
def perplexity(model: torch.nn.Module, held: torch.Tensor, cfg: LMConfig) -> float:
    """exp of the mean next-byte cross-entropy over the first ``eval_windows``
    non-overlapping windows of the held-out bytes."""
    n = min(cfg.eval_windows, (len(held) - 1) // cfg.context)
    x = held[: n * cfg.context + 1]
    inputs = x[:-1].view(n, cfg.context)
    targets = x[1:].view(n, cfg.context)
    total = 0.0
    for i in range(0, n, 32):
        logits = model(inputs[i:i + 32])
        total += F.cross_entropy(logits.reshape(-1, 256), targets[i:i + 32].reshape(-1), reduction="sum").item()
    return math.exp(total / targets.numel())


def measured_sparsity(model: torch.nn.Module, names: list[str]) -> float:
    zeros = total = 0
    for name in names:
        w = model.get_parameter(name)
        dense = w.to_dense() if isinstance(w, sten.SparseTensorWrapper) else w
        zeros += int((dense == 0).sum())
        total += dense.numel()
    return zeros / total


def _method(method: str, sequential: bool) -> str:
    return method if sequential or method in ("dense", "magnitude") else f"{method} (one pass)"


def _label(method: str, sparsity: float | None, pattern: tuple[int, int] | None) -> str:
    if method == "dense":
        return "dense"
    return f"{sparsity:.0%}" if pattern is None else f"{pattern[0]}:{pattern[1]}"


def run_lm(cfg: LMConfig, max_bytes: int | None, log: bool = True) -> dict[str, Any]:
    train, held, info = stdlib_text(max_bytes)
    if log:
        print(f"LM: {info['files']} stdlib files, {info['train_bytes']} train / {info['heldout_bytes']} held-out bytes", flush=True)
    model, train_s = train_lm(cfg, train, log)
    calib_gen = torch.Generator().manual_seed(cfg.seed + 2)
    calib = random_windows(train, cfg.calib_sequences, cfg.context, calib_gen)[:, :-1]
    batches = list(calib.split(8))
    names = [f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and prunable(n, m)]
    rows = []
    for method, sparsity, pattern, sequential in SETTINGS:
        pruned = copy.deepcopy(model)
        start = time.perf_counter()
        if method != "dense":
            sten.prune(pruned, batches, method, sparsity=sparsity, pattern=pattern, layers=prunable, sequential=sequential)
        seconds = time.perf_counter() - start
        rows.append({"method": _method(method, sequential), "pattern": _label(method, sparsity, pattern),
                     "perplexity": perplexity(pruned, held, cfg), "sparsity": measured_sparsity(pruned, names),
                     "prune_seconds": seconds})
        if log:
            print(f"  {method:9s} {rows[-1]['pattern']:5s} ppl {rows[-1]['perplexity']:.3f}  ({seconds:.1f}s)", flush=True)
    for (suffix, layout), method in [(lay, mth) for lay in grouped_layouts() for mth in METHODS]:
        pruned = copy.deepcopy(model)
        start = time.perf_counter()
        sten.prune(pruned, batches, method, pattern=(2, 4), layers=prunable, out_format=layout)
        seconds = time.perf_counter() - start
        rows.append({"method": method, "pattern": f"2:4 {suffix}", "perplexity": perplexity(pruned, held, cfg),
                     "sparsity": measured_sparsity(pruned, names), "prune_seconds": seconds})
        if log:
            print(f"  {method:9s} {rows[-1]['pattern']} ppl {rows[-1]['perplexity']:.3f}  ({seconds:.1f}s)", flush=True)
    layout_row = _layout_check(model, batches, held, cfg)
    return {"config": asdict(cfg), "data": info, "train_seconds": train_s, "rows": rows, "layout_check": layout_row}


def _layout_check(model: torch.nn.Module, batches: list, held: torch.Tensor, cfg: LMConfig) -> dict[str, Any] | None:
    """SparseGPT 2:4 written as sten_nm's NMTensor: the same perplexity as the dense-with-zeros weights."""
    try:
        from sten_nm import NMTensor
    except Exception:
        return None
    dense = sten.prune(copy.deepcopy(model), batches, "sparsegpt", pattern=(2, 4), layers=prunable)
    stored = sten.prune(copy.deepcopy(model), batches, "sparsegpt", pattern=(2, 4), layers=prunable, out_format=NMTensor)
    layouts = sorted({type(p.wrapped_tensor).__name__ for p in stored.parameters() if isinstance(p, sten.SparseTensorWrapper)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {"layouts": layouts, "perplexity_dense_zeros": perplexity(dense, held, cfg),
                "perplexity_layout": perplexity(stored, held, cfg)}


# -- digits ------------------------------------------------------------------------------

def run_digits(epochs: int, log: bool = True) -> dict[str, Any]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_digits", Path(__file__).with_name("train_digits.py"))
    digits = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(digits)
    dense = digits.train("dense", epochs=epochs)
    model = dense["model"].eval()
    xtr, _, xte, yte = digits.load_data(0)
    calib = list(xtr[:256].split(64))
    rows = []
    settings = SETTINGS[:7] + [("magnitude", 0.75, None, True), ("wanda", 0.75, None, True), ("sparsegpt", 0.75, None, True),
                               ("magnitude", None, (1, 4), True), ("wanda", None, (1, 4), True),
                               ("sparsegpt", None, (1, 4), True)] + SETTINGS[7:] + [
        ("wanda", 0.75, None, False), ("wanda", None, (1, 4), False), ("sparsegpt", 0.75, None, False),
        ("sparsegpt", None, (1, 4), False)]
    for method, sparsity, pattern, sequential in settings:
        pruned = copy.deepcopy(model)
        if method != "dense":
            sten.prune(pruned, calib, method, sparsity=sparsity, pattern=pattern, sequential=sequential)
        with torch.no_grad():
            acc = (pruned(xte).argmax(1) == yte).float().mean().item()
        rows.append({"method": _method(method, sequential), "pattern": _label(method, sparsity, pattern), "accuracy": acc,
                     "sparsity": measured_sparsity(pruned, list(digits.WEIGHTS))})
        if log:
            print(f"  digits {method:9s} {rows[-1]['pattern']:5s} acc {acc:.4f}", flush=True)
    for (suffix, layout), pattern, method in [(lay, pat, mth) for lay in grouped_layouts()
                                              for pat in ((2, 4), (1, 4)) for mth in METHODS]:
        pruned = copy.deepcopy(model)
        sten.prune(pruned, calib, method, pattern=pattern, out_format=layout)
        with torch.no_grad():
            acc = (pruned(xte).argmax(1) == yte).float().mean().item()
        rows.append({"method": method, "pattern": f"{pattern[0]}:{pattern[1]} {suffix}", "accuracy": acc,
                     "sparsity": measured_sparsity(pruned, list(digits.WEIGHTS))})
        if log:
            print(f"  digits {method:9s} {rows[-1]['pattern']} acc {acc:.4f}", flush=True)
    return {"epochs": epochs, "rows": rows}


# -- report ------------------------------------------------------------------------------

def machine() -> dict[str, Any]:
    try:
        load = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        load = []
    return {"cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "isa": torch.backends.cpu.get_cpu_capability(), "loadavg": load}


def markdown(result: dict[str, Any]) -> str:
    lm, dg = result["lm"], result["digits"]
    base = lm["rows"][0]["perplexity"]
    out = ["| method | pattern | held-out perplexity | increase | zero weights in pruned layers | pruning time |",
           "|---|---|---|---|---|---|"]
    for r in lm["rows"]:
        out.append(f"| {r['method']} | {r['pattern']} | {r['perplexity']:.3f} | {r['perplexity'] / base - 1:+.1%} "
                   f"| {r['sparsity']:.3f} | {r['prune_seconds']:.1f} s |")
    out += ["", "| method | pattern | test accuracy | zero weights |", "|---|---|---|---|"]
    for r in dg["rows"]:
        out.append(f"| {r['method']} | {r['pattern']} | {r['accuracy']:.4f} | {r['sparsity']:.3f} |")
    m = result["machine"]
    out += ["", f"Machine: {m['cpu']}, {m['threads']} thread(s), kernel ISA {m['isa']}, torch {m['torch']}, "
            f"load average before/after {' '.join(result['load_before'])} / {' '.join(m['loadavg'])}; "
            f"LM training {lm['train_seconds']:.0f} s ({lm['config']['steps']} steps), "
            f"Python {lm['data']['python']} stdlib ({lm['data']['files']} files, {lm['data']['train_bytes']} train / "
            f"{lm['data']['heldout_bytes']} held-out bytes)."]
    if lm.get("layout_check"):
        c = lm["layout_check"]
        out.append(f"SparseGPT 2:4 stored as {', '.join(c['layouts'])}: perplexity {c['perplexity_layout']:.4f} "
                   f"(dense with zeros: {c['perplexity_dense_zeros']:.4f}).")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model and data: a smoke test in seconds")
    parser.add_argument("--steps", type=int, default=None, help="LM training steps (default 600; quick: 30)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine is shared)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = copy.deepcopy(QUICK if args.quick else LMConfig())
    if args.steps is not None:
        cfg.steps = args.steps
    load_before = Path("/proc/loadavg").read_text().split()[:3] if os.path.exists("/proc/loadavg") else []
    lm = run_lm(cfg, 200_000 if args.quick else None, log=not args.quick)
    dg = run_digits(2 if args.quick else 30, log=not args.quick)
    result = {"lm": lm, "digits": dg, "machine": machine(), "load_before": load_before, "quick": args.quick}
    print(markdown(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
