import pytest
import torch

from sten_nm import _kernel

PATTERNS = [(1, 2), (2, 4), (1, 4), (2, 8), (1, 8), (1, 10), (2, 16), (3, 32)]


def _isas():
    ok, reason = _kernel.available()
    return _kernel.supported_isas() if ok else [pytest.param("none", marks=pytest.mark.skip(reason=reason))]


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
