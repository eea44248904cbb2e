"""``NMSparsifier(n, m)``: magnitude n:m (the n largest of every m along a dim).

Example:
    >>> import torch
    >>> from sten_nm import NMSparsifier
    >>> NMSparsifier(1, 2).mask(torch.tensor([[1., -3., 2., 0.]])).tolist()
    [[False, True, True, False]]
"""

from __future__ import annotations

from typing import Any

import torch

from ._checks import check_dim, check_float_tensor, check_nm
from .nm_tensor import NMTensor

from sten_core.plugin_api import BLOCKING, Sparsifier as _Base


class NMSparsifier(_Base):
    """Keep the ``n`` largest magnitudes of every ``m`` consecutive values along
    ``dim`` (1, the default: the input dimension of an ``F.linear`` weight).

    Args:
        n, m: ``1 <= n < m <= 32``.
        dim: 0 or 1.
    """

    kind = BLOCKING
    compares_only = True

    def __init__(self, n: int, m: int, dim: int = 1):
        self.n, self.m = check_nm(n, m)
        self.dim = check_dim(dim)

    def mask(self, tensor: torch.Tensor) -> torch.Tensor:
        """Boolean keep-mask of a 2-D dense tensor."""
        return NMTensor.from_dense(tensor, self.n, self.m, self.dim).mask()

    def params(self) -> dict[str, Any]:
        return {"n": self.n, "m": self.m, "dim": self.dim}

    def __repr__(self) -> str:
        return f"NMSparsifier(n={self.n}, m={self.m}, dim={self.dim})"

    def __eq__(self, other: Any) -> bool:
        return type(self) is type(other) and self.params() == other.params()

    def __hash__(self) -> int:
        return hash((type(self), self.n, self.m, self.dim))


def _wrap(layout: NMTensor, tensor: torch.Tensor, grad_fmt: Any) -> Any:
    from sten_core.plugin_api import SparseTensorWrapper

    return SparseTensorWrapper.wrapped_from_dense(layout, tensor, grad_fmt)


def _dense_of(tensor: Any) -> torch.Tensor:
    from sten_core.plugin_api import to_dense_tensor

    if isinstance(tensor, torch.Tensor) and not hasattr(tensor, "wrapped_tensor"):
        return tensor
    return to_dense_tensor(getattr(tensor, "wrapped_tensor", tensor))


def nm_sparsify(sparsifier: NMSparsifier, tensor: torch.Tensor, grad_fmt: Any = None) -> Any:
    """Sparsifier implementation: dense tensor → wrapper of an ``NMTensor``."""
    dense = _dense_of(tensor)
    return _wrap(NMTensor.from_dense(dense, sparsifier.n, sparsifier.m, sparsifier.dim), dense, grad_fmt)


def per_block_sparsify(sparsifier: Any, tensor: torch.Tensor, grad_fmt: Any = None) -> Any:
    """The core's ``PerBlockFractionSparsifier(n, m)`` (last dim) as an ``NMTensor``."""
    dense = _dense_of(tensor)
    check_float_tensor(dense, "tensor", ndim=2)
    n, m = sparsifier.n, sparsifier.m
    if not (1 <= n < m <= 32):
        raise ValueError(f"NMTensor needs 1 <= n < m <= 32, got PerBlockFractionSparsifier(n={n}, m={m})")
    return _wrap(NMTensor.from_dense(dense, n, m, dim=1), dense, grad_fmt)


class GroupedNMSparsifier(NMSparsifier):
    """Grouped n:m: rows in groups of 16 share one n:m pattern along dim 1
    (greedy row grouping, see :func:`sten_nm.grouped_tensor.greedy_row_groups`).

    >>> GroupedNMSparsifier(2, 4)
    GroupedNMSparsifier(n=2, m=4, group=True)
    """

    compares_only = False  # rows are grouped by summed magnitudes

    def __init__(self, n: int, m: int, group: bool = True):
        super().__init__(n, m, 1)
        self.group = bool(group)

    def mask(self, tensor: torch.Tensor) -> torch.Tensor:
        from .grouped_tensor import GroupedNMTensor

        return GroupedNMTensor.from_dense(tensor, self.n, self.m, self.group).mask()

    def params(self) -> dict[str, Any]:
        return {"n": self.n, "m": self.m, "group": self.group}

    def __repr__(self) -> str:
        return f"GroupedNMSparsifier(n={self.n}, m={self.m}, group={self.group})"

    def __hash__(self) -> int:
        return hash((type(self), self.n, self.m, self.group))


def grouped_sparsify(sparsifier: GroupedNMSparsifier, tensor: torch.Tensor, grad_fmt: Any = None) -> Any:
    """Sparsifier implementation: dense tensor → wrapper of a ``GroupedNMTensor``."""
    from .grouped_tensor import GroupedNMTensor

    dense = _dense_of(tensor)
    return _wrap(GroupedNMTensor.from_dense(dense, sparsifier.n, sparsifier.m, sparsifier.group), dense, grad_fmt)


class ColumnGroupedNMSparsifier(NMSparsifier):
    """The paper's grouped n:m (:class:`~sten_nm.ColumnGroupedNMTensor`): ``n`` of every
    ``m`` output rows per column, columns in chunks where each of the ``C(m, n)``
    patterns owns ``g`` columns (greedy balanced assignment by magnitude).

    >>> ColumnGroupedNMSparsifier(2, 4)
    ColumnGroupedNMSparsifier(n=2, m=4, g=None)
    """

    compares_only = False  # columns are assigned by summed magnitudes

    def __init__(self, n: int, m: int, g: "int | None" = None):
        from .column_grouped import check_patterns

        super().__init__(n, m, 0)
        check_patterns(self.n, self.m)
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
            raise ValueError(f"g must be None (automatic) or an int >= 1, got {g!r}")
        self.g = g

    def mask(self, tensor: torch.Tensor) -> torch.Tensor:
        from .column_grouped import ColumnGroupedNMTensor

        return ColumnGroupedNMTensor.from_dense(tensor, self.n, self.m, self.g).mask()

    def params(self) -> dict[str, Any]:
        return {"n": self.n, "m": self.m, "g": self.g}

    def __repr__(self) -> str:
        return f"ColumnGroupedNMSparsifier(n={self.n}, m={self.m}, g={self.g})"

    def __hash__(self) -> int:
        return hash((type(self), self.n, self.m, self.g))


def column_grouped_sparsify(sparsifier: ColumnGroupedNMSparsifier, tensor: torch.Tensor, grad_fmt: Any = None) -> Any:
    """Sparsifier implementation: dense tensor → wrapper of a ``ColumnGroupedNMTensor``."""
    from .column_grouped import ColumnGroupedNMTensor

    dense = _dense_of(tensor)
    return _wrap(ColumnGroupedNMTensor.from_dense(dense, sparsifier.n, sparsifier.m, sparsifier.g), dense, grad_fmt)
