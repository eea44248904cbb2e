"""torch.compile with scipy weights (issue #15): sten_scipy::linear custom operators,
no graph breaks, fullgraph, compiled == eager == dense, gradients, torch.export."""

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_core.testing import (check_compile, check_compile_shared_weight, check_compile_training_products, check_compile_weight_products,
                               compile_whole, compiled_training_grads, sgd_steps_eager_and_compiled)
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

    run = compiled_training_grads(model, x)
    assert run["graph_breaks"] == 0, run["reasons"]
    want, got = ([g for g in run[k] if g is not None] for k in ("eager", "compiled"))
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


# -- compiled training of trainable scipy weights (traceable wrappers) ------------------------
DENSE_GRAD = (sten.KeepAll(), torch.Tensor, sten.KeepAll(), torch.Tensor)


def keep_layout(layout):
    """The gradient format that keeps the weight's layout and pattern (the values' gradient)."""
    return (sten.KeepAll(), layout, sten.KeepAll(), layout)


def trainable_mlp(layout, grad_fmt, dtype=torch.float32):
    model, dense = scipy_mlp(layout, dtype)
    for lin in (model[0], model[2]):
        lin.weight = sten.SparseParameterWrapper(lin.weight.wrapped_tensor, requires_grad=True, grad_fmt=grad_fmt)
        assert sten.dispatch.traceable.trains_compiled(lin.weight)
    return model, dense


def all_grads(model, x, fn):
    model.zero_grad()
    x.grad = None
    fn(x).square().sum().backward()
    return [p.grad for p in model.parameters()] + [x.grad.clone()]


def dense_reference_grads(model, dense, x):
    """The dense model's gradients (weights, biases, input) with the same stored weights."""
    ws = [w.clone().requires_grad_(True) for w in dense]
    bs = [model[i].bias.detach().clone().requires_grad_(True) for i in (0, 2)]
    rx = x.detach().clone().requires_grad_(True)
    F.linear(torch.relu(F.linear(rx, ws[0], bs[0])), ws[1], bs[1]).square().sum().backward()
    return [ws[0].grad, bs[0].grad, ws[1].grad, bs[1].grad, rx.grad]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(6, 32), (2, 3, 32)])
def test_training_step_keeping_the_layout_compiles_whole_with_eager_gradients(layout, dtype, shape):
    """Scipy weights that require grad, gradient in their own layout and pattern: no graph
    breaks, fullgraph, the gradient a scipy wrapper of the weight's pattern, every gradient
    equal to eager's and to the dense model's (the weight's at the stored positions)."""
    model, dense = trainable_mlp(layout, keep_layout(layout), dtype)
    x = torch.randn(*shape, dtype=dtype, requires_grad=True)
    want = [g.to_dense() if isinstance(g, sten.SparseTensorWrapper) else g.clone()
            for g in all_grads(model, x, model)]
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    assert explained.graph_count == 1
    torch._dynamo.reset()
    got = all_grads(model, x, torch.compile(model, fullgraph=True))
    for i in (0, 2):
        gw = got[i]
        assert isinstance(gw, sten.SparseTensorWrapper) and type(gw.wrapped_tensor) is layout
        assert not gw.wrapped_tensor.traced and gw.wrapped_tensor.same_pattern(model[i].weight.wrapped_tensor)
    got = [g.to_dense() if isinstance(g, sten.SparseTensorWrapper) else g for g in got]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    ref = dense_reference_grads(model, dense, x)
    masks = {0: dense[0] != 0, 2: dense[1] != 0}
    for i, (g, r) in enumerate(zip(got, ref)):
        torch.testing.assert_close(g, r * masks[i] if i in masks else r)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_training_step_with_dense_weight_gradients_compiles_whole(layout, dtype):
    """grad_fmt=(KeepAll(), Tensor, KeepAll(), Tensor): the compiled weight gradient is the
    plain dense gy.T @ x, equal to eager's (and to the default grad_fmt's) and to the dense
    model's; no graph breaks, fullgraph."""
    model, dense = scipy_mlp(layout, dtype)
    for lin in (model[0], model[2]):
        lin.weight.requires_grad_(True)
    x = torch.randn(2, 3, 32, dtype=dtype, requires_grad=True)
    default = [g.clone() for g in all_grads(model, x, model)]
    model, dense = trainable_mlp(layout, DENSE_GRAD, dtype)
    want = [g.clone() for g in all_grads(model, x, model)]
    explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    torch._dynamo.reset()
    got = all_grads(model, x, torch.compile(model, fullgraph=True))
    assert all(type(g) is torch.Tensor for g in got)
    for g, w, d in zip(got, want, default):
        torch.testing.assert_close(g, w)
        torch.testing.assert_close(w, d)
    for g, r in zip(got, dense_reference_grads(model, dense, x)):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("grad_fmt", ["keep", "dense"])
