"""A plain (non-parameter) ``SparseTensorWrapper(layout, requires_grad=True)`` trains compiled
like a parameter (a traceable wrapper while it is a trainable leaf): no graph breaks, eager's
gradients; frozen wrappers, results of operations and non-traceable layouts keep the eager class."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_core.dispatch.traceable import traceable, trains_compiled
from sten_core.testing import compile_whole


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def sparse(seed=0, shape=(8, 16)):
    torch.manual_seed(seed)
    return (torch.randn(shape) * (torch.rand(shape) > 0.5)).to_sparse_csr().to_dense()


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CscTensor])
def test_a_trainable_plain_wrapper_trains_compiled_with_eager_gradients(layout):
    dense = sparse()
    w = sten.SparseTensorWrapper(layout.from_dense(dense), requires_grad=True)
    assert traceable(w) and trains_compiled(w) and not isinstance(w, torch.nn.Parameter)
    b = torch.zeros(8, requires_grad=True)
    x = torch.randn(2, 3, 16, requires_grad=True)

    def loss(x):
        return F.linear(torch.relu(x), w, b).square().sum()

    loss(x).backward()
    eager = [w.grad.clone(), b.grad.clone(), x.grad.clone()]
    w.grad = b.grad = x.grad = None
    explained = torch._dynamo.explain(loss)(x)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    w.grad = b.grad = x.grad = None
    torch._dynamo.reset()
    torch.compile(loss, fullgraph=True)(x).backward()
    compiled = [w.grad, b.grad, x.grad]
    assert type(compiled[0]) is torch.Tensor and torch.equal(compiled[0], eager[0])
    for c, e in zip(compiled, eager):
        torch.testing.assert_close(c, e)
    rd, rx = dense.clone().requires_grad_(True), x.detach().clone().requires_grad_(True)
    F.linear(torch.relu(rx), rd, b.detach()).square().sum().backward()
    torch.testing.assert_close(compiled[0], rd.grad)
    torch.testing.assert_close(compiled[2], rx.grad)


def test_which_plain_wrappers_are_traceable():
    layout = sten.CsrTensor.from_dense(sparse())
    assert not traceable(sten.SparseTensorWrapper(layout))  # frozen: the eager class (custom backends, export)
    w = sten.SparseTensorWrapper(layout, requires_grad=True)
    assert traceable(w)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        result = w * 2  # the result of an operation (no leaf): the eager class
    assert isinstance(result, sten.SparseTensorWrapper) and not traceable(result)
    w.wrapped_tensor = sten.CooTensor.from_dense(w.to_dense().detach())  # not a traceable layout
    assert not traceable(w) and w.requires_grad
    w.wrapped_tensor = sten.CsrTensor.from_dense(w.to_dense().detach())
    assert traceable(w)
    p = torch.nn.Parameter(w)  # a parameter of it: the same class
    assert isinstance(p, torch.nn.Parameter) and traceable(p)
    frozen = torch.nn.Parameter(sten.SparseTensorWrapper(layout), requires_grad=False)
    assert not traceable(frozen)


def test_strict_export_of_a_module_holding_a_trainable_plain_wrapper_runs():
    """Before, the eager dispatcher broke strict export there (a ContextVar it reads)."""
    w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(sparse()), requires_grad=True)

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = w

        def forward(self, x):
            return F.linear(x, self.w)

    x = torch.randn(4, 16)
    program = torch.export.export(Holder(), (x,), strict=True)
    other = torch.randn(4, 16)
    torch.testing.assert_close(program.module()(other), other @ w.to_dense().detach().t())


def test_a_frozen_plain_wrapper_compiles_with_its_custom_operator():
    w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(sparse()))
    x = torch.randn(4, 16)
    torch.testing.assert_close(compile_whole(lambda x: F.linear(x, w), x), x @ w.to_dense().t())
