"""A trainable sparse weight used twice in one compiled training step (the same tensor passed
twice): its two gradients are summed inside the compiled backward. With a dense gradient
format the sum is a dense add; with a pattern-keeping format it is a sum of values at the
weight's pattern, which must neither build a torch sparse tensor nor compare patterns on fake
members (it once failed with "Values and compressed tensor instance need to be on the same
device", and the n:m layouts fell back with a backend graph break on ``aten.equal``)."""

import pytest
import torch

import sten_core as sten
from sten_core.testing import SHARED_WEIGHT_GRAD_FMTS, check_compile_shared_weight


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("fmt", list(SHARED_WEIGHT_GRAD_FMTS))
@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CscTensor])
def test_a_weight_used_twice_trains_compiled_with_eager_gradients(layout, fmt):
    check_compile_shared_weight(layout, grad_fmts=[fmt])
