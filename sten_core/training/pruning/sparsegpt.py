"""``SparseGPTSparsifier``: one-shot pruning with reconstruction (Frantar & Alistarh 2023).

For a linear layer with weight ``W`` ``[rows, cols]`` and calibration inputs
``X`` ``[cols, N]``, SparseGPT looks for a sparse ``Ŵ`` with small
``‖WX − ŴX‖²``. It visits the columns left to right; when column ``j`` is
pruned, the error it causes is spread over the columns not yet visited with
the optimal-brain-surgeon update ``W[:, j:] -= (w_j − ŵ_j) / [H⁻¹]_jj · [H⁻¹]_{j, j:}``,
where ``H = 2XXᵀ/N`` (extra input ``hessian``) and ``H⁻¹`` is taken through
the upper Cholesky factor of its inverse. As in the paper's reference code:

* dampening: ``H + percdamp · mean(diag H) · I`` (``percdamp = 0.01``);
* lazy batch updates: columns in blocks of ``blocksize`` (128); the update of
  the columns after a block is one matrix product;
* adaptive mask selection: for unstructured sparsity the mask of each block is
  chosen when the block starts, by the saliency ``w² / [H⁻¹]_jj²`` of the
  already-updated weights (the lowest are pruned); for n:m, per group of ``m``
  columns when that group starts; for any other structured pattern given as a
  ``rule`` (:class:`ChunkRule`, e.g. sten_nm's grouped n:m), per chunk of the
  rule's ``width`` columns when that chunk starts.

The number pruned per block is chosen so that the whole weight keeps exactly
``round(rows · cols · (1 − fraction))``. Inputs never seen (``H_jj = 0``)
have their weights set to 0.

Example:
    >>> import torch, sten_core as sten
    >>> from sten_core.training.pruning import input_hessian
    >>> _ = torch.manual_seed(0); x = torch.randn(64, 8); w = torch.randn(4, 8)
    >>> sp = SparseGPTSparsifier(0.5).bind(hessian=input_hessian(x))
    >>> sparse = sten.sparsify(sp, w, sten.CsrTensor)
    >>> sparse.wrapped_tensor.nnz
    16
    >>> err = lambda v: float(((w - v) @ x.t()).norm())
    >>> err(sparse.to_dense()) < err(w * sten.ScalarFractionSparsifier(0.5).mask(w))
    True
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from sten_core.model.sparsifiers import kept_count
from sten_core.training.pruning.base import CalibratedSparsifier


def _upper_inverse_factor(hessian: torch.Tensor, percdamp: float) -> torch.Tensor:
    """The upper Cholesky factor of ``(H + damp·I)⁻¹``."""
    h = hessian.clone()
    damp = percdamp * torch.mean(torch.diag(h))
    h.diagonal().add_(damp)
    chol, info = torch.linalg.cholesky_ex(h)
    if int(info) != 0:
        raise ValueError(f"SparseGPT: the dampened Hessian is not positive definite (percdamp={percdamp}); "
                         "use a larger percdamp or more calibration data")
    inv = torch.cholesky_inverse(chol)
    upper, info = torch.linalg.cholesky_ex(inv, upper=True)
    if int(info) != 0:
        raise ValueError(f"SparseGPT: the inverse Hessian is not positive definite (percdamp={percdamp}); "
                         "use a larger percdamp or more calibration data")
    return upper


class ChunkRule(Protocol):
    """How SparseGPT chooses a structured mask: chunk by chunk of ``width`` columns
    (from column 0; the last may be narrower), when it reaches the chunk, from the
    saliency ``w² / [H⁻¹]_jj²`` of the already-updated weights. ``keep(saliency)``
    (``[rows, ≤ width]``) returns the bool keep-mask of that chunk."""

    width: int

    def keep(self, saliency: torch.Tensor) -> torch.Tensor: ...


class NMRule:
    """Keep ``n`` of every ``m`` columns of each row (a short last group keeps ``min(n, size)``).

    >>> NMRule(1, 2).keep(torch.tensor([[1., 2.], [4., 3.]])).tolist()
    [[False, True], [True, False]]
    """

    def __init__(self, n: int, m: int):
        self.n, self.width = n, m

    def keep(self, saliency: torch.Tensor) -> torch.Tensor:
        g = saliency.shape[1]
        pruned = torch.zeros_like(saliency, dtype=torch.bool)
        drop = g - min(self.n, g)
        if drop > 0:
            pruned.scatter_(1, torch.argsort(saliency, dim=1, stable=True)[:, :drop], True)
        return ~pruned


def sparsegpt(weight: torch.Tensor, hessian: torch.Tensor, *, fraction: float | None = None,
              n: int | None = None, m: int | None = None, percdamp: float = 0.01,
              blocksize: int = 128, rule: ChunkRule | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseGPT of one weight: ``(values, keep_mask)``, values in the weight's dtype.

    ``fraction``: unstructured sparsity; or ``n``/``m``: keep ``n`` of every ``m``
    along dim 1 (a short last group keeps ``min(n, size)``); or ``rule``: any
    structured pattern chosen chunk by chunk (:class:`ChunkRule`, e.g. sten_nm's
    column-grouped n:m). ``blocksize`` is rounded up to a multiple of the chunk
    width. The computation runs in float32 (float64 for a float64 weight).
    """
    rows, cols = weight.shape
    if hessian.shape != (cols, cols):
        raise ValueError(f"SparseGPT: hessian must be [{cols}, {cols}] (in_features²), got {tuple(hessian.shape)}")
    work = torch.float64 if weight.dtype == torch.float64 else torch.float32
    w = weight.detach().to(work).clone()
    h = hessian.detach().to(device=w.device, dtype=work).clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    hinv = _upper_inverse_factor(h, percdamp)
    del h

    if rule is None and n is not None:
        rule = NMRule(n, m)
    if rule is not None:
        width = rule.width
        blocksize = width * math.ceil(blocksize / width)  # whole chunks in every block
    elif fraction is None:
        raise TypeError("sparsegpt: give fraction, n and m, or rule")
    pruned = torch.zeros_like(w, dtype=torch.bool)
    total_pruned = 0 if rule is not None else rows * cols - kept_count(rows * cols, fraction)
    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        count = i2 - i1
        w1 = w[:, i1:i2].clone()
        q1 = torch.zeros_like(w1)
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        d1 = torch.diag(hinv1)
        mask1 = torch.zeros_like(w1, dtype=torch.bool)  # True: pruned
        if rule is None:
            # exact total: the pruned count up to this block's end follows round(fraction · seen)
            k = round(total_pruned * (rows * i2) / (rows * cols)) - round(total_pruned * (rows * i1) / (rows * cols))
            if k > 0:
                saliency = (w1.square() / d1.square().unsqueeze(0)).reshape(-1)
                order = torch.argsort(saliency, stable=True)
                mask1.view(-1)[order[:k]] = True
        for i in range(count):
            if rule is not None and i % width == 0:
                g = min(width, count - i)
                saliency = w1[:, i:i + g].square() / d1[i:i + g].square().unsqueeze(0)
                keep = rule.keep(saliency)
                if keep.shape != saliency.shape:
                    raise ValueError(f"sparsegpt: rule.keep returned shape {tuple(keep.shape)} for a chunk "
                                     f"{tuple(saliency.shape)}")
                mask1[:, i:i + g] = ~keep.to(device=mask1.device, dtype=torch.bool)
            col = w1[:, i]
            d = hinv1[i, i]
            q = col.masked_fill(mask1[:, i], 0.0)
            q1[:, i] = q
            err = (col - q) / d
            w1[:, i:] -= err.unsqueeze(1) * hinv1[i, i:].unsqueeze(0)
            err1[:, i] = err
        w[:, i1:i2] = q1
        pruned[:, i1:i2] = mask1
        if i2 < cols:
            w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    keep = ~pruned
    return (w * keep).to(weight.dtype), keep


