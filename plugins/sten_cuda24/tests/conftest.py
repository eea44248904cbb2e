"""Shared fixtures. Without a GPU the Triton kernels run under the interpreter
(``TRITON_INTERPRET=1`` is set here, before any kernel module is imported)."""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except Exception:
    HAS_TRITON = False

requires_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (sm_80+); none in this session")
requires_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


@pytest.fixture
def kernel_device() -> str:
    """Where the Triton kernels run: the GPU, or the CPU under TRITON_INTERPRET=1."""
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def sten():
    import sten_core

    sten_core.plugins.manager.ensure_loaded()
    previous = sten_core.dispatch.get_dispatch_failure()
    sten_core.set_dispatch_failure("raise")  # our implementations must be the ones that run
    yield sten_core
    sten_core.set_dispatch_failure(previous)
