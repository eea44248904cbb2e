"""torch.compile with n:m weights (issue #15): the sten_nm::... custom operators,
no graph breaks, fullgraph, compiled == eager == dense, gradients, torch.export."""

import pytest
import torch
import torch.nn.functional as F
from conftest import requires_kernel

import sten_core as sten
from sten_core.testing import (check_compile, check_compile_shared_weight, check_compile_training_products, check_compile_weight_products,
                               compile_whole, compiled_training_grads, sgd_steps_eager_and_compiled)
from sten_nm import ColumnGroupedNMTensor, GroupedNMTensor, NMTensor
from sten_nm import compiled as nmc

SPARSE_GRAD = (sten.KeepAll(), NMTensor, sten.KeepAll(), NMTensor)

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

    run = compiled_training_grads(model, x)
    assert run["graph_breaks"] == 0, run["reasons"]
    want, got = ([g for g in run[k] if g is not None] for k in ("eager", "compiled"))
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    ref_x = x.detach().clone().requires_grad_(True)
    dense_twin(model)(ref_x).square().sum().backward()
    torch.testing.assert_close(got[-1], ref_x.grad, rtol=1e-4, atol=1e-4)


DENSE = (sten.KeepAll(), torch.Tensor, sten.KeepAll(), torch.Tensor)
"""The explicit dense gradient format (eager: the same dense gradient as the default None)."""


@pytest.mark.parametrize("layout", LAYOUTS)
def test_trainable_sparse_weights_compile_with_eager_gradients(layout):
    """n:m weights that require grad with the default grad_fmt (None, dense) are traceable
    parameters: no graph breaks, fullgraph, dense weight gradients bitwise eager's."""
    model = nm_mlp(layout, requires_grad=True)
    run = compiled_training_grads(model, torch.randn(6, 32, requires_grad=True))
    assert run["graph_breaks"] == 0, run["reasons"]
    want, got = run["eager"], run["compiled"]
    assert all(type(g) is torch.Tensor for g in got)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def dense_grad_mlp(layout, seed=0):
    model = nm_mlp(layout, seed=seed)
    for lin in (model[0], model[2]):
        lin.weight = sten.SparseParameterWrapper(lin.weight.wrapped_tensor, requires_grad=True, grad_fmt=DENSE)
    return model


@pytest.mark.parametrize("layout", LAYOUTS)
def test_trainable_sparse_weights_with_dense_gradients_compile_whole(layout):
    """n:m weights that require grad with the explicit dense gradient format: traceable
    wrappers, forward and backward in one graph (no breaks, fullgraph), the weights' dense
    gradients equal eager's exactly and the dense twin's; the others equal eager's."""
    model = dense_grad_mlp(layout)
    assert all(sten.dispatch.traceable.trains_compiled(lin.weight) for lin in (model[0], model[2]))
    x = torch.randn(6, 32, requires_grad=True)

    run = compiled_training_grads(model, x)
    assert run["graph_breaks"] == 0, run["reasons"]
    want, got = run["eager"], run["compiled"]
    assert all(type(g) is torch.Tensor for g in got)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])   # the dense weight gradients
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    dense = dense_twin(model)
    rx = x.detach().clone().requires_grad_(True)
    dense(rx).square().sum().backward()
    for g, ref in zip(got, [p.grad for p in dense.parameters()] + [rx.grad]):
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-4)


