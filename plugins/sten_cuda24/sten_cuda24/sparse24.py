"""``Sparse24Tensor``: 2:4 semi-structured sparsity along the last (contraction) dim.

Storage: ``packed`` ``[R, Kp/2]`` (two kept values per group of 4) and ``meta``
``[R, Kp/16]`` int16 (see ``sten_cuda24.encoding``), where ``R`` is the product
of the leading dims and ``Kp`` is ``K`` rounded up to 16 (zero padded inside).
An optional *transposed pair* (``meta_t`` of the transposed matrix) exists when
the mask is 2:4 along both dims (``Sparse24Sparsifier(transposable=True)``);
training then computes the input gradient with the sparse kernel too.

One mask: a group with fewer than two kept values still stores two slots (the
CUTLASS *filler* positions hold zeros). ``live`` ``[R, Kp/2]`` (bool, or
``None`` when every slot is live) says which slots are in the mask; fillers are
never trained (``gather`` and ``with_values`` keep them zero), so the forward
metadata and the transposed pair always describe the same matrix.

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
import re
from typing import Any

import torch

from . import encoding

from sten_core.plugin_api import Layout, check_tensor


class Sparse24Tensor(Layout):
    """2:4 sparse tensor (fp16/bf16/fp32), compressed values plus metadata."""

    def __init__(
        self,
        packed: torch.Tensor,
        meta: torch.Tensor,
        shape: tuple[int, ...] | torch.Size,
        meta_t: torch.Tensor | None = None,
        live: torch.Tensor | None = None,
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
        if live is not None and (live.shape != packed.shape or live.dtype != torch.bool):
            raise ValueError(f"live must be a bool tensor of shape {tuple(packed.shape)}, got {live.dtype} {tuple(live.shape)}")
        self.packed = packed
        self.meta = meta
        self.meta_t = meta_t
        self.live = live
        self._shape = shape
        self._cache: dict[Any, Any] = {}

    # -- construction ---------------------------------------------------------------
    @classmethod
    def from_dense(cls, tensor: torch.Tensor, transposable: bool = False) -> "Sparse24Tensor":
        """Compress a tensor that is already 2:4 along its last dim (raises otherwise).

        ``transposable=True`` also records the transposed pair (2-D only; the
        tensor must then be 2:4 along the first dim too).
        """
        check_tensor(tensor, "tensor", where="Sparse24Tensor.from_dense")
        if tensor.dim() == 0:
            raise ValueError("Sparse24Tensor needs at least 1 dim")
        tensor = tensor.detach()
        if transposable:
            if tensor.dim() != 2:
                raise ValueError(f"the transposed pair needs a 2-D tensor, got {tensor.dim()}-D")
            try:
                encoding.compress(tensor.t())  # raises, naming the group, when not 2:4 along dim 0
            except ValueError as error:   # named in the transpose's coordinates: swap them back
                raise ValueError(re.sub(r"group of 4 at row (\d+), columns (\d+)\.\.(\d+)",
                                        r"group of 4 at column \1, rows \2..\3 (transposable=True needs 2:4 "
                                        r"along the columns too)", str(error))) from None
            return cls.from_dense_masked(tensor, tensor != 0, transposable=True)
        packed, meta = encoding.compress(encoding.as_rows(tensor))
        return cls(packed, meta, tensor.shape)

    @classmethod
    def from_dense_masked(cls, tensor: torch.Tensor, mask: torch.Tensor, transposable: bool = False) -> "Sparse24Tensor":
        """Store ``tensor`` at the positions where ``mask`` is True, kept zeros included.

        ``mask`` (tensor's shape) must have at most 2 True per group of 4 along
        the last dim; groups with fewer use CUTLASS's filler positions, which
        hold zeros and are not trainable. ``transposable=True`` (2-D; the mask
        must then be 2:4 along dim 0 too) also records the transposed pair.
        """
        if mask.shape != tensor.shape:
            raise ValueError(f"mask shape {tuple(mask.shape)} differs from tensor shape {tuple(tensor.shape)}")
        encoding.check_dtype(tensor.dtype)
        mask = mask.to(device=tensor.device, dtype=torch.bool)
        k = tensor.shape[-1]
        kp = encoding.padded_k(k)
        rows = torch.nn.functional.pad(encoding.as_rows(tensor.detach()), (0, kp - k))
        mrows = torch.nn.functional.pad(encoding.as_rows(mask), (0, kp - k))
        codes = encoding.group_codes(mrows.to(torch.uint8))
        values = encoding.gather_codes(rows.masked_fill(~mrows, 0), codes)  # not rows * mask: inf * 0 is NaN
        meta = encoding.pack_codes(codes)
        live = encoding.live_slots(meta, mrows)
        meta_t = None
        if transposable:
            if tensor.dim() != 2:
                raise ValueError(f"the transposed pair needs a 2-D tensor, got {tensor.dim()}-D")
            kt = tensor.shape[0]
            mt = torch.nn.functional.pad(mask.t(), (0, encoding.padded_k(kt) - kt))
            meta_t = encoding.pack_codes(encoding.group_codes(mt.to(torch.uint8)))
        full = bool(live.all()) if live.numel() else True
        return cls(values, meta, tensor.shape, meta_t, None if full else live)

    @classmethod
    def from_pair(cls, packed: torch.Tensor, meta: torch.Tensor, shape: tuple[int, ...] | torch.Size, meta_t: torch.Tensor) -> "Sparse24Tensor":
        """A transposable tensor from kernel output (``packed``/``meta`` and the
        transposed ``meta_t``): the live slots are those both metadata name."""
        shape = torch.Size(shape)
        both = encoding.keep_mask(meta, shape[1]) & encoding.keep_mask(meta_t, shape[0]).t()
        live = encoding.live_slots(meta, both)
        packed = packed.masked_fill(~live, 0)
        return cls(packed, meta, shape, meta_t, None if bool(live.all()) else live)

    # -- dense ------------------------------------------------------------------------
    def to_dense(self) -> torch.Tensor:
        # contiguous: the padded columns cut off would leave a strided view, and a dense
        # tensor's strides are visible (``view``, ``as_strided``) to the ops run on it
        dense = encoding.decompress(self.packed, self.meta, self._shape[-1])
        return dense.reshape(self._shape).contiguous()

    def mask(self) -> torch.Tensor:
        """Boolean mask of the stored, trainable positions (logical shape; fillers excluded)."""
        return encoding.slot_mask(self.meta, self.live, self._shape[-1]).reshape(self._shape)

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
        if self.live is not None:
            return int(self.live.sum())
        k = self._shape[-1]
        return math.prod(self._shape[:-1]) * (2 * (k // 4) + min(2, k % 4))

    @property
    def transposable(self) -> bool:
        return self.meta_t is not None

    # -- stored-values protocol ---------------------------------------------------------
    def values(self) -> torch.Tensor:
        return self.packed

    def with_values(self, values: torch.Tensor) -> "Sparse24Tensor":
        """The same pattern with new stored values (fillers forced to zero).

        When ``values`` is this tensor's own storage (an optimizer step updated it
        in place), the new tensor shares the prepared GPU operands, which are then
        refreshed in place instead of rebuilt (see ``backends.prepare``).
        """
        if values.shape != self.packed.shape:
            raise ValueError(f"values must have shape {tuple(self.packed.shape)}, got {tuple(values.shape)}")
        same = values is self.packed
        if self.live is not None:
            values = values.masked_fill_(~self.live, 0) if same else values.masked_fill(~self.live, 0)
        # in the values' own dtype (a bf16 weight times float32 is float32, as in torch; a dtype
        # 2:4 cannot store raises): cast to the weight's, it rounded the product silently
        out = Sparse24Tensor(values, self.meta, self._shape, self.meta_t, self.live)
        if out.packed is self.packed:
            out._cache = self._cache
        return out

    def gather(self, dense: torch.Tensor) -> torch.Tensor:
        """Values of ``dense`` (logical shape) at the stored positions."""
        if tuple(dense.shape) != tuple(self._shape):
            raise ValueError(f"gather expects shape {tuple(self._shape)}, got {tuple(dense.shape)}")
        k = self._shape[-1]
        rows = encoding.as_rows(dense)
        kp = encoding.padded_k(k)
        if kp != k:
            rows = torch.nn.functional.pad(rows, (0, kp - k))
        values = encoding.gather_codes(rows, encoding.unpack_codes(self.meta.to(dense.device)))
        if self.live is not None:
            values = values.masked_fill(~self.live.to(values.device), 0)
        return values

    def same_pattern(self, other: Any) -> bool:
        return (
            isinstance(other, Sparse24Tensor)
            and other._shape == self._shape
            and other.meta.device == self.meta.device
            and bool(torch.equal(other.meta, self.meta))
            and (other.live is None) == (self.live is None)
            and (self.live is None or bool(torch.equal(other.live, self.live)))
        )

    def __getstate__(self) -> dict:
        """Pickle the tensors, not the cached GPU operands (rebuilt on first use)."""
        state = dict(self.__dict__)
        state["_cache"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        state.setdefault("live", None)  # tensors pickled before ``live`` existed
        self.__dict__.update(state)

    # -- saving: torch.save / torch.load(weights_only=True) -----------------------------
    def state_tensors(self) -> tuple[torch.Tensor, ...]:
        """``(packed, meta, meta_t, live)``: plain tensors that ``from_state_tensors``
        rebuilds it from (an empty tensor stands for an absent ``meta_t`` / ``live``)."""
        meta_t = self.meta_t if self.meta_t is not None else torch.empty(0, dtype=self.meta.dtype)
        live = self.live if self.live is not None else torch.empty(0, dtype=torch.bool)
        return (self.packed, self.meta, meta_t, live)

    @classmethod
    def from_state_tensors(cls, tensors: tuple, shape: tuple) -> "Sparse24Tensor":
        packed, meta, *rest = tensors
        meta_t = rest[0] if rest and rest[0].numel() else None
        live = rest[1] if len(rest) > 1 and rest[1].numel() else None
        layout = cls(packed, meta, shape, meta_t, live)
        encoding.check_meta(meta)   # (a damaged checkpoint fails on load, not later with values lost)
        if meta_t is not None:
            encoding.check_meta(meta_t, "meta_t")
        return layout

    # -- helpers ------------------------------------------------------------------------
    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "Sparse24Tensor":
        """Move/cast the storage (the mask is unchanged)."""
        if dtype is not None:
            encoding.check_dtype(dtype)
        packed = self.packed.to(device=device, dtype=dtype)
        meta = self.meta.to(device=device)
        meta_t = None if self.meta_t is None else self.meta_t.to(device=device)
        live = None if self.live is None else self.live.to(device=device)
        return Sparse24Tensor(packed, meta, self._shape, meta_t, live)

    def transposed(self) -> "Sparse24Tensor":
        """The transposed matrix as a ``Sparse24Tensor`` (needs the transposed pair)."""
        if self.meta_t is None:
            raise ValueError("this Sparse24Tensor has no transposed pair; build it with transposable=True")
        hit = self._cache.get("transposed")
        if hit is not None and hit[0] is self.packed and hit[1] == self.packed._version:
            return hit[2]
        flat = self.packed.reshape(-1)
        if hit is not None and hit[2].meta_t is self.meta:
            layout_t, index = hit[2], hit[3]          # same pattern: refresh the values in place
            layout_t.packed.copy_(torch.where(index >= 0, flat[index.clamp_min(0)], 0))
        else:
            index = self._transpose_index()
            live_t = index >= 0
            values_t = torch.where(live_t, flat[index.clamp_min(0)], 0)
            full = bool(live_t.all()) if live_t.numel() else True
            shape_t = (self._shape[1], self._shape[0])
            layout_t = Sparse24Tensor(values_t, self.meta_t, shape_t, self.meta, None if full else live_t)
        self._cache["transposed"] = (self.packed, self.packed._version, layout_t, index)
        return layout_t

    def _transpose_index(self) -> torch.Tensor:
        """For every slot of the transposed pair, the flat index of the same value in
        ``packed`` (``-1``: a filler of the transposed metadata, or not live here)."""
        r, k = self._shape
        slots = torch.arange(1, self.packed.numel() + 1, device=self.packed.device).reshape(self.packed.shape)
        if self.live is not None:
            slots = slots.masked_fill(~self.live, 0)
        where = encoding.decompress(slots, self.meta, k)            # [R, K]: slot number + 1, 0 if none
        kpt = encoding.padded_k(r)
        rows_t = torch.nn.functional.pad(where.t(), (0, kpt - r))
        return encoding.gather_codes(rows_t, encoding.unpack_codes(self.meta_t)) - 1

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
