"""Pure-torch n:m compression, used where the C extension is unavailable (no compiler,
failed load), so that the layouts still build and convert; the products then run through
STen's dense fallback. Same result as the C ``nm_compress_f32`` (tests compare them).

Example:
    >>> import torch
    >>> from sten_nm._portable import compress
    >>> vals, idx = compress(torch.tensor([[1., -4., 2., 3.]]), 2, 4)
    >>> vals.tolist(), idx.tolist()
    ([[-4.0, 3.0]], [[13]])
"""

from __future__ import annotations

from typing import Optional

import torch


def _index_bits(m: int) -> int:
    return max(1, (m - 1).bit_length())


def pack_offsets(offs: torch.Tensor, m: int) -> torch.Tensor:
    """Pack in-group offsets ``[R, S]`` into int32 words ``[R, ceil(S / per)]``, low bits first."""
    bits = _index_bits(m)
    per = 32 // bits
    R, S = offs.shape
    iw = -(-S // per)
    padded = torch.zeros((R, iw * per), dtype=torch.int64)
    padded[:, :S] = offs
    shifts = bits * torch.arange(per, dtype=torch.int64)
    words = (padded.reshape(R, iw, per) << shifts).sum(-1)      # disjoint bits: sum == or
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def compress(D: torch.Tensor, n: int, m: int, mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Values ``[R, G*n]`` (float32) and packed offsets of the ``n`` largest magnitudes of
    every ``m`` (ties: lower index; NaN largest), or of the positions where ``mask`` is set
    (at most ``n`` per group); unused slots take the lowest free offsets and hold 0."""
    D = D.float()
    R, C = D.shape
    G = -(-C // m)
    Cp = G * m
    if mask is not None:
        keyed = torch.zeros((R, Cp))
        keyed[:, :C] = (mask != 0).float()
        if bool((keyed.reshape(R, G, m).sum(-1) > n).any()):
            raise ValueError("nm_compress: the mask keeps more than n of some group of m")
        kept = keyed.reshape(R, G, m)
    else:
        mag = D.abs()
        mag = torch.where(torch.isnan(mag), torch.full_like(mag, float("inf")), mag)
        keyed = torch.full((R, Cp), -1.0)
        keyed[:, :C] = mag
        kept = None
    order = torch.sort(keyed.reshape(R, G, m), dim=-1, descending=True, stable=True).indices[..., :n]
    offs = order.sort(dim=-1).values                                  # [R, G, n], increasing
    cols = offs + (torch.arange(G) * m)[None, :, None]
    src = torch.zeros((R, Cp))
    src[:, :C] = D
    vals = torch.gather(src.reshape(R, Cp), 1, cols.reshape(R, G * n))
    if kept is not None:   # fill slots (outside the mask) hold 0
        vals = torch.where(torch.gather(kept.reshape(R, Cp), 1, cols.reshape(R, G * n)) != 0, vals, 0.0)
    return vals, pack_offsets(offs.reshape(R, G * n), m)
