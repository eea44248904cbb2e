"""``sten explain``: what the dispatcher did while a model ran.

Inside ``with sten_core.explain() as report:`` every dispatched operator call is
recorded, one row per (operator and layouts, plan): which implementation ran
(and from which plugin), every conversion between layouts, every sparsifier
call and every dense fallback with the ``register_*`` decorator that would
remove it, with call counts, time and the modules (call sites) it ran in.
Dense-fallback warnings are silenced inside the block: the report lists them.

Example:
    >>> import torch, torch.nn.functional as F, sten_core as sten
    >>> w = sten.sparsify(sten.ScalarFractionSparsifier(0.5), torch.randn(4, 4), sten.CsrTensor)
    >>> with sten.explain() as report:
    ...     _ = F.linear(torch.randn(2, 4), w)
    >>> [(r.plan, r.calls) for r in report.rows]
    [('impl', 1)]
    >>> report.fallbacks
    []
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from sten_core import dispatch
from sten_core.model.registry import OpKey, registry
from sten_core.model.signatures import op_name


@dataclass
class Row:
    """One line of the report.

    ``kind`` is ``op`` (forward or backward operator call), ``sparsifier`` or
    ``conversion``; ``plan`` is ``impl``, ``generic``, ``convert``, ``native``
    or ``fallback`` (conversions: ``convert``); ``ran`` names the function that
    ran; ``fix`` is the decorator that would remove a fallback; ``notes`` what
    the implementation said it picked (``plugin_api.note``, e.g. a tuned kernel),
    with counts.
    """

    kind: str
    what: str
    plan: str
    ran: str = ""
    fix: str | None = None
    calls: int = 0
    seconds: float = 0.0
    sites: dict[str, int] = field(default_factory=dict)
    key: Any = None
    notes: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"kind": self.kind, "what": self.what, "plan": self.plan, "ran": self.ran, "fix": self.fix,
                "calls": self.calls, "ms": round(self.seconds * 1e3, 3), "sites": dict(self.sites),
                "notes": dict(self.notes)}


def _fn_name(fn: Any) -> str:
    module = getattr(fn, "__module__", None) or ""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{module}.{name}" if module else name


def _owner(key: OpKey) -> str | None:
    return registry.owner_of("impls", key)


def _layout_name(layout: Any) -> str:
    if layout is None:
        return "None"
    return "Tensor" if layout is torch.Tensor else getattr(layout, "__name__", repr(layout))


class Report:
    """What ran, collected while the ``with`` block is active (re-entrant: no).

    Args:
        model: optional; its submodules are named by their paths in ``sites``
            (otherwise by their class names).
    """

    def __init__(self, model: torch.nn.Module | None = None):
        self._rows: dict[tuple, Row] = {}
        self._names = {id(m): (path or type(m).__name__) for path, m in model.named_modules()} if model is not None else {}
        self._stack: list[str] = []
        self._undo: list[Callable[[], None]] = []
        self._warnings: Any = None
        self._pending: list[str] = []

    # -- reading ---------------------------------------------------------------
    @property
    def rows(self) -> list[Row]:
        """All rows, in the order they first happened."""
        return list(self._rows.values())

    @property
    def fallbacks(self) -> list[Row]:
        return [r for r in self._rows.values() if r.plan == "fallback"]

    @property
    def conversions(self) -> list[Row]:
        return [r for r in self._rows.values() if r.kind == "conversion"]

    def as_dicts(self) -> list[dict]:
        return [r.as_dict() for r in self.rows]

    def __str__(self) -> str:
        return format_report(self)

    # -- recording --------------------------------------------------------------
    def _site(self) -> str:
        return self._stack[-1] if self._stack else "-"

    def _add(self, ident: tuple, seconds: float, make: Callable[[], Row]) -> None:
        row = self._rows.get(ident)
        if row is None:
            row = self._rows[ident] = make()
        for text in self._pending:   # said inside this call (its notify comes after it ran)
            row.notes[text] = row.notes.get(text, 0) + 1
        self._pending.clear()
        row.calls += 1
        row.seconds += seconds
        site = self._site()
        row.sites[site] = row.sites.get(site, 0) + 1

    def _on_event(self, event: dict) -> None:
        key, kind, seconds = event["key"], event["plan"], event["seconds"]
        if event["kind"] == "op":
            self._add(("op", key, kind), seconds, lambda: self._op_row(key, kind))
        elif event["kind"] == "sparsifier" and kind != "identity":
            self._add(("sparsifier", key, kind), seconds, lambda: self._sp_row(key, kind))
        elif event["kind"] == "convert":
            src, target = key.inp[0], key.out
            what = f"convert {_layout_name(src)} -> {_layout_name(target)}"
            self._add(("conversion", src, target), seconds,
                      lambda: Row("conversion", what, "convert", ran=_conversion_route(src, target)))

    def _on_note(self, text: str) -> None:
        self._pending.append(text)

    def _op_row(self, key: OpKey, kind: str) -> Row:
        plan = dispatch.plan_of(key)
        row = Row("op", key.describe(), kind, key=key)
        name = op_name(key.op)
        if kind == "fallback":
            what = "backward through autograd" if key.direction == "bwd" else "op"
            row.ran = f"dense {name} {what} (inputs densified, outputs sparsified)"
            row.fix = dispatch.errors.fix_text(key)
        elif kind == "native":
            row.ran = f"torch's own {name}" + (" backward (autograd)" if key.direction == "bwd" else "")
        elif plan is not None and plan.entry is not None:
            owner = _owner(plan.key)
            row.ran = _fn_name(plan.entry.fn) + (f" [{owner}]" if owner else "")
            if kind == "convert":
                steps = [f"arg {i}: {_layout_name(key.inp[i])} -> {_layout_name(c)}"
                         for i, c in enumerate(plan.conversions) if c is not None]
                row.ran += f" after converting {', '.join(steps)}"
        return row

    def _sp_row(self, key: OpKey, kind: str) -> Row:
        row = Row("sparsifier", key.describe(), kind, key=key)
        if kind == "fallback":
            row.ran = "dense: densify, keep all, convert"
            row.fix = dispatch.errors.fix_text(key)
        else:
            entry = registry.impls.get(key)
            owner = _owner(key)
            row.ran = (_fn_name(entry.fn) + (f" [{owner}]" if owner else "")) if entry else "generic / via conversion"
        return row

    def _pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        self._stack.append(self._names.get(id(module), type(module).__name__))

    def _post_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack.pop()

    # -- context manager ------------------------------------------------------------
    def __enter__(self) -> "Report":
        from sten_core import plugins

        plugins.ensure_loaded()
        dispatch.add_observer(self._on_event)
        self._undo.append(lambda: dispatch.remove_observer(self._on_event))
        dispatch.add_note_listener(self._on_note)
        self._undo.append(lambda: dispatch.remove_note_listener(self._on_note))
        from torch.nn.modules import module as nn_module

        handles = [nn_module.register_module_forward_pre_hook(self._pre_hook)]
        try:
            handles.append(nn_module.register_module_forward_hook(self._post_hook, always_call=True))
        except TypeError:  # pragma: no cover - older torch
            handles.append(nn_module.register_module_forward_hook(self._post_hook))
        self._undo.extend(h.remove for h in handles)
        self._warnings = dispatch.quiet_fallbacks()
        self._warnings.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._warnings.__exit__(*exc)
        while self._undo:
            self._undo.pop()()
        self._stack.clear()
        self._pending.clear()


def _conversion_route(src: Any, target: Any) -> str:
    if target is torch.Tensor:
        return "densify"
    if src is None:
        return "from_dense"
    path = dispatch.conversion_path(src, target) if src is not torch.Tensor else None
    if path:
        return " then ".join(_fn_name(fn) for fn in path)
    return f"{_layout_name(target)}.from_dense" if src is torch.Tensor else "sten_convert hook or via dense"


def explain(model: torch.nn.Module | None = None) -> Report:
    """A context manager recording what the dispatcher does inside its block.

    >>> import torch, sten_core as sten
    >>> with sten.explain() as report:
    ...     pass
    >>> report.rows
    []
    """
    return Report(model)


# -- text ---------------------------------------------------------------------------


def _sites(row: Row, limit: int = 3) -> str:
    names = [s for s in row.sites if s != "-"]
    if not names:
        return "-"
    text = ", ".join(names[:limit])
    return text + (f" (+{len(names) - limit})" if len(names) > limit else "")


def format_report(report: Report) -> str:
    """The report as text: one row per (operator and layouts, plan) with the
    implementation, conversions, fallbacks and the decorator that fixes each."""
    rows = report.rows
    if not rows:
        return "nothing was dispatched (no sparse tensors or sparse operators were used)"
    order = {"fallback": 0, "convert": 1, "impl": 2, "generic": 3, "native": 4}
    rows = sorted(rows, key=lambda r: (order.get(r.plan, 5), r.kind != "op"))
    width = max(len(r.what) for r in rows)
    lines = [f"{'plan':8s}  {'calls':>5s}  {'ms':>9s}  {'call':{width}s}  sites"]
    for r in rows:
        lines.append(f"{r.plan:8s}  {r.calls:5d}  {r.seconds * 1e3:9.3f}  {r.what:{width}s}  {_sites(r)}")
        if r.ran:
            lines.append(f"{'':8s}  {'':5s}  {'':9s}  ran: {r.ran}")
        for text, count in r.notes.items():
            lines.append(f"{'':8s}  {'':5s}  {'':9s}  chose: {text}" + (f" ({count} calls)" if count != r.calls else ""))
        if r.fix:
            lines.append(f"{'':8s}  {'':5s}  {'':9s}  fix: {r.fix}")
    n = len(report.fallbacks)
    lines.append(f"{len(rows)} rows, {n} dense fallback{'s' if n != 1 else ''}"
                 + (": add the decorators above (or set_dispatch_failure('raise') to find them)" if n else ""))
    return "\n".join(lines)


# -- models to explain ----------------------------------------------------------------
