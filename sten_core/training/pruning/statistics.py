"""Calibration statistics of a linear layer's inputs, accumulated batch by batch.

* ``InputNorms``: the ℓ2 norm of every input feature over all calibration
  tokens, ``‖X_j‖₂`` (what Wanda needs);
* ``InputHessian``: ``H = 2 X Xᵀ / N`` over the ``N`` calibration tokens (the
  Hessian of the layer-wise squared reconstruction error, what SparseGPT needs).

Both take the layer's input as it arrives (any leading dims; the last is the
feature dim) and keep O(features) or O(features²) memory, never the inputs.

Example:
    >>> import torch
    >>> x = torch.tensor([[3., 0.], [4., 1.]])
    >>> norms = InputNorms(2); norms.update(x); norms.result().tolist()
    [5.0, 1.0]
    >>> h = InputHessian(2); h.update(x); h.result().tolist()     # 2 XᵀX / 2
    [[25.0, 4.0], [4.0, 1.0]]
"""

from __future__ import annotations

import torch


def _rows(x: torch.Tensor, features: int, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: the layer input must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0 or x.shape[-1] != features:
        raise ValueError(f"{what}: expected inputs with last dim {features}, got shape {tuple(x.shape)}")
    return x.detach().reshape(-1, features)


class InputNorms:
    """Running ``‖X_j‖₂`` per input feature ``j`` (a sum of squares, then a root)."""

    def __init__(self, features: int, device: torch.device | str | None = None):
        self.features = features
        self.sumsq = torch.zeros(features, dtype=torch.float64 if _cpu(device) else torch.float32, device=device)
        self.tokens = 0
        self.out_dtype = torch.float32   # float64 once a float64 batch was seen

    def update(self, x: torch.Tensor) -> None:
        """Add a batch of inputs (``[..., features]``)."""
        rows = _rows(x, self.features, "InputNorms")
        self.out_dtype = _out_dtype(self.out_dtype, rows)
        self.sumsq += rows.to(self.sumsq.dtype).square().sum(0)
        self.tokens += rows.shape[0]

    def result(self) -> torch.Tensor:
        """The norms, shape ``[features]``: float32, float64 where the inputs were."""
        return self.sumsq.sqrt().to(self.out_dtype)


class InputHessian:
    """Running ``H = 2 X Xᵀ / N`` (``[features, features]``) of the layer inputs."""

    def __init__(self, features: int, device: torch.device | str | None = None):
        self.features = features
        self.sum = torch.zeros(features, features, dtype=torch.float64 if _cpu(device) else torch.float32, device=device)
        self.tokens = 0
        self.out_dtype = torch.float32   # float64 once a float64 batch was seen

    def update(self, x: torch.Tensor) -> None:
        """Add a batch of inputs (``[..., features]``)."""
        rows = _rows(x, self.features, "InputHessian")
        self.out_dtype = _out_dtype(self.out_dtype, rows)
        rows = rows.to(self.sum.dtype)
        self.sum.addmm_(rows.t(), rows)
        self.tokens += rows.shape[0]

    def result(self) -> torch.Tensor:
        """``2 XᵀX / N`` (zeros if nothing was seen): float32, float64 where the inputs were (a
        float64 model's SparseGPT then computes in float64 throughout, as documented)."""
        return (self.sum * (2.0 / max(self.tokens, 1))).to(self.out_dtype)


def _out_dtype(current: torch.dtype, rows: torch.Tensor) -> torch.dtype:
    """float64 once float64 inputs were seen (on a device where the sums are float64), else float32."""
    return torch.float64 if current == torch.float64 or rows.dtype == torch.float64 else torch.float32


def _cpu(device: torch.device | str | None) -> bool:
    return device is None or torch.device(device).type == "cpu"


def input_norms(x: torch.Tensor) -> torch.Tensor:
    """``‖X_j‖₂`` of a block of inputs ``x`` (``[..., features]``) in one call.

    >>> input_norms(torch.tensor([[3., 0.], [4., 0.]])).tolist()
    [5.0, 0.0]
    """
    acc = InputNorms(x.shape[-1], x.device)
    acc.update(x)
    return acc.result()


def input_hessian(x: torch.Tensor) -> torch.Tensor:
    """``2 XᵀX / N`` of a block of inputs ``x`` (``[..., features]``) in one call.

    >>> input_hessian(torch.tensor([[1., 2.]])).tolist()
    [[2.0, 4.0], [4.0, 8.0]]
    """
    acc = InputHessian(x.shape[-1], x.device)
    acc.update(x)
    return acc.result()
