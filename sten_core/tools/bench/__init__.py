"""``sten bench``: the paper's Fig. 2 on this machine.

Forward time of a BERT-base encoder layer (``BertLayer(BertConfig())``, random
weights, batch 8, sequence 128) with its six Linear weights sparsified into each
installed and available layout, at sparsities 50-95 %; or of one linear layer.
Writes a table, ``<case>.csv``, ``<case>.json`` and ``<case>.png``.

Example:
    >>> import tempfile
    >>> from sten_core.tools.bench import bench
    >>> result = bench("linear", layouts="dense,csr", sparsities="50", shape="16x8", tokens=4,
    ...                out=tempfile.mkdtemp(), repeats=1, progress=False, echo=False)
    >>> [r["layout"] for r in result["rows"]]
    ['dense', 'torch_csr']
"""

from __future__ import annotations

import os
import platform
import time
from typing import Any, Callable

import torch

from sten_core.tools.bench import layouts as layouts_mod
from sten_core.tools.bench import options, report
from sten_core.tools.bench.models import bert_case, linear_case
from sten_core.tools.bench.runner import Settings, run

TARGETS = ("bert", "linear")
QUICK = {"sparsities": "50,90", "repeats": 3, "warmup": 1, "budget_s": 1.5, "batch": 2}
FULL = {"sparsities": "50,60,70,80,90,95", "repeats": 10, "warmup": 2, "budget_s": 10.0, "batch": 8}


def bench(target: str = "bert", *, quick: bool = False, layouts: str | None = None, sparsities: str | None = None,
          threads: str | None = None, device: str = "auto", dtype: str | None = None, out: str = "bench-out",
          batch: int | None = None, seq_len: int = 128, size: str = "base", shape: str = "3072x768", tokens: int | None = None,
          repeats: int | None = None, progress: bool | None = None, echo: bool = True,
          print_fn: Callable[[str], Any] = print) -> dict:
    """Run the benchmark and write its files; returns ``{"rows", "files", "meta"}``.

    String arguments take the command line's spelling (``layouts="dense,csr"``,
    ``sparsities="50,90"``); bad values raise a one-line ``ValueError``.
    """
    if target not in TARGETS:
        raise ValueError(f"unknown benchmark {target!r}; valid choices: {', '.join(TARGETS)}")
    preset = QUICK if quick else FULL
    dev = options.parse_device(device)
    settings = Settings(
        sparsities=options.parse_sparsities(sparsities or preset["sparsities"]),
        threads=options.parse_threads(threads),
        device=dev,
        dtype=options.parse_dtype(dtype, dev),
        warmup=preset["warmup"],
        repeats=preset["repeats"] if repeats is None else repeats,
        budget_s=preset["budget_s"],
    )
    if settings.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {settings.repeats}")
    chosen = layouts_mod.choose(options.parse_layouts(layouts), dev)
    if target == "bert":
        b = preset["batch"] if batch is None else batch
        make_case = lambda: bert_case(batch=b, seq_len=seq_len, device=dev, dtype=settings.dtype, size=size)  # noqa: E731
    else:
        out_f, in_f = options.parse_shape(shape)
        n = (preset["batch"] * seq_len if batch is None else batch * seq_len) if tokens is None else tokens
        make_case = lambda: linear_case(out_f, in_f, n, device=dev, dtype=settings.dtype)  # noqa: E731
    skipped = {} if layouts else _skipped(layouts_mod.known(), dev)
    _check_out_dir(out)
    started = time.perf_counter()
    case = make_case()
    rows = run(lambda: case, chosen, settings, progress=progress)
    meta = _meta(case.description, settings, quick, time.perf_counter() - started, skipped)
    files = report.write_all(rows, meta, out, case.name)
    if echo:
        print_fn(f"{meta['description']} on {dev} ({meta['dtype']}), median of up to {settings.repeats} runs")
        print_fn(report.format_table(rows))
        for name, reason in skipped.items():
            print_fn(f"skipped {name}: {reason} (see `sten plugins`)")
        print_fn(f"wrote {files['csv']} and {files['json']}")
        print_fn(f"plot: {files['png']}" if files["png"] else "plot: not written (pip install matplotlib)")
    return {"rows": rows, "files": files, "meta": meta}


def _check_out_dir(out: str) -> None:
    """``out`` made (a directory) before the benchmark runs: an existing file or an unwritable path
    failed with a traceback after the whole run, its table never printed."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out!r} is a file; give a directory for the CSV, JSON and plot")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as error:
        raise ValueError(f"--out {out!r}: cannot make the directory ({error.strerror or error})") from None
    if not os.access(out, os.W_OK):
        raise ValueError(f"--out {out!r}: the directory is not writable")


def _skipped(candidates: Any, device: str) -> dict[str, str]:
    out = {}
    for layout in candidates:
        ok, reason = layouts_mod.availability(layout, device)
        if not ok:
            out[layout.name] = reason
    return out


def _meta(description: str, settings: Settings, quick: bool, seconds: float, skipped: dict) -> dict:
    return {
        "description": description,
        "device": settings.device,
        "dtype": str(settings.dtype).replace("torch.", ""),
        "quick": quick,
        "repeats": settings.repeats,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "seconds": round(seconds, 2),
        "skipped": skipped,
    }


__all__ = ["Settings", "bench", "run"]
