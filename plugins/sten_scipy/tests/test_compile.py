"""torch.compile with scipy weights (issue #15): sten_scipy::linear custom operators,
no graph breaks, fullgraph, compiled == eager == dense, gradients, torch.export."""

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_core.testing import check_compile
from sten_scipy import ScipyCscTensor, ScipyCsrTensor
from sten_scipy import compiled as spc

LAYOUTS = [ScipyCsrTensor, ScipyCscTensor]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def scipy_mlp(layout, dtype=torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8)).to(dtype)
    dense = []
    for lin in (model[0], model[2]):
        w = lin.weight.detach() * (torch.rand_like(lin.weight) > 0.5)
        dense.append(w)
        lin.weight = sten.SparseParameterWrapper(layout.from_dense(w), requires_grad=False)
    return model, dense


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(5, 32), (2, 3, 32)])
def test_inference_compiles_whole_and_equals_eager_and_dense(layout, dtype, shape):
    model, dense = scipy_mlp(layout, dtype)
    x = torch.randn(*shape, dtype=dtype)
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(x)
        assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
        torch._dynamo.reset()
        got = torch.compile(model, fullgraph=True)(x)
        want = model(x)
        ref = F.linear(torch.relu(F.linear(x, dense[0], model[0].bias)), dense[1], model[2].bias)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_in_place_value_changes_are_seen_and_export_runs(layout):
    model, _ = scipy_mlp(layout)
    x = torch.randn(4, 32)
    with torch.no_grad():
        compiled = torch.compile(model, fullgraph=True)
        before = compiled(x)
        model[0].weight.wrapped_tensor.values().mul_(2)  # an optimizer-like in-place update
        torch.testing.assert_close(compiled(x), model(x))
        assert not torch.allclose(compiled(x), before)
        program = torch.export.export(model, (x,), strict=True)
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.sten_scipy.linear.default) == 2
    torch.testing.assert_close(program.module()(x), model(x))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_frozen_sparse_weights_train_compiled_whole(layout):
    model, _ = scipy_mlp(layout)
    x = torch.randn(6, 32, requires_grad=True)

    def grads(fn):
        model.zero_grad()
        x.grad = None
        fn(x).square().sum().backward()
        return [p.grad.clone() for p in model.parameters() if p.requires_grad] + [x.grad.clone()]

    want = grads(model)
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    torch._dynamo.reset()
    got = grads(torch.compile(model, fullgraph=True))
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_custom_operator_gradients_match_dense(layout):
    dense_w = torch.randn(20, 24, dtype=torch.float64) * (torch.rand(20, 24) > 0.5)
    w = layout.from_dense(dense_w)
    tensors, consts = spc.members(w)
    values = tensors[2].clone().requires_grad_(True)
    x = torch.randn(2, 3, 24, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(20, dtype=torch.float64, requires_grad=True)
    out = torch.ops.sten_scipy.linear(x, tensors[:2] + [values], consts, bias)
    g = torch.randn_like(out)
    gv, gx, gb = torch.autograd.grad(out, (values, x, bias), g)
    rw = dense_w.clone().requires_grad_(True)
    rx, rb = x.detach().clone().requires_grad_(True), bias.detach().clone().requires_grad_(True)
    ref = F.linear(rx, rw, rb)
    torch.testing.assert_close(out, ref.detach())
    gw_ref, gx_ref, gb_ref = torch.autograd.grad(ref, (rw, rx, rb), g)
    torch.testing.assert_close(gx, gx_ref)
    torch.testing.assert_close(gb, gb_ref)
    torch.testing.assert_close(w.with_values(gv.detach()).to_dense(), gw_ref * (dense_w != 0))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_custom_operators_pass_opcheck(layout):
    w = layout.from_dense(torch.randn(20, 24) * (torch.rand(20, 24) > 0.5))
    tensors, consts = spc.members(w)
    values = tensors[2].clone().requires_grad_(True)
    x = torch.randn(3, 24, requires_grad=True)
    torch.library.opcheck(torch.ops.sten_scipy.linear.default, (x, tensors[:2] + [values], consts, torch.randn(20)))
    torch.library.opcheck(torch.ops.sten_scipy.linear.default, (x.detach(), tensors, consts, None))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_check_compile_passes_with_the_custom_operator(layout):
    report = check_compile(layout, require_compiled_impl=True)
    assert report == {"compiled_impl": "linear_compiled", "graph_breaks": 0, "reasons": []}


def test_compiled_linear_rejects_a_wrong_dtype():
    model, _ = scipy_mlp(ScipyCsrTensor)
    with torch.no_grad(), pytest.raises(Exception, match="weight's dtype"):
        torch.compile(model, fullgraph=True)(torch.randn(2, 32, dtype=torch.float64))
