"""``ColumnGroupedNMTensor``: the STen paper's grouped n:m format for an ``F.linear``
weight ``W [N, K]`` (out, in).

* n:m runs along the output (non-contraction) dimension: within each block of ``m``
  output rows, every column keeps ``n`` of the ``m`` rows (the column's *pattern*, one
  of the ``P = C(m, n)`` subsets, numbered in lexicographic order);
* the columns are split into chunks of ``P * g``; inside a chunk each pattern owns
  exactly ``g`` columns (the last chunk may be narrower: ``g_last = ceil(rest / P)``,
  padded with zero columns). A greedy assignment by magnitude decides which column gets
  which pattern (:func:`assign_patterns`).

So a row block is ``P`` small dense products, one per pattern, with no data-dependent
branches: ``y[:, block rows of p] += x[:, columns of p] @ V_p^T``.

Storage (``Nb = ceil(N / m)`` row blocks, ``L`` columns per pattern and block):

* ``values``  ``[Nb, P, n, L]`` (the weight's dtype): ``W[q*m + pattern[p][j], columns[q, p, t]]``;
* ``columns`` ``[Nb, P, L]`` int32: the columns each pattern owns, chunk after chunk
  (columns ``>= K`` are padding, value 0).

Bytes: ``n/m`` of dense for the values plus one int32 per ``n`` values (1.5x of ``n/m``
dense fp32 at 2:4, 2x at 1:m) - it trades index memory for branch-free products.

Example:
    >>> import torch
    >>> from sten_nm import ColumnGroupedNMTensor
    >>> t = ColumnGroupedNMTensor.from_dense(torch.randn(8, 24), n=2, m=4, g=2)
    >>> bool(((t.to_dense() != 0).reshape(2, 4, 24).sum(1) == 2).all())
    True
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any, Optional

import torch

from ._checks import FLOAT_DTYPES, check_float_tensor, check_nm
from ._meta import empty_layout, read_params
from ._padding import zero_padding

from sten_core.plugin_api import Layout as _Base

DEFAULT_G = (16, 8, 4, 2, 1)
MAX_PATTERNS = 1024


def patterns(n: int, m: int) -> torch.Tensor:
    """The ``C(m, n)`` row subsets, ``[P, n]`` int64, lexicographic.

    >>> patterns(1, 3).tolist()
    [[0], [1], [2]]
    """
    return torch.tensor(list(itertools.combinations(range(m), n)), dtype=torch.int64).reshape(-1, n)


@functools.lru_cache(maxsize=64)
def _kernel_patterns(n: int, m: int) -> torch.Tensor:
    """:func:`patterns` as the kernels read them (int32, contiguous), built once per (n, m):
    every forward's descriptor points at it (never written)."""
    return patterns(n, m).to(torch.int32).contiguous()


def check_patterns(n: int, m: int) -> int:
    """``P = C(m, n)``; ValueError when the format would need too many patterns."""
    P = math.comb(m, n)
    if P > MAX_PATTERNS:
        raise ValueError(f"n={n}, m={m} has C(m, n) = {P} patterns (at most {MAX_PATTERNS} for "
                         f"ColumnGroupedNMTensor); use NMTensor for such patterns")
    return P


def default_g(K: int, n: int, m: int) -> int:
    """Columns per pattern and chunk: the largest of 16, 8, 4, 2, 1 whose chunk
    (``C(m, n) * g`` columns) fits in ``K`` (1 when none does).

    >>> default_g(768, 2, 4), default_g(768, 1, 10), default_g(40, 2, 4)
    (16, 16, 4)
    """
    P = check_patterns(n, m)
    return next((g for g in DEFAULT_G if P * g <= K), 1)


