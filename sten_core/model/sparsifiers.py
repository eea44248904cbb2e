"""Sparsifiers: which output values are kept (paper §2, Table 1).

A sparsifier is a small object that carries its parameters and its *kind*
(``"streaming"``, ``"blocking"`` or ``"materializing"``). What it does for a
given input and output layout is an *implementation*, registered with
``register_sparsifier_implementation``. The built-in ones also know their dense
keep-mask (``mask``), so any layout with ``from_dense`` gets them for free.

Example:
    >>> import torch, sten_core as sten
    >>> x = torch.tensor([[1., -4., 2., 3.]])
    >>> sten.PerBlockFractionSparsifier(2, 4).mask(x)
    tensor([[False,  True, False,  True]])
"""

from __future__ import annotations

import math
import numbers
from typing import Any, ClassVar, Sequence

import torch

from sten_core.model.layouts import is_layout_object, type_name

STREAMING = "streaming"
BLOCKING = "blocking"
MATERIALIZING = "materializing"
KINDS = (STREAMING, BLOCKING, MATERIALIZING)


def _check_fraction(value: Any, name: str = "fraction") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number in [0, 1], got {type(value).__name__}")
    if not (0.0 <= float(value) <= 1.0) or math.isnan(value):
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return float(value)


def _check_block_shape(block_shape: Any) -> tuple[int, ...]:
    """``block_shape`` as a tuple of positive ints (one int is a 1-D block)."""
    if isinstance(block_shape, int) and not isinstance(block_shape, bool):
        block_shape = (block_shape,)
    if not isinstance(block_shape, (tuple, list, torch.Size)) or any(
            isinstance(b, bool) or not isinstance(b, int) for b in block_shape):
        raise TypeError(f"block_shape must be an int or a tuple of ints, got {block_shape!r}")
    block_shape = tuple(block_shape)
    if not block_shape or any(b < 1 for b in block_shape):
        raise ValueError(f"block_shape must be positive integers, got {block_shape}")
    return block_shape


def _check_tensor(tensor: Any, name: str = "tensor") -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    return tensor


#: Values that are never a sparsifier nor its class: a number or a string where a sparsifier
#: belongs (``0.9`` for ``ScalarFractionSparsifier(0.9)``), a tensor.
NOT_SPARSIFIERS = (numbers.Number, str, bytes, torch.Tensor)


class Sparsifier:
    """Base class of sparsifiers: parameters plus a kind.

    Subclasses that can decide from a dense tensor alone implement ``mask``.
    """

    kind: ClassVar[str] = MATERIALIZING
    #: Whether ``mask`` depends only on how magnitudes compare, never on their sums (a
    #: pruning schedule then hands it ranks, which keep every position pruned earlier below
    #: every kept one; other sparsifiers get the magnitudes with those positions zeroed).
    compares_only: ClassVar[bool] = False

    def params(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def mask(self, tensor: torch.Tensor) -> torch.Tensor:
        """Boolean keep-mask of a dense tensor."""
        raise NotImplementedError(f"{type(self).__name__} has no dense mask")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: Any) -> bool:
        return type(self) is type(other) and self.params() == other.params()

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted((k, repr(v)) for k, v in self.params().items()))))