def keep_layout(layout):
    """The gradient format that keeps the weight's layout and pattern (the values' gradient)."""
    return (sten.KeepAll(), layout, sten.KeepAll(), layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_training_step_of_nm_weights_compiles_whole_with_eager_gradients(layout):
    """n:m weights that require grad, gradient in their own layout: the wrappers are
    traceable tensor subclasses, forward and backward compile into one graph
    (sten_core::wrapper_linear), and every gradient equals eager's and the dense one
    at the kept positions."""
    model = nm_mlp(layout)
    for lin in (model[0], model[2]):
        lin.weight = sten.SparseParameterWrapper(lin.weight.wrapped_tensor, requires_grad=True,
                                                 grad_fmt=keep_layout(layout))
        assert sten.dispatch.traceable.trains_compiled(lin.weight)
    x = torch.randn(6, 32, requires_grad=True)
    run = compiled_training_grads(model, x)
    assert run["graph_breaks"] == 0, run["reasons"]
    assert isinstance(run["compiled"][0], sten.SparseTensorWrapper)
    assert type(run["compiled"][0].wrapped_tensor) is layout
    want, got = ([g.to_dense() if isinstance(g, sten.SparseTensorWrapper) else g for g in run[k]]
                 for k in ("eager", "compiled"))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    dense = dense_twin(model)
    rx = x.detach().clone().requires_grad_(True)
    dense(rx).square().sum().backward()
    for lin, ref, g in ((model[0], dense[0], got[0]), (model[2], dense[2], got[2])):
        mask = lin.weight.wrapped_tensor.mask()
        torch.testing.assert_close(g, ref.weight.grad * mask, rtol=1e-4, atol=1e-4)


def test_compiled_training_steps_with_an_optimizer_follow_eager():
    """Three SGD steps, eager and compiled from the same start: the same weights after
    (the optimizer's in-place update is seen by the compiled graph without recompiling)."""
    def make_model():
        model = nm_mlp(NMTensor)
        for lin in (model[0], model[2]):
            lin.weight = sten.SparseParameterWrapper(lin.weight.wrapped_tensor, requires_grad=True,
                                                     grad_fmt=keep_layout(NMTensor))
        return model

    models = sgd_steps_eager_and_compiled(make_model, lambda: torch.randn(6, 32), lr=0.01)
    eager, compiled = ([p.to_dense() if isinstance(p, sten.SparseTensorWrapper) else p.detach()
                        for p in m.parameters()] for m in models)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-5)
    assert not torch.equal(eager[0], nm_mlp(NMTensor)[0].weight.to_dense())  # the steps changed it


def test_which_wrappers_are_traceable():
    """The explicit dense gradient format or the layout's own: traceable (a compiled step
    computes the gradient in the graph); the default None on a parameter that requires grad too;
    a re-sparsified gradient format (a new pattern) while it trains too (converted after the
    compiled step, tests/test_compile_regrad.py)."""
    layout = NMTensor.from_dense(torch.randn(4, 8))
    from sten_core.dispatch.traceable import traceable
    assert traceable(sten.SparseParameterWrapper(layout, grad_fmt=DENSE))
    assert traceable(sten.SparseParameterWrapper(layout, grad_fmt=keep_layout(NMTensor)))
    assert traceable(sten.SparseParameterWrapper(layout))  # the default None while it trains
    assert not traceable(sten.SparseParameterWrapper(layout, requires_grad=False))
    assert traceable(sten.SparseTensorWrapper(layout, requires_grad=True))  # a trainable plain wrapper too
    assert not traceable(sten.SparseTensorWrapper(layout))  # frozen
    assert traceable(sten.SparseParameterWrapper(layout, grad_fmt=(sten.KeepAll(), torch.Tensor,  # re-sparsified:
                                                                   sten.KeepAll(), NMTensor)))  # test_compile_regrad.py


def test_dense_gradient_training_steps_with_an_optimizer_follow_eager():
    """Three SGD steps with dense weight gradients (explicit format), eager and compiled whole."""
    def run(compile_it):
        model = dense_grad_mlp(NMTensor)
        step = torch.compile(model, fullgraph=True) if compile_it else model
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        torch.manual_seed(1)
        for _ in range(3):
            opt.zero_grad()
            step(torch.randn(6, 32)).square().sum().backward()
            opt.step()
        return [p.to_dense() if isinstance(p, sten.SparseTensorWrapper) else p.detach().clone()
                for p in model.parameters()]

    eager, compiled = run(False), run(True)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-5)
    assert not torch.equal(eager[0], nm_mlp(NMTensor)[0].weight.to_dense())


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


