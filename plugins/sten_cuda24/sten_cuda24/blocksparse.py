"""``BlockSparseTensor``: block-sparse rows (BSR) with square or rectangular blocks.

Storage: ``crow`` ``[MB + 1]`` and ``col`` ``[nnzb]`` (int32, block-row
pointers and block-column indices, columns sorted within a row) and ``blocks``
``[nnzb, bh, bw]``. Shapes not divisible by the block are zero-padded inside;
``shape`` stays the logical one. Block sizes 16..128 run on the Triton kernel
(``sten_cuda24.triton_bsr``); any block size works for storage and on CPU.

Example:
    >>> import torch
    >>> x = torch.zeros(40, 40); x[:16, 16:32] = 1.0
    >>> b = BlockSparseTensor.from_dense(x, block_shape=(16, 16))
    >>> b.shape, b.nnz, b.num_blocks, bool((b.to_dense() == x).all())
    (torch.Size([40, 40]), 256, 1, True)
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch

from sten_core.plugin_api import Layout, check_tensor

DEFAULT_BLOCK = (64, 64)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _block_shape(block_shape: Sequence[int] | int) -> tuple[int, int]:
    if isinstance(block_shape, int):
        block_shape = (block_shape, block_shape)
    bs = tuple(block_shape)
    if len(bs) != 2 or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in bs):
        raise ValueError(f"block_shape must be two positive ints, got {block_shape!r}")
    return bs  # type: ignore[return-value]


class BlockSparseTensor(Layout):
    """2-D block-sparse tensor (BSR) of blocks ``(bh, bw)``."""

    def __init__(
        self,
        crow: torch.Tensor,
        col: torch.Tensor,
        blocks: torch.Tensor,
        shape: Sequence[int],
    ) -> None:
        shape = torch.Size(shape)
        if len(shape) != 2:
            raise ValueError(f"BlockSparseTensor is 2-D, got shape {tuple(shape)}")
        if blocks.dim() != 3:
            raise ValueError(f"blocks must be [nnzb, bh, bw], got {tuple(blocks.shape)}")
        bh, bw = blocks.shape[1:]
        mb = -(-shape[0] // bh)
        if crow.shape != (mb + 1,) or col.shape != (blocks.shape[0],):
            raise ValueError(f"crow {tuple(crow.shape)} / col {tuple(col.shape)} do not fit {mb} block rows and {blocks.shape[0]} blocks")
        self.crow, self.col, self.blocks = crow, col, blocks
        self._shape = shape
        self._cache: dict[Any, Any] = {}

    # -- construction ----------------------------------------------------------------
    @classmethod
    def from_dense(cls, tensor: torch.Tensor, block_shape: Sequence[int] | int = DEFAULT_BLOCK) -> "BlockSparseTensor":
        """Keep every block that has a nonzero."""
        bh, bw = _block_shape(block_shape)
        padded = cls._pad(tensor, bh, bw)
        tiles = padded.reshape(padded.shape[0] // bh, bh, padded.shape[1] // bw, bw)
        return cls._from_tiles(tensor, tiles, (tiles != 0).any(dim=(1, 3)))

    @classmethod
    def from_dense_block_mask(cls, tensor: torch.Tensor, block_mask: torch.Tensor, block_shape: Sequence[int] | int) -> "BlockSparseTensor":
        """Keep exactly the blocks where ``block_mask`` ``[MB, KB]`` is True."""
        bh, bw = _block_shape(block_shape)
        padded = cls._pad(tensor, bh, bw)
        tiles = padded.reshape(padded.shape[0] // bh, bh, padded.shape[1] // bw, bw)
        if tuple(block_mask.shape) != (tiles.shape[0], tiles.shape[2]):
            raise ValueError(f"block_mask must be {(tiles.shape[0], tiles.shape[2])}, got {tuple(block_mask.shape)}")
        return cls._from_tiles(tensor, tiles, block_mask.to(device=tensor.device, dtype=torch.bool))

    @staticmethod
    def _pad(tensor: torch.Tensor, bh: int, bw: int, stored: bool = True) -> torch.Tensor:
        """``tensor`` zero-padded to whole blocks; ``stored``: it becomes this layout's values (a float
        dtype the kernels take), else it is only read at the stored positions (``gather``: a bool
        mask or an int operand of ``W.mul_(mask)`` too)."""
        check_tensor(tensor, "tensor", where="BlockSparseTensor")
        if tensor.dim() != 2:
            raise ValueError(f"BlockSparseTensor is 2-D [rows, cols]; got a {tensor.dim()}-D tensor")
        if stored and tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"BlockSparseTensor supports {', '.join(str(d) for d in SUPPORTED_DTYPES)}; got {tensor.dtype}")
        m, k = tensor.shape
        padded = tensor.detach().new_zeros((m + (-m) % bh, k + (-k) % bw))
        padded[:m, :k] = tensor.detach()
        return padded

    @classmethod
    def _from_tiles(cls, tensor: torch.Tensor, tiles: torch.Tensor, keep: torch.Tensor) -> "BlockSparseTensor":
        rows, cols = keep.nonzero(as_tuple=True)  # row-major: columns sorted per row
        counts = torch.bincount(rows, minlength=keep.shape[0])
        crow = torch.zeros(keep.shape[0] + 1, dtype=torch.int32, device=tensor.device)
        crow[1:] = torch.cumsum(counts, 0)
        blocks = tiles.permute(0, 2, 1, 3)[rows, cols].contiguous()
        return cls(crow, cols.to(torch.int32), blocks, tensor.shape)

    # -- dense ----------------------------------------------------------------------------
    def to_dense(self) -> torch.Tensor:
        bh, bw = self.block_shape
        mb, kb = self.grid
        tiles = torch.zeros(mb, kb, bh, bw, dtype=self.dtype, device=self.device)
        tiles[self.block_rows().long(), self.col.long()] = self.blocks
        dense = tiles.permute(0, 2, 1, 3).reshape(mb * bh, kb * bw)
        # contiguous: a padded grid cut to the logical shape would be a strided view, and a
        # dense tensor's strides are visible (``view``, ``as_strided``) to the ops run on it
        return dense[: self._shape[0], : self._shape[1]].contiguous()

    def block_mask(self) -> torch.Tensor:
        mb, kb = self.grid
        mask = torch.zeros(mb, kb, dtype=torch.bool, device=self.device)
        mask[self.block_rows().long(), self.col.long()] = True
        return mask

    def block_rows(self) -> torch.Tensor:
        """Block-row index of every stored block (int32)."""
        counts = (self.crow[1:] - self.crow[:-1]).long()
        return torch.repeat_interleave(torch.arange(len(counts), device=self.device, dtype=torch.int32), counts)

    # -- metadata ---------------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks.dtype

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @property
    def block_shape(self) -> tuple[int, int]:
        return int(self.blocks.shape[1]), int(self.blocks.shape[2])

    @property
    def grid(self) -> tuple[int, int]:
        bh, bw = self.block_shape
        return -(-self._shape[0] // bh), -(-self._shape[1] // bw)

    @property
    def num_blocks(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def nnz(self) -> int:
        """Stored positions of the tensor: the blocks' positions inside its shape (a 10x12 weight in
        8x8 blocks stores at most 120, not the 128 of its padded blocks)."""
        bh, bw = self.block_shape
        rows, cols = self._shape[0], self._shape[1]
        if (rows % bh == 0 and cols % bw == 0) or self.blocks.device.type == "meta" or torch.compiler.is_compiling():
            return self.blocks.numel()   # (no padding, or no index values to read: padding included)
        per_row = (self.crow[1:] - self.crow[:-1]).to(torch.int64)
        heights = (rows - torch.arange(per_row.numel(), device=per_row.device) * bh).clamp(max=bh)
        widths = (cols - self.col.to(torch.int64) * bw).clamp(max=bw)
        return int((heights.repeat_interleave(per_row) * widths).sum())

    @property
    def density(self) -> float:
        mb, kb = self.grid
        return self.num_blocks / max(1, mb * kb)

    # -- stored-values protocol --------------------------------------------------------------
    def values(self) -> torch.Tensor:
        return self.blocks

    def with_values(self, values: torch.Tensor) -> "BlockSparseTensor":
        if values.shape != self.blocks.shape:
            raise ValueError(f"values must have shape {tuple(self.blocks.shape)}, got {tuple(values.shape)}")
        return BlockSparseTensor(self.crow, self.col, values, self._shape)

    def gather(self, dense: torch.Tensor) -> torch.Tensor:
        if tuple(dense.shape) != tuple(self._shape):
            raise ValueError(f"gather expects shape {tuple(self._shape)}, got {tuple(dense.shape)}")
        bh, bw = self.block_shape
        padded = self._pad(dense, bh, bw, stored=False)
        tiles = padded.reshape(padded.shape[0] // bh, bh, padded.shape[1] // bw, bw).permute(0, 2, 1, 3)
        return tiles[self.block_rows().long(), self.col.long()].contiguous()

    def same_pattern(self, other: Any) -> bool:
        return (
            isinstance(other, BlockSparseTensor)
            and other._shape == self._shape
            and other.block_shape == self.block_shape
            and bool(torch.equal(other.crow, self.crow))
            and bool(torch.equal(other.col, self.col))
        )

    # -- saving: torch.save / torch.load(weights_only=True) ------------------------------------
    def state_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(crow, col, blocks)``: plain tensors that ``from_state_tensors`` rebuilds it from."""
        return (self.crow, self.col, self.blocks)

    @classmethod
    def from_state_tensors(cls, tensors: tuple, shape: tuple) -> "BlockSparseTensor":
        crow, col, blocks = tensors
        layout = cls(crow, col, blocks, shape)
        layout._check_indices()
        return layout

    def _check_indices(self) -> None:
        """Saved block indices must be a valid BSR structure (a damaged checkpoint fails on load)."""
        if self.crow.device.type == "meta":
            return
        nnzb, bw = self.blocks.shape[0], self.blocks.shape[2]
        block_cols = -(-self._shape[1] // bw)
        crow, col = self.crow.long(), self.col.long()
        steps = crow.diff()
        if crow.numel() and (int(crow[0]) != 0 or int(crow[-1]) != nnzb or bool((steps < 0).any())):
            raise ValueError(f"BlockSparseTensor: crow must rise from 0 to the {nnzb} blocks, got {crow.tolist()[:8]}...")
        if col.numel() and (int(col.min()) < 0 or int(col.max()) >= block_cols):
            raise ValueError(f"BlockSparseTensor: col must be block columns in [0, {block_cols}), "
                             f"got values in [{int(col.min())}, {int(col.max())}]")

    # -- helpers -------------------------------------------------------------------------------
    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "BlockSparseTensor":
        return BlockSparseTensor(self.crow.to(device), self.col.to(device), self.blocks.to(device=device, dtype=dtype), self._shape)

    def transposed(self) -> "BlockSparseTensor":
        """The transpose as a BSR of ``(bw, bh)`` blocks (cached; used for input gradients)."""
        key = ("t", self.blocks.data_ptr(), self.blocks._version)
        hit = self._cache.get(key)
        if hit is None:
            rows = self.block_rows().long()
            cols = self.col.long()
            order = torch.argsort(cols * self.grid[0] + rows)
            kb = self.grid[1]
            counts = torch.bincount(cols, minlength=kb)
            crow = torch.zeros(kb + 1, dtype=torch.int32, device=self.device)
            crow[1:] = torch.cumsum(counts, 0)
            blocks = self.blocks[order].transpose(1, 2).contiguous()
            hit = BlockSparseTensor(crow, rows[order].to(torch.int32), blocks, (self._shape[1], self._shape[0]))
            self._cache = {key: hit}
        return hit

    def to_torch_bsr(self) -> torch.Tensor:
        """torch's ``sparse_bsr`` tensor of the padded matrix (for ``bsr_dense_mm``)."""
        bh, bw = self.block_shape
        mb, kb = self.grid
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*BSR tensor support is in beta.*")
            return torch.sparse_bsr_tensor(self.crow, self.col, self.blocks, size=(mb * bh, kb * bw), check_invariants=False)

    def __repr__(self) -> str:
        return (
            f"BlockSparseTensor(shape={tuple(self._shape)}, block={self.block_shape}, blocks={self.num_blocks}, "
            f"density={self.density:.3f}, dtype={self.dtype}, device={self.device})"
        )