def chunk_widths(K: int, P: int, g: int) -> list[int]:
    """Columns per pattern in each chunk: ``g`` for full chunks, ``ceil(rest / P)`` last."""
    full, rest = divmod(K, P * g)
    return [g] * full + ([-(-rest // P)] if rest else [])


def assign_patterns(score: torch.Tensor, g: int, max_swap_rounds: int = 64) -> torch.Tensor:
    """Balanced pattern per column: ``score`` ``[T, C, P]`` (T independent chunks of
    ``C = P * g`` columns; the kept magnitude of each column under each pattern) ->
    ``[T, C]`` pattern indices, every pattern used exactly ``g`` times per chunk.

    Greedy in rounds (:func:`_propose`), then pairwise swaps that raise the kept
    magnitude (:func:`_improve_by_swaps`). A chunk whose columns already follow a balanced
    assignment keeps it.

    >>> assign_patterns(torch.tensor([[[1., 0.], [2., 0.]]]), 1).tolist()
    [[1, 0]]
    """
    T, C, P = score.shape
    if C != P * g:
        raise ValueError(f"score must have P * g = {P * g} columns per chunk, got {C}")
    return _improve_by_swaps(score, _propose(score, g), max_swap_rounds)


def _propose(score: torch.Tensor, g: int) -> torch.Tensor:
    """Each free column proposes its best pattern that has room; each pattern accepts its
    highest-scoring proposers up to its room; repeat (at most P + 1 rounds)."""
    T, C, P = score.shape
    pattern = torch.full((T, C), -1, dtype=torch.int64)
    room = torch.full((T, P), g, dtype=torch.int64)
    position = torch.arange(C)
    for _ in range(P + 1):
        free = pattern < 0
        if not bool(free.any()):
            break
        s = torch.where((room > 0)[:, None, :], score, -float("inf"))
        best = s.argmax(2)                                                   # [T, C]
        best_score = torch.where(free, s.gather(2, best[..., None])[..., 0], -float("inf"))
        key = torch.where(free, best, P)                                     # taken columns last
        by_score = torch.sort(best_score, dim=1, descending=True, stable=True).indices
        order = by_score.gather(1, torch.sort(key.gather(1, by_score), dim=1, stable=True).indices)
        pat = key.gather(1, order)                                           # grouped by proposal
        rank = position[None] - torch.searchsorted(pat, pat)                 # place in its group
        capped = pat.clamp(max=P - 1)
        accept = (pat < P) & (rank < room.gather(1, capped))
        t = torch.nonzero(accept)[:, 0]
        pattern[t, order[accept]] = pat[accept]
        room -= torch.zeros_like(room).scatter_add_(1, capped, accept.long())
    return pattern


def _improve_by_swaps(score: torch.Tensor, pattern: torch.Tensor, max_rounds: int) -> torch.Tensor:
    """Per chunk and round, the best swap of two columns' patterns (column i from a to b,
    column j from b to a) if it raises the kept magnitude; stops when none does."""
    T, C, P = score.shape
    active = torch.arange(T)
    for _ in range(max_rounds):
        if active.numel() == 0:
            break
        S, p = score[active], pattern[active]
        D = S - S.gather(2, p[..., None])                         # gain of moving column i to b
        M = torch.full((active.numel(), P, P), -float("inf"), dtype=D.dtype).scatter_reduce(
            1, p[..., None].expand(-1, -1, P), D, reduce="amax")   # best column of a for b
        best, ab = (M + M.transpose(1, 2)).reshape(active.numel(), P * P).max(1)
        go = best > 1e-6 * S.amax((1, 2)).clamp_min(1e-30)
        active, D, p, ab = active[go], D[go], p[go], ab[go]
        if active.numel() == 0:
            break
        a, b = ab // P, ab % P
        k = torch.arange(active.numel())
        i = torch.where(p == a[:, None], D[k, :, b], -float("inf")).argmax(1)
        j = torch.where(p == b[:, None], D[k, :, a], -float("inf")).argmax(1)
        pattern[active, i] = b
        pattern[active, j] = a
    return pattern


def _keep_all_where_possible(score: torch.Tensor, pattern: torch.Tensor, nonzero: torch.Tensor,
                             masks: torch.Tensor, g: int) -> torch.Tensor:
    """Where a chunk's columns have at most ``n`` nonzero rows each (it can be stored
    without loss) but the magnitude assignment dropped some (ties between patterns, e.g.
    zero padding rows), find a lossless balanced assignment by augmenting paths.

    ``nonzero`` ``[T, C]`` and ``masks`` ``[P]`` are row bitmasks.
    """
    T, C, P = score.shape
    kept = score.gather(2, pattern[..., None])[..., 0]
    lossy = (kept < score.amax(2) - 1e-12 * score.amax(2).clamp_min(1)) | (
        (nonzero[..., None] & ~masks[None, None]).ne(0).gather(2, pattern[..., None])[..., 0])
    fits = (nonzero[..., None] & ~masks[None, None] == 0).any(2).all(1)    # every column has a pattern
    for t in torch.nonzero(lossy.any(1) & fits).flatten().tolist():
        allowed = [[p for p in range(P) if (int(nonzero[t, c]) & ~int(masks[p])) == 0] for c in range(C)]
        owner: list[list[int]] = [[] for _ in range(P)]      # columns held by each pattern

        def augment(c: int, seen: set) -> bool:
            for p in allowed[c]:
                if p in seen:
                    continue
                seen.add(p)
                if len(owner[p]) < g:
                    owner[p].append(c)
                    return True
                for other in list(owner[p]):
                    owner[p].remove(other)
                    owner[p].append(c)
                    if augment(other, seen):
                        return True
                    owner[p].remove(c)
                    owner[p].append(other)
            return False

        if all(augment(c, set()) for c in range(C)):
            for p in range(P):
                pattern[t, owner[p]] = p
    return pattern


def _check_same_shape(x: Any, tensor: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.shape != tensor.shape:
        raise ValueError(f"{name} must be a tensor of the weight's shape {tuple(tensor.shape)}, "
                         f"got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    return x


def grouped_columns(score: torch.Tensor, n: int, m: int, g: int,
                    nonzero: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The columns each pattern owns per row block, ``[Nb, P, L]`` int32, chosen to keep
    the most ``score`` (``[N, K]``, ``>= 0``: ``|W|`` for magnitude, ``|W| * ||X||`` for
    Wanda, SparseGPT's saliency): per row block and chunk of ``C(m, n) * g`` columns
    :func:`assign_patterns`; where every column of a chunk has at most ``n`` positions in
    ``nonzero`` (bool, default ``score != 0``) the assignment keeps all of them.

    >>> grouped_columns(torch.tensor([[1., 0.], [0., 1.]]), 1, 2, 1).tolist()
    [[[0], [1]]]
    """
    n, m = check_nm(n, m)
    P = check_patterns(n, m)
    N, K = score.shape
    widths = chunk_widths(K, P, g)
    Nb, L = -(-N // m), sum(widths)
    Kp = P * L
    s_full = torch.zeros((Nb * m, Kp), dtype=torch.float32)
    s_full[:N, :K] = score.float()
    nz_full = torch.zeros((Nb * m, Kp), dtype=torch.bool)
    nz_full[:N, :K] = (score != 0) if nonzero is None else nonzero
    pats = patterns(n, m)
    onehot = torch.zeros((m, P), dtype=torch.float32)
    onehot[pats, torch.arange(P)[:, None].expand(P, n)] = 1.0
    kept = torch.einsum("qrk,rp->qkp", s_full.reshape(Nb, m, Kp), onehot)   # [Nb, Kp, P] kept score per pattern
    bit = 1 << torch.arange(m)
    nz = (nz_full.reshape(Nb, m, Kp).long() * bit[None, :, None]).sum(1)    # [Nb, Kp] nonzero rows
    masks = (bit[pats]).sum(1)                                               # [P] rows of each pattern
    columns = torch.empty((Nb, P, L), dtype=torch.int64)
    for wd in sorted(set(widths), reverse=True):
        idx = [i for i, x in enumerate(widths) if x == wd]
        col0 = [sum(P * x for x in widths[:i]) for i in idx]
        slot0 = [sum(widths[:i]) for i in idx]
        cols = torch.tensor(col0)[:, None] + torch.arange(P * wd)          # [c, P*wd]
        s = kept[:, cols].reshape(-1, P * wd, P)                            # [Nb*c, P*wd, P]
        pat = _keep_all_where_possible(s, assign_patterns(s, wd), nz[:, cols].reshape(-1, P * wd),
                                       masks, wd).reshape(Nb, len(idx), P * wd)
        # columns of each pattern, in increasing order: sort by (pattern, column)
        key = pat * Kp + cols[None]
        own = torch.sort(key, dim=2).values % Kp                           # [Nb, c, P*wd]
        own = own.reshape(Nb, len(idx), P, wd)
        for j, s0 in enumerate(slot0):
            columns[:, :, s0:s0 + wd] = own[:, j]
    return columns.to(torch.int32)


def column_grouped_keep_mask(score: torch.Tensor, n: int, m: int, g: Optional[int] = None) -> torch.Tensor:
    """The bool keep-mask ``[N, K]`` of the grouped pattern that keeps the most ``score``
    (:func:`grouped_columns`; ``g`` defaults to :func:`default_g`).

    >>> column_grouped_keep_mask(torch.tensor([[3., 0.], [1., 2.]]), 1, 2, 1).tolist()
    [[True, False], [False, True]]
    """
    N, K = score.shape
    g = default_g(K, n, m) if g is None else g
    columns = grouped_columns(score, n, m, g)
    return ColumnGroupedNMTensor._trusted(torch.zeros(1), columns, (N, K), n, m, g,
                                          values_later=True)._stored_positions()


_BIG_SCORE = torch.finfo(torch.float32).max / 2 ** 22
"""Where magnitudes are clamped for the assignment: ~1e32, so that NaN (twice it) ranks first and
sums of a chunk's scores stay finite (an infinite score made the pattern sums inf * 0 = NaN)."""


def _magnitude_score(tensor: torch.Tensor) -> torch.Tensor:
    """``|tensor|`` as the assignment's score: NaN above everything, inf and huge values tied.

    >>> _magnitude_score(torch.tensor([float("nan"), float("inf"), -1.0])).tolist()[2]
    1.0
    """
    score = tensor.detach().float().abs()
    return torch.where(score.isnan(), torch.tensor(2 * _BIG_SCORE), score.clamp(max=_BIG_SCORE))


class ColumnGroupedNMTensor(_Base):
    """The paper's grouped n:m weight ``[out, in]`` (see the module docstring).

    Args:
        values: ``[Nb, P, n, L]`` kept values.
        columns: ``[Nb, P, L]`` int32, the columns each pattern owns per row block.
        shape: ``(N, K)``.
        n, m: ``n`` of every ``m`` output rows kept, per column.
        g: columns per pattern in a full chunk.

    Build one with :meth:`from_dense`.
    """

    def __init__(self, values: torch.Tensor, columns: torch.Tensor, shape: Any, n: int, m: int, g: int):
        self._setup(values, columns, shape, n, m, g)
        self._check_columns()

    def _setup(self, values: torch.Tensor, columns: torch.Tensor, shape: Any, n: int, m: int, g: int) -> None:
        self.n, self.m = check_nm(n, m)
        P = check_patterns(n, m)
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ValueError(f"g must be an int >= 1, got {g!r}")
        self.g = g
        self._shape = torch.Size(shape)
        if len(self._shape) != 2:
            raise ValueError(f"shape must be 2-D, got {tuple(self._shape)}")
        N, K = self._shape
        Nb, L = -(-N // m), sum(chunk_widths(K, P, g))
        if not isinstance(values, torch.Tensor) or values.dtype not in FLOAT_DTYPES:
            raise TypeError(f"ColumnGroupedNMTensor: values must be a floating-point torch.Tensor, got "
                            f"{getattr(values, 'dtype', type(values).__name__)} (an n:m layout holds float16, bfloat16, "
                            "float32 or float64; for another dtype densify first: w.to_dense().to(dtype))")
        if tuple(values.shape) != (Nb, P, n, L):
            raise ValueError(f"values must have shape {(Nb, P, n, L)}, got {tuple(values.shape)}")
        if not isinstance(columns, torch.Tensor) or columns.dtype != torch.int32 or tuple(columns.shape) != (Nb, P, L):
            raise ValueError(f"columns must be int32 of shape {(Nb, P, L)}, got "
                             f"{getattr(columns, 'dtype', type(columns).__name__)} {tuple(getattr(columns, 'shape', ()))}")
        self._values, self.columns = values.contiguous(), columns.contiguous()

    def _check_columns(self) -> None:
        """Each chunk's columns are owned by exactly one pattern, ``width`` each."""
        N, K = self._shape
        P = math.comb(self.m, self.n)
        Nb, _, L = self.columns.shape
        if Nb == 0 or L == 0 or self.columns.is_meta:   # (the meta device holds no columns to check)
            return
        c = self.columns.long()
        start_col, start_slot = 0, 0
        for w in chunk_widths(K, P, self.g):
            got = c[:, :, start_slot:start_slot + w].reshape(Nb, P * w).sort(dim=1).values
            want = torch.arange(start_col, start_col + P * w).expand(Nb, P * w)
            if not torch.equal(got, want):
                q = int(torch.nonzero((got != want).any(1))[0])
                raise ValueError(f"columns: row block {q} does not give each of the {P} patterns exactly {w} "
                                 f"of columns {start_col}..{start_col + P * w - 1} (each column once)")
            start_col, start_slot = start_col + P * w, start_slot + w

    @classmethod
    def _trusted(cls, values: torch.Tensor, columns: torch.Tensor, shape: Any, n: int, m: int,
                 g: int, values_later: bool = False) -> "ColumnGroupedNMTensor":
        """Skip the column scan (a pattern made by this package); ``values_later``: a
        pattern-only object whose values ``with_values`` sets (``from_dense``)."""
        t = cls.__new__(cls)
        if values_later:
            Nb, P, L = columns.shape
            values = torch.zeros((Nb, P, n, L), dtype=torch.float32)
        t._setup(values, columns, shape, n, m, g)
        return t

    # -- construction ----------------------------------------------------------
    @classmethod
    def from_dense(cls, tensor: torch.Tensor, n: int = 2, m: int = 4, g: Optional[int] = None, *,
                   score: Optional[torch.Tensor] = None,
                   mask: Optional[torch.Tensor] = None) -> "ColumnGroupedNMTensor":
        """Per row block and chunk, the greedy balanced assignment of patterns to columns
        (:func:`assign_patterns`) that keeps the most ``|tensor|``; ``g`` defaults to
        :func:`default_g`.

        ``score`` (``>= 0``, the tensor's shape) is kept instead of ``|tensor|`` (e.g.
        Wanda's ``|W| * ||X||``); ``mask`` (bool, the tensor's shape, a mask of this
        grouped pattern such as :func:`column_grouped_keep_mask` returns) stores those
        positions (ValueError if no balanced assignment keeps all of it); a slot the
        pattern needs beyond the mask (a column keeping fewer than ``n`` in a block) holds 0.

        >>> ColumnGroupedNMTensor.from_dense(torch.ones(4, 12), 2, 4).nnz
        24
        """
        check_float_tensor(tensor, "tensor", ndim=2)
        n, m = check_nm(n, m)
        check_patterns(n, m)
        N, K = tensor.shape
        g = default_g(K, n, m) if g is None else g
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ValueError(f"g must be an int >= 1, got {g!r}")
        if score is not None and mask is not None:
            raise TypeError("give score or mask, not both")
        if mask is not None:
            keep = _check_same_shape(mask, tensor, "mask") != 0
            columns = grouped_columns(keep.float(), n, m, g, nonzero=keep)
            t = cls._trusted(torch.zeros(1), columns, tensor.shape, n, m, g, values_later=True)
            if bool((keep & ~t._stored_positions()).any()):
                raise ValueError(f"mask is not a ColumnGroupedNMTensor(n={n}, m={m}, g={g}) mask: no balanced "
                                 f"assignment of the C(m, n) patterns to the columns of each chunk keeps all of it")
            return t.with_values(t.gather(tensor.detach() * keep))    # slots off the mask hold 0
        else:
            if score is None:
                score = _magnitude_score(tensor)
                nonzero = tensor.detach() != 0
            else:
                score = _check_same_shape(score, tensor, "score").detach().float()
                if bool((score < 0).any()) or bool(score.isnan().any()):
                    raise ValueError("score must be >= 0 and not NaN (kept weight of each position)")
                nonzero = score != 0
            columns = grouped_columns(score, n, m, g, nonzero=nonzero)
            t = cls._trusted(torch.zeros(1), columns, tensor.shape, n, m, g, values_later=True)
        return t.with_values(t.gather(tensor.detach()))

    @classmethod
    def pruning_sparsifier(cls, method: str, **options: Any) -> Any:
        """The sparsifier ``sten.prune(..., out_format=ColumnGroupedNMTensor)`` uses for
        ``method`` (see :func:`sten_nm.pruning.pruning_sparsifier`)."""
        from .pruning import pruning_sparsifier

        return pruning_sparsifier(method, **options)

    # -- metadata ----------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        return self._values.dtype

    @property
    def device(self) -> torch.device:
        return self._values.device

    @property
    def num_patterns(self) -> int:
        return math.comb(self.m, self.n)

    @property
    def nnz(self) -> int:
        """Stored positions inside the logical shape (a padded last row block may keep
        padding rows for some columns; on the meta device only when there is no such block)."""
        N, K = self._shape
        if self.columns.is_meta:
            if N % self.m:
                raise NotImplementedError(
                    f"ColumnGroupedNMTensor.nnz on the meta device: with {N} rows (not a multiple of m={self.m}) "
                    f"it depends on the columns' patterns, which the meta device does not hold")
            return N * self.n // self.m * K
        inside = (self._rows() < N) & (self.columns.long()[:, :, None, :] < K)
        return int(inside.sum())

    @property
    def nbytes(self) -> int:
        return self._values.numel() * self._values.element_size() + self.columns.numel() * 4

    def _rows(self) -> torch.Tensor:
        """Row of every stored value, ``[Nb, P, n, 1]`` int64."""
        Nb = self._values.shape[0]
        return (torch.arange(Nb)[:, None, None] * self.m + patterns(self.n, self.m)[None]).reshape(
            Nb, self.num_patterns, self.n, 1)

    def desc(self, round_to: Optional[torch.dtype] = None) -> "Any":
        """C descriptor of the stored matrix (for ``sten_nm._kernel.colgrouped_gather``): bf16
        values (or values rounded to bf16, ``round_to``) as bf16, widened in the kernel; other
        dtypes as a float32 copy made once and cached (rounded through ``round_to`` first)."""
        from . import _kernel
        from ._fp32 import kernel_values

        v = kernel_values(self, self._values, round_to)
        pats = _kernel_patterns(self.n, self.m)
        N, K = self._shape
        return _kernel.colgrouped(v.contiguous(), self.columns, pats, N, K, self.n, self.m)

    def _nm_pattern(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This pattern as an exact n:m matrix ``A = Wᵀ`` ``[K, N]`` (groups of ``m`` along N:
        ``NMTensor(dim=0)``'s storage): its packed ``indices`` and ``perm`` ``[K, Nb*n]``, the
        index in ``values().flatten()`` of every slot of A. Computed once per pattern (shared
        by ``with_values``)."""
        cached = getattr(self, "_nm_cache", None)
        if cached is not None and cached[0] is self.columns:
            return cached[1], cached[2]
        from ._portable import pack_offsets

        N, K = self._shape
        Nb, P, n, L = self._values.shape
        if self.columns.is_meta:   # (the columns' owners are data: only the shapes)
            from ._kernel import index_per_word

            words = -(-Nb * n // index_per_word(self.m))
            return self.columns.new_empty((K, words)), self.columns.new_empty((K, Nb * n), dtype=torch.int64)
        pats = patterns(n, self.m)
        q = torch.arange(Nb)[:, None, None, None]
        p = torch.arange(P)[None, :, None, None]
        j = torch.arange(n)[None, None, :, None]
        t = torch.arange(L)[None, None, None, :]
        col = self.columns.long()[:, :, None, :].expand(Nb, P, n, L)
        flat = ((q * P + p) * n + j) * L + t                                   # [Nb, P, n, L]
        slot = (q * n + j).expand(Nb, P, n, L)
        off = pats[None, :, :, None].expand(Nb, P, n, L)
        keep = col < K
        perm = torch.zeros((K, Nb * n), dtype=torch.int64)
        offs = torch.zeros((K, Nb * n), dtype=torch.int64)
        perm[col[keep], slot[keep]] = flat.expand(Nb, P, n, L)[keep]
        offs[col[keep], slot[keep]] = off[keep]
        indices = pack_offsets(offs, self.m)
        self._nm_cache = (self.columns, indices, perm)
        return indices, perm

    def to_nm(self) -> "Any":
        """The same matrix as an exact :class:`NMTensor` with ``dim=0`` (lossless)."""
        from .nm_tensor import NMTensor

        indices, perm = self._nm_pattern()
        vals = self._values.reshape(-1)[perm] if perm.numel() else self._values.new_zeros(perm.shape)
        return NMTensor._trusted(vals, indices, self._shape, self.n, self.m, dim=0)

    def values_from_nm(self, nm_values: torch.Tensor) -> torch.Tensor:
        """``NMTensor(dim=0)``-ordered values (``[K, Nb*n]``, e.g. a gradient) in this layout's order."""
        _, perm = self._nm_pattern()
        out = nm_values.new_zeros(self._values.numel())
        if perm.numel():
            out[perm.reshape(-1)] = nm_values.reshape(-1)
        return out.reshape(self._values.shape)

    # -- conversions -----------------------------------------------------------
    def _plain_desc(self, reads_values: bool) -> Optional["Any"]:
        """A C descriptor of this tensor as stored (float32 or bf16 values, no copy) when the
        kernels may read it in place of torch's indexing (``reads_values``: they read the
        values, not only their address), else None."""
        from . import _kernel

        v = self._values.detach()
        if v.dtype not in _kernel.VTYPES or not v.is_contiguous() or not self.columns.is_contiguous() \
                or not _kernel.can_read(self._values if reads_values else v, self.columns):
            return None
        N, K = self._shape
        return _kernel.colgrouped(v, self.columns, _kernel_patterns(self.n, self.m), N, K, self.n, self.m)

    def to_dense(self) -> torch.Tensor:
        from . import _kernel

        d = self._plain_desc(reads_values=True) if self._values.dtype == torch.float32 else None
        if d is not None:   # in C: torch's indexing took ~3x as long (3072x768 2:4, 2 threads)
            return _kernel.colgrouped_decompress(d)
        N, K = self._shape
        Nb, P, n, L = self._values.shape
        out = self._values.new_zeros((Nb * self.m, P * L))
        if self._values.numel():
            out[self._rows(), self.columns.long()[:, :, None, :]] = self._values
        return out[:N, :K].contiguous()

    def mask(self) -> torch.Tensor:
        return self.with_values(torch.ones_like(self._values, dtype=torch.float32)).to_dense() != 0

    def _stored_positions(self) -> torch.Tensor:
        """Bool ``[N, K]``: the positions this pattern stores (= ``mask()`` of nonzero values)."""
        return self.mask()

    def kept_magnitude_ratio(self, dense: torch.Tensor) -> float:
        """Kept ``|w|`` of this pattern over the kept ``|w|`` of exact n:m along the rows."""
        from .nm_tensor import NMTensor

        exact = NMTensor.from_dense(dense, self.n, self.m, dim=0).to_dense().abs().sum()
        return float(self.to_dense().abs().sum() / exact) if float(exact) else 1.0

    # -- stored-values protocol --------------------------------------------------
    def values(self) -> torch.Tensor:
        return self._values

    def to(self, device: Any = None, dtype: Optional[torch.dtype] = None) -> "ColumnGroupedNMTensor":
        """The same pattern, values cast to ``dtype`` and both tensors on ``device`` (``"meta"`` too)."""
        return ColumnGroupedNMTensor._trusted(self._values.to(device=device, dtype=dtype), self.columns.to(device=device),
                                              self._shape, self.n, self.m, self.g)

    def empty_like(self, device: Any = None, dtype: Optional[torch.dtype] = None) -> "ColumnGroupedNMTensor":
        """``torch.empty_like``'s layout (``Module.to_empty``): this pattern with zero values on
        ``device``; from the meta device, the assignment ``from_dense`` makes for all-zero weights."""
        return empty_layout(self, device, dtype,
                            lambda zeros: ColumnGroupedNMTensor.from_dense(zeros, self.n, self.m, self.g))

    def state_tensors(self) -> tuple[torch.Tensor, ...]:
        """``(values, columns, [n, m, g])``: plain tensors that ``from_state_tensors`` rebuilds it from."""
        return (self._values, self.columns, torch.tensor([self.n, self.m, self.g], dtype=torch.int64))

    @classmethod
    def from_state_tensors(cls, tensors: tuple, shape: tuple) -> "ColumnGroupedNMTensor":
        values, columns, params = tensors
        n, m, g = read_params(params, cls.__name__, "n, m, g")
        return cls(values, columns, shape, n, m, g)

    def with_values(self, values: torch.Tensor) -> "ColumnGroupedNMTensor":
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
        values = zero_padding(self, self.columns, values.reshape(self._values.shape))
        t = ColumnGroupedNMTensor._trusted(values, self.columns, self._shape, self.n, self.m, self.g)
        if getattr(self, "_nm_cache", None) is not None:
            t._nm_cache = self._nm_cache   # same pattern
        return t

    def gather(self, dense: torch.Tensor) -> torch.Tensor:
        """Values of ``dense`` (the logical shape) at the stored positions (0 in padding)."""
        if not isinstance(dense, torch.Tensor) or dense.shape != self._shape:
            raise ValueError(f"dense must be a tensor of shape {tuple(self._shape)}")
        from . import _kernel

        d = self._plain_desc(reads_values=False) if dense.dtype == torch.float32 and _kernel.can_read(dense) else None
        if d is not None:   # in C: torch's indexing took 3x as long (3072x768 2:4, 2 threads)
            return _kernel.colgrouped_values_at(d, dense)
        N, K = self._shape
        Nb, P, n, L = self._values.shape
        full = dense.new_zeros((Nb * self.m, P * L))
        full[:N, :K] = dense
        return full[self._rows(), self.columns.long()[:, :, None, :]]

    def same_pattern(self, other: Any) -> bool:
        return (isinstance(other, ColumnGroupedNMTensor) and other._shape == self._shape
                and (other.n, other.m, other.g) == (self.n, self.m, self.g)
                and (other.columns is self.columns or torch.equal(other.columns, self.columns)))

    def __repr__(self) -> str:
        nnz = "?" if self.columns.is_meta and self._shape[0] % self.m else self.nnz
        return (f"ColumnGroupedNMTensor(shape={tuple(self._shape)}, n={self.n}, m={self.m}, g={self.g}, "
                f"dtype={self.dtype}, nnz={nnz})")