class SparseGPTSparsifier(CalibratedSparsifier):
    """SparseGPT: prune and update the kept weights to reconstruct ``WX``.

    Args:
        fraction: unstructured sparsity (exactly ``round(numel · (1 − fraction))`` kept).
        n, m: instead, keep ``n`` of every ``m`` consecutive inputs of each row.
        percdamp: dampening, a fraction of the mean diagonal of ``H`` (0.01).
        blocksize: columns per lazy batch update (128; rounded up to a multiple of ``m``).

    Extra input: ``hessian``, ``2XXᵀ/N`` of the layer's calibration inputs
    (``sten_core.training.pruning.input_hessian(x)`` or ``InputHessian`` batch by batch).
    """

    needs = ("hessian",)
    hint = ("Compute it from the layer's calibration inputs x with sten_core.training.pruning.input_hessian(x) "
            "(or InputHessian batch by batch), or let sten_core.prune(model, batches, method='sparsegpt') collect it.")

    def __init__(self, fraction: float | None = None, *, n: int | None = None, m: int | None = None,
                 percdamp: float = 0.01, blocksize: int = 128):
        super().__init__(fraction, n=n, m=m)
        if isinstance(percdamp, bool) or not isinstance(percdamp, (int, float)) or not (0.0 <= percdamp) or math.isnan(percdamp):
            raise ValueError(f"percdamp must be a number >= 0, got {percdamp!r}")
        if isinstance(blocksize, bool) or not isinstance(blocksize, int) or blocksize < 1:
            raise ValueError(f"blocksize must be a positive int, got {blocksize!r}")
        self.percdamp = float(percdamp)
        self.blocksize = blocksize

    def prune(self, tensor: torch.Tensor, **inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, keep_mask)``: the reconstructed sparse weight and its mask."""
        dense = self.check_weight(tensor, "SparseGPTSparsifier")
        hessian = self.inputs_for(dense, inputs)["hessian"]
        if self.n is None:
            return sparsegpt(dense, hessian, fraction=self.fraction, percdamp=self.percdamp, blocksize=self.blocksize)
        return sparsegpt(dense, hessian, n=self.n, m=self.m, percdamp=self.percdamp, blocksize=self.blocksize)

    def mask(self, tensor: torch.Tensor, **inputs: Any) -> torch.Tensor:
        """The keep-mask SparseGPT chooses (the values it keeps change too: see ``prune``)."""
        return self.prune(tensor, **inputs)[1]
