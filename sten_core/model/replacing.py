"""Replacing a sparse tensor's contents: ``w.data = t``, ``w.set_(t)``, loading a checkpoint value
of another layout. Unlike in-place arithmetic (written at the stored positions), a replacement
holds the new value exactly in the wrapper's layout class or raises a ``ValueError`` saying what
it cannot store and what to do instead (``replacement_layout``).

Example:
    >>> import torch, sten_core as sten
    >>> w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(2)))
    >>> replacement_layout(w, torch.ones(2, 2), "w.data = t", REPLACE_ADVICE).nnz
    4
"""

from __future__ import annotations

from typing import Any

import torch

from sten_core.model.layouts import builds_from_dense, layout_metadata, supports_values, to_dense_tensor

REPLACE_ADVICE = ("To write t at the stored positions only (dropping the rest), use w.copy_(t); to choose "
                  "what is kept, sparsify t first (sten.sparsify(sparsifier, t, {layout})); a layout that "
                  "holds any pattern (sten.CsrTensor) takes t whole.")
"""What to do instead, for ``w.data = t`` and ``w.set_(t)`` (``{layout}``: the layout's name)."""


def replacement_layout(target: Any, dense: torch.Tensor, what: str, advice: str) -> Any:
    """A layout object of ``target``'s layout class holding exactly ``dense`` (what
    replacing ``target``'s contents needs: ``w.data = t``, ``w.set_(t)``, loading a value
    of another layout), the first of:

    1. ``from_dense(dense)`` when it stores exactly ``dense``'s nonzeros (a layout that
       holds any pattern: CSR, COO, scipy; ``dense``'s nonzeros make the pattern);
    2. ``target``'s own pattern with ``dense``'s values, when ``dense`` is zero wherever
       ``target`` stores nothing (``vector_to_parameters(parameters_to_vector(...))`` on an
       n:m weight keeps its n:m and pattern);
    3. ``from_dense(dense)`` when it holds ``dense`` exactly and stores no more values than
       ``target`` (an n:m value with another n:m pattern).

    Else a ``ValueError`` saying what ``what`` could not store and, from ``advice``
    (formatted with ``layout``, the layout's name), what to do instead. The checks
    densify once or twice: they run only on these replacing paths.

    Example:
        >>> import torch, sten_core as sten
        >>> w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(2)))
        >>> replacement_layout(w, torch.ones(2, 2), "w.data = t", REPLACE_ADVICE).nnz
        4
    """
    layout = target.wrapped_tensor
    built = _from_dense(type(layout), dense)
    built_dense = None if built is None else to_dense_tensor(built)
    exact = built_dense is not None and same_values(built_dense, dense)
    if exact and _nnz(built) == int(torch.count_nonzero(dense)):
        return built
    at_pattern = _at_stored_positions(layout, dense)
    pattern_dense = None if at_pattern is None else to_dense_tensor(at_pattern)
    if pattern_dense is not None and same_values(pattern_dense, dense):
        return at_pattern
    if exact and stores_at_most(built, layout):
        return built
    raise ValueError(_unrepresentable(layout, dense, built_dense, pattern_dense, what,
                                      advice.format(layout=type(layout).__name__)))


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` holds exactly ``b``'s values (shape and values, NaN equal to NaN), in ``b``'s dtype.

    >>> same_values(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, float("nan")], dtype=torch.float64))
    True
    """
    if a.shape != b.shape:
        return False
    a = a.to(device=b.device, dtype=b.dtype)
    equal = a == b
    if b.is_floating_point() or b.is_complex():
        equal |= a.isnan() & b.isnan()
    return bool(equal.all())


def _from_dense(layout_cls: type, dense: torch.Tensor) -> Any:
    """``dense`` in ``layout_cls`` by its ``from_dense`` (through ``sten.convert``), or
    ``None`` for a layout without one."""
    return layout_cls.from_dense(dense) if builds_from_dense(layout_cls) else None


def _at_stored_positions(layout: Any, dense: torch.Tensor) -> Any:
    """``layout`` with ``dense``'s values at its stored positions (the pattern kept), or
    ``None`` where it has no stored-values protocol or another shape, dtype or device."""
    if not supports_values(layout) or layout_metadata(layout) != (dense.shape, dense.dtype, dense.device):
        return None
    return layout.with_values(layout.gather(dense))


def _nnz(layout: Any) -> int | None:
    """The number of values ``layout`` stores, ``None`` where it does not say."""
    nnz = getattr(layout, "nnz", None)
    return nnz if isinstance(nnz, int) else None


def stores_at_most(layout: Any, other: Any) -> bool:
    """Whether ``layout`` stores no more values than ``other`` (true where one does not say)."""
    mine, theirs = _nnz(layout), _nnz(other)
    return mine is None or theirs is None or mine <= theirs


def _unrepresentable(layout: Any, dense: torch.Tensor, built: torch.Tensor | None, at_pattern: torch.Tensor | None,
                     what: str, advice: str) -> str:
    """The message of a replacement ``layout`` cannot hold: how many of ``dense``'s nonzeros
    its ``from_dense`` (``built``) and its stored pattern (``at_pattern``) keep."""
    name, nonzero = type(layout).__name__, dense != 0
    found = [f"it has {int(nonzero.sum())} nonzero values"]
    if built is not None:
        found.append(f"{name}.from_dense keeps {_kept(built, dense, nonzero)} of them")
    if at_pattern is not None:
        found.append(f"the {_nnz(layout)} positions stored now hold {_kept(at_pattern, dense, nonzero)} of them")
    return f"{what}: {_describe(layout)} cannot hold the new value exactly: {'; '.join(found)}. {advice}"


def _kept(held: torch.Tensor, dense: torch.Tensor, nonzero: torch.Tensor) -> int:
    """How many of ``dense``'s nonzeros ``held`` has, with their values."""
    return int((nonzero & (held.to(dense.dtype) == dense)).sum())


def _describe(layout: Any) -> str:
    """``repr(layout)`` (an n:m layout's shows n, m and dim), else its class name."""
    try:
        return repr(layout)
    except Exception:  # a layout's repr never breaks an error message
        return type(layout).__name__
