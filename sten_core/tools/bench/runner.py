"""Run the benchmark: sparsify a case's weights into each layout at each
sparsity, time the forward pass, check it against the dense reference and
count dense fallbacks.

Dense-fallback warnings are silenced while it runs; fallbacks are counted
through ``sten_core.dispatch.observers`` and reported per row instead.

Example:
    >>> from sten_core.tools.bench import layouts, models
    >>> rows = run(lambda: models.linear_case(8, 16, 4), layouts.choose(["dense", "csr"], "cpu"),
    ...            Settings(sparsities=[0.5], repeats=1, warmup=0), progress=False)
    >>> [(r["layout"], r["sparsity"]) for r in rows]
    [('dense', 0.0), ('torch_csr', 0.5)]
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from sten_core.progress import show_progress
from sten_core.tools.bench.layouts import BenchLayout, layout_class
from sten_core.tools.bench.models import Case


@dataclass
class Settings:
    """How to run: sparsities (fractions), thread counts (``None``: torch's
    current one), device, dtype, warm-up runs, timed runs, and a time budget
    per configuration after which fewer timed runs are taken (at least one)."""

    sparsities: list[float] = field(default_factory=lambda: [0.5, 0.6, 0.7, 0.8, 0.9, 0.95])
    threads: list[int | None] = field(default_factory=lambda: [None])
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    warmup: int = 1
    repeats: int = 10
    budget_s: float = 20.0
    check: bool = True


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_forward(fn: Callable[[], Any], settings: Settings) -> tuple[list[float], Any]:
    """Seconds of each timed call of ``fn`` and the output of its first call."""
    out = None
    for i in range(max(1, settings.warmup)):
        result = fn()
        out = result if i == 0 else out
    _sync(settings.device)
    times: list[float] = []
    spent = 0.0
    while len(times) < max(1, settings.repeats) and (not times or spent < settings.budget_s):
        start = time.perf_counter()
        fn()
        _sync(settings.device)
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return times, out


@contextlib.contextmanager
def watch_fallbacks() -> Iterator[dict]:
    """Count dense fallbacks per key (description → calls), warnings silenced."""
    from sten_core import dispatch

    seen: dict[str, int] = {}

    def observe(event: dict) -> None:
        if event["plan"] == "fallback":
            text = event["key"].describe()
            seen[text] = seen.get(text, 0) + 1

    dispatch.add_observer(observe)
    try:
        with dispatch.quiet_fallbacks():
            yield seen
    finally:
        dispatch.remove_observer(observe)


@contextlib.contextmanager
def num_threads(n: int | None) -> Iterator[int]:
    """Run with ``n`` intra-op threads (``None``: unchanged)."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def sparse_model(case: Case, layout: BenchLayout, sparsity: float) -> torch.nn.Module:
    """``case.model`` with its weights in ``layout`` at ``sparsity``."""
    from sten_core.training.builder import SparsityBuilder

    if layout.layout_name is None:
        return case.model
    builder = SparsityBuilder(case.model)
    out_format = layout_class(layout)
    for name in case.weights:  # tmp_format too: the sparsifier builds the layout itself (n:m keeps its n and m)
        builder.set_weight(name, initial_sparsifier=layout.sparsifier(sparsity), tmp_format=out_format,
                           out_format=out_format)
    return builder.get_sparse_model()


def _weight_stats(model: torch.nn.Module, weights: list[str]) -> tuple[int, int]:
    nnz = numel = 0
    for name in weights:
        w = model.get_parameter(name)
        numel += w.numel()
        layout = getattr(w, "wrapped_tensor", None)
        count = getattr(layout, "nnz", None) if layout is not None else None
        nnz += int(count) if count is not None else int(torch.count_nonzero(w.detach()))
    return nnz, numel


def _magnitude(model: torch.nn.Module, weights: list[str]) -> float:
    """Σ|W| over the named weights (densified)."""
    from sten_core.model.tensor import densify

    return sum(float(densify(model.get_parameter(name).detach()).abs().double().sum()) for name in weights)


def _max_errors(case: Case, reference: torch.nn.Module, model: torch.nn.Module, out: Any) -> tuple[float, float]:
    """Max absolute and relative error of ``out`` against ``reference`` holding
    the same (densified) weights."""
    from sten_core.model.tensor import densify

    with torch.no_grad():
        for name in case.weights:
            reference.get_parameter(name).copy_(densify(model.get_parameter(name)).to(reference.get_parameter(name).dtype))
        expected = _first(reference(*case.inputs)).float()
    got = densify(_first(out)).float()
    err = (got - expected).abs().max().item()
    return err, err / max(expected.abs().max().item(), 1e-12)


