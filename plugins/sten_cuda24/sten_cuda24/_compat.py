"""Probes for the optional pieces: CUDA, cuSPARSELt, CUTLASS ops, Triton, nvcc.

Private torch APIs are looked up here only, by name, so a torch that lacks them
makes the plugin report itself unavailable instead of failing at import.

Example:
    >>> from sten_cuda24._compat import availability
    >>> ok, reason = availability()
    >>> isinstance(ok, bool) and (ok or bool(reason))
    True
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
from typing import Any, Callable

import torch


def private_op(name: str) -> Callable[..., Any] | None:
    """``torch.<name>`` if this torch has it, else ``None``."""
    fn = getattr(torch, name, None)
    return fn if callable(fn) else None


@functools.lru_cache(maxsize=None)
def has_cuda() -> bool:
    try:
        return bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0
    except Exception:
        return False


@functools.lru_cache(maxsize=None)
def has_cusparselt() -> bool:
    """cuSPARSELt ops present and the library loaded (needs a CUDA build)."""
    if private_op("_cslt_compress") is None or private_op("_cslt_sparse_mm") is None:
        return False
    try:
        return bool(torch.backends.cusparselt.is_available())
    except Exception:
        return False


@functools.lru_cache(maxsize=None)
def has_cutlass() -> bool:
    """torch's CUTLASS semi-structured ops are present and run on this GPU.

    torch builds them for compute capability 8.x only: on an sm_90 (Hopper) device
    they raise "Supported only on GPUs with compute capability 8.x", so there the
    backend is cuSPARSELt alone. Without a GPU only their presence is checked (the
    fake implementations trace on any machine).
    """
    present = private_op("_sparse_semi_structured_mm") is not None or private_op("_sparse_semi_structured_linear") is not None
    cap = cuda_capability()
    return present and (cap is None or cap[0] == 8)


def cuda_capability(device: torch.device | None = None) -> tuple[int, int] | None:
    if not has_cuda():
        return None
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def ieee_fp32_dot(dtype: torch.dtype) -> bool:
    """Whether a Triton ``tl.dot`` on ``dtype`` inputs must be full fp32 (``input_precision="ieee"``).

    Triton's default for fp32 is TF32 (10-bit mantissa); torch's fp32 matmul is full
    precision unless ``torch.backends.cuda.matmul.allow_tf32`` is set, and our kernels
    follow torch's setting so that sparse and dense products agree.
    """
    return dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def triton_runs_on(x: torch.Tensor) -> bool:
    """Whether the Triton kernels may run on ``x``: a CUDA tensor, or a CPU one under
    ``TRITON_INTERPRET=1`` that is not bfloat16 (the interpreter's bf16 gave values of 1e10
    where the answer was about 20, without an error: such calls take the dense path)."""
    if x.device.type == "cuda":
        return True
    return triton_interpret() and x.dtype != torch.bfloat16


INTERPRETED_BF16 = "bfloat16 on CPU under TRITON_INTERPRET=1 (the interpreter computes it wrong)"


def nvcc_path() -> str | None:
    """``$STEN_NVCC``, ``$CUDA_HOME/bin/nvcc`` or ``nvcc`` on ``PATH``."""
    env = os.environ.get("STEN_NVCC")
    if env and os.path.exists(env):
        return env
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def semi_structured_backend() -> str | None:
    """``"cusparselt"``, ``"cutlass"`` or ``None`` (``STEN_CUDA24_BACKEND`` forces one)."""
    forced = os.environ.get("STEN_CUDA24_BACKEND")
    if forced == "cusparselt":
        return "cusparselt" if has_cusparselt() else None
    if forced == "cutlass":
        return "cutlass" if has_cutlass() else None
    if has_cusparselt():
        return "cusparselt"
    if has_cutlass():
        return "cutlass"
    return None


def availability() -> tuple[bool, str | None]:
    """Whether the GPU paths can run here, and why not."""
    if not torch.version.cuda:
        return False, f"torch {torch.__version__} is not a CUDA build (no CUDA device)"
    if not has_cuda():
        return False, "no CUDA device"
    cap = cuda_capability()
    if cap is not None and cap < (8, 0):
        return False, f"2:4 sparse tensor cores need sm_80+, device is sm_{cap[0]}{cap[1]}"
    if semi_structured_backend() is None:
        return False, (
            "neither cuSPARSELt (torch._cslt_compress/_cslt_sparse_mm) nor CUTLASS "
            "(torch._sparse_semi_structured_mm/_linear) is available in this torch"
        )
    return True, None


def describe() -> dict[str, Any]:
    """Everything the probes found (for reports and the benchmark)."""
    ok, reason = availability()
    return {
        "available": ok,
        "reason": reason,
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_device": torch.cuda.get_device_name() if has_cuda() else None,
        "capability": cuda_capability(),
        "cusparselt": has_cusparselt(),
        "cutlass": has_cutlass(),
        "backend": semi_structured_backend(),
        "triton": has_triton(),
        "nvcc": nvcc_path(),
    }


def require_cuda(tensor: torch.Tensor, what: str) -> None:
    """Raise a clear error when a GPU-only path gets a CPU tensor or no GPU exists."""
    if tensor.device.type != "cuda":
        raise ValueError(f"{what} runs on CUDA tensors only; got a tensor on {tensor.device}")
    if not has_cuda():
        raise RuntimeError(f"{what} needs a CUDA device; none is available")
