"""``GroupedNMTensor``: grouped n:m sparsity (the STen paper's CPU format).

Output rows (``F.linear`` weight ``[out, in]``) are put in groups of 16 that
share one n:m pattern along the input dimension; a greedy assignment groups rows
whose magnitude patterns agree. It keeps a little less weight magnitude than
exact n:m (see ``kept_magnitude_ratio``) but its kernel is a dense-GEMM-like
6 x 16 register block, so it runs much closer to ``m/n`` times faster than dense.

Memory: ``vals [Q, G*n, 16]`` (the kernel's order), ``indices [Q, iw]`` (one
pattern per group: 1/16 of exact n:m's), ``perm [Q*16]`` int32 (the original
row of each stored row, -1 for padding) - O(rows).

Example:
    >>> import torch
    >>> from sten_nm import GroupedNMTensor
    >>> t = GroupedNMTensor.from_dense(torch.randn(32, 64), n=1, m=4)
    >>> bool(((t.to_dense() != 0).reshape(32, 16, 4).sum(-1) <= 1).all())
    True
"""

from __future__ import annotations

from typing import Any

import torch

from . import _kernel
from ._fp32 import fp32_values
from ._meta import empty_layout, read_params
from ._checks import FLOAT_DTYPES, check_float_tensor, check_nm
from ._padding import zero_padding
from .nm_tensor import NMTensor, check_offsets

from sten_core.plugin_api import Layout as _Base

GR = _kernel.GROUP_ROWS


def greedy_row_groups(w: torch.Tensor, n: int, m: int, group_rows: int = GR) -> torch.Tensor:
    """Order rows so that consecutive groups of ``group_rows`` have similar n:m masks.

    Greedy: take the unassigned row with the largest magnitude as a seed, and put
    with it the unassigned rows whose exact n:m keep-masks (weighted by
    magnitude) overlap it most. Returns the row order (a permutation).
    """
    R = w.shape[0]
    if R <= group_rows:
        return torch.arange(R)
    a = w.detach().float().abs()
    mask = NMTensor.from_dense(a, n, m).to_dense() != 0
    feat = (a * mask)
    feat = feat / feat.norm(dim=1, keepdim=True).clamp_min(1e-30)
    sim = feat @ feat.t()
    free = torch.ones(R, dtype=torch.bool)
    order = []
    norms = a.sum(1)
    while free.any():
        idx = torch.nonzero(free).flatten()
        seed = idx[torch.argmax(norms[idx])]
        cand = sim[seed, idx]
        take = idx[torch.topk(cand, min(group_rows, idx.numel())).indices]
        order.append(take)
        free[take] = False
    return torch.cat(order)


