import os

import pytest
import torch

# The kernel tests must run the kernels: the per-machine choice of "decompress + dense GEMM"
# (sten_nm.tuning) is off here; tests/test_tuning.py turns it on with a private cache.
os.environ["STEN_NM_TUNE"] = "0"

from sten_nm import _kernel

KERNEL_OK, KERNEL_REASON = _kernel.available()
requires_kernel = pytest.mark.skipif(not KERNEL_OK, reason=f"needs the C kernels: {KERNEL_REASON}")
"""Tests that run the C kernels skip, with the loader's reason, where the extension is
unavailable (no compiler at install, a failed load); the layouts' own tests still run."""

PATTERNS = [(1, 2), (2, 4), (1, 4), (2, 8), (1, 8), (1, 10), (2, 16), (3, 32)]


def _isas():
    if not KERNEL_OK:
        return [pytest.param("none", marks=pytest.mark.skip(reason=f"needs the C kernels: {KERNEL_REASON}"))]
    return _kernel.supported_isas()


@pytest.fixture(params=_isas())
def isa(request):
    """Run a test once per instruction set this CPU supports (generic, avx2, avx512)."""
    before = _kernel.isa()
    _kernel.set_isa(request.param)
    yield request.param
    _kernel.set_isa(before)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
