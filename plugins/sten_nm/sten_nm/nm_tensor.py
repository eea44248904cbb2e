"""``NMTensor``: exact n:m sparsity for 2-D weights (every m consecutive elements
along one dimension keep n).

Memory format (the C kernel reads it directly). The matrix ``A`` is the weight
itself when the groups run along dim 1 (the default: the input / contraction
dimension of an ``F.linear`` weight ``[out, in]``), or its transpose when they run
along dim 0. With ``A`` of shape ``[R, C]`` and ``G = ceil(C / m)`` groups per row:

* ``values``  ``[R, G*n]`` (the weight's dtype): the kept values of each group in
  increasing column order; slots past column ``C`` (internal padding) hold 0;
* ``indices`` ``[R, ceil(G*n / per)]`` int32 words: each kept value's offset in
  its group, ``bits = ceil(log2 m)`` bits each, ``per = 32 // bits`` per word.

Bytes: ``n/m * dense * (1 + bits/(8*itemsize) * 32/(per*bits))`` plus O(rows)
of padding: 1.03x (m=2), 1.06x (m=4), 1.125x (m=8,10,16) of ``n/m`` dense fp32.

Example:
    >>> import torch
    >>> from sten_nm import NMTensor
    >>> w = torch.tensor([[1., -4., 2., 3.]])
    >>> t = NMTensor.from_dense(w, n=2, m=4)
    >>> t.to_dense().tolist()
    [[0.0, -4.0, 0.0, 3.0]]
    >>> t.nnz
    2
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from . import _kernel
from ._fp32 import fp32_values
from ._meta import empty_layout, read_params
from ._checks import FLOAT_DTYPES, check_dim, check_float_tensor, check_nm
from ._padding import zero_padding

from sten_core.plugin_api import Layout as _Base


def group_offsets(indices: torch.Tensor, slots: int, m: int) -> torch.Tensor:
    """Unpack ``indices`` ``[rows, words]`` into the in-group offsets ``[rows, slots]`` (int64).

    >>> group_offsets(torch.tensor([[0b1101]], dtype=torch.int32), 2, 4).tolist()
    [[1, 3]]
    """
    bits, per = _kernel.index_bits(m), _kernel.index_per_word(m)
    e = torch.arange(slots, device=indices.device)
    words = indices.to(torch.int64) & 0xFFFFFFFF
    return (words[:, e // per] >> (bits * (e % per))) & ((1 << bits) - 1)


def check_offsets(indices: torch.Tensor, rows: int, C: int, n: int, m: int, name: str = "indices") -> None:
    """Every group's ``n`` offsets lie in ``[0, m)`` and increase strictly (no duplicates).

    Raises ValueError naming ``name``, the row and the group otherwise: the kernels
    would read out of bounds, or disagree with ``to_dense()``.
    """
    G = -(-C // m)
    if rows == 0 or G == 0 or indices.is_meta:   # (the meta device holds no offsets to check)
        return
    offs = group_offsets(indices, G * n, m).reshape(rows, G, n)
    bad = offs >= m
    if bool(bad.any()):
        r, g, j = (int(v) for v in torch.nonzero(bad)[0])
        raise ValueError(f"{name}: offset {int(offs[r, g, j])} of row {r}, group {g} is not < m={m}")
    if n > 1:
        dup = offs[:, :, 1:] <= offs[:, :, :-1]
        if bool(dup.any()):
            r, g, _ = (int(v) for v in torch.nonzero(dup)[0])
            raise ValueError(f"{name}: the offsets of row {r}, group {g} must increase strictly "
                             f"(distinct positions in increasing order), got {offs[r, g].tolist()}")


def largest_n(a: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Bool mask of the ``n`` largest magnitudes of every ``m`` consecutive entries of each row of
    ``a``, ranked in ``a``'s own dtype (ties: lower index; NaN largest, as ``nm_compress``).

    >>> largest_n(torch.tensor([[1.0, 1.0 + 1e-12, 0.0, 0.0]], dtype=torch.float64), 1, 4).tolist()
    [[False, True, False, False]]
    """
    R, C = a.shape
    G = -(-C // m)
    mag = a.abs()
    mag = torch.where(mag.isnan(), torch.tensor(float("inf"), dtype=mag.dtype), mag)
    keyed = torch.full((R, G * m), -1.0, dtype=mag.dtype)
    keyed[:, :C] = mag
    order = torch.sort(keyed.view(R, G, m), dim=-1, descending=True, stable=True).indices[..., :n]
    mask = torch.zeros((R, G, m), dtype=torch.bool).scatter_(-1, order, True)
    return mask.view(R, G * m)[:, :C]


class NMTensor(_Base):
    """n:m sparse 2-D tensor (values plus packed in-group offsets).

    Args:
        values: ``[R, G*n]`` kept values (see the module docstring).
        indices: ``[R, iw]`` int32 packed offsets.
        shape: logical ``(rows, cols)`` of the tensor.
        n, m: keep ``n`` of every ``m``.
        dim: the dimension the groups run along (1: columns, the default).

    Build one with :meth:`from_dense` (magnitude: the n largest of each group).
    """

    def __init__(self, values: torch.Tensor, indices: torch.Tensor, shape: Any, n: int, m: int, dim: int = 1):
        self._setup(values, indices, shape, n, m, dim)
        R, C = self._rc()
        check_offsets(self.indices, R, C, self.n, self.m)

    def _setup(self, values: torch.Tensor, indices: torch.Tensor, shape: Any, n: int, m: int, dim: int) -> None:
        """Shape and dtype checks (not the offsets: trusted producers skip that scan)."""
        self.n, self.m = check_nm(n, m)
        self.dim = check_dim(dim)
        self._shape = torch.Size(shape)
        if len(self._shape) != 2:
            raise ValueError(f"shape must be 2-D, got {tuple(self._shape)}")
        R, C = self._rc()
        G = -(-C // m)
        per = _kernel.index_per_word(m)
        if not isinstance(values, torch.Tensor) or values.dtype not in FLOAT_DTYPES:
            raise TypeError(f"NMTensor: values must be a floating-point torch.Tensor, got "
                            f"{getattr(values, 'dtype', type(values).__name__)} (an n:m layout holds float16, bfloat16, "
                            "float32 or float64; for another dtype densify first: w.to_dense().to(dtype))")
        if not isinstance(indices, torch.Tensor):
            raise TypeError(f"indices must be a torch.Tensor, got {type(indices).__name__}")
        if tuple(values.shape) != (R, G * n):
            raise ValueError(f"values must have shape {(R, G * n)}, got {tuple(values.shape)}")
        if indices.dtype != torch.int32 or tuple(indices.shape) != (R, -(-G * n // per)):
            raise ValueError(f"indices must be int32 of shape {(R, -(-G * n // per))}, got {indices.dtype} {tuple(indices.shape)}")
        self._values = values.contiguous()
        self.indices = indices.contiguous()

    @classmethod
    def _trusted(cls, values: torch.Tensor, indices: torch.Tensor, shape: Any, n: int, m: int,
                 dim: int = 1) -> "NMTensor":
        """Build from indices made by this package (compress, or an existing tensor's)."""
        t = cls.__new__(cls)
        t._setup(values, indices, shape, n, m, dim)
        return t

    # -- construction ----------------------------------------------------------
    @classmethod
    def from_dense(cls, tensor: torch.Tensor, n: int = 2, m: int = 4, dim: int = 1,
                   mask: Optional[torch.Tensor] = None) -> "NMTensor":
        """Keep the ``n`` largest magnitudes of every ``m`` along ``dim``.

        ``mask`` (bool, the tensor's shape, at most ``n`` per group) picks the
        kept positions instead. Ties keep the lower index; NaN counts as largest.

        >>> NMTensor.from_dense(torch.ones(2, 8), n=1, m=4).nnz
        4
        """
        check_float_tensor(tensor, "tensor", ndim=2)
        n, m = check_nm(n, m)
        dim = check_dim(dim)
        a = tensor.detach()
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or mask.shape != tensor.shape:
                raise ValueError(f"mask must be a tensor of shape {tuple(tensor.shape)}")
            mask = mask != 0
        if dim == 0:
            a = a.t()
            mask = mask.t() if mask is not None else None
        if mask is None and a.dtype == torch.float64:   # ranked in float64: fp32 rounding reorders
            mask = largest_n(a, n, m)                     # 1 and 1 + 1e-12, or 1e-300 and 2e-300
        vals, idx = _kernel.compress(a.float(), n, m, mask=mask)
        if tensor.dtype != torch.float32:
            # keep the original dtype's values exactly (fp64 would lose bits through fp32)
            cols = cls._cols(idx, a.shape[1], n, m, a.shape[0])
            vals = cls._gather_cols(a.contiguous(), cols)
            if mask is not None:  # fill slots (not in the mask) hold 0, whatever the dense value there
                kept = cls._gather_cols(mask.to(a.dtype).contiguous(), cols) != 0
                vals = torch.where(kept, vals, torch.zeros((), dtype=vals.dtype))
        return cls._trusted(vals, idx, tensor.shape, n, m, dim)

    # -- metadata ----------------------------------------------------------------
    def _rc(self) -> tuple[int, int]:
        r, c = self._shape
        return (r, c) if self.dim == 1 else (c, r)

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
    def nnz(self) -> int:
        """Stored positions inside the logical shape (zeros kept by the pattern count)."""
        R, C = self._rc()
        return R * ((C // self.m) * self.n + min(self.n, C % self.m))

    @property
    def nbytes(self) -> int:
        """Bytes of the stored values plus indices."""
        return self._values.numel() * self._values.element_size() + self.indices.numel() * 4

    def mat(self) -> "_kernel.NMMat":
        """C descriptor of the fp32 stored matrix (``values`` must be float32)."""
        R, C = self._rc()
        return _kernel.mat(self._values, self.indices, R, C, self.n, self.m)

    def fp32(self, round_to: Optional[torch.dtype] = None) -> "NMTensor":
        """This tensor with float32 values (itself when it already is), rounded through
        ``round_to`` first when given (CPU autocast); the conversion is cached."""
        v = fp32_values(self, self._values, round_to)
        if v is self._values:
            return self
        return NMTensor._trusted(v, self.indices, self._shape, self.n, self.m, self.dim)

    # -- dense conversion --------------------------------------------------------
    @staticmethod
    def _cols(indices: torch.Tensor, C: int, n: int, m: int, R: int) -> torch.Tensor:
        G = -(-C // m)
        if not R:
            return torch.zeros((0, G * n), dtype=torch.int64, device=indices.device)
        return (torch.arange(G * n, device=indices.device) // n) * m + group_offsets(indices, G * n, m)

    def columns(self) -> torch.Tensor:
        """Column of ``A`` of every stored slot, ``[R, G*n]`` int64 (may be >= C in padding)."""
        R, C = self._rc()
        return self._cols(self.indices, C, self.n, self.m, R)

    @staticmethod
    def _gather_cols(a: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        C = a.shape[1]
        pad = int(cols.max()) + 1 - C if cols.numel() and not cols.is_meta else 0   # (meta: no bounds to read)
        if pad > 0:
            a = torch.nn.functional.pad(a, (0, pad))
        return torch.gather(a, 1, cols) if cols.numel() else a.new_zeros(cols.shape)

    def to_dense(self) -> torch.Tensor:
        """The dense tensor (zeros at the dropped positions)."""
        R, C = self._rc()
        if self._values.dtype == torch.float32 and _kernel.can_read(self._values, self.indices):
            a = _kernel.decompress(self.mat())
        else:
            G = -(-C // self.m)
            a = self._values.new_zeros((R, G * self.m))
            if R and G:
                a.scatter_(1, self.columns(), self._values)
            a = a[:, :C]
        return (a.t() if self.dim == 0 else a).contiguous()

    def mask(self) -> torch.Tensor:
        """Boolean mask of the stored positions (logical shape)."""
        R, C = self._rc()
        G = -(-C // self.m)
        a = torch.zeros((R, G * self.m), dtype=torch.bool, device=self.indices.device)
        if R and G:
            a.scatter_(1, self.columns(), True)
        a = a[:, :C]
        return (a.t() if self.dim == 0 else a).contiguous()

    # -- stored-values protocol --------------------------------------------------
    def values(self) -> torch.Tensor:
        """The stored values ``[R, G*n]`` (a view: in-place updates change the tensor)."""
        return self._values

    def with_values(self, values: torch.Tensor) -> "NMTensor":
        """Same pattern, new values (shape ``[R, G*n]``)."""
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
        values = zero_padding(self, self.indices, values.reshape(self._values.shape))
        return NMTensor._trusted(values, self.indices, self._shape, self.n, self.m, self.dim)

    def gather(self, dense: torch.Tensor) -> torch.Tensor:
        """Values of ``dense`` (the logical shape) at the stored positions (0 in padding)."""
        if not isinstance(dense, torch.Tensor) or dense.shape != self._shape:
            raise ValueError(f"dense must be a tensor of shape {tuple(self._shape)}")
        a = dense.t() if self.dim == 0 else dense
        # in C (values_at reads the pattern, the values' address only): torch.gather took 3.5x
        # as long (3072x768 2:4, 2 threads)
        if a.dtype == torch.float32 and _kernel.can_read(a, self._values.detach(), self.indices):
            return _kernel.values_at(self.mat(), a)
        return self._gather_cols(a.contiguous(), self.columns())

    def same_pattern(self, other: Any) -> bool:
        return (
            isinstance(other, NMTensor)
            and other._shape == self._shape
            and (other.n, other.m, other.dim) == (self.n, self.m, self.dim)
            and (other.indices is self.indices or torch.equal(other.indices, self.indices))
        )

    def to(self, device: Any = None, dtype: Optional[torch.dtype] = None) -> "NMTensor":
        """The same pattern, values cast to ``dtype`` and both tensors on ``device`` (the
        ``"meta"`` device too: a move reads no index, unlike ``from_state_tensors``).

        >>> NMTensor.from_dense(torch.ones(2, 4)).to(dtype=torch.float64).dtype
        torch.float64
        """
        return NMTensor._trusted(self._values.to(device=device, dtype=dtype), self.indices.to(device=device),
                                 self._shape, self.n, self.m, self.dim)

    def empty_like(self, device: Any = None, dtype: Optional[torch.dtype] = None) -> "NMTensor":
        """``torch.empty_like``'s layout (``Module.to_empty``): this pattern with zero values on
        ``device``; from the meta device, the first ``n`` of every ``m`` (see :mod:`sten_nm._meta`).

        >>> NMTensor.from_dense(torch.ones(2, 4)).to("meta").empty_like("cpu").to_dense().tolist()
        [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
        """
        return empty_layout(self, device, dtype, lambda zeros: NMTensor.from_dense(zeros, self.n, self.m, self.dim))

    # -- saving: torch.save / torch.load(weights_only=True) ---------------------
    def state_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(values, indices, [n, m, dim])``: plain tensors that ``from_state_tensors`` rebuilds it from.

        >>> t = NMTensor.from_dense(torch.tensor([[1., -4., 2., 3.]]))
        >>> NMTensor.from_state_tensors(t.state_tensors(), t.shape).same_pattern(t)
        True
        """
        return (self._values, self.indices, torch.tensor([self.n, self.m, self.dim], dtype=torch.int64))

    @classmethod
    def from_state_tensors(cls, tensors: tuple, shape: tuple) -> "NMTensor":
        values, indices, params = tensors
        n, m, dim = read_params(params, cls.__name__, "n, m, dim")
        return cls(values, indices, shape, n, m, dim)

    def __repr__(self) -> str:
        return (f"NMTensor(shape={tuple(self._shape)}, n={self.n}, m={self.m}, dim={self.dim}, "
                f"dtype={self.dtype}, nnz={self.nnz})")