class KeepAll(Sparsifier):
    """Keeps every produced value (the default for dense tensors)."""

    kind = STREAMING

    def mask(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(tensor, dtype=torch.bool)


class RandomFractionSparsifier(Sparsifier):
    """Drops each value with probability ``fraction`` (dropout-like)."""

    kind = STREAMING

    def __init__(self, fraction: float):
        self.fraction = _check_fraction(fraction)

    def mask(self, tensor: torch.Tensor) -> torch.Tensor:
        return random_keep_mask(tensor, self.fraction)


class ScalarThresholdSparsifier(Sparsifier):
    """Keeps values whose magnitude is at least ``threshold`` (ReLU-like)."""

    kind = STREAMING

    def __init__(self, threshold: float):
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
            raise TypeError(f"threshold must be a number, got {type(threshold).__name__}")
        if math.isnan(threshold):
            raise ValueError("threshold must be a number, not NaN (it would drop every value)")
        self.threshold = float(threshold)

    def mask(self, tensor: torch.Tensor) -> torch.Tensor:
        return magnitude(tensor) >= self.threshold


class ScalarFractionSparsifier(Sparsifier):
    """Magnitude pruning: drops the ``fraction`` of values of smallest magnitude.

    Exactly ``round(numel * (1 - fraction))`` values are kept (Python's ``round``:
    a half rounds to even, so 0.5 of 5 values keeps 2); among equal magnitudes at the
    threshold the earliest (row-major) are kept; NaN counts as the largest magnitude.

    >>> ScalarFractionSparsifier(0.5).mask(torch.tensor([1.0, float("nan"), -3.0, 2.0]))
    tensor([False,  True,  True, False])
    """

    kind = MATERIALIZING
    compares_only = True

    def __init__(self, fraction: float):
        self.fraction = _check_fraction(fraction)

    def mask(self, tensor: torch.Tensor) -> torch.Tensor:
        return fraction_keep_mask(tensor, self.fraction)


class BlockwiseFractionSparsifier(Sparsifier):
    """Drops the ``fraction`` of blocks with the smallest summed magnitude.

    ``block_shape`` tiles the last ``len(block_shape)`` dims; edge blocks are
    partial. Exactly ``round(num_blocks * (1 - fraction))`` blocks are kept (ties:
    the earliest block; a block holding NaN counts as the largest).
    """

    kind = MATERIALIZING

    def __init__(self, fraction: float, block_shape: Sequence[int]):
        self.fraction = _check_fraction(fraction)
        self.block_shape = _check_block_shape(block_shape)

    def mask(self, tensor: torch.Tensor) -> torch.Tensor:
        return block_keep_mask(tensor, self.fraction, self.block_shape)


class PerBlockFractionSparsifier(Sparsifier):
    """n:m sparsity: keeps the ``n`` largest magnitudes of every ``m``
    consecutive values along the last dimension (a short last group keeps
    ``min(n, size)``); ties keep the lower index, NaN counts as the largest.

    >>> PerBlockFractionSparsifier(2, 4).mask(torch.tensor([1.0, 1.0, 1.0, 1.0]))
    tensor([ True,  True, False, False])
    """

    kind = BLOCKING
    compares_only = True

    def __init__(self, n: int, m: int):
        for name, v in (("n", n), ("m", m)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if m < 1 or n < 0:
            raise ValueError(f"n and m must satisfy 0 <= n and 1 <= m, got n={n}, m={m}")
        if n > m:
            raise ValueError(f"n must be <= m, got n={n} > m={m}")
        self.n, self.m = n, m

    def mask(self, tensor: torch.Tensor) -> torch.Tensor:
        return nm_keep_mask(tensor, self.n, self.m)


class SameFormatSparsifier(Sparsifier):
    """Keeps the positions that the reference tensor ``ref`` stores, in its layout.

    ``ref_sp_ten`` is the original STen's name of ``ref``:

    >>> import sten_core as sten
    >>> w = sten.sparsify(sten.KeepAll(), torch.eye(2), sten.CsrTensor)
    >>> SameFormatSparsifier(w).ref_sp_ten is w
    True
    """

    kind = STREAMING

    def __init__(self, ref: Any = None, *, ref_sp_ten: Any = None):
        if (ref is None) == (ref_sp_ten is None):
            raise TypeError("SameFormatSparsifier takes one reference tensor: ref (or ref_sp_ten)")
        name, ref = ("ref", ref) if ref is not None else ("ref_sp_ten", ref_sp_ten)
        if not isinstance(ref, torch.Tensor) and not is_layout_object(ref):
            raise TypeError(f"SameFormatSparsifier: {name} must be the reference tensor (a sparse wrapper or a "
                            f"torch.Tensor) or a layout object, got {type_name(ref)}")
        self.ref = ref

    @property
    def ref_sp_ten(self) -> Any:
        """The reference tensor (the original STen's attribute name)."""
        return self.ref

    @ref_sp_ten.setter
    def ref_sp_ten(self, value: Any) -> None:
        self.ref = value

    def params(self) -> dict[str, Any]:
        return {"ref": type(getattr(self.ref, "wrapped_tensor", self.ref)).__name__}

    def __eq__(self, other: Any) -> bool:
        return type(self) is type(other) and self.ref is other.ref

    def __hash__(self) -> int:
        return id(self.ref)

    def mask(self, tensor: torch.Tensor) -> torch.Tensor:
        """The reference's stored positions (all of them for ``DenseTensor``;
        the nonzeros for a plain tensor or a layout without stored values)."""
        from sten_core.model.layouts import supports_values, to_dense_tensor

        ref = getattr(self.ref, "wrapped_tensor", self.ref)
        if isinstance(ref, torch.Tensor):
            return ref != 0
        if supports_values(ref):
            values = ref.values()
            return to_dense_tensor(ref.with_values(torch.ones_like(values))) != 0
        return to_dense_tensor(ref) != 0


# -- dense keep-masks -------------------------------------------------------

def random_keep_mask(tensor: torch.Tensor, fraction: float) -> torch.Tensor:
    """Keep each value with probability ``1 - fraction`` (one pass)."""
    return torch.rand(tensor.shape, device=tensor.device) >= fraction


def magnitude(tensor: torch.Tensor) -> torch.Tensor:
    """``|tensor|`` as the score magnitude sparsifiers rank by, exact in every dtype:
    integers and bools widened to int64 (``|-128|`` of an int8 is 128), NaN as the
    largest (``inf``: a NaN weight stays stored, where it shows, not pruned away).

    >>> magnitude(torch.tensor([-2.0, float("nan")]))
    tensor([2., inf])
    """
    t = tensor.detach()
    if not t.is_floating_point() and not t.is_complex():
        return t.to(torch.int64).abs()
    mag = t.abs()
    return torch.where(mag.isnan(), torch.full_like(mag, float("inf")), mag)


def _keep_top(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Boolean mask over a 1-D ``scores`` keeping exactly ``keep`` largest,
    ties at the threshold resolved by position (earliest first); NaN scores
    count as the largest."""
    numel = scores.numel()
    if keep <= 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    if keep >= numel:
        return torch.ones_like(scores, dtype=torch.bool)
    if scores.dtype == torch.bool:
        scores = scores.to(torch.int64)
    elif scores.is_floating_point():
        scores = torch.where(scores.isnan(), torch.full_like(scores, float("inf")), scores)
    threshold = torch.kthvalue(scores, numel - keep + 1).values
    above = scores > threshold
    ties = scores == threshold
    missing = keep - int(above.sum())
    return above | (ties & (torch.cumsum(ties, 0) <= missing))


def kept_count(total: int, fraction: float) -> int:
    """``round(total * (1 - fraction))`` of the exact product (a half rounds to even): binary floating
    point made ``10 * (1 - 0.95)`` 0.5000000000000004, which rounded to 1.

    >>> kept_count(10, 0.95), kept_count(15, 0.9), kept_count(15, 0.7), kept_count(4, 0.5)
    (0, 2, 4, 2)
    """
    return round(round(total * (1.0 - fraction), 9))


def fraction_keep_mask(tensor: torch.Tensor, fraction: float) -> torch.Tensor:
    """Keep the ``round(numel * (1 - fraction))`` largest magnitudes (``kept_count``)."""
    flat = magnitude(tensor).reshape(-1)
    keep = kept_count(flat.numel(), fraction)
    return _keep_top(flat, keep).view(tensor.shape)


def block_keep_mask(tensor: torch.Tensor, fraction: float, block_shape: Sequence[int]) -> torch.Tensor:
    """Keep the blocks of largest summed magnitude (see ``BlockwiseFractionSparsifier``)."""
    nb = len(block_shape)
    if tensor.dim() < nb:
        raise ValueError(f"tensor must have at least {nb} dims for block_shape {tuple(block_shape)}, got {tensor.dim()}")
    lead = tensor.shape[: tensor.dim() - nb]
    tail = tensor.shape[tensor.dim() - nb:]
    counts = [math.ceil(s / b) for s, b in zip(tail, block_shape)]
    pad = []
    for s, b, c in reversed(list(zip(tail, block_shape, counts))):
        pad += [0, c * b - s]
    mag = magnitude(tensor)
    if mag.is_floating_point() and mag.element_size() < 4:
        mag = mag.float()                       # half-precision sums would round
    padded = torch.nn.functional.pad(mag, pad)
    shape = list(lead)
    for c, b in zip(counts, block_shape):
        shape += [c, b]
    blocks = padded.reshape(shape)
    red_dims = tuple(len(lead) + 2 * i + 1 for i in range(nb))
    scores = blocks.sum(dim=red_dims)
    keep = kept_count(scores.numel(), fraction)
    block_mask = _keep_top(scores.reshape(-1), keep).view(scores.shape)
    for i, b in enumerate(block_shape):
        block_mask = block_mask.repeat_interleave(b, dim=len(lead) + i)
    index = tuple([slice(None)] * len(lead) + [slice(0, s) for s in tail])
    return block_mask[index].contiguous()


def nm_keep_mask(tensor: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Keep the ``n`` largest magnitudes of every ``m`` along the last dim (ties: the
    lower index; NaN counts as the largest)."""
    if tensor.dim() == 0:
        raise ValueError("tensor must have at least 1 dim for n:m sparsity")
    k = tensor.shape[-1]
    groups = math.ceil(k / m) if k else 0
    padded = torch.nn.functional.pad(magnitude(tensor), (0, groups * m - k), value=-1)
    grouped = padded.reshape(*tensor.shape[:-1], groups, m)
    mask = torch.zeros_like(grouped, dtype=torch.bool)
    if n > 0 and groups:
        idx = torch.sort(grouped, dim=-1, descending=True, stable=True).indices[..., :n]
        mask.scatter_(-1, idx, True)
    mask = mask.reshape(*tensor.shape[:-1], groups * m)[..., :k]
    return mask.contiguous()


# -- paper helpers ------------------------------------------------------------

def random_mask_sparsify(tensor: torch.Tensor, frac: float) -> torch.Tensor:
    """Zero each value with probability ``frac``; returns a dense tensor.

    >>> random_mask_sparsify(torch.ones(2, 2), frac=0.0)
    tensor([[1., 1.],
            [1., 1.]])
    """
    _check_tensor(tensor)
    frac = _check_fraction(frac, "frac")
    return tensor * random_keep_mask(tensor, frac)


def scalar_mask_sparsify(tensor: torch.Tensor, frac: float) -> torch.Tensor:
    """Zero the ``frac`` fraction of values with the smallest magnitude (the
    original STen's helper); returns a dense tensor.

    ``ceil(frac * numel)`` values are dropped, so the largest ``1 - frac``
    fraction by magnitude is kept; among equal magnitudes the earliest are kept.

    >>> scalar_mask_sparsify(torch.tensor([[1., -4., 2., 3.]]), frac=0.5)
    tensor([[ 0., -4.,  0.,  3.]])
    """
    _check_tensor(tensor)
    frac = _check_fraction(frac, "frac")
    flat = magnitude(tensor).reshape(-1)
    dropped = math.ceil(round(frac * flat.numel(), 9))  # round: 0.7 * 10 is 7.000000000000001
    keep = _keep_top(flat, flat.numel() - dropped).view(tensor.shape)
    return tensor * keep


BUILTIN_SPARSIFIERS = (
    KeepAll,
    RandomFractionSparsifier,
    ScalarThresholdSparsifier,
    ScalarFractionSparsifier,
    BlockwiseFractionSparsifier,
    PerBlockFractionSparsifier,
    SameFormatSparsifier,
)
