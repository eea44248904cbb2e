"""``WandaSparsifier``: pruning by weights and activations (Sun et al. 2023).

The score of weight ``W[i, j]`` is ``|W[i, j]| · ‖X_j‖₂``, where ``‖X_j‖₂`` is
the ℓ2 norm of input feature ``j`` over the calibration tokens (the extra
input ``input_norm``). Weights compete within each output row: every row
keeps its ``round(in_features · (1 - fraction))`` highest scores (ties to the
lower column); with ``n``/``m`` each group of ``m`` consecutive inputs of a
row keeps its ``n`` highest. The kept weights are not changed.

Example:
    >>> import torch, sten_core as sten
    >>> w = torch.tensor([[1., 2., 3., 4.]])
    >>> norms = torch.tensor([8., 1., 1., 1.])        # input 0 is large
    >>> WandaSparsifier(0.5).mask(w, input_norm=norms).tolist()
    [[True, False, False, True]]
    >>> sp = WandaSparsifier(n=1, m=2).bind(input_norm=norms)
    >>> sten.sparsify(sp, w, sten.CsrTensor).to_dense().tolist()
    [[1.0, 0.0, 0.0, 4.0]]
"""

from __future__ import annotations

from typing import Any

import torch

from sten_core.model.sparsifiers import kept_count, nm_keep_mask
from sten_core.training.pruning.base import CalibratedSparsifier


def row_keep_mask(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Keep the ``keep`` highest scores of every row (ties to the lower column).

    >>> row_keep_mask(torch.tensor([[1., 3., 3., 0.]]), 2).tolist()
    [[False, True, True, False]]
    """
    mask = torch.zeros_like(scores, dtype=torch.bool)
    if keep > 0:
        order = torch.argsort(scores, dim=1, descending=True, stable=True)
        mask.scatter_(1, order[:, :keep], True)
    return mask


class WandaSparsifier(CalibratedSparsifier):
    """Wanda: keep the highest ``|W| · ‖X_j‖₂`` per output row (or per n:m group).

    Args:
        fraction: the fraction of every row's weights removed (unstructured).
        n, m: instead, keep ``n`` of every ``m`` consecutive inputs.

    Extra input: ``input_norm``, the ``[in_features]`` norms ``‖X_j‖₂``
    (``sten_core.training.pruning.input_norms(x)`` or ``InputNorms`` batch by batch).
    """

    needs = ("input_norm",)
    hint = ("Compute it from the layer's calibration inputs x with sten_core.training.pruning.input_norms(x) "
            "(or InputNorms batch by batch), or let sten_core.prune(model, batches, method='wanda') collect it.")

    def score(self, tensor: torch.Tensor, input_norm: torch.Tensor = None, **inputs: Any) -> torch.Tensor:
        if input_norm.shape != (tensor.shape[-1],):
            raise ValueError(f"WandaSparsifier: input_norm must have shape ({tensor.shape[-1]},) (in_features), "
                             f"got {tuple(input_norm.shape)}")
        dtype = torch.float64 if tensor.dtype == torch.float64 else torch.float32  # float64 ranks in float64
        return tensor.abs().to(dtype) * input_norm.to(tensor.device, dtype).unsqueeze(0)

    def mask(self, tensor: torch.Tensor, **inputs: Any) -> torch.Tensor:
        """The keep-mask of a ``[out, in]`` weight for the given or bound ``input_norm``."""
        dense = self.check_weight(tensor, "WandaSparsifier")
        scores = self.score(dense, **self.inputs_for(dense, inputs))
        if self.n is not None:
            return nm_keep_mask(scores, self.n, self.m)
        return row_keep_mask(scores, kept_count(dense.shape[1], self.fraction))
