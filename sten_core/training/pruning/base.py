"""``CalibratedSparsifier``: the common base of the one-shot pruning sparsifiers.

A calibrated sparsifier is a ``ScoreSparsifier`` (``sten_core.training.scores``) whose
extra inputs are statistics of the layer's *inputs* over calibration data
(declared in ``needs``, given as keywords or bound with ``bind``). It prunes a
2-D ``F.linear`` weight ``[out_features, in_features]`` to one of two patterns:

* unstructured: ``fraction`` of the weights are removed;
* n:m: ``n`` of every ``m`` consecutive weights along the input dim are kept.

``prune(weight, **inputs)`` returns ``(values, keep_mask)``: the values may
differ from the weight's (SparseGPT updates the kept weights); the sparsifier
implementation of the ``pruning`` plugin stores exactly ``keep_mask`` with
those values in any layout.

Example:
    >>> CalibratedSparsifier.check_pattern(None, 2, 4)
    (0.5, 2, 4)
"""

from __future__ import annotations

from typing import Any

import torch

from sten_core.training.scores import MissingInputError, ScoreSparsifier, check_inputs, needs_of
from sten_core.model.masks import masked
from sten_core.model.sparsifiers import _check_fraction


class CalibratedSparsifier(ScoreSparsifier):
    """Base of ``WandaSparsifier`` and ``SparseGPTSparsifier``.

    Args:
        fraction: unstructured sparsity, the fraction of weights removed.
        n, m: instead of ``fraction``, keep ``n`` of every ``m`` along the input dim.
    """

    hint = ""  # how to obtain the inputs, appended to a MissingInputError

    def __init__(self, fraction: float | None = None, *, n: int | None = None, m: int | None = None):
        fraction, self.n, self.m = self.check_pattern(fraction, n, m)
        super().__init__(fraction)

    @staticmethod
    def check_pattern(fraction: Any, n: Any, m: Any) -> tuple[float, int | None, int | None]:
        """``(fraction, n, m)`` validated; exactly one of ``fraction`` and ``(n, m)``."""
        if (n is None) != (m is None):
            raise TypeError(f"give both n and m for an n:m pattern, got n={n!r}, m={m!r}")
        if n is None:
            if fraction is None:
                raise TypeError("give fraction (unstructured) or n and m (an n:m pattern)")
            return _check_fraction(fraction), None, None
        if fraction is not None:
            raise TypeError(f"give fraction or n and m, not both (fraction={fraction!r}, n={n!r}, m={m!r})")
        for name, v in (("n", n), ("m", m)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if not (1 <= n <= m):
            raise ValueError(f"an n:m pattern needs 1 <= n <= m, got n={n}, m={m}")
        return 1.0 - n / m, n, m

    @property
    def pattern(self) -> tuple[int, int] | None:
        """``(n, m)`` for an n:m sparsifier, ``None`` for an unstructured one."""
        return None if self.n is None else (self.n, self.m)

    def layout_params(self) -> dict[str, Any]:
        """Keyword arguments a layout's ``from_dense`` may take (``n``, ``m``, ``dim``)."""
        return {} if self.n is None else {"n": self.n, "m": self.m, "dim": 1}

    # -- inputs ---------------------------------------------------------------------
    def inputs_for(self, weight: torch.Tensor, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Bound and given inputs, checked: present, dense, and sized for ``weight``."""
        merged = {**self.inputs, **{k: v for k, v in inputs.items() if v is not None}}
        try:
            check_inputs(self, merged)
        except MissingInputError as error:
            raise MissingInputError(f"{error} {self.hint}".strip()) from None
        out = {}
        for name in needs_of(self):
            value = merged[name]
            value = value.to_dense() if hasattr(value, "wrapped_tensor") else value
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{type(self).__name__}: input {name!r} must be a torch.Tensor, got {type(value).__name__}")
            out[name] = value.detach()
        return out

    @staticmethod
    def check_weight(weight: Any, who: str) -> torch.Tensor:
        dense = weight.to_dense() if hasattr(weight, "wrapped_tensor") else weight
        if not isinstance(dense, torch.Tensor):
            raise TypeError(f"{who}: tensor must be a torch.Tensor, got {type(weight).__name__}")
        if dense.dim() != 2:
            raise ValueError(f"{who} prunes a 2-D F.linear weight [out_features, in_features], got shape {tuple(dense.shape)}")
        if not dense.is_floating_point():
            raise TypeError(f"{who}: tensor must be floating point, got {dense.dtype}")
        return dense.detach()

    # -- pruning --------------------------------------------------------------------
    def prune(self, tensor: torch.Tensor, **inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, keep_mask)``: the pruned weight (zeros off the mask) and the mask."""
        keep = self.mask(tensor, **inputs)
        dense = self.check_weight(tensor, type(self).__name__)
        return masked(dense, keep), keep   # (dense * keep left NaN where a pruned weight was inf or NaN)
