"""Compiled training of scipy weights whose gradient is re-sparsified (a new pattern per step,
``sten_core.dispatch.compiled_regrad``): no graph breaks, eager's gradients, the dense
model's gradient re-sparsified by the format."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_core.dispatch.traceable import traceable
from sten_core.testing import compiled_training_grads
from sten_scipy import ScipyCscTensor, ScipyCsrTensor

LAYOUTS = [ScipyCsrTensor, ScipyCscTensor]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        yield
    torch._dynamo.reset()


def dense(value):
    return value.to_dense() if isinstance(value, sten.SparseTensorWrapper) else value


@pytest.mark.parametrize("layout", LAYOUTS)
def test_resparsified_scipy_gradients_compile_whole_with_eager_gradients(layout):
    grad_fmt = (sten.KeepAll(), torch.Tensor, sten.ScalarFractionSparsifier(0.5), layout)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8))
    for lin in (model[0], model[2]):
        w = lin.weight.detach() * (torch.rand_like(lin.weight) > 0.5)
        lin.weight = sten.SparseParameterWrapper(layout.from_dense(w), grad_fmt=grad_fmt)
        assert traceable(lin.weight)
    x = torch.randn(6, 32, requires_grad=True)
    run = compiled_training_grads(model, x)
    assert run["graph_breaks"] == 0, run["reasons"]
    want, got = run["eager"], run["compiled"]
    for i in (0, 2):
        assert type(got[i].wrapped_tensor) is type(want[i].wrapped_tensor) is layout
        assert torch.equal(dense(got[i]) != 0, dense(want[i]) != 0)
    for g, w in zip(got, want):
        torch.testing.assert_close(dense(g), dense(w))
    w0, w2 = (model[i].weight.to_dense().detach().requires_grad_(True) for i in (0, 2))
    rx = x.detach().clone().requires_grad_(True)
    F.linear(torch.relu(F.linear(rx, w0, model[0].bias.detach())), w2, model[2].bias.detach()).square().sum().backward()
    spec = sten.OutputSpec.coerce(grad_fmt)
    for i, ref in ((0, w0.grad), (2, w2.grad)):
        torch.testing.assert_close(dense(got[i]), dense(sten.dispatch.apply_spec(ref, spec)))
    torch.testing.assert_close(got[-1], rx.grad)
