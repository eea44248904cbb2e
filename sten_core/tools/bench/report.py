"""Present benchmark rows: a terminal table, CSV, JSON and a PNG like the
paper's Fig. 2 (forward time against sparsity, one line per layout, dense as
the reference). ``|W| kept`` is the weight magnitude each layout's mask keeps
(Σ|W| kept / Σ|W|): speed is judged at the quality it keeps.

Example:
    >>> rows = [{"layout": "dense", "pattern": "", "sparsity": 0.0, "median_ms": 2.0, "speedup": 1.0,
    ...          "threads": 2, "runs": 3, "max_rel_err": None, "fallback_keys": 0, "fallback_calls": 0}]
    >>> print(format_table(rows).splitlines()[0].split())
    ['layout', 'sparsity', '|W|', 'kept', 'median', 'ms', 'speed-up', 'threads', 'runs', 'rel', 'err', 'fallbacks']
"""

from __future__ import annotations

import csv
import json
import os
from typing import Any

CSV_FIELDS = ("case", "layout", "pattern", "sparsity", "device", "dtype", "threads", "median_ms", "min_ms",
              "speedup", "runs", "build_s", "weight_density", "weight_kept", "max_abs_err", "max_rel_err",
              "fallback_keys", "fallback_calls", "error")


def _fmt(value: Any, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def format_table(rows: list[dict]) -> str:
    """The rows as an aligned text table (one line per row, fallbacks listed below)."""
    header = ("layout", "sparsity", "|W| kept", "median ms", "speed-up", "threads", "runs", "rel err", "fallbacks")
    lines = []
    for r in rows:
        name = r["layout"] + (f" {r['pattern']}" if r.get("pattern") else "")
        sparsity = "-" if r["layout"] == "dense" else f"{r['sparsity']:.0%}"
        fallbacks = "0" if not r["fallback_keys"] else f"{r['fallback_keys']} ({r['fallback_calls']} calls)"
        if r.get("error"):
            lines.append((name, sparsity, "-", "failed", "-", str(r["threads"]), "0", "-", "-"))
            continue
        lines.append((name, sparsity, _fmt(r.get("weight_kept"), ".3f"), f"{r['median_ms']:.2f}",
                      "-" if r.get("speedup") is None else f"{r['speedup']:.2f}x",
                      str(r["threads"]), str(r["runs"]), _fmt(r.get("max_rel_err"), ".1e"), fallbacks))
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
    right = {1, 2, 3, 4, 5, 6, 7}

    def render(cells: tuple) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [render(header), render(tuple("-" * w for w in widths))]
    out.extend(render(line) for line in lines)
    out.extend(f"{r['layout']} at {r['sparsity']:.0%} failed: {r['error']}" for r in rows if r.get("error"))
    notes = sorted({f for r in rows for f in r.get("fallbacks", [])})
    if notes:
        out.append("dense fallbacks (run `sten explain` for the decorator that removes each):")
        out.extend(f"  {n}" for n in notes)
    return "\n".join(out)


def write_csv(rows: list[dict], path: str) -> str:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_json(rows: list[dict], meta: dict, path: str) -> str:
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=2)
    return path


def plot(rows: list[dict], title: str, path: str) -> str | None:
    """Forward time against sparsity, one line per layout, one panel per
    thread count, dense as a dashed horizontal line. ``None`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    threads = sorted({r["threads"] for r in rows})
    fig, axes = plt.subplots(1, len(threads), figsize=(6.4 * len(threads), 4.4), squeeze=False)
    for ax, t in zip(axes[0], threads):
        mine = [r for r in rows if r["threads"] == t and r.get("median_ms")]
        for r in mine:
            if r["layout"] == "dense":
                ax.axhline(r["median_ms"], color="black", linestyle="--", label="dense (torch)")
        layouts = [name for name in dict.fromkeys(r["layout"] for r in mine) if name != "dense"]
        for name in layouts:
            points = sorted((r["sparsity"] * 100, r["median_ms"]) for r in mine if r["layout"] == name)
            label = next(r.get("label", name) for r in mine if r["layout"] == name)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        ax.set_yscale("log")
        ax.set_xlabel("weight sparsity (%)")
        ax.set_ylabel("forward time (ms, median)")
        device = mine[0]["device"] if mine else ""
        ax.set_title(f"{title}\n{device}, {t} thread{'s' if t != 1 else ''}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        if mine:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_all(rows: list[dict], meta: dict, out_dir: str, stem: str) -> dict[str, str | None]:
    """Write ``<stem>.csv``, ``<stem>.json`` and ``<stem>.png`` under ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, stem)
    return {
        "csv": write_csv(rows, base + ".csv"),
        "json": write_json(rows, meta, base + ".json"),
        "png": plot(rows, meta.get("description", stem), base + ".png"),
    }
