"""Compiled training of n:m weights whose gradient is re-sparsified into an n:m layout (a new
pattern per step, ``sten_core.dispatch.compiled_regrad``): no graph breaks, eager's gradients
(layout, pattern, values) and optimizer steps, the dense model's gradient re-sparsified."""

import warnings

import pytest
import torch
from conftest import requires_kernel

import sten_core as sten
from sten_core.dispatch.sparsifier_dispatch import apply_grad_spec
from sten_core.dispatch.traceable import traceable, trains_compiled
from sten_core.testing import compiled_training_grads
from sten_nm import ColumnGroupedNMTensor, GroupedNMTensor, NMSparsifier, NMTensor

pytestmark = requires_kernel
LAYOUTS = [NMTensor, GroupedNMTensor, ColumnGroupedNMTensor]
KEEP = sten.KeepAll()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        yield
    torch._dynamo.reset()


def formats(layout):
    return {"dense-to-nm": (KEEP, torch.Tensor, KEEP, NMTensor),
            "nm-sparsifier": (KEEP, torch.Tensor, NMSparsifier(1, 4), NMTensor),
            "to-csr": (KEEP, torch.Tensor, sten.ScalarFractionSparsifier(0.5), sten.CsrTensor)}


def nm_mlp(layout, grad_fmt, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8))
    for lin in (model[0], model[2]):
        lin.weight = sten.SparseParameterWrapper(layout.from_dense(lin.weight.detach(), n=2, m=4), grad_fmt=grad_fmt)
    return model


def dense(value):
    return value.to_dense() if isinstance(value, sten.SparseTensorWrapper) else value


@pytest.mark.parametrize("fmt", ["dense-to-nm", "nm-sparsifier", "to-csr"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_resparsified_nm_gradients_compile_whole_with_eager_gradients(layout, fmt):
    grad_fmt = formats(layout)[fmt]
    model = nm_mlp(layout, grad_fmt)
    assert all(traceable(lin.weight) and trains_compiled(lin.weight) for lin in (model[0], model[2]))
    x = torch.randn(6, 32, requires_grad=True)
    run = compiled_training_grads(model, x)
    assert run["graph_breaks"] == 0, run["reasons"]
    want, got = run["eager"], run["compiled"]
    for i in (0, 2):
        assert isinstance(got[i], sten.SparseTensorWrapper) and type(got[i].wrapped_tensor) is grad_fmt[3]
        assert type(want[i].wrapped_tensor) is grad_fmt[3]
        assert torch.equal(dense(got[i]) != 0, dense(want[i]) != 0)  # eager's pattern
    for g, w in zip(got, want):
        torch.testing.assert_close(dense(g), dense(w))
    # the dense model's gradients through the format (a format naming a layout without
    # sparsifying, "dense-to-nm", holds them at the weight's stored positions)
    w0, w2 = (model[i].weight.to_dense().detach().requires_grad_(True) for i in (0, 2))
    rx = x.detach().clone().requires_grad_(True)
    h = torch.relu(torch.nn.functional.linear(rx, w0, model[0].bias.detach()))
    torch.nn.functional.linear(h, w2, model[2].bias.detach()).square().sum().backward()
    spec = sten.OutputSpec.coerce(grad_fmt)
    for i, ref in ((0, w0.grad), (2, w2.grad)):
        want_i = apply_grad_spec(ref, spec, model[i].weight)
        torch.testing.assert_close(dense(got[i]), dense(want_i), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[-1], rx.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", [NMTensor, GroupedNMTensor])
def test_sgd_steps_with_resparsified_nm_gradients_follow_eager(layout):
    fmt = formats(layout)["nm-sparsifier"]

    def run(compile_it):
        torch._dynamo.reset()
        model = nm_mlp(layout, fmt, seed=3)
        step = torch.compile(model, fullgraph=True) if compile_it else model
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        torch.manual_seed(1)
        for _ in range(3):
            opt.zero_grad()
            step(torch.randn(6, 32)).square().sum().backward()
            opt.step()
        return model

    eager, compiled = run(False), run(True)
    for e, c in zip(eager.parameters(), compiled.parameters()):
        if isinstance(e, sten.SparseTensorWrapper):
            assert type(c.wrapped_tensor) is type(e.wrapped_tensor) is layout
        torch.testing.assert_close(dense(c).detach(), dense(e).detach(), rtol=1e-5, atol=1e-5)
    assert not torch.equal(dense(eager[0].weight).detach(), dense(nm_mlp(layout, fmt, seed=3)[0].weight).detach())
