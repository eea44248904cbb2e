"""``Sparse24Tensor``: 2:4 semi-structured sparsity along the last (contraction) dim.

Storage: ``packed`` ``[R, Kp/2]`` (two kept values per group of 4) and ``meta``
``[R, Kp/16]`` int16 (see ``sten_cuda24.encoding``), where ``R`` is the product
of the leading dims and ``Kp`` is ``K`` rounded up to 16 (zero padded inside).
An optional *transposed pair* (``meta_t`` of the transposed matrix) exists when
the mask is 2:4 along both dims (``Sparse24Sparsifier(transposable=True)``);
training then computes the input gradient with the sparse kernel too.

On a GPU the matmul operand (cuSPARSELt compressed tensor or CUTLASS
packed/meta) is built once per tensor and cached; on CPU the layout still works
(``from_dense``/``to_dense``, conversions, values protocol).

Example:
    >>> import torch
    >>> w = torch.tensor([[1., 0., 0., 2.] * 4, [0., 3., 4., 0.] * 4])
    >>> s = Sparse24Tensor.from_dense(w)
    >>> s.shape, s.nnz, bool((s.to_dense() == w).all())
    (torch.Size([2, 16]), 16, True)
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import encoding

try:  # the core may not be importable in a bare checkout; the layout works alone
    from sten_core.layouts import Layout
except Exception:  # pragma: no cover
    Layout = object  # type: ignore[misc,assignment]


class Sparse24Tensor(Layout):
    """2:4 sparse tensor (fp16/bf16/fp32), compressed values plus metadata."""

    def __init__(
        self,
        packed: torch.Tensor,
        meta: torch.Tensor,
        shape: tuple[int, ...] | torch.Size,
        meta_t: torch.Tensor | None = None,
    ) -> None:
        shape = torch.Size(shape)
        if len(shape) < 1:
            raise ValueError("Sparse24Tensor needs at least 1 dim")
        encoding.check_dtype(packed.dtype)
        rows = math.prod(shape[:-1])
        kp = encoding.padded_k(shape[-1])
        if tuple(packed.shape) != (rows, kp // 2) or tuple(meta.shape) != (rows, kp // encoding.WORD):
            raise ValueError(
                f"packed {tuple(packed.shape)} / meta {tuple(meta.shape)} do not fit shape {tuple(shape)}: "
                f"expected {(rows, kp // 2)} / {(rows, kp // encoding.WORD)}"
            )
        if meta.dtype != torch.int16:
            raise TypeError(f"meta must be int16, got {meta.dtype}")
        self.packed = packed
        self.meta = meta
        self.meta_t = meta_t
        self._shape = shape
        self._cache: dict[Any, Any] = {}

    # -- construction ---------------------------------------------------------------
    @classmethod
    def from_dense(cls, tensor: torch.Tensor, transposable: bool = False) -> "Sparse24Tensor":
        """Compress a tensor that is already 2:4 along its last dim (raises otherwise).

        ``transposable=True`` also records the transposed pair (2-D only; the
        tensor must then be 2:4 along the first dim too).
        """
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() == 0:
            raise ValueError("Sparse24Tensor needs at least 1 dim")
        tensor = tensor.detach()
        packed, meta = encoding.compress(tensor.reshape(-1, tensor.shape[-1]))
        meta_t = None
        if transposable:
            if tensor.dim() != 2:
                raise ValueError(f"the transposed pair needs a 2-D tensor, got {tensor.dim()}-D")
            _, meta_t = encoding.compress(tensor.t())
        return cls(packed, meta, tensor.shape, meta_t)

    @classmethod
    def from_dense_masked(cls, tensor: torch.Tensor, mask: torch.Tensor) -> "Sparse24Tensor":
        """Store ``tensor`` at the positions where ``mask`` is True, kept zeros included.

        ``mask`` (tensor's shape) must have at most 2 True per group of 4 along
        the last dim; groups with fewer use CUTLASS's filler positions.
        """
        if mask.shape != tensor.shape:
            raise ValueError(f"mask shape {tuple(mask.shape)} differs from tensor shape {tuple(tensor.shape)}")
        encoding.check_dtype(tensor.dtype)
        k = tensor.shape[-1]
        kp = encoding.padded_k(k)
        rows = torch.nn.functional.pad(tensor.detach().reshape(-1, k), (0, kp - k))
        mrows = torch.nn.functional.pad(mask.to(device=tensor.device, dtype=torch.bool).reshape(-1, k), (0, kp - k))
        codes = encoding.group_codes(mrows.to(torch.uint8))
        values = encoding.gather_codes(rows * mrows, codes)
        return cls(values, encoding.pack_codes(codes), tensor.shape)

    # -- dense ------------------------------------------------------------------------
    def to_dense(self) -> torch.Tensor:
        dense = encoding.decompress(self.packed, self.meta, self._shape[-1])
        return dense.reshape(self._shape)

    def mask(self) -> torch.Tensor:
        """Boolean mask of the stored positions (logical shape)."""
        return encoding.keep_mask(self.meta, self._shape[-1]).reshape(self._shape)

    # -- metadata ---------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        return self.packed.dtype

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nnz(self) -> int:
        """Stored values inside the logical shape (two per group of 4)."""
        k = self._shape[-1]
        return math.prod(self._shape[:-1]) * (2 * (k // 4) + min(2, k % 4))

    @property
    def transposable(self) -> bool:
        return self.meta_t is not None

    # -- stored-values protocol ---------------------------------------------------------
    def values(self) -> torch.Tensor:
        return self.packed

    def with_values(self, values: torch.Tensor) -> "Sparse24Tensor":
        if values.shape != self.packed.shape:
            raise ValueError(f"values must have shape {tuple(self.packed.shape)}, got {tuple(values.shape)}")
        return Sparse24Tensor(values.to(self.packed.dtype), self.meta, self._shape, self.meta_t)

    def gather(self, dense: torch.Tensor) -> torch.Tensor:
        """Values of ``dense`` (logical shape) at the stored positions."""
        if tuple(dense.shape) != tuple(self._shape):
            raise ValueError(f"gather expects shape {tuple(self._shape)}, got {tuple(dense.shape)}")
        k = self._shape[-1]
        rows = dense.reshape(-1, k)
        kp = encoding.padded_k(k)
        if kp != k:
            rows = torch.nn.functional.pad(rows, (0, kp - k))
        return encoding.gather_codes(rows, encoding.unpack_codes(self.meta.to(dense.device)))

    def same_pattern(self, other: Any) -> bool:
        return (
            isinstance(other, Sparse24Tensor)
            and other._shape == self._shape
            and other.meta.device == self.meta.device
            and bool(torch.equal(other.meta, self.meta))
        )

    # -- saving: torch.save / torch.load(weights_only=True) -----------------------------
    def state_tensors(self) -> tuple[torch.Tensor, ...]:
        """``(packed, meta[, meta_t])``: plain tensors that ``from_state_tensors`` rebuilds it from."""
        return (self.packed, self.meta) if self.meta_t is None else (self.packed, self.meta, self.meta_t)

    @classmethod
    def from_state_tensors(cls, tensors: tuple, shape: tuple) -> "Sparse24Tensor":
        packed, meta, *rest = tensors
        return cls(packed, meta, shape, rest[0] if rest else None)

    # -- helpers ------------------------------------------------------------------------
    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "Sparse24Tensor":
        """Move/cast the storage (the mask is unchanged)."""
        if dtype is not None:
            encoding.check_dtype(dtype)
        packed = self.packed.to(device=device, dtype=dtype)
        meta = self.meta.to(device=device)
        meta_t = None if self.meta_t is None else self.meta_t.to(device=device)
        return Sparse24Tensor(packed, meta, self._shape, meta_t)

    def transposed(self) -> "Sparse24Tensor":
        """The transposed matrix as a ``Sparse24Tensor`` (needs the transposed pair)."""
        if self.meta_t is None:
            raise ValueError("this Sparse24Tensor has no transposed pair; build it with transposable=True")
        key = ("transposed", self.packed.data_ptr(), self.packed._version)
        hit = self._cache.get(key)
        if hit is None:
            dense_t = self.to_dense().t()
            kp = encoding.padded_k(dense_t.shape[1])
            rows = torch.nn.functional.pad(dense_t, (0, kp - dense_t.shape[1]))
            values_t = encoding.gather_codes(rows, encoding.unpack_codes(self.meta_t))
            hit = Sparse24Tensor(values_t, self.meta_t, dense_t.shape, self.meta)
            self._cache = {k: v for k, v in self._cache.items() if k[0] != "transposed"}
            self._cache[key] = hit
        return hit

    def cutlass_pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(packed, meta_reordered)`` in CUTLASS's format (2-D, fp16/bf16, rows % 32 == 0)."""
        if len(self._shape) != 2:
            raise ValueError(f"CUTLASS operands are 2-D, this tensor is {len(self._shape)}-D")
        if self.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"CUTLASS 2:4 metadata is for float16/bfloat16, got {self.dtype}")
        return self.packed, encoding.cutlass_reorder(self.meta)

    def __repr__(self) -> str:
        extra = ", transposable" if self.transposable else ""
        return f"Sparse24Tensor(shape={tuple(self._shape)}, dtype={self.dtype}, device={self.device}, nnz={self.nnz}{extra})"
