"""``BitmaskTensor``: a bitmask of the kept positions plus their values, packed.

The mask is stored as bits (one ``uint8`` per 8 positions, row-major) and the
kept values as one 1-D tensor in row-major order, so a 90 % sparse fp32
matrix takes about 10 % + 3 % of its dense size.

Example:
    >>> import torch
    >>> b = BitmaskTensor.from_dense(torch.tensor([[0., 2.], [3., 0.]]))
    >>> b.nnz, b.values().tolist()
    (2, [2.0, 3.0])
    >>> b.to_dense().tolist()
    [[0.0, 2.0], [3.0, 0.0]]
"""

from __future__ import annotations

from typing import Any

import torch

from sten_core.plugin_api import Layout

_BITS = 2 ** torch.arange(8, dtype=torch.uint8)  # bit i of a byte holds position 8k + i


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A boolean tensor as bytes, 8 positions per ``uint8`` (row-major)."""
    flat = mask.reshape(-1).to(torch.uint8)
    flat = torch.nn.functional.pad(flat, (0, -flat.numel() % 8))
    return (flat.view(-1, 8) * _BITS.to(flat.device)).sum(1, dtype=torch.uint8)


def unpack_bits(bits: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The boolean tensor of ``shape`` that ``pack_bits`` stored in ``bits``."""
    numel = shape.numel()
    flat = (bits.unsqueeze(1) & _BITS.to(bits.device)) != 0
    return flat.reshape(-1)[:numel].view(shape)


class BitmaskTensor(Layout):
    """Bitmask + packed values, any number of dimensions.

    Args:
        bits: the mask from ``pack_bits``.
        packed: the kept values, row-major, one per set bit.
        shape: the logical shape.
    """

    def __init__(self, bits: torch.Tensor, packed: torch.Tensor, shape: torch.Size):
        self.bits, self.packed, self._shape = bits, packed, torch.Size(shape)
        self._mask: torch.Tensor | None = None  # unpacked mask, made on first use

    # -- the two required methods ------------------------------------------------
    @classmethod
    def from_dense(cls, tensor: torch.Tensor) -> "BitmaskTensor":
        """Keep the nonzeros of ``tensor``."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"BitmaskTensor.from_dense: tensor must be a torch.Tensor, got {type(tensor).__name__}")
        tensor = tensor.detach()
        return cls.from_mask(tensor, tensor != 0)

    @classmethod
    def from_mask(cls, tensor: torch.Tensor, mask: torch.Tensor) -> "BitmaskTensor":
        """Keep the values of ``tensor`` where the boolean ``mask`` is set."""
        if mask.shape != tensor.shape or mask.dtype is not torch.bool:
            raise ValueError(f"mask must be a bool tensor of shape {tuple(tensor.shape)}, got {mask.dtype} {tuple(mask.shape)}")
        layout = cls(pack_bits(mask), tensor.detach()[mask], tensor.shape)
        layout._mask = mask
        return layout

    def to_dense(self) -> torch.Tensor:
        dense = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        dense[self.mask()] = self.packed
        return dense

    # -- metadata -------------------------------------------------------------------
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
        return self.packed.numel()

    def mask(self) -> torch.Tensor:
        """The boolean mask of kept positions (unpacked once, then cached)."""
        if self._mask is None:
            self._mask = unpack_bits(self.bits, self.shape)
        return self._mask

    def coords(self) -> tuple[torch.Tensor, ...]:
        """The index of every kept value along each dimension (row-major order)."""
        return tuple(self.mask().nonzero().unbind(1))

    # -- the stored-values protocol (O(nnz) optimizer updates) ----------------------
    def values(self) -> torch.Tensor:
        return self.packed

    def with_values(self, values: torch.Tensor) -> "BitmaskTensor":
        layout = BitmaskTensor(self.bits, values, self.shape)
        layout._mask = self._mask
        return layout

    def gather(self, dense: torch.Tensor) -> torch.Tensor:
        return dense.expand(self.shape)[self.mask()]

    def same_pattern(self, other: Any) -> bool:
        return isinstance(other, BitmaskTensor) and other.shape == self.shape and (
            other.bits is self.bits or torch.equal(other.bits, self.bits)
        )

    # -- saving: torch.save / torch.load(weights_only=True) -------------------------
    def state_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The plain tensors that ``from_state_tensors`` rebuilds this layout from."""
        return (self.bits, self.packed)

    @classmethod
    def from_state_tensors(cls, tensors: tuple, shape: tuple) -> "BitmaskTensor":
        bits, packed = tensors
        return cls(bits, packed, torch.Size(shape))
