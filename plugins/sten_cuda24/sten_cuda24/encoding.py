"""2:4 metadata encoding in plain torch ops (runs on CPU and GPU).

A row of ``K`` values is cut into groups of 4. Each group stores two values
(``values[..., 2*g]`` and ``values[..., 2*g + 1]``) and a 4-bit code
``idx0 | idx1 << 2`` saying where they came from (``idx0 < idx1``). Four codes
are packed into one ``int16`` (group ``4*w + j`` in bits ``4*j .. 4*j+3``), so
the *plain* metadata of a ``[R, K]`` matrix is ``[R, K // 16]`` ``int16``.

Groups with fewer than two nonzeros store zeros at the positions CUTLASS
chooses (the table in ``torch.sparse._semi_structured_conversions``), so the
plain metadata is bit-identical to CUTLASS's metadata before its interleaved
reordering. ``cutlass_reorder`` / ``cutlass_unreorder`` convert between the
two (``ColumnMajorInterleaved<2>`` with 32-row groups for ``int16`` metadata).

Example:
    >>> import torch
    >>> x = torch.tensor([[0., 3., 0., -1.] * 4])
    >>> values, meta = compress(x)
    >>> values[0, :2], hex(int(meta[0, 0]) & 0xFFFF)
    (tensor([ 3., -1.]), '0xdddd')
    >>> bool((decompress(values, meta, 16) == x).all())
    True
"""

from __future__ import annotations

import torch

GROUP = 4
GROUPS_PER_WORD = 4
WORD = GROUP * GROUPS_PER_WORD  # 16 logical columns per int16 metadata word