def test_compiled_sgd_steps_follow_eager(layout, grad_fmt):
    """Three SGD steps, eager and compiled from the same start: the same weights after, the
    pattern kept, one compiled graph (the optimizer's in-place update of the scipy values
    is seen without recompiling)."""
    fmt = keep_layout(layout) if grad_fmt == "keep" else DENSE_GRAD

    torch._dynamo.utils.counters.clear()
    eager, compiled = sgd_steps_eager_and_compiled(lambda: trainable_mlp(layout, fmt)[0], lambda: torch.randn(6, 32),
                                                   lr=0.01)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    start, _ = scipy_mlp(layout)
    for e, c in zip(eager.parameters(), compiled.parameters()):
        if isinstance(e, sten.SparseTensorWrapper):
            assert type(c.wrapped_tensor) is layout and not c.wrapped_tensor.traced
            e, c = e.to_dense(), c.to_dense()
        torch.testing.assert_close(c, e)
    for i in (0, 2):
        assert compiled[i].weight.wrapped_tensor.same_pattern(start[i].weight.wrapped_tensor)
    assert not torch.equal(eager[0].weight.to_dense(), start[0].weight.to_dense())  # the steps changed it


@pytest.mark.parametrize("layout", LAYOUTS)
def test_check_compile_training_passes(layout):
    from sten_core.testing import check_compile_training

    assert check_compile_training(layout) == {"traceable": True, "graph_breaks": 0}
    assert check_compile_training(layout, dtype=torch.float64, shapes=((3, 8, 6),)) == \
        {"traceable": True, "graph_breaks": 0}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unflatten_of_traced_tensors_reads_no_values_and_no_scipy(layout, monkeypatch):
    """On fake tensors (what Dynamo and AOTAutograd trace) the unflatten builds a traced
    layout without calling scipy; its metadata and to_dense() are torch ops on the members;
    scipy-backed methods say why they cannot run while tracing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    w = layout.from_dense(torch.randn(5, 7) * (torch.rand(5, 7) > 0.5))
    tensors, consts = spc.members(w)
    mode = FakeTensorMode()
    fakes = [mode.from_tensor(t) for t in tensors]

    def no_scipy(*args, **kwargs):
        raise AssertionError("scipy called while tracing")

    monkeypatch.setattr(layout, "array_type", no_scipy)
    with mode:
        traced = spc.from_members(fakes, consts)
        dense = traced.to_dense()
    assert type(traced) is layout and traced.traced
    assert (traced.shape, traced.dtype, traced.device, traced.nnz) == (w.shape, w.dtype, w.device, w.nnz)
    assert traced.values() is fakes[2] and list(traced.torch_members) == fakes
    assert dense.shape == (5, 7) and dense.dtype == w.dtype
    with pytest.raises(RuntimeError, match=f"{layout.__name__}: this layout was rebuilt from the tensors "
                                           "torch.compile traces.*no scipy array"):
        traced.transpose()
    monkeypatch.undo()
    meta = spc.from_members([t.to("meta") for t in tensors], consts)
    assert meta.traced and meta.to_dense().device.type == "meta"
    torch.testing.assert_close(spc.from_members(tensors, consts).to_dense(), w.to_dense())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unflatten_of_real_tensors_shares_their_memory(layout):
    """At run time (a compiled step's gradient output) the unflatten gets plain tensors: a
    scipy array on numpy views of them, so the layout's values are the tensor's memory."""
    w = layout.from_dense(torch.randn(5, 7) * (torch.rand(5, 7) > 0.5))
    tensors, consts = spc.members(w)
    grad = torch.randn_like(tensors[2])
    rebuilt = spc.from_members(tensors[:2] + [grad], consts)
    assert not rebuilt.traced and rebuilt.same_pattern(w)
    assert rebuilt.values().data_ptr() == grad.data_ptr()
    assert rebuilt.data.indptr.ctypes.data == w.data.indptr.ctypes.data
    torch.testing.assert_close(rebuilt.to_dense(), w.with_values(grad).to_dense())
    wrapper = sten.SparseParameterWrapper(w, grad_fmt=keep_layout(layout))
    names, ctx = wrapper.__tensor_flatten__()
    again = type(wrapper).__tensor_unflatten__({n: getattr(wrapper, n) for n in names}, ctx, None, None)
    assert type(again.wrapped_tensor) is layout and torch.equal(again.to_dense(), w.to_dense())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_other_operators_on_traceable_scipy_weights(layout):
    """A frozen traceable weight: operators without a compiled implementation run on the
    traced layout's dense matrix (torch ops on its members), with eager's values. A trainable
    one: such a product says to write F.linear (only it trains compiled)."""
    import warnings

    w = sten.SparseParameterWrapper(layout.from_dense(torch.randn(6, 8) * (torch.rand(6, 8) > 0.5)),
                                    grad_fmt=keep_layout(layout))
    w.requires_grad_(False)

    def f(x):
        return torch.mm(x, w.t()) + 1

    x = torch.randn(3, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        want = f(x)
        torch.testing.assert_close(torch.compile(f, fullgraph=True)(x), want)
    torch.testing.assert_close(want, x @ w.to_dense().t() + 1)
    w.requires_grad_(True)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=rf"Tensor.t on a trainable {layout.__name__} weight.*F.linear\(x, W, b\)"):
        torch.compile(f, fullgraph=True)(x)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_training_with_the_default_grad_fmt_compiles_whole(layout):
    """Trainable scipy weights with the default grad_fmt=None: traceable parameters, no graph
    breaks, fullgraph, dense weight gradients bitwise eager's."""
    model, _ = scipy_mlp(layout)
    for lin in (model[0], model[2]):
        lin.weight.requires_grad_(True)
        assert sten.dispatch.traceable.trains_compiled(lin.weight)
    run = compiled_training_grads(model, torch.randn(6, 32, requires_grad=True))
    assert run["graph_breaks"] == 0, run["reasons"]
    got, want = run["compiled"], run["eager"]
    assert all(type(g) is torch.Tensor for g in got)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("product", ["W @ x", "matmul", "mm", "W @ vector"])
def test_weight_first_products_compile_whole(layout, product):
    """``W @ x`` with the scipy wrapper first: sten_scipy::linear transposed, no graph break."""
    torch.manual_seed(2)
    dense = torch.randn(8, 16) * (torch.rand(8, 16) > 0.5)
    w = sten.SparseTensorWrapper(layout.from_dense(dense))
    f = {"W @ x": lambda w, x: w @ x, "matmul": lambda w, x: torch.matmul(w, x), "mm": lambda w, x: torch.mm(w, x),
         "W @ vector": lambda w, x: w @ x[:, 0]}[product]
    x = torch.randn(16, 5)
    got = compile_whole(lambda x: f(w, x), x)
    torch.testing.assert_close(got, f(w, x))
    torch.testing.assert_close(got, f(dense, x), rtol=1e-5, atol=1e-5)


# -- products other than F.linear (frozen: x @ W, W.matmul(x); trainable: x @ W.t() and friends) ------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_frozen_weight_products_and_method_calls_compile_whole(layout):
    """``x @ W`` / ``torch.matmul(x, W)`` / ``torch.mm(x, W)`` (1 break before: the dense path's
    to_dense() goes through scipy) and ``W.matmul(x)`` / ``W.mm(x)``: no break, fullgraph, values and
    x's gradient equal eager's and the dense product's (``testing.check_compile_weight_products``)."""
    assert set(check_compile_weight_products(layout).values()) == {0}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_training_through_other_products_compiles_whole(layout):
    """A trainable scipy weight with the default grad_fmt trains compiled through ``torch.mm(x, W.t())``,
    ``x @ W.t()``, ``torch.matmul(x, W.t())``, ``torch.addmm(b, x, W.t())``, ``W @ x.t()``: eager's
    (plain dense) gradients, the dense model's, and SGD steps equal eager's."""
    assert set(check_compile_training_products(layout).values()) == {0}


@pytest.mark.parametrize("layout", [ScipyCsrTensor, ScipyCscTensor])
def test_a_weight_used_twice_trains_compiled_with_eager_gradients(layout):
    check_compile_shared_weight(layout)


@pytest.mark.parametrize("layout", [ScipyCsrTensor, ScipyCscTensor])
def test_compiled_layers_under_cpu_autocast_follow_eager_float32(layout):
    """scipy computes in the weight's dtype, so eager's ``F.linear`` under CPU autocast returns float32;
    compiled must too (``ignores_autocast``): casting it to bfloat16 made the next scipy layer refuse its
    bfloat16 input (``TypeError``) in a compiled two-layer model that runs eagerly."""
    import warnings

    g = torch.Generator().manual_seed(3)
    dense = [torch.randn(16, 16, generator=g) * (torch.rand(16, 16, generator=g) > 0.5) for _ in range(2)]
    ws = [sten.SparseParameterWrapper(layout.from_dense(d), requires_grad=False) for d in dense]
    x = torch.randn(4, 16, generator=g)
    fn = lambda t: F.linear(F.linear(t, ws[0]).relu(), ws[1])
    torch._dynamo.reset()
    with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.bfloat16):
        warnings.simplefilter("ignore")
        eager, compiled = fn(x), torch.compile(fn, fullgraph=True)(x)
    torch._dynamo.reset()
    assert eager.dtype == compiled.dtype == torch.float32
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(compiled, F.linear(F.linear(x, dense[0]).relu(), dense[1]))
