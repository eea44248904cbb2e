"""A trainable default weight whose layout object is replaced by one of a non-traceable class
(``CooTensor``: the wrapper becomes the eager class), then trained eagerly and compiled: the
compiled step runs the eager dispatcher (graph breaks) with eager's gradients. Once failed inside
Dynamo (``InternalTorchDynamoError: 'dict' object has no attribute 'node'``: it traced
``detached()`` reading the wrapper's ``__dict__``) when an eager step came between the swap and
the compiled one."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_core.dispatch.traceable import traceable


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        yield
    torch._dynamo.reset()


def mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 8))
    sb = sten.SparsityBuilder(model)
    for name in ("0.weight", "2.weight"):
        sb.set_weight(name, sten.ScalarFractionSparsifier(0.5), out_format=sten.CsrTensor)
    return sb.get_sparse_model()


@pytest.mark.parametrize("sequence", ["swap eager compiled", "compiled swap eager compiled",
                                      "eager swap eager compiled", "swap compiled", "compiled swap compiled"])
def test_swapping_a_trainable_weight_to_a_non_traceable_layout_then_compiling(sequence):
    model = mlp()
    step = torch.compile(model)
    x = torch.randn(4, 24)
    for action in sequence.split():
        model.zero_grad()
        if action == "swap":
            w = model[0].weight
            w.wrapped_tensor = sten.CooTensor.from_dense(w.to_dense().detach())
            assert not traceable(w) and w.requires_grad
        else:
            (step if action == "compiled" else model)(x).square().sum().backward()
    compiled = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).square().sum().backward()
    for c, e in zip(compiled, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(c, e)
    w0, w2 = (model[i].weight.to_dense().detach().requires_grad_(True) for i in (0, 2))
    F.linear(torch.relu(F.linear(x, w0, model[0].bias.detach())), w2, model[2].bias.detach()).square().sum().backward()
    torch.testing.assert_close(compiled[0], w0.grad)
    torch.testing.assert_close(compiled[2], w2.grad)