def as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as ``[R, K]``: ``R`` the product of the leading dims, ``K`` the last.

    Unlike ``reshape(-1, K)`` this also holds for empty tensors (``K == 0``, or no rows).
    """
    rows = 1
    for d in tensor.shape[:-1]:
        rows *= d
    return tensor.reshape(rows, tensor.shape[-1])
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Nonzero-mask of a group (bit i = position i is nonzero) -> (idx0, idx1).
# Exactly-two masks are unique; the others follow CUTLASS's choice.
_PAIR_OF_MASK = {
    0b0000: (2, 3), 0b0001: (0, 2), 0b0010: (1, 2), 0b0011: (0, 1),
    0b0100: (2, 3), 0b0101: (0, 2), 0b0110: (1, 2), 0b0111: (0, 1),
    0b1000: (2, 3), 0b1001: (0, 3), 0b1010: (1, 3), 0b1011: (0, 1),
    0b1100: (2, 3), 0b1101: (0, 3), 0b1110: (1, 3), 0b1111: (0, 1),
}
_CODE_OF_MASK = [i0 | (i1 << 2) for i0, i1 in (_PAIR_OF_MASK[m] for m in range(16))]
_POPCOUNT = [bin(m).count("1") for m in range(16)]


def padded_k(k: int) -> int:
    """The stored row length: ``k`` rounded up to a multiple of 16."""
    return -(-k // WORD) * WORD


def check_dtype(dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise TypeError(f"2:4 layouts support dtypes {names}; got {str(dtype).replace('torch.', '')}")


def _to_int16(words: torch.Tensor) -> torch.Tensor:
    """int32 values in [0, 65536) -> int16 with the same bits."""
    return torch.where(words >= 32768, words - 65536, words).to(torch.int16)


def group_codes(rows: torch.Tensor, *, strict: bool = True) -> torch.Tensor:
    """The 4-bit code of every group of a 2-D ``[R, Kp]`` tensor (``Kp % 4 == 0``).

    ``strict`` raises ``ValueError`` when a group has more than two nonzeros.
    """
    r, kp = rows.shape
    nz = (rows.reshape(r, kp // GROUP, GROUP) != 0).to(torch.int64)
    mask = nz[..., 0] | (nz[..., 1] << 1) | (nz[..., 2] << 2) | (nz[..., 3] << 3)
    if strict and mask.numel():
        counts = torch.tensor(_POPCOUNT, device=rows.device)[mask]
        bad = counts > 2
        if bool(bad.any()):
            row, grp = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"tensor is not 2:4 sparse: group of 4 at row {row}, columns {4 * grp}..{4 * grp + 3} "
                f"has {int(counts[row, grp])} nonzeros (at most 2 allowed); prune it first with "
                "Sparse24Sparsifier() or PerBlockFractionSparsifier(2, 4)"
            )
    return torch.tensor(_CODE_OF_MASK, device=rows.device)[mask]


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """``[R, G]`` 4-bit codes (``G % 4 == 0``) -> ``[R, G // 4]`` int16 words."""
    r, g = codes.shape
    c = codes.reshape(r, g // GROUPS_PER_WORD, GROUPS_PER_WORD).to(torch.int32)
    words = c[..., 0] | (c[..., 1] << 4) | (c[..., 2] << 8) | (c[..., 3] << 12)
    return _to_int16(words)


def unpack_codes(meta: torch.Tensor) -> torch.Tensor:
    """``[R, W]`` int16 words -> ``[R, 4 * W]`` 4-bit codes (int64)."""
    words = meta.to(torch.int64) & 0xFFFF
    shifts = torch.arange(0, 16, 4, device=meta.device)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).reshape(meta.shape[0], 4 * meta.shape[1])


def compress(dense: torch.Tensor, *, strict: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress a 2:4-sparse ``[R, K]`` tensor into ``(values [R, Kp/2], meta [R, Kp/16])``.

    ``K`` is zero-padded to ``Kp = padded_k(K)``. ``strict=False`` keeps the two
    positions CUTLASS picks in groups with more than two nonzeros.
    """
    if dense.dim() != 2:
        raise ValueError(f"compress expects a 2-D tensor [rows, K], got {dense.dim()}-D")
    check_dtype(dense.dtype)
    r, k = dense.shape
    kp = padded_k(k)
    rows = torch.nn.functional.pad(dense, (0, kp - k)) if kp != k else dense
    codes = group_codes(rows, strict=strict)
    return gather_codes(rows, codes), pack_codes(codes)


def gather_codes(rows: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Values of ``rows`` ``[R, Kp]`` at the positions named by ``codes`` ``[R, Kp/4]``."""
    r, kp = rows.shape
    groups = rows.reshape(r, kp // GROUP, GROUP)
    idx = torch.stack((codes & 3, codes >> 2), dim=-1)
    return groups.gather(-1, idx).reshape(r, kp // 2)


def decompress(values: torch.Tensor, meta: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """Inverse of ``compress``: ``[R, Kp]`` dense, cut to ``k`` columns if given."""
    r, half = values.shape
    kp = half * 2
    if meta.shape != (r, kp // WORD):
        raise ValueError(f"meta shape {tuple(meta.shape)} does not match values {tuple(values.shape)}: expected {(r, kp // WORD)}")
    codes = unpack_codes(meta)
    idx = torch.stack((codes & 3, codes >> 2), dim=-1)
    out = torch.zeros(r, kp // GROUP, GROUP, dtype=values.dtype, device=values.device)
    out.scatter_(-1, idx, values.reshape(r, kp // GROUP, 2))
    out = out.reshape(r, kp)
    return out if k is None or k == kp else out[:, :k]


def check_meta(meta: torch.Tensor, name: str = "meta") -> None:
    """Refuse metadata whose codes do not name two distinct positions per group, in increasing order
    (a damaged checkpoint: code 0 names position 0 twice, and ``to_dense`` then lost a stored value).

    >>> check_meta(torch.zeros(1, 1, dtype=torch.int16))
    Traceback (most recent call last):
    ...
    ValueError: meta: group 0 of row 0 names positions 0 and 0 (each group stores two distinct positions of four, in increasing order): the metadata is damaged
    """
    if meta.device.type == "meta" or torch.compiler.is_compiling():
        return   # (no values to read)
    codes = unpack_codes(meta)
    bad = (codes & 3) >= (codes >> 2)
    if bool(bad.any()):
        row, group = (int(i) for i in bad.nonzero()[0])
        code = int(codes[row, group])
        raise ValueError(f"{name}: group {group} of row {row} names positions {code & 3} and {code >> 2} (each group "
                         "stores two distinct positions of four, in increasing order): the metadata is damaged")


def keep_mask(meta: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """Boolean ``[R, Kp]`` mask of the stored positions."""
    codes = unpack_codes(meta)
    r, g = codes.shape
    idx = torch.stack((codes & 3, codes >> 2), dim=-1)
    out = torch.zeros(r, g, GROUP, dtype=torch.bool, device=meta.device)
    out.scatter_(-1, idx, True)
    out = out.reshape(r, g * GROUP)
    return out if k is None else out[:, :k]


def slot_positions(meta: torch.Tensor) -> torch.Tensor:
    """Column (in ``[0, Kp)``) of every stored slot: ``[R, Kp/2]`` int64."""
    codes = unpack_codes(meta)
    r, g = codes.shape
    base = torch.arange(0, g * GROUP, GROUP, device=meta.device).unsqueeze(0)
    return torch.stack((base + (codes & 3), base + (codes >> 2)), dim=-1).reshape(r, g * 2)


def live_slots(meta: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Which stored slots of ``meta`` lie inside ``mask`` (``[R, K]`` bool, K <= Kp): ``[R, Kp/2]`` bool.

    Slots outside the mask are CUTLASS fillers (groups with fewer than two kept
    values); they hold zeros and are never trained.
    """
    r, words = meta.shape
    kp = words * WORD
    rows = torch.nn.functional.pad(mask.to(device=meta.device, dtype=torch.bool), (0, kp - mask.shape[1]))
    return rows.gather(1, slot_positions(meta))


def slot_mask(meta: torch.Tensor, live: torch.Tensor | None, k: int | None = None) -> torch.Tensor:
    """Boolean ``[R, Kp]`` mask of the live slots (all slots when ``live`` is None)."""
    if live is None:
        return keep_mask(meta, k)
    r, words = meta.shape
    out = torch.zeros(r, words * WORD, dtype=torch.bool, device=meta.device)
    out.scatter_(1, slot_positions(meta), live)
    return out if k is None else out[:, :k]


# -- CUTLASS interleaved metadata --------------------------------------------------

def cutlass_meta_offsets(rows: int, words: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Flat position in CUTLASS's reordered ``int16`` metadata of every plain word.

    CUTLASS keeps sparse-GEMM metadata in ``ColumnMajorInterleaved<2>``: rows
    are regrouped in blocks of 32 (row ``8*a + b`` of a block goes to
    ``4*b + a``), 2x2 word blocks are transposed, and pairs of columns are
    stored column-major. ``rows`` must be a multiple of 32.
    """
    if rows % 32:
        raise ValueError(f"CUTLASS metadata needs rows divisible by 32, got {rows}")
    r = torch.arange(rows, device=device).unsqueeze(1).expand(rows, words)
    c = torch.arange(words, device=device).unsqueeze(0).expand(rows, words)
    r = (r // 32) * 32 + (r % 8) * 4 + (r % 32) // 8
    swap = (r % 2 == 0) & (c % 2 == 1)
    back = (r % 2 == 1) & (c % 2 == 0)
    shift = swap.to(torch.int64) - back.to(torch.int64)
    r, c = r + shift, c - shift
    return ((c // 2) * rows * 2 + r * 2 + c % 2).reshape(-1)


def cutlass_reorder(meta: torch.Tensor) -> torch.Tensor:
    """Plain ``[R, W]`` metadata -> CUTLASS's reordered metadata (same shape)."""
    rows, words = meta.shape
    out = torch.empty(rows * words, dtype=meta.dtype, device=meta.device)
    out[cutlass_meta_offsets(rows, words, meta.device)] = meta.reshape(-1)
    return out.view(rows, words)


def cutlass_unreorder(meta_reordered: torch.Tensor) -> torch.Tensor:
    """CUTLASS's reordered metadata -> plain ``[R, W]`` metadata."""
    rows, words = meta_reordered.shape
    offsets = cutlass_meta_offsets(rows, words, meta_reordered.device)
    return meta_reordered.reshape(-1)[offsets].view(rows, words)


def to_cutlass(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our encoder in CUTLASS's format (fp16/bf16): ``(packed, meta_reordered)``.

    Equal to ``sparse_semi_structured_from_dense_cutlass(dense)`` for rows % 32 == 0
    and ``K % 16 == 0``.
    """
    if dense.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"to_cutlass supports float16/bfloat16 (fp32 is 1:2 in CUTLASS); got {dense.dtype}")
    values, meta = compress(dense, strict=False)
    return values, cutlass_reorder(meta)


def from_cutlass(packed: torch.Tensor, meta_reordered: torch.Tensor) -> torch.Tensor:
    """Dense tensor from CUTLASS's ``(packed, meta_reordered)`` (fp16/bf16)."""
    return decompress(packed, cutlass_unreorder(meta_reordered))


# -- transposable (2:4 along rows and columns) masks ------------------------------------

def transposable_mask(dense: torch.Tensor) -> torch.Tensor:
    """Greedy 4x4-tile magnitude mask that is 2:4 along rows *and* columns.

    In each 4x4 tile, values are visited from the largest magnitude down and
    kept while their row and column have fewer than two kept values (ties: the
    lower flat index first). Shapes are zero-padded to multiples of 4.
    """
    if dense.dim() != 2:
        raise ValueError(f"transposable_mask expects a 2-D tensor, got {dense.dim()}-D")
    r, k = dense.shape
    rp, kp = -(-r // 4) * 4, -(-k // 4) * 4
    a = torch.nn.functional.pad(_magnitude(dense), (0, kp - k, 0, rp - r))
    tiles = a.reshape(rp // 4, 4, kp // 4, 4).permute(0, 2, 1, 3).reshape(-1, 16)
    order = torch.sort(-tiles, dim=1, stable=True).indices
    t = tiles.shape[0]
    keep = torch.zeros(t, 16, dtype=torch.bool, device=dense.device)
    row_n = torch.zeros(t, 4, dtype=torch.int64, device=dense.device)
    col_n = torch.zeros(t, 4, dtype=torch.int64, device=dense.device)
    ar = torch.arange(t, device=dense.device)
    for step in range(16):
        pos = order[:, step]
        i, j = pos // 4, pos % 4
        ok = (row_n[ar, i] < 2) & (col_n[ar, j] < 2)
        keep[ar, pos] = ok
        row_n[ar, i] += ok
        col_n[ar, j] += ok
    mask = keep.reshape(rp // 4, kp // 4, 4, 4).permute(0, 2, 1, 3).reshape(rp, kp)
    return mask[:r, :k].contiguous()


def _magnitude(dense: torch.Tensor) -> torch.Tensor:
    """``|dense|`` in float32 with NaN as the largest magnitude (as sten_nm's n:m masks):
    compared as NaN, it would beat nothing and be beaten by nothing, and a group
    holding one would keep three values."""
    a = dense.detach().abs().float()
    return a.masked_fill(a.isnan(), float("inf"))


def row_mask(dense: torch.Tensor) -> torch.Tensor:
    """2:4 magnitude mask along the last dim: the two largest |x| of each group of 4
    (ties: the lower index; NaN counts as largest), the reference of the sparsifier kernels."""
    shape = dense.shape
    k = shape[-1]
    kp = -(-k // 4) * 4
    a = torch.nn.functional.pad(as_rows(_magnitude(dense)), (0, kp - k), value=-1.0)
    g = a.reshape(a.shape[0], kp // 4, 4)
    # rank_i = #{j : |x_j| > |x_i| or (|x_j| == |x_i| and j < i)}
    gi, gj = g.unsqueeze(-1), g.unsqueeze(-2)
    lower = torch.tril(torch.ones(4, 4, dtype=torch.bool, device=dense.device), diagonal=-1)
    beats = (gj > gi) | ((gj == gi) & lower)
    rank = beats.sum(-1)
    return (rank < 2).reshape(a.shape[0], kp)[:, :k].reshape(shape)


# -- fp32 (CUTLASS treats fp32 as 1:2 on pairs) ---------------------------------------------

def is_one_of_two(dense: torch.Tensor) -> bool:
    """Whether every pair of consecutive values along the last dim has at most one nonzero."""
    k = dense.shape[-1]
    rows = torch.nn.functional.pad(as_rows(dense), (0, k % 2))
    return bool(((rows.reshape(rows.shape[0], rows.shape[1] // 2, 2) != 0).sum(-1) <= 1).all())


def fp32_to_cutlass(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A 1:2-sparse fp32 ``[R, K]`` tensor -> CUTLASS ``(packed [R, K/2], meta_reordered [R, K/8])``.

    CUTLASS encodes an fp32 pair as four 16-bit halves: the first value kept is
    ``0b0100``, the second ``0b1110``; four pairs per int16 word.
    """
    if dense.dtype != torch.float32 or dense.dim() != 2:
        raise TypeError(f"fp32_to_cutlass expects a 2-D float32 tensor, got {dense.dim()}-D {dense.dtype}")
    r, k = dense.shape
    if k % 8:
        raise ValueError(f"fp32 CUTLASS operands need K divisible by 8, got {k}")
    if not is_one_of_two(dense):
        raise ValueError("fp32 2:4 on CUTLASS needs a 1:2 pattern (one nonzero per pair of values)")
    pairs = dense.reshape(r, k // 2, 2)
    first = pairs[..., 0] != 0
    packed = torch.where(first, pairs[..., 0], pairs[..., 1])
    codes = torch.where(first, 0b0100, 0b1110)
    return packed, cutlass_reorder(pack_codes(codes))
