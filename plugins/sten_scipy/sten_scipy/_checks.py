"""Input checks shared by the scipy layouts and their operators.

Every check raises a ``TypeError`` or ``ValueError`` that names the argument
and what was expected.

Example:
    >>> import torch
    >>> check_dense(torch.ones(2, 3), "ScipyCsrTensor.from_dense").shape
    torch.Size([2, 3])
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from sten_core import plugin_api

TORCH_TO_NUMPY = {torch.float32: np.float32, torch.float64: np.float64}
NUMPY_TO_TORCH = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}
SUPPORTED = "float32 or float64"


def torch_dtype(np_dtype: Any, where: str) -> torch.dtype:
    """The torch dtype of a numpy dtype (float32/float64 only)."""
    try:
        return NUMPY_TO_TORCH[np.dtype(np_dtype)]
    except KeyError:
        raise TypeError(f"{where}: dtype must be {SUPPORTED}, got {np.dtype(np_dtype)}") from None


def check_dense(tensor: Any, where: str, name: str = "tensor") -> torch.Tensor:
    """A detached, strided, 2-D, CPU, float32/float64 tensor, or a clear error."""
    tensor = plugin_api.check_tensor(tensor, name, where=where).detach()
    if tensor.layout is not torch.strided:
        tensor = tensor.to_dense()
    if tensor.dim() != 2:
        raise ValueError(f"{where}: {name} must be 2-D (scipy.sparse arrays are matrices), got shape {tuple(tensor.shape)}")
    if tensor.dtype not in TORCH_TO_NUMPY:
        raise TypeError(f"{where}: {name} dtype must be {SUPPORTED}, got {tensor.dtype}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{where}: {name} must be on the CPU (scipy.sparse is CPU-only), got device {tensor.device}")
    return tensor


def check_operand(tensor: torch.Tensor, dtype: torch.dtype, where: str, name: str) -> torch.Tensor:
    """A dense operand of a scipy kernel: CPU, same dtype as the sparse one. Under CPU autocast
    a floating operand of another dtype (the bfloat16 output of an autocast layer before) is
    cast to the weight's: scipy computes in float32/float64 whatever autocast says."""
    if tensor.device.type != "cpu":
        raise ValueError(f"{where}: {name} must be on the CPU (scipy.sparse is CPU-only), got device {tensor.device}")
    if tensor.dtype != dtype and tensor.is_floating_point() and torch.is_autocast_enabled("cpu"):
        return tensor.detach().to(dtype)
    if tensor.dtype != dtype:
        raise TypeError(f"{where}: {name} dtype {tensor.dtype} does not match the sparse operand's dtype {dtype}; "
                        f"expected {dtype}")
    return tensor.detach()
