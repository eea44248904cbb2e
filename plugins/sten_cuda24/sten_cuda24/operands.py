"""GPU matmul operands built from a ``Sparse24Tensor``'s own values and metadata,
and refreshed in place after an optimizer step (pure tensor code: runs on CPU).

The stored values of a 2:4 weight are the same numbers in every backend's
operand, only permuted; the metadata depends on the pattern alone. So when an
optimizer step changes the values (same pattern), the operand is refreshed by
copying the values into it, without densifying or compressing:

- CUTLASS fp16/bf16: ``packed`` *is* our ``[R, Kp/2]`` values (padded to the
  backend's alignment: a view when no padding is needed, else one copy);
  metadata = our codes in CUTLASS's interleaved order (``encoding.cutlass_reorder``).
- CUTLASS fp32 (1:2 on pairs): the same values again, when every group's slots
  are one per pair; codes ``0b0100``/``0b1110`` per pair.
- cuSPARSELt: the compressed buffer's layout is not documented, so
  ``discover_positions`` finds where each value lands by compressing probe
  matrices whose values spell their own slot index, and checks the map on one
  more probe; a buffer that is not a permutation of the values is recompressed
  on every step instead (``Refresher.kind == "recompress"``).

Example:
    >>> import torch
    >>> from sten_cuda24 import encoding, sparsify_24
    >>> w = sparsify_24(torch.randn(32, 64, dtype=torch.float16))
    >>> packed, meta = padded_values(w, 32, 64), padded_meta(w, 32, 64)
    >>> bool((encoding.decompress(packed, meta) == w.to_dense()).all())
    True
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from . import encoding
from .sparse24 import Sparse24Tensor

EMPTY_CODE = {"cutlass": 0xE, "fp32": 0x8}  # (2, 3) like CUTLASS for empty groups; (0, 2) for 1:2
PROBE_BASE = {torch.float16: 1024, torch.bfloat16: 128, torch.float32: 1 << 22}  # probe values 2..base+1 are exact


def _word(code: int) -> int:
    w = code | code << 4 | code << 8 | code << 12
    return w - 65536 if w >= 32768 else w


def padded_values(w: Sparse24Tensor, n_pad: int, k_pad: int) -> torch.Tensor:
    """``w``'s values ``[n_pad, k_pad/2]`` (zeros in the padding); ``w.packed`` itself when no padding is needed."""
    r, half = w.packed.shape
    if (r, half) == (n_pad, k_pad // 2):
        return w.packed
    return F.pad(w.packed, (0, k_pad // 2 - half, 0, n_pad - r))


def padded_meta(w: Sparse24Tensor, n_pad: int, k_pad: int, empty_code: int = EMPTY_CODE["cutlass"]) -> torch.Tensor:
    """``w``'s plain metadata ``[n_pad, k_pad/16]``; groups wholly in the padding get ``empty_code``."""
    r, words = w.meta.shape
    meta = F.pad(w.meta, (0, k_pad // encoding.WORD - words, 0, n_pad - r), value=_word(empty_code))
    k = w.shape[-1]
    first_pad_group = -(-k // encoding.GROUP)
    if first_pad_group < words * encoding.GROUPS_PER_WORD:
        codes = encoding.unpack_codes(meta)
        codes[:, first_pad_group:] = empty_code
        meta = encoding.pack_codes(codes)
    return meta


def fp32_codes_ok(meta: torch.Tensor) -> bool:
    """Whether every group's two slots are one per pair (CUTLASS's fp32 1:2 layout)."""
    codes = encoding.unpack_codes(meta)
    return bool((((codes & 3) < 2) & ((codes >> 2) >= 2)).all())


def fp32_meta(meta: torch.Tensor) -> torch.Tensor:
    """Plain 2:4 metadata whose slots are one per pair -> CUTLASS fp32 metadata (reordered)."""
    codes = encoding.unpack_codes(meta)
    first = torch.stack(((codes & 3) == 0, (codes >> 2) == 2), dim=-1).reshape(codes.shape[0], 2 * codes.shape[1])
    return encoding.cutlass_reorder(encoding.pack_codes(torch.where(first, 0b0100, 0b1110)))


def _bits(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    flat = t.reshape(-1)
    if flat.dtype != dtype:
        flat = flat.view(torch.uint8).view(dtype)
    return flat.view(torch.int32 if dtype == torch.float32 else torch.int16)


def discover_positions(
    compress: Callable[[torch.Tensor], torch.Tensor], meta: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where ``compress`` puts each stored value, for the pattern ``meta`` ``[R, Kp/16]``.

    Returns ``(template, positions)``: ``template`` is the compressed buffer of
    the pattern (metadata in place), ``positions[i]`` the element of the buffer
    (viewed as ``dtype``) that holds value slot ``i`` (row-major over
    ``[R, Kp/2]``). ``None`` when the buffer is not a permutation of the values.
    """
    r, words = meta.shape
    nslots = r * words * encoding.WORD // 2
    base = PROBE_BASE[dtype]
    slot = torch.arange(nslots, device=meta.device)

    def probe(values: torch.Tensor) -> torch.Tensor:
        return compress(encoding.decompress(values.to(dtype).view(r, -1), meta).contiguous())

    template = probe(torch.ones(nslots, device=meta.device))
    ref = _bits(template, dtype)
    digits = max(1, math.ceil(math.log(max(nslots, 2)) / math.log(base)))
    found = None
    index = torch.zeros(nslots, dtype=torch.int64, device=meta.device)
    for d in range(digits):
        buf = probe((slot // base**d) % base + 2)
        changed = (_bits(buf, dtype) != ref).nonzero().squeeze(1)
        if found is None:
            found = changed
            if found.numel() != nslots:
                return None
        elif not torch.equal(changed, found):
            return None
        index += (_bits(buf, dtype)[found].view(dtype).to(torch.float64) - 2).round().to(torch.int64) * base**d
    if found is None or bool(((index < 0) | (index >= nslots)).any()) or bool((torch.bincount(index, minlength=nslots) != 1).any()):
        return None
    positions = torch.empty(nslots, dtype=torch.int64, device=meta.device)
    positions[index] = found
    check = ((slot * 7919) % (base - 1) + 2).to(dtype)
    built = template.reshape(-1).clone()
    _values_view(built, dtype)[positions] = check
    if not torch.equal(_bits(built, dtype), _bits(probe(check), dtype)):
        return None
    return template, positions


def _values_view(buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    flat = buffer.reshape(-1)
    return flat if flat.dtype == dtype else flat.view(torch.uint8).view(dtype)


class Refresher:
    """Keeps a compressed buffer equal to ``compress`` of a weight whose values change in place.

    ``kind``: ``"prefix"`` (values are the buffer's first elements, one copy),
    ``"scatter"`` (a fixed permutation, one indexed copy) or ``"recompress"``.
    """

    def __init__(self, compress: Callable[[torch.Tensor], torch.Tensor], meta: torch.Tensor, dtype: torch.dtype) -> None:
        self.compress, self.meta, self.dtype = compress, meta, dtype
        found = discover_positions(compress, meta, dtype)
        if found is None:
            self.kind, self.positions, self.buffer = "recompress", None, None
            return
        self.buffer, self.positions = found
        self.buffer = self.buffer.clone()   # keeps the compressed buffer's shape: torch's matmul wants it 2-D
        prefix = torch.arange(self.positions.numel(), device=self.positions.device)
        if torch.equal(self.positions, prefix):
            self.kind, self.positions = "prefix", None
        else:
            self.kind = "scatter"

    def refresh(self, values: torch.Tensor) -> torch.Tensor:
        """The compressed buffer for ``values`` ``[R, Kp/2]`` (updated in place unless recompressing)."""
        if self.kind == "recompress":
            return self.compress(encoding.decompress(values, self.meta).contiguous())
        view = _values_view(self.buffer, self.dtype)
        flat = values.reshape(-1)
        if self.kind == "prefix":
            view[: flat.numel()].copy_(flat)
        else:
            view[self.positions] = flat
        return self.buffer