def _same_shape(x: Any, tensor: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.shape != tensor.shape:
        raise ValueError(f"{name} must be a tensor of the weight's shape {tuple(tensor.shape)}, "
                         f"got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    return x


def rows_by_mask(keep: torch.Tensor, group_rows: int = GR) -> torch.Tensor:
    """A row order putting rows with identical masks together (the class whose size is
    not a multiple of ``group_rows``, the partial last group's, at the end).

    >>> rows_by_mask(torch.tensor([[True, False], [False, True], [True, False]]), 2).tolist()
    [0, 2, 1]
    """
    if keep.shape[0] == 0:
        return torch.arange(0)
    _, inverse, counts = torch.unique(keep, dim=0, return_inverse=True, return_counts=True)
    partial = (counts % group_rows != 0).long()[inverse]
    return torch.argsort(partial * (counts.numel() + 1) + inverse, stable=True)


class GroupedNMTensor(_Base):
    """Grouped n:m weight ``[out, in]``: rows in groups of 16 sharing one pattern.

    Build one with :meth:`from_dense`. ``to_nm()`` gives the same values as an
    exact :class:`NMTensor` (the backward uses it).
    """

    def __init__(self, vals: torch.Tensor, indices: torch.Tensor, perm: torch.Tensor, shape: Any, n: int, m: int):
        self._setup(vals, indices, perm, shape, n, m)
        N, K = self._shape
        if not isinstance(perm, torch.Tensor) or perm.dtype != torch.int32 or tuple(perm.shape) != (self._Q * GR,):
            raise ValueError(f"perm must be int32 of shape {(self._Q * GR,)}")
        pad = self._Q * GR - N
        rows = torch.cat([torch.full((pad,), -1, dtype=torch.int32), torch.arange(N, dtype=torch.int32)])
        if not perm.is_meta and not torch.equal(perm.sort().values, rows):   # (meta: no rows to check)
            raise ValueError(f"perm must hold each row 0..{N - 1} once and -1 for the {pad} padding rows")
        check_offsets(self.indices, self._Q, K, self.n, self.m)

    def _setup(self, vals: torch.Tensor, indices: torch.Tensor, perm: torch.Tensor, shape: Any, n: int, m: int) -> None:
        """Shape and dtype checks (not perm and the offsets: trusted producers skip those scans)."""
        self.n, self.m = check_nm(n, m)
        self._shape = torch.Size(shape)
        if len(self._shape) != 2:
            raise ValueError(f"shape must be 2-D, got {tuple(self._shape)}")
        N, K = self._shape
        G = -(-K // m)
        self._Q = Q = -(-N // GR)
        per = _kernel.index_per_word(m)
        if not isinstance(vals, torch.Tensor) or vals.dtype not in FLOAT_DTYPES:
            raise TypeError(f"GroupedNMTensor: vals must be a floating-point torch.Tensor, got "
                            f"{getattr(vals, 'dtype', type(vals).__name__)} (an n:m layout holds float16, bfloat16, "
                            "float32 or float64; for another dtype densify first: w.to_dense().to(dtype))")
        if tuple(vals.shape) != (Q, G * n, GR):
            raise ValueError(f"vals must have shape {(Q, G * n, GR)}, got {tuple(vals.shape)}")
        if not isinstance(indices, torch.Tensor) or indices.dtype != torch.int32 or tuple(indices.shape) != (Q, -(-G * n // per)):
            raise ValueError(f"indices must be int32 of shape {(Q, -(-G * n // per))}, got "
                             f"{getattr(indices, 'dtype', type(indices).__name__)} {tuple(getattr(indices, 'shape', ()))}")
        self._vals, self.indices, self.perm = vals.contiguous(), indices.contiguous(), perm.contiguous()

    @classmethod
    def _trusted(cls, vals: torch.Tensor, indices: torch.Tensor, perm: torch.Tensor, shape: Any, n: int,
                 m: int) -> "GroupedNMTensor":
        """Build from a pattern made by this package (``from_dense``, or an existing tensor's)."""
        t = cls.__new__(cls)
        t._setup(vals, indices, perm, shape, n, m)
        return t

    @classmethod
    def from_dense(cls, tensor: torch.Tensor, n: int = 2, m: int = 4, group: bool = True, *,
                   score: "torch.Tensor | None" = None, mask: "torch.Tensor | None" = None) -> "GroupedNMTensor":
        """Grouped n:m of a 2-D weight: greedy row groups (``group=False``: consecutive
        rows), then per group the ``n`` columns of each ``m`` with the largest summed
        magnitude.

        ``score`` (``>= 0``, the tensor's shape, e.g. Wanda's ``|W| * ||X||``) replaces
        the magnitude in both steps; ``mask`` (bool, a mask of this pattern: rows in
        groups of 16 sharing one n:m mask) stores exactly those positions (ValueError
        if it is not such a mask).

        >>> GroupedNMTensor.from_dense(torch.ones(16, 8), 1, 4).nnz
        32
        """
        check_float_tensor(tensor, "tensor", ndim=2)
        n, m = check_nm(n, m)
        w = tensor.detach()
        if score is not None and mask is not None:
            raise TypeError("give score or mask, not both")
        if mask is not None:
            keep = _same_shape(mask, w, "mask") != 0
            t = cls._select(w.where(keep, 0), keep.float(), rows_by_mask(keep), n, m)   # slots off the mask hold 0
            if bool((keep & ~t.mask()).any()):
                raise ValueError(f"mask is not a GroupedNMTensor(n={n}, m={m}) mask: its rows do not fall into "
                                 f"groups of {GR} sharing one n:m mask")
            return t
        if score is None:
            sel = w.float().abs()
        else:
            sel = _same_shape(score, w, "score").detach().float()
            if bool((sel < 0).any()) or bool(sel.isnan().any()):
                raise ValueError("score must be >= 0 and not NaN (kept weight of each position)")
        if group and score is None:
            exact = cls._already_grouped(w, sel, n, m)
            if exact is not None:
                return exact
        order = greedy_row_groups(sel, n, m) if group else torch.arange(w.shape[0])
        return cls._select(w, sel, order, n, m)

    @classmethod
    def _already_grouped(cls, w: torch.Tensor, sel: torch.Tensor, n: int, m: int) -> "GroupedNMTensor | None":
        """``w`` stored as it is where its nonzeros already form a grouped n:m pattern (rows with
        identical masks, at most one partial group), else ``None``: the greedy grouping, by
        magnitude-weighted similarity, split rows of one mask across groups, so re-sparsifying a
        grouped weight (a densified checkpoint) changed up to 4.5 % of its kept magnitude."""
        keep = w != 0
        if keep.numel() == 0 or torch.unique(keep, dim=0).shape[0] > -(-keep.shape[0] // GR):
            return None
        t = cls._select(w, sel, rows_by_mask(keep), n, m)
        return t if torch.equal(t.to_dense(), w) else None

    @classmethod
    def _select(cls, w: torch.Tensor, sel: torch.Tensor, order: torch.Tensor, n: int, m: int) -> "GroupedNMTensor":
        """Rows grouped in ``order``; per group the ``n`` of each ``m`` columns with the largest summed ``sel``."""
        N, K = w.shape
        Q = -(-N // GR)
        perm = torch.full((Q * GR,), -1, dtype=torch.int32)
        perm[:N] = order.to(torch.int32)
        ranked = torch.zeros((Q * GR, K), dtype=torch.float32)
        ranked[:N] = sel[order]
        score = ranked.reshape(Q, GR, K).sum(1)  # [Q, K]
        _, idx = _kernel.compress(score, n, m)
        cols = NMTensor._cols(idx, K, n, m, Q)  # [Q, G*n]
        rows = torch.zeros((Q * GR, K), dtype=w.dtype)
        rows[:N] = w[order]
        full = torch.nn.functional.pad(rows, (0, int(cols.max()) + 1 - K if cols.numel() else 0))
        gathered = torch.gather(full.reshape(Q, GR, full.shape[1]), 2, cols[:, None, :].expand(Q, GR, cols.shape[1]))
        vals = gathered.transpose(1, 2).contiguous()  # [Q, G*n, GR]
        return cls._trusted(vals, idx, perm, (N, K), n, m)

    @classmethod
    def pruning_sparsifier(cls, method: str, **options: Any) -> Any:
        """The sparsifier ``sten.prune(..., out_format=GroupedNMTensor)`` uses for ``method``
        (see :func:`sten_nm.pruning.grouped_pruning_sparsifier`)."""
        from .pruning import grouped_pruning_sparsifier

        return grouped_pruning_sparsifier(method, **options)

    # -- metadata ----------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        return self._vals.dtype

    @property
    def device(self) -> torch.device:
        return self._vals.device

    @property
    def nnz(self) -> int:
        N, K = self._shape
        return N * ((K // self.m) * self.n + min(self.n, K % self.m))

    @property
    def nbytes(self) -> int:
        return self._vals.numel() * self._vals.element_size() + self.indices.numel() * 4 + self.perm.numel() * 4

    def desc(self, round_to: "torch.dtype | None" = None) -> "_kernel.NMGrouped":
        """C descriptor of the float32 values (converted once, cached; rounded through
        ``round_to`` first when given)."""
        v = fp32_values(self, self._vals, round_to)
        N, K = self._shape
        return _kernel.grouped(v, self.indices, self.perm, N, K, self.n, self.m)

    # -- conversions -----------------------------------------------------------
    def _row_values(self) -> torch.Tensor:
        """``[N, G*n]`` values in the original row order."""
        N = self._shape[0]
        Q, gn, _ = self._vals.shape
        flat = self._vals.transpose(1, 2).reshape(Q * GR, gn)  # [Q*GR, G*n]
        out = flat.new_zeros((N, flat.shape[1]))
        keep = self.perm >= 0
        out[self.perm[keep].long()] = flat[keep]
        return out

    def to_nm(self) -> NMTensor:
        """The same tensor as an exact :class:`NMTensor` (rows share their group's indices)."""
        N, K = self._shape
        if self.perm.is_meta:   # (the rows' order is data: only the shapes)
            return NMTensor._trusted(self._vals.new_empty((N, self._vals.shape[1])),
                                     self.indices.new_empty((N, self.indices.shape[1])), self._shape, self.n, self.m)
        idx_rows = self.indices.repeat_interleave(GR, dim=0)  # [Q*GR, iw]
        keep = self.perm >= 0
        idx = torch.empty((N, self.indices.shape[1]), dtype=torch.int32)
        idx[self.perm[keep].long()] = idx_rows[keep]
        return NMTensor._trusted(self._row_values(), idx, self._shape, self.n, self.m, dim=1)

    def to_dense(self) -> torch.Tensor:
        return self.to_nm().to_dense()

    def mask(self) -> torch.Tensor:
        return self.to_nm().mask()

    def kept_magnitude_ratio(self, dense: torch.Tensor) -> float:
        """Kept |w| of this pattern divided by the kept |w| of exact n:m on ``dense``."""
        exact = NMTensor.from_dense(dense, self.n, self.m).to_dense().abs().sum()
        return float(self.to_dense().abs().sum() / exact) if float(exact) else 1.0

    # -- stored-values protocol --------------------------------------------------
    def values(self) -> torch.Tensor:
        return self._vals

    def with_values(self, values: torch.Tensor) -> "GroupedNMTensor":
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
        values = zero_padding(self, self.perm, values.reshape(self._vals.shape))
        return GroupedNMTensor._trusted(values, self.indices, self.perm, self._shape, self.n, self.m)

    def from_row_values(self, row_values: torch.Tensor) -> torch.Tensor:
        """``[N, G*n]`` row-ordered values (e.g. a gradient) in this layout's order."""
        Q, gn, _ = self._vals.shape
        if self.perm.is_meta:   # (the rows' order is data: only the shape)
            return row_values.new_empty(self._vals.shape)
        flat = row_values.new_zeros((Q * GR, gn))
        keep = self.perm >= 0
        flat[keep] = row_values[self.perm[keep].long()]
        return flat.reshape(Q, GR, gn).transpose(1, 2).contiguous()

    def gather(self, dense: torch.Tensor) -> torch.Tensor:
        return self.from_row_values(self.to_nm().gather(dense))

    def same_pattern(self, other: Any) -> bool:
        return (isinstance(other, GroupedNMTensor) and other._shape == self._shape
                and (other.n, other.m) == (self.n, self.m)
                and (other.indices is self.indices or torch.equal(other.indices, self.indices))
                and (other.perm is self.perm or torch.equal(other.perm, self.perm)))

    def to(self, device: Any = None, dtype: "torch.dtype | None" = None) -> "GroupedNMTensor":
        """The same pattern, values cast to ``dtype`` and every tensor on ``device`` (``"meta"`` too)."""
        return GroupedNMTensor._trusted(self._vals.to(device=device, dtype=dtype), self.indices.to(device=device),
                                        self.perm.to(device=device), self._shape, self.n, self.m)

    def empty_like(self, device: Any = None, dtype: "torch.dtype | None" = None) -> "GroupedNMTensor":
        """``torch.empty_like``'s layout (``Module.to_empty``): this pattern with zero values on
        ``device``; from the meta device, rows in order and the first ``n`` of every ``m``."""
        return empty_layout(self, device, dtype,
                            lambda zeros: GroupedNMTensor.from_dense(zeros, self.n, self.m, group=False))

    # -- saving: torch.save / torch.load(weights_only=True) ---------------------
    def state_tensors(self) -> tuple[torch.Tensor, ...]:
        """``(vals, indices, perm, [n, m])``: plain tensors that ``from_state_tensors`` rebuilds it from."""
        return (self._vals, self.indices, self.perm, torch.tensor([self.n, self.m], dtype=torch.int64))

    @classmethod
    def from_state_tensors(cls, tensors: tuple, shape: tuple) -> "GroupedNMTensor":
        vals, indices, perm, params = tensors
        n, m = read_params(params, cls.__name__, "n, m")
        return cls(vals, indices, perm, shape, n, m)

    def __repr__(self) -> str:
        return f"GroupedNMTensor(shape={tuple(self._shape)}, n={self.n}, m={self.m}, dtype={self.dtype}, nnz={self.nnz})"