def _configs(layouts: list[BenchLayout], settings: Settings) -> list[tuple[int | None, BenchLayout, float]]:
    configs = []
    for threads in settings.threads:
        for layout in layouts:
            if layout.layout_name is None:
                configs.append((threads, layout, 0.0))
                continue
            configs.extend((threads, layout, s) for s in settings.sparsities if layout.runs_at(s))
    return configs


def _progress(total: int, enabled: bool | None) -> Any:
    if show_progress(enabled):  # None: only when stderr is a terminal
        try:
            from tqdm import tqdm

            return tqdm(total=total, unit="run", leave=False, dynamic_ncols=True)
        except ImportError:  # tqdm is in the optional ``bench`` extra
            pass
    return None


def run(make_case: Callable[[], Case], layouts: list[BenchLayout], settings: Settings,
        progress: bool | None = None) -> list[dict]:
    """One result row (a dict) per (threads, layout, sparsity); the dense
    reference runs once per thread count with ``sparsity`` 0.0. ``progress``: a
    bar on stderr (tqdm); by default only when stderr is a terminal."""
    case = make_case()
    reference = copy.deepcopy(case.model) if settings.check else None
    dense_magnitude = _magnitude(case.model, case.weights)
    configs = _configs(layouts, settings)
    bar = _progress(len(configs), progress)
    rows: list[dict] = []
    try:
        for threads, layout, sparsity in configs:
            if bar is not None:
                bar.set_description(f"{layout.name} {sparsity:.0%}")
            with num_threads(threads) as used, torch.no_grad():
                try:
                    rows.append(_run_one(case, reference, layout, sparsity, used, settings, dense_magnitude))
                except Exception as error:  # one layout failing must not lose the others' results
                    rows.append(_failed_row(case, layout, sparsity, used, settings, error))
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    _add_speedups(rows)
    return rows


def _run_one(case: Case, reference: Any, layout: BenchLayout, sparsity: float, threads: int,
             settings: Settings, dense_magnitude: float) -> dict:
    with watch_fallbacks() as fallbacks:
        start = time.perf_counter()
        model = sparse_model(case, layout, sparsity)
        build_s = time.perf_counter() - start
        times, out = time_forward(lambda: model(*case.inputs), settings)
    nnz, numel = _weight_stats(model, case.weights)
    abs_err = rel_err = None
    if reference is not None and layout.layout_name is not None:
        abs_err, rel_err = _max_errors(case, reference, model, out)
    return {
        "case": case.name,
        "layout": layout.name,
        "label": layout.label,
        "pattern": layout.pattern_at(sparsity),
        "sparsity": sparsity,
        "device": settings.device,
        "dtype": str(settings.dtype).replace("torch.", ""),
        "threads": threads,
        "median_ms": statistics.median(times) * 1e3,
        "min_ms": min(times) * 1e3,
        "runs": len(times),
        "build_s": build_s,
        "weight_density": nnz / numel if numel else 1.0,
        "weight_kept": _magnitude(model, case.weights) / dense_magnitude if dense_magnitude else 1.0,
        "max_abs_err": abs_err,
        "max_rel_err": rel_err,
        "fallback_keys": len(fallbacks),
        "fallback_calls": sum(fallbacks.values()),
        "fallbacks": sorted(fallbacks),
    }


def _failed_row(case: Case, layout: BenchLayout, sparsity: float, threads: int, settings: Settings,
                error: Exception) -> dict:
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return {"case": case.name, "layout": layout.name, "label": layout.label, "pattern": layout.pattern_at(sparsity),
            "sparsity": sparsity, "device": settings.device, "dtype": str(settings.dtype).replace("torch.", ""),
            "threads": threads, "median_ms": None, "min_ms": None, "runs": 0, "build_s": None,
            "weight_density": None, "weight_kept": None, "max_abs_err": None, "max_rel_err": None, "fallback_keys": 0,
            "fallback_calls": 0, "fallbacks": [], "error": f"{type(error).__name__}: {message}"[:300]}


def _add_speedups(rows: list[dict]) -> None:
    dense = {r["threads"]: r["median_ms"] for r in rows if r["layout"] == "dense" and r["median_ms"]}
    for row in rows:
        ref = dense.get(row["threads"])
        row["speedup"] = ref / row["median_ms"] if ref and row["median_ms"] else None