def test_products_with_the_nm_operand_first_compile_whole_and_train():
    """``W @ x``, ``torch.mm(W, x)``, ``torch.matmul(W, x)`` (2-D and 1-D x) compile into the
    ``sten_nm::nm_linear`` node on x^T: no graph break; compiled, eager and dense torch agree on
    the values and the gradients (W's at its kept positions, in its own layout)."""
    torch.manual_seed(0)
    t = NMTensor.from_dense(torch.randn(12, 24), n=2, m=4)
    x0, v0 = torch.randn(24, 5), torch.randn(24)

    def f(w, x, v):
        return (torch.mm(w, x) + torch.matmul(w, x) + w @ x).sum(-1) + w @ v

    runs = {}
    for mode in ("dense", "eager", "compiled"):
        w = t.to_dense().requires_grad_() if mode == "dense" else \
            sten.SparseParameterWrapper(sten.SparseTensorWrapper(t, requires_grad=True, grad_fmt=SPARSE_GRAD))
        x, v = x0.clone().requires_grad_(), v0.clone().requires_grad_()
        torch._dynamo.reset()
        if mode == "compiled":
            explained = torch._dynamo.explain(f)(w, x, v)
            assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
            torch._dynamo.reset()
        y = (torch.compile(f, fullgraph=True) if mode == "compiled" else f)(w, x, v)
        y.square().sum().backward()
        gw = w.grad * t.mask() if mode == "dense" else w.grad.wrapped_tensor.to_dense()
        runs[mode] = (y, x.grad, v.grad, gw)
    torch._dynamo.reset()
    for mode in ("eager", "compiled"):
        for got, want in zip(runs[mode], runs["dense"]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


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
    from sten_core.tools.bench.models import bert_case  # transformers: in sten_nm's [test] extra

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


@pytest.mark.parametrize("layout", LAYOUTS)
def test_check_compile_training_passes(layout):
    from sten_core.testing import check_compile_training

    assert check_compile_training(layout, shapes=((4, 16, 12),), sparsifier=sten.ScalarFractionSparsifier(0.5)) == \
        {"traceable": True, "graph_breaks": 0}


def test_traceable_weights_survive_module_conversions():
    """Module._apply swaps traceable subclasses (torch.utils.swap_tensors) instead of setting
    .data: the weight stays a trainable parameter with its gradient format and values."""
    lin = torch.nn.Linear(16, 8)
    lin.weight = sten.SparseParameterWrapper(NMTensor.from_dense(lin.weight.detach()), grad_fmt=keep_layout(NMTensor))
    before = lin.weight.to_dense().double()
    lin = lin.double()
    w = lin.weight
    assert isinstance(w, torch.nn.Parameter) and w.requires_grad and w.dtype == torch.float64
    assert sten.dispatch.traceable.trains_compiled(w) and len(list(lin.parameters())) == 2
    torch.testing.assert_close(w.to_dense(), before)
    lin(torch.randn(3, 16, dtype=torch.float64)).sum().backward()
    assert type(w.grad.wrapped_tensor) is NMTensor


@pytest.mark.parametrize("threads", [1, 2])
def test_paper_format_training_step_compiles_without_caches(threads, caplog):
    """#15's "one-thread" failure (PendingUnbackedSymbolNotFound): torch's debug logs, formatted
    by a capturing handler, printed the wrapper, whose layout repr counted nnz on fake members
    (unbacked symbols Inductor then rejects); only a compile that missed Inductor's on-disk
    caches met it. Now a wrapper with fake members prints metadata only: compiled from
    scratch with debug logging on, at 1 and 2 threads, the step equals eager."""
    import logging

    caplog.set_level(logging.DEBUG)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            test_training_step_of_nm_weights_compiles_whole_with_eager_gradients(ColumnGroupedNMTensor)
    finally:
        torch.set_num_threads(before)


def test_a_wrapper_on_fake_members_prints_without_reading_values():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    w = sten.SparseParameterWrapper(ColumnGroupedNMTensor.from_dense(torch.randn(8, 16)),
                                    grad_fmt=keep_layout(ColumnGroupedNMTensor))
    shape_env = ShapeEnv()
    with FakeTensorMode(shape_env=shape_env) as mode:
        fake = mode.from_tensor(w)
        text = repr(fake)
    assert "ColumnGroupedNMTensor(shape=(8, 16)" in text and "nnz" not in text
    assert not shape_env.pending_fresh_unbacked_symbols
    assert "nnz=" in repr(w)  # real members: the layout's own repr


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("product", ["W @ x", "matmul", "mm", "W @ vector", "W @ batch"])
def test_weight_first_products_compile_whole(layout, product):
    """``W @ x`` with the n:m wrapper first: the layout's compiled F.linear transposed, no graph
    break (two before, in the dense path's ctypes/nonzero), eager's and the dense values."""
    torch.manual_seed(2)
    dense = torch.randn(8, 16)
    w = sten.SparseTensorWrapper(layout.from_dense(dense, n=2, m=4))
    wd = w.wrapped_tensor.to_dense()
    f = {"W @ x": lambda w, x: w @ x, "matmul": lambda w, x: torch.matmul(w, x), "mm": lambda w, x: torch.mm(w, x),
         "W @ vector": lambda w, x: w @ x[:, 0], "W @ batch": lambda w, x: w @ torch.stack([x, -x])}[product]
    x = torch.randn(16, 5)
    got = compile_whole(lambda x: f(w, x), x)
    torch.testing.assert_close(got, f(w, x))
    torch.testing.assert_close(got, f(wd, x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("grad_fmt", ["default", "keep"])
def test_paper_format_compiled_backward_does_not_rebuild_its_nm_view(grad_fmt, monkeypatch):
    """The compiled backward of a ColumnGroupedNMTensor weight (its custom operators rebuild the
    layout from its members per call) runs the layout's own kernels or dense products: it never
    re-derives the n:m view (to_nm / _nm_pattern), which the eager layout caches."""
    from sten_nm import column_grouped as cg

    calls = []
    for name in ("to_nm", "_nm_pattern"):
        original = getattr(cg.ColumnGroupedNMTensor, name)
        monkeypatch.setattr(cg.ColumnGroupedNMTensor, name,
                            lambda self, *a, _o=original, _n=name, **k: calls.append(_n) or _o(self, *a, **k))
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 16)
    fmt = None if grad_fmt == "default" else keep_layout(ColumnGroupedNMTensor)
    lin.weight = sten.SparseParameterWrapper(ColumnGroupedNMTensor.from_dense(lin.weight.detach(), n=2, m=4),
                                             grad_fmt=fmt)
    x = torch.randn(8, 32, requires_grad=True)
    lin(x).square().sum().backward()
    want = lin.weight.grad.to_dense() if fmt else lin.weight.grad.clone()
    lin.zero_grad()
    calls.clear()
    step = torch.compile(lin, fullgraph=True)
    for _ in range(3):
        lin.zero_grad()
        step(x).square().sum().backward()
    assert calls == []
    got = lin.weight.grad.to_dense() if fmt else lin.weight.grad
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# -- products other than F.linear (frozen: x @ W, W.matmul(x); trainable: x @ W.t() and friends) ------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_frozen_weight_products_and_method_calls_compile_whole(layout):
    """``x @ W`` / ``torch.matmul(x, W)`` / ``torch.mm(x, W)`` (GroupedNMTensor: 6 breaks before) and
    ``W.matmul(x)`` / ``W.mm(x)`` (1 break before): no break, fullgraph, values and x's gradient
    equal eager's and the dense product's (``testing.check_compile_weight_products``)."""
    assert set(check_compile_weight_products(layout).values()) == {0}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_training_through_other_products_compiles_whole(layout):
    """A trainable n:m weight with the default grad_fmt: ``torch.mm(x, W.t())``, ``x @ W.t()``,
    ``torch.matmul(x, W.t())``, ``torch.addmm(b, x, W.t())``, ``W @ x.t()`` train compiled on its
    dense view: eager's gradients (plain dense), the dense model's, and SGD steps equal eager's."""
    assert set(check_compile_training_products(layout).values()) == {0}


def test_x_at_a_frozen_grouped_weight_runs_its_own_to_dense_in_one_custom_operator():
    w = sten.SparseParameterWrapper(GroupedNMTensor.from_dense(torch.randn(8, 16), n=2, m=4), requires_grad=False)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    x = torch.randn(3, 8)
    got = compile_whole(lambda x: x @ w, x, backend=backend)
    targets = {getattr(n.target, "overloadpacket", n.target) for g in graphs for n in g.graph.nodes
               if n.op == "call_function"}
    assert torch.ops.sten_core.members_to_dense in targets, targets
    torch.testing.assert_close(got, x @ w.to_dense())


@pytest.mark.parametrize("layout", [NMTensor, GroupedNMTensor, ColumnGroupedNMTensor])
def test_a_weight_used_twice_trains_compiled_with_eager_gradients(layout):
    check_compile_shared_weight(layout, size=32)


@pytest.mark.parametrize("layout", [NMTensor, GroupedNMTensor, ColumnGroupedNMTensor])
@pytest.mark.parametrize("trainable", [False, True])
def test_compiled_linear_under_cpu_autocast_returns_eagers_dtype(layout, trainable):
    """Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` a compiled ``F.linear`` with an n:m weight
    returns bfloat16 as eager and dense torch do (it returned float32 silently: the custom operators
    have no autocast rule; ``sten_core.dispatch.compiled.autocast_result``), with output and gradients
    equal to eager's within bfloat16's precision."""
    import warnings

    g = torch.Generator().manual_seed(3)
    dense = layout.from_dense(torch.randn(12, 16, generator=g)).to_dense()  # its n:m pattern
    x0, b = torch.randn(2, 5, 16, generator=g), torch.linspace(-1, 1, 12)
    runs = []
    for mode in ("eager", "compiled", "dense"):
        w = torch.nn.Parameter(dense.clone(), requires_grad=trainable) if mode == "dense" else \
            sten.SparseParameterWrapper(layout.from_dense(dense), requires_grad=trainable)
        x = x0.clone().requires_grad_(True)
        torch._dynamo.reset()
        with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.bfloat16):
            warnings.simplefilter("ignore")
            fn = (lambda t: F.linear(t, w, b))
            y = torch.compile(fn, fullgraph=True)(x) if mode == "compiled" else fn(x)
        torch._dynamo.reset()
        y.float().square().sum().backward()
        wg = w.grad.to_dense() if isinstance(w.grad, sten.SparseTensorWrapper) else w.grad
        runs.append((mode, y, x.grad, wg))
    (_, ye, gxe, gwe), (_, yc, gxc, gwc), (_, yd, _, _) = runs
    assert ye.dtype == yc.dtype == yd.dtype == torch.bfloat16, (ye.dtype, yc.dtype, yd.dtype)
    torch.testing.assert_close(yc.float(), ye.float(), rtol=1.6e-2, atol=2e-2)
    torch.testing.assert_close(yc.float(), yd.float(), rtol=1.6e-2, atol=2e-2)
    torch.testing.assert_close(gxc, gxe, rtol=0, atol=2e-2 * gxe.abs().max().item())
    if trainable:
        torch.testing.assert_close(gwc, gwe, rtol=0, atol=2e-2 * gwe.abs().max().item())
