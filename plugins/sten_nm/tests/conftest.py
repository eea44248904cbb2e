import pytest
import torch

from sten_nm import _kernel

PATTERNS = [(1, 2), (2, 4), (1, 4), (2, 8), (1, 8), (1, 10), (2, 16), (3, 32)]


def _isas():
    out = ["generic"]
    best = _kernel.isa()
    if best != "generic":
        out.append(best)
    return out


@pytest.fixture(params=_isas())
def isa(request):
    """Run a test once per instruction set available here (portable + best)."""
    before = _kernel.isa()
    _kernel.set_isa(request.param)
    yield request.param
    _kernel.set_isa(before)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
