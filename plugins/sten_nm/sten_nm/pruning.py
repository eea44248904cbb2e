"""One-shot pruning into the paper's grouped n:m formats: :class:`ColumnGroupedNMTensor`
and the 16-row :class:`GroupedNMTensor`.

The pattern: within each block of ``m`` output rows every column keeps ``n`` rows, and
in each chunk of ``C(m, n) * g`` columns each of the ``C(m, n)`` row patterns owns
exactly ``g`` columns. Every method picks that pattern with the same balanced
assignment (:func:`sten_nm.column_grouped.grouped_columns`), fed its own score:

* magnitude: ``|W|`` (:class:`~sten_nm.ColumnGroupedNMSparsifier`);
* Wanda: ``|W| * ||X_j||`` (:class:`ColumnGroupedWandaSparsifier`);
* SparseGPT: chunk by chunk as its column sweep reaches each chunk, the saliency
  ``w^2 / [H^-1]_jj^2`` of the already-updated weights, then the OBS updates
  (:class:`ColumnGroupedSparseGPTSparsifier`; its lazy block size is rounded up to
  a multiple of the chunk width ``C(m, n) * g``).

``sten.prune(model, batches, method, pattern=(n, m), out_format=ColumnGroupedNMTensor)``
picks these through :meth:`ColumnGroupedNMTensor.pruning_sparsifier`
(:func:`pruning_sparsifier`); ``pattern=(n, m, g)`` fixes ``g`` (default: per layer,
:func:`~sten_nm.column_grouped.default_g`). The 16-row :class:`GroupedNMTensor` (rows in groups of 16 sharing one n:m mask along
the inputs) works the same way (:class:`GroupedWandaSparsifier`,
:class:`GroupedSparseGPTSparsifier`, magnitude :class:`~sten_nm.GroupedNMSparsifier`):
the greedy row grouping and each group's choice use the method's score; SparseGPT fixes
the row groups up front by ``|W| * sqrt(diag H)`` (its saliency with a diagonal
Hessian, i.e. Wanda's score) and chooses each group's ``n`` of every ``m`` columns
by the summed saliency of the updated weights as its sweep reaches them.

For ColumnGroupedNMTensor, a column count that is not a multiple of
the chunk width is allowed: the last chunk is narrower (``ceil(rest / C(m, n))``
columns per pattern, padded with zero columns, as the layout stores it); a row count
that is not a multiple of ``m`` pads the last row block with zero rows.

Example:
    >>> import torch, sten_core as sten
    >>> from sten_core.training.pruning import input_norms
    >>> from sten_nm import ColumnGroupedNMTensor
    >>> _ = torch.manual_seed(0); x = torch.randn(64, 12); w = torch.randn(8, 12)
    >>> sp = ColumnGroupedWandaSparsifier(2, 4, g=2).bind(input_norm=input_norms(x))
    >>> t = sten.sparsify(sp, w, ColumnGroupedNMTensor).wrapped_tensor
    >>> (t.n, t.m, t.g), bool(((t.to_dense() != 0).reshape(2, 4, 12).sum(1) == 2).all())
    ((2, 4, 2), True)
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from sten_core.plugin_api import METHODS, SparseGPTSparsifier, WandaSparsifier, sparsegpt

from ._checks import check_nm
from .column_grouped import check_patterns, column_grouped_keep_mask, default_g
from .grouped_tensor import GR, GroupedNMTensor, greedy_row_groups
from .sparsifier import ColumnGroupedNMSparsifier, GroupedNMSparsifier


def _check_g(g: Any) -> Optional[int]:
    if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
        raise ValueError(f"g must be None (automatic) or an int >= 1, got {g!r}")
    return g


class ColumnGroupedRule:
    """SparseGPT's :class:`~sten_core.training.pruning.sparsegpt.ChunkRule` for the grouped
    pattern: chunks of ``C(m, n) * g`` columns, each chunk's mask the balanced
    assignment that keeps the most saliency.

    >>> ColumnGroupedRule(1, 2, 1).keep(torch.tensor([[3., 0.], [1., 2.]])).tolist()
    [[True, False], [False, True]]
    """

    def __init__(self, n: int, m: int, g: int):
        self.n, self.m, self.g = n, m, g
        self.width = check_patterns(n, m) * g

    def keep(self, saliency: torch.Tensor) -> torch.Tensor:
        return column_grouped_keep_mask(saliency.float(), self.n, self.m, self.g).to(saliency.device)


class ColumnGroupedWandaSparsifier(WandaSparsifier):
    """Wanda into the grouped n:m pattern: the balanced assignment keeping the most
    ``|W| * ||X_j||`` (extra input ``input_norm``, as :class:`WandaSparsifier`).

    Args:
        n, m: ``n`` of every ``m`` output rows kept per column.
        g: columns per pattern in a chunk (``None``: :func:`default_g` of the weight).
    """

    def __init__(self, n: int, m: int, g: Optional[int] = None):
        super().__init__(n=n, m=m)
        check_patterns(self.n, self.m)
        self.g = _check_g(g)

    def mask(self, tensor: torch.Tensor, **inputs: Any) -> torch.Tensor:
        dense = self.check_weight(tensor, type(self).__name__)
        scores = self.score(dense, **self.inputs_for(dense, inputs))
        return column_grouped_keep_mask(scores, self.n, self.m, self.g).to(dense.device)

    def layout_params(self) -> dict[str, Any]:
        return {"n": self.n, "m": self.m, "g": self.g}


class ColumnGroupedSparseGPTSparsifier(SparseGPTSparsifier):
    """SparseGPT into the grouped n:m pattern (extra input ``hessian``, as
    :class:`SparseGPTSparsifier`): the mask of each chunk of ``C(m, n) * g`` columns
    is chosen when the sweep reaches it (:class:`ColumnGroupedRule`).

    Args:
        n, m, g: as :class:`ColumnGroupedWandaSparsifier`.
        percdamp: dampening (0.01).
        blocksize: lazy-update block (128), rounded up to a multiple of the chunk width.
    """

    def __init__(self, n: int, m: int, g: Optional[int] = None, *, percdamp: float = 0.01, blocksize: int = 128):
        super().__init__(n=n, m=m, percdamp=percdamp, blocksize=blocksize)
        check_patterns(self.n, self.m)
        self.g = _check_g(g)

    def prune(self, tensor: torch.Tensor, **inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        dense = self.check_weight(tensor, type(self).__name__)
        hessian = self.inputs_for(dense, inputs)["hessian"]
        g = default_g(dense.shape[1], self.n, self.m) if self.g is None else self.g
        return sparsegpt(dense, hessian, rule=ColumnGroupedRule(self.n, self.m, g), percdamp=self.percdamp,
                         blocksize=self.blocksize)

    def layout_params(self) -> dict[str, Any]:
        return {"n": self.n, "m": self.m, "g": self.g}


class GroupedRowsRule:
    """SparseGPT's :class:`~sten_core.training.pruning.sparsegpt.ChunkRule` for the 16-row grouped
    n:m: rows in the fixed groups of ``order`` (16 consecutive entries each); per chunk of
    ``m`` columns each group keeps the ``min(n, width)`` columns of largest summed saliency.

    >>> GroupedRowsRule(1, 2, torch.tensor([1, 0])).keep(torch.tensor([[3., 0.], [0., 4.]])).tolist()
    [[False, True], [False, True]]
    """

    def __init__(self, n: int, m: int, order: torch.Tensor):
        self.n, self.width, self.order = n, m, order

    def keep(self, saliency: torch.Tensor) -> torch.Tensor:
        N, width = saliency.shape
        Q = -(-N // GR)
        ranked = saliency.new_zeros((Q * GR, width))
        ranked[:N] = saliency[self.order]
        summed = ranked.reshape(Q, GR, width).sum(1)                        # [Q, width]
        chosen = torch.argsort(summed, dim=1, descending=True, stable=True)[:, :min(self.n, width)]
        per_group = torch.zeros((Q, width), dtype=torch.bool, device=saliency.device).scatter_(1, chosen, True)
        keep = torch.empty((N, width), dtype=torch.bool, device=saliency.device)
        keep[self.order] = per_group.repeat_interleave(GR, dim=0)[:N]
        return keep


class GroupedWandaSparsifier(WandaSparsifier):
    """Wanda into the 16-row grouped n:m: rows grouped and each group's ``n`` of every ``m``
    inputs chosen by ``|W| * ||X_j||`` (extra input ``input_norm``).

    Args:
        n, m: ``n`` of every ``m`` inputs kept, one choice per group of 16 rows.
        group: greedy row groups (``False``: consecutive rows).
    """

    def __init__(self, n: int, m: int, group: bool = True):
        super().__init__(n=n, m=m)
        check_nm(self.n, self.m)
        self.group = bool(group)

    def mask(self, tensor: torch.Tensor, **inputs: Any) -> torch.Tensor:
        dense = self.check_weight(tensor, type(self).__name__)
        scores = self.score(dense, **self.inputs_for(dense, inputs))
        return GroupedNMTensor.from_dense(dense.cpu(), self.n, self.m, self.group, score=scores.cpu()).mask().to(dense.device)

    def layout_params(self) -> dict[str, Any]:
        return {"n": self.n, "m": self.m, "group": self.group}


class GroupedSparseGPTSparsifier(SparseGPTSparsifier):
    """SparseGPT into the 16-row grouped n:m (extra input ``hessian``): row groups fixed
    by ``|W| * sqrt(diag H)``, each group's ``n`` of every ``m`` inputs chosen when the
    sweep reaches them (:class:`GroupedRowsRule`).

    Args:
        n, m, group: as :class:`GroupedWandaSparsifier`.
        percdamp, blocksize: as :class:`SparseGPTSparsifier`.
    """

    def __init__(self, n: int, m: int, group: bool = True, *, percdamp: float = 0.01, blocksize: int = 128):
        super().__init__(n=n, m=m, percdamp=percdamp, blocksize=blocksize)
        check_nm(self.n, self.m)
        self.group = bool(group)

    def prune(self, tensor: torch.Tensor, **inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        dense = self.check_weight(tensor, type(self).__name__)
        hessian = self.inputs_for(dense, inputs)["hessian"]
        if hessian.shape != (dense.shape[1], dense.shape[1]):
            raise ValueError(f"{type(self).__name__}: hessian must be [{dense.shape[1]}, {dense.shape[1]}] "
                             f"(in_features²), got {tuple(hessian.shape)}")
        if self.group:
            score = dense.float().abs() * torch.diagonal(hessian).float().clamp_min(0).sqrt().to(dense.device)[None]
            order = greedy_row_groups(score.cpu(), self.n, self.m).to(dense.device)
        else:
            order = torch.arange(dense.shape[0], device=dense.device)
        return sparsegpt(dense, hessian, rule=GroupedRowsRule(self.n, self.m, order), percdamp=self.percdamp,
                         blocksize=self.blocksize)

    def layout_params(self) -> dict[str, Any]:
        return {"n": self.n, "m": self.m, "group": self.group}


def _method_and_pattern(method: str, sparsity: Any, pattern: Any, layout: str, sizes: tuple[int, ...]) -> tuple:
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(repr(m) for m in METHODS)}, got {method!r}")
    if sparsity is not None:
        raise ValueError(f"out_format={layout} stores an n:m pattern: give pattern=(n, m){' or (n, m, g)' if 3 in sizes else ''}, "
                         f"not sparsity={sparsity!r}")
    if not isinstance(pattern, (tuple, list)) or len(pattern) not in sizes:
        raise TypeError(f"pattern must be (n, m){' or (n, m, g)' if 3 in sizes else ''} for out_format={layout}, "
                        f"got {pattern!r}")
    return tuple(pattern)


def grouped_pruning_sparsifier(method: str, *, sparsity: Any = None, pattern: Any = None, percdamp: float = 0.01,
                               blocksize: int = 128) -> Any:
    """The sparsifier of ``method`` that prunes into the 16-row grouped n:m
    ``pattern=(n, m)`` (``sten.prune`` calls it for ``out_format=GroupedNMTensor``).

    >>> grouped_pruning_sparsifier("magnitude", pattern=(2, 4))
    GroupedNMSparsifier(n=2, m=4, group=True)
    """
    n, m = _method_and_pattern(method, sparsity, pattern, "GroupedNMTensor", (2,))
    if method == "magnitude":
        return GroupedNMSparsifier(n, m)
    if method == "wanda":
        return GroupedWandaSparsifier(n, m)
    return GroupedSparseGPTSparsifier(n, m, percdamp=percdamp, blocksize=blocksize)


def pruning_sparsifier(method: str, *, sparsity: Any = None, pattern: Any = None, percdamp: float = 0.01,
                       blocksize: int = 128) -> Any:
    """The sparsifier of ``method`` that prunes into the grouped n:m pattern
    ``pattern=(n, m)`` or ``(n, m, g)`` (``sten.prune`` calls it for
    ``out_format=ColumnGroupedNMTensor``).

    >>> pruning_sparsifier("wanda", pattern=(2, 4, 8))
    ColumnGroupedWandaSparsifier(n=2, m=4, fraction=0.5, g=8)
    """
    pattern = _method_and_pattern(method, sparsity, pattern, "ColumnGroupedNMTensor", (2, 3))
    n, m = pattern[0], pattern[1]
    g = _check_g(pattern[2] if len(pattern) == 3 else None)
    if method == "magnitude":
        return ColumnGroupedNMSparsifier(n, m, g)
    if method == "wanda":
        return ColumnGroupedWandaSparsifier(n, m, g)
    return ColumnGroupedSparseGPTSparsifier(n, m, g, percdamp=percdamp, blocksize=blocksize)
