"""torch.compile with n:m weights (issue #15): the sten_nm::... custom operators,
no graph breaks, fullgraph, compiled == eager == dense, gradients, torch.export."""

import pytest
import torch
import torch.nn.functional as F
from conftest import requires_kernel

import sten_core as sten
from sten_core.testing import check_compile
from sten_nm import ColumnGroupedNMTensor, GroupedNMTensor, NMTensor
from sten_nm import compiled as nmc

pytestmark = requires_kernel

LAYOUTS = [NMTensor, GroupedNMTensor, ColumnGroupedNMTensor]
OPS = {NMTensor: torch.ops.sten_nm.nm_linear.default, GroupedNMTensor: torch.ops.sten_nm.grouped_linear.default,
       ColumnGroupedNMTensor: torch.ops.sten_nm.column_grouped_linear.default}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def nm_mlp(layout, n=2, m=4, requires_grad=False, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8))
    for lin in (model[0], model[2]):
        lin.weight = sten.SparseParameterWrapper(layout.from_dense(lin.weight.detach(), n=n, m=m),
                                                 requires_grad=requires_grad)
    return model


def dense_twin(model):
    """The same MLP with dense weights (the reference)."""
    twin = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8))
    with torch.no_grad():
        for src, dst in ((model[0], twin[0]), (model[2], twin[2])):
            dst.weight.copy_(src.weight.wrapped_tensor.to_dense())
            dst.bias.copy_(src.bias)
    return twin


@pytest.mark.parametrize("layout", LAYOUTS)
def test_inference_has_no_graph_breaks_and_holds_the_custom_operator(layout):
    model = nm_mlp(layout).eval()
    x = torch.randn(5, 32)
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    assert explained.graph_count == 1
    program = torch.export.export(model, (x,), strict=True)
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert targets.count(OPS[layout]) == 2


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("nm", [(2, 4), (1, 8)])
@pytest.mark.parametrize("shape", [(5, 32), (2, 3, 32)])
def test_fullgraph_equals_eager_and_dense(layout, nm, shape):
    model = nm_mlp(layout, *nm).eval()
    x = torch.randn(*shape)
    with torch.no_grad():
        want = model(x)
        got = torch.compile(model, fullgraph=True)(x)
        dense = dense_twin(model)(x)
    assert type(got) is torch.Tensor
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got, dense, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_frozen_sparse_weights_train_compiled_whole_with_eager_gradients(layout):
    """Biases and the input train, the n:m weights are frozen: forward and backward
    compile through AOTAutograd (the operator's autograd: sten_nm::..._grad_input)."""
    model = nm_mlp(layout)
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
    ref_x = x.detach().clone().requires_grad_(True)
    dense_twin(model)(ref_x).square().sum().backward()
    torch.testing.assert_close(got[-1], ref_x.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_trainable_sparse_weights_compile_with_eager_gradients(layout):
    """n:m weights that require grad run the eager dispatcher while compiled (a graph
    break per call, see docs/compile.md): the gradients (sparse, in the layout) equal eager's."""
    model = nm_mlp(layout, requires_grad=True)
    x = torch.randn(6, 32, requires_grad=True)

    def grads(fn):
        model.zero_grad()
        x.grad = None
        fn(x).square().sum().backward()
        return [p.grad.to_dense() if isinstance(p.grad, sten.SparseTensorWrapper) else p.grad.clone()
                for p in model.parameters()] + [x.grad.clone()]

    want = grads(model)
    got = grads(torch.compile(model))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_custom_operator_gradients_match_dense(layout):
    """The registered autograd, values gradient included (what a compiled training step
    of trainable n:m weights will use): equal to the dense product's at the kept positions."""
    w = layout.from_dense(torch.randn(20, 24), n=2, m=4)
    tensors, consts = nmc.members(w)
    values = tensors[0].clone().requires_grad_(True)
    x = torch.randn(2, 3, 24, requires_grad=True)
    bias = torch.randn(20, requires_grad=True)
    out = OPS[layout](x, [values] + tensors[1:], consts, bias)
    g = torch.randn_like(out)
    gv, gx, gb = torch.autograd.grad(out, (values, x, bias), g)
    dense_w = w.to_dense().requires_grad_(True)
    rx, rb = x.detach().clone().requires_grad_(True), bias.detach().clone().requires_grad_(True)
    ref = F.linear(rx, dense_w, rb)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-4, atol=1e-5)
    rw, rxg, rbg = torch.autograd.grad(ref, (dense_w, rx, rb), g)
    torch.testing.assert_close(gx, rxg, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gb, rbg)
    torch.testing.assert_close(w.with_values(gv.detach()).to_dense(), rw * w.mask(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_custom_operators_pass_opcheck(layout):
    w = layout.from_dense(torch.randn(20, 24), n=2, m=4)
    tensors, consts = nmc.members(w)
    values = tensors[0].clone().requires_grad_(True)
    x = torch.randn(3, 24, requires_grad=True)
    torch.library.opcheck(OPS[layout], (x, [values] + tensors[1:], consts, torch.randn(20)))
    torch.library.opcheck(OPS[layout], (x.detach(), tensors, consts, None))


def test_matmul_and_mm_with_an_nm_operand_compile_whole():
    s = sten.SparseTensorWrapper(NMTensor.from_dense(torch.randn(24, 12), n=2, m=4, dim=0))
    x = torch.randn(5, 24)

    def f(x):
        return torch.mm(x, s) + torch.matmul(x, s) + x @ s

    explained = torch._dynamo.explain(f)(x)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(x), f(x))
    torch.testing.assert_close(f(x), 3 * x @ s.to_dense(), rtol=1e-4, atol=1e-5)


def test_compiled_impl_rejects_a_mismatched_input():
    model = nm_mlp(NMTensor).eval()
    with pytest.raises(Exception, match="last dimension is 32"):
        torch.compile(model, fullgraph=True)(torch.randn(2, 31))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_check_compile_passes_with_the_custom_operator(layout):
    report = check_compile(layout, require_compiled_impl=True)
    assert report["compiled_impl"].endswith("_compiled")
    assert report["graph_breaks"] == 0


@pytest.mark.parametrize("layout,nm", [(NMTensor, (2, 4)), (NMTensor, (1, 10)), (GroupedNMTensor, (2, 4))])
def test_bert_layer_with_nm_weights_compiles_whole(layout, nm):
    """A BERT encoder layer (tiny config) whose six Linear weights are n:m: no graph
    breaks, fullgraph runs, strict export runs; all equal eager."""
    pytest.importorskip("transformers")
    from sten_core.bench.models import bert_case

    case = bert_case(batch=2, seq_len=8, size="tiny")
    model = case.model
    for name in case.weights:
        module_name, _, attr = name.rpartition(".")
        lin = model.get_submodule(module_name)
        setattr(lin, attr, sten.SparseParameterWrapper(layout.from_dense(getattr(lin, attr).detach(), n=nm[0], m=nm[1]),
                                                       requires_grad=False))
    (x,) = case.inputs
    with torch.no_grad():
        want = model(x)
        want = want[0] if isinstance(want, tuple) else want
        explained = torch._dynamo.explain(model)(x)
        assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
        torch._dynamo.reset()
        got = torch.compile(model, fullgraph=True)(x)
        got = got[0] if isinstance(got, tuple) else got
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        program = torch.export.export(model, (x,), strict=True)
        out = program.module()(x)
        out = out[0] if isinstance(out, tuple) else out
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    assert sum(n.target == OPS[layout] for n in program.graph.nodes) == len(case.weights)
