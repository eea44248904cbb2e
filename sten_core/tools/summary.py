"""``sten.summary(model)``: what each sparse parameter stores and what it saves.

One row per sparse parameter: its name, layout, shape, stored values (nnz), the
bytes it stores (values and indices) against the bytes of the dense tensor, and
the totals, for the sparse parameters and for the whole model.

Example:
    >>> import torch, sten_core as sten
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    >>> model[0].weight = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.eye(4, 8)))
    >>> rows = sten.summary(model)   # doctest: +NORMALIZE_WHITESPACE
    parameter  layout     shape   nnz  stored B  dense B  stored/dense
    0.weight   CsrTensor  [4, 8]    4        88      128         68.8%
    sparse parameters                        88      128         68.8%
    whole model (+1 dense)                  104      144         72.2%
    >>> rows[0]["nnz"], rows[0]["stored_bytes"]   # int64 row pointers and columns, fp32 values
    (4, 88)
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from sten_core.model.layouts import supports_values, to_dense_tensor
from sten_core.model.tensor import SparseTensorWrapper


def stored_bytes(layout: Any) -> int | None:
    """Bytes a layout object stores: its ``nbytes``, else its ``state_tensors()``,
    else its stored values; ``None`` where none of these is known."""
    nbytes = getattr(layout, "nbytes", None)
    if isinstance(nbytes, int) and not isinstance(nbytes, bool):
        return nbytes
    state = getattr(layout, "state_tensors", None)
    if callable(state):
        return sum(t.numel() * t.element_size() for t in state() if isinstance(t, torch.Tensor))
    if supports_values(layout):
        values = layout.values()
        return values.numel() * values.element_size()
    return None


def _nnz(layout: Any) -> int:
    nnz = getattr(layout, "nnz", None)
    if isinstance(nnz, int) and not isinstance(nnz, bool):
        return nnz
    return int((to_dense_tensor(layout) != 0).sum())


def _ratio(part: int | None, whole: int) -> str:
    return "?" if part is None or whole == 0 else f"{100.0 * part / whole:.1f}%"


def summary(model: torch.nn.Module, print_fn: Callable[[str], Any] | None = print) -> list[dict]:
    """Print, per sparse parameter of ``model``, its layout, shape, nnz and stored
    bytes against dense bytes, then the totals; returns the rows as dicts.

    Args:
        model: any ``nn.Module``.
        print_fn: where the table goes (``None``: nowhere, only the rows are returned).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    rows, dense_count, dense_params_bytes = [], 0, 0
    for name, param in model.named_parameters():
        if not isinstance(param, SparseTensorWrapper):
            dense_count += 1
            dense_params_bytes += param.numel() * param.element_size()
            continue
        layout = param.wrapped_tensor
        rows.append({
            "name": name,
            "layout": type(layout).__name__,
            "shape": list(param.shape),
            "nnz": _nnz(layout),
            "stored_bytes": stored_bytes(layout),
            "dense_bytes": param.numel() * param.element_size(),
        })
    if print_fn is not None:
        print_fn(_table(rows, dense_count, dense_params_bytes))
    return rows


def _table(rows: list[dict], dense_count: int, dense_params_bytes: int) -> str:
    known = all(r["stored_bytes"] is not None for r in rows)
    stored = sum(r["stored_bytes"] for r in rows) if known else None
    dense = sum(r["dense_bytes"] for r in rows)
    lines = [["parameter", "layout", "shape", "nnz", "stored B", "dense B", "stored/dense"]]
    for r in rows:
        lines.append([r["name"], r["layout"], str(r["shape"]), str(r["nnz"]),
                      "?" if r["stored_bytes"] is None else str(r["stored_bytes"]), str(r["dense_bytes"]),
                      _ratio(r["stored_bytes"], r["dense_bytes"])])
    totals = [["sparse parameters", str(stored if known else "?"), str(dense), _ratio(stored, dense)]]
    whole_stored = None if stored is None else stored + dense_params_bytes
    totals.append([f"whole model (+{dense_count} dense)", str(whole_stored if known else "?"),
                   str(dense + dense_params_bytes), _ratio(whole_stored, dense + dense_params_bytes)])
    widths = [max(len(line[i]) for line in lines) for i in range(7)]
    right = {3, 4, 5, 6}
    out = ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))).rstrip()
           for line in lines]
    label_width = sum(widths[:4]) + 2 * 3
    for label, s, d, ratio in totals:
        label_width = max(label_width, len(label))
    for label, s, d, ratio in totals:
        out.append(f"{label.ljust(label_width)}  {s.rjust(widths[4])}  {d.rjust(widths[5])}  {ratio.rjust(widths[6])}")
    return "\n".join(out)
