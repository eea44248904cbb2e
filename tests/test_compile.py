"""torch.compile of sparse models (issue #15): graph breaks, fullgraph, eager equality."""

import pathlib
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from fake_layouts import DenseCopyLayout

import sten_core as sten
from sten_core.builtin import compiled_ops
from sten_core.testing import check_compile, compiled_training_grads, sgd_steps_eager_and_compiled

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "sten_example_plugin"


def sparse_mlp(layout=sten.CsrTensor, fraction=0.5, seed=0, requires_grad=True):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 8))
    sb = sten.SparsityBuilder(model)
    for name in ("0.weight", "2.weight"):
        sb.set_weight(name, sten.ScalarFractionSparsifier(fraction), out_format=layout)
    model = sb.get_sparse_model()
    if not requires_grad:
        for p in model.parameters():
            p.requires_grad_(False)
    return model


def dense_grads(grads):
    """Gradients as dense tensors (a sparse wrapper's by its to_dense())."""
    return [g.to_dense() if isinstance(g, sten.SparseTensorWrapper) else g for g in grads]


def dense_reference_grads(model, x):
    """The gradients of the tests' loss through ``model``'s dense twin: ``(W0, W2, x)``."""
    w0, w2 = (model[i].weight.to_dense().detach().requires_grad_(True) for i in (0, 2))
    rx = x.detach().clone().requires_grad_(True)
    F.linear(torch.relu(F.linear(rx, w0, model[0].bias.detach())), w2, model[2].bias.detach()).square().sum().backward()
    return w0.grad, w2.grad, rx.grad


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CscTensor])
def test_csr_inference_has_no_graph_breaks(layout):
    model = sparse_mlp(layout).eval()
    x = torch.randn(5, 24)
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(x)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CscTensor])
@pytest.mark.parametrize("grad_off", ["no_grad", "frozen"])
@pytest.mark.parametrize("shape", [(5, 24), (2, 3, 24)])
def test_csr_fullgraph_equals_eager(layout, grad_off, shape):
    model = sparse_mlp(layout, requires_grad=grad_off != "frozen").eval()
    x = torch.randn(*shape)
    compiled = torch.compile(model, fullgraph=True)
    if grad_off == "no_grad":
        with torch.no_grad():
            want, got = model(x), compiled(x)
    else:
        want, got = model(x), compiled(x)
    assert type(got) is torch.Tensor and got.shape == want.shape
    torch.testing.assert_close(got, want)
    dense = model[2](model[1](F.linear(x, model[0].weight.to_dense().detach(), model[0].bias)))
    torch.testing.assert_close(got, dense.detach(), rtol=1e-5, atol=1e-5)


def test_compiled_graph_holds_the_custom_operator():
    model = sparse_mlp(requires_grad=False).eval()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch.compile(model, backend=backend, fullgraph=True)(torch.randn(3, 24))
    (gm,) = graphs
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.sten_core.csr_mm.default) + targets.count(torch.ops.sten_core.csr_mm) == 2


def test_changing_the_weight_values_is_seen_without_recompiling():
    model = sparse_mlp(requires_grad=False).eval()
    x = torch.randn(4, 24)
    compiled = torch.compile(model, fullgraph=True)
    compiled(x)
    with torch.no_grad():
        model[0].weight.wrapped_tensor.values().mul_(2.0)  # in place, as an optimizer step does
    torch.testing.assert_close(compiled(x), model(x))


def test_a_new_layout_class_recompiles_instead_of_reusing_the_plan():
    model = sparse_mlp(requires_grad=False).eval()
    x = torch.randn(4, 24)
    compiled = torch.compile(model)
    compiled(x)
    w = model[0].weight
    w.wrapped_tensor = sten.CooTensor.from_dense(w.to_dense() * 2)  # same wrapper, another layout
    want = model(x)
    torch.testing.assert_close(compiled(x), want)
    w.wrapped_tensor = sten.CsrTensor.from_dense(w.to_dense() * 3)  # back to CSR, new members
    torch.testing.assert_close(compiled(x), model(x))
    assert not torch.allclose(model(x), want)


def test_training_step_compiles_with_eager_gradients():
    """Sparse weights that require grad run the eager dispatcher (graph breaks)
    until the wrapper can be a compiled graph's input: gradients equal eager's."""
    model = sparse_mlp()
    run = compiled_training_grads(model, torch.randn(6, 24, requires_grad=True), fullgraph=False)
    want, got = run["eager"], run["compiled"]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_custom_operators_pass_opcheck():
    w = sten.CsrTensor.from_dense(torch.randn(6, 5) * (torch.rand(6, 5) > 0.5))
    crow, col, values = w.state_tensors()
    values = values.clone().requires_grad_(True)
    dense = torch.randn(3, 5).t().requires_grad_(True)  # a transposed view, as the linear passes it
    torch.library.opcheck(torch.ops.sten_core.csr_mm.default, (crow, col, values, 5, dense))
    torch.library.opcheck(torch.ops.sten_core.csr_mm.default, (crow, col, values.detach(), 5, torch.randn(5, 4)))
    torch.library.opcheck(torch.ops.sten_core.csr_t_mm.default, (crow, col, values.detach(), 5, torch.randn(6, 3)))
    torch.library.opcheck(torch.ops.sten_core.csr_t_mm.default, (crow, col, values, 5, torch.randn(3, 6).t().requires_grad_(True)))
    torch.library.opcheck(torch.ops.sten_core.csr_sampled.default, (torch.randn(6, 3), torch.randn(3, 5), crow, col))


@pytest.mark.parametrize("transposed", [False, True])
def test_custom_operator_gradients_match_dense(transposed):
    dense_w = torch.randn(6, 5) * (torch.rand(6, 5) > 0.5)
    crow, col, values = sten.CsrTensor.from_dense(dense_w).state_tensors()
    values = values.clone().requires_grad_(True)
    if transposed:  # csr_t_mm: W.t() @ d
        d = torch.randn(6, 4, requires_grad=True)
        out = torch.ops.sten_core.csr_t_mm(crow, col, values, 5, d)
    else:
        d = torch.randn(5, 4, requires_grad=True)
        out = torch.ops.sten_core.csr_mm(crow, col, values, 5, d)
    g = torch.randn_like(out)
    gv, gd = torch.autograd.grad(out, (values, d), g)
    ref_w = dense_w.clone().requires_grad_(True)
    ref_d = d.detach().clone().requires_grad_(True)
    ref = (ref_w.t() if transposed else ref_w) @ ref_d
    torch.testing.assert_close(out, ref.detach())
    rw, rd = torch.autograd.grad(ref, (ref_w, ref_d), g)
    torch.testing.assert_close(gd, rd)
    torch.testing.assert_close(gv, rw[dense_w != 0])


def test_compiled_linear_kernel_gradients_match_dense():
    """The kernel the graph holds, run directly: F.linear's values and gradients."""
    dense_w = torch.randn(7, 5) * (torch.rand(7, 5) > 0.5)
    w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(dense_w))
    x = torch.randn(2, 3, 5, requires_grad=True)
    bias = torch.randn(7, requires_grad=True)
    out = compiled_ops.csr_linear_kernel(x, w, bias)
    ref_x = x.detach().clone().requires_grad_(True)
    ref_b = bias.detach().clone().requires_grad_(True)
    ref = F.linear(ref_x, dense_w, ref_b)
    torch.testing.assert_close(out, ref.detach())
    g = torch.randn_like(out)
    gx, gb = torch.autograd.grad(out, (x, bias), g)
    rx, rb = torch.autograd.grad(ref, (ref_x, ref_b), g)
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gb, rb)


def test_register_compiled_impl_checks_its_arguments():
    with pytest.raises(TypeError, match="operator"):
        sten.registry.register_compiled_impl("linear", (torch.Tensor, sten.CsrTensor), compiled_ops.csr_linear_kernel)
    with pytest.raises(TypeError, match="impl"):
        sten.registry.register_compiled_impl(F.linear, (torch.Tensor, sten.CsrTensor), None)


@pytest.fixture
def bitmask(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    from sten_example_plugin import BitmaskTensor, plugin

    assert sten.plugins.register_plugin(plugin, name="example")
    try:
        yield BitmaskTensor
    finally:
        sten.plugins.unregister_plugin("example")
        for name in [m for m in sys.modules if m.startswith("sten_example_plugin")]:
            del sys.modules[name]


@pytest.fixture
def dense_copy():
    sten.registry.register_layout(DenseCopyLayout)
    try:
        yield DenseCopyLayout
    finally:
        sten.registry.layouts.pop("DenseCopyLayout", None)


@pytest.mark.parametrize("which", ["bitmask", "dense_copy"])
def test_third_party_layout_compiles_whole(which, request):
    """A layout without compiled implementations: its ``to_dense`` is traced and
    the dense product runs in the graph (same values as eager)."""
    layout = request.getfixturevalue(which)
    model = sparse_mlp(layout).eval()
    x = torch.randn(5, 24)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)  # DenseCopyLayout has no linear: eager falls back
        want = model(x)
        explained = torch._dynamo.explain(model)(x)
        torch._dynamo.reset()
        got = torch.compile(model, fullgraph=True)(x)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_matmul_operator_form_compiles():
    w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.randn(6, 5) * (torch.rand(6, 5) > 0.5)))
    x = torch.randn(5, 3)

    def f(x):
        return (w @ x).relu()

    want = f(x)
    torch.testing.assert_close(torch.compile(f)(x), want)


@pytest.mark.parametrize("layout,kernel", [(sten.CsrTensor, "csr_linear_kernel"), (sten.CscTensor, "csc_linear_kernel")])
def test_check_compile_passes_for_csr_with_its_custom_operator(layout, kernel):
    report = check_compile(layout, require_compiled_impl=True)
    assert report == {"compiled_impl": kernel, "graph_breaks": 0, "reasons": []}


def test_check_compile_passes_for_a_traceable_third_party_layout(dense_copy):
    report = check_compile(dense_copy)
    assert report["compiled_impl"] is None and report["graph_breaks"] == 0


def test_check_compile_says_a_compiled_implementation_is_missing(dense_copy):
    with pytest.raises(AssertionError, match="no compiled implementation of F.linear.*register_compiled_impl"):
        check_compile(dense_copy, require_compiled_impl=True)


def test_check_compile_reports_graph_breaks():
    """COO's to_dense() densifies a sparse torch tensor, which Dynamo cannot trace."""
    with pytest.raises(AssertionError, match="graph break.*sparse Tensor.*register_compiled_impl"):
        check_compile(sten.CooTensor)


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CscTensor])
def test_training_with_frozen_sparse_weights_compiles_whole(layout):
    """Sparse weights frozen, the rest trained (biases, adapters): forward and
    backward compile through AOTAutograd into one graph (the custom operator's
    registered autograd gives the input gradient); gradients equal eager's."""
    model = sparse_mlp(layout)
    for p in model.parameters():
        if isinstance(p, sten.SparseTensorWrapper):
            p.requires_grad_(False)
    x = torch.randn(6, 24, requires_grad=True)

    run = compiled_training_grads(model, x)
    assert run["graph_breaks"] == 0, run["reasons"]
    want, got = ([g for g in run[k] if g is not None] for k in ("eager", "compiled"))
    assert len(got) == len(want) == 3  # two biases and x
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_torch_export_strict_holds_the_custom_operator_and_runs():
    model = sparse_mlp(requires_grad=False).eval()
    x = torch.randn(4, 24)
    program = torch.export.export(model, (x,), strict=True)
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.sten_core.csr_mm.default) == 2
    other = torch.randn(4, 24)
    torch.testing.assert_close(program.module()(other), model(other))


@pytest.mark.parametrize("shape", [(3, 24), (2, 3, 24)])
def test_strict_export_of_frozen_coo_weights_runs(shape):
    """Strict export stopped at ``tensor.is_inference()`` in the torch layouts' ``to_dense`` ("Encountered
    tensor.is_inference() during tracing"), a check for tensors made under inference_mode."""
    model = sparse_mlp(layout=sten.CooTensor, requires_grad=False).eval()
    x = torch.randn(*shape)
    program = torch.export.export(model, (x,), strict=True)
    torch.testing.assert_close(program.module()(x), model(x))


def test_run_decompositions_of_a_program_with_trainable_sparse_weights_says_to_freeze_them():
    """torch unwraps a trainable subclass parameter into member parameters that require grad, which
    CSR's indices cannot: its own error ("Only Tensors of floating point and complex dtype can
    require gradients") named no cause. Frozen, the program decomposes and runs."""
    model = sparse_mlp(requires_grad=True).eval()
    x = torch.randn(4, 24)
    with pytest.raises(RuntimeError, match="Freeze the model before exporting"):
        torch.export.export(model, (x,), strict=True).run_decompositions()
    model.requires_grad_(False)
    program = torch.export.export(model, (x,), strict=True).run_decompositions()
    torch.testing.assert_close(program.module()(x), model(x))


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.fc(x))


def test_sparsified_intermediates_compile_with_eager_results():
    """``set_interm`` outputs go through the eager dispatcher (graph breaks): same values."""
    torch.manual_seed(0)
    sb = sten.SparsityBuilder(torch.nn.Sequential(_Block(), torch.nn.Linear(16, 4)))
    sb.set_weight("0.fc.weight", sten.ScalarFractionSparsifier(0.5), out_format=sten.CsrTensor)
    sb.set_interm("0.relu", sten.ScalarFractionSparsifier(0.5), sten.CooTensor, sten.KeepAll(), sten.CooTensor)
    model = sb.get_sparse_model().eval()
    x = torch.randn(4, 16)
    with torch.no_grad():
        want = model(x)
        got = torch.compile(model)(x)
    torch.testing.assert_close(got, want)
    with torch.no_grad():
        hidden = torch.relu(F.linear(x, model[0].fc.weight.to_dense(), model[0].fc.bias))
    assert (model[0](x).to_dense() == 0).sum() >= hidden.numel() // 2  # the intermediate was sparsified


def test_strict_export_of_sparsified_intermediates_names_the_reason():
    """Strict ``torch.export`` (and ``fullgraph=True``) cannot hold ``set_interm`` calls, which run
    eagerly: the error was Dynamo's ``str.startswith`` inside the builder's mode; it now names
    ``set_interm`` and what to do."""
    sb = sten.SparsityBuilder(torch.nn.Sequential(_Block(), torch.nn.Linear(16, 4)))
    sb.set_interm("0.relu", sten.ScalarFractionSparsifier(0.5), out_format=torch.Tensor)
    model = sb.get_sparse_model().eval()
    with pytest.raises(Exception, match="set_interm"):
        torch.export.export(model, (torch.randn(4, 16),), strict=True)
    with pytest.raises(Exception, match="set_interm"):
        torch.compile(model, fullgraph=True)(torch.randn(4, 16))
    # non-strict export (torch's default) said "Could not extract specialized integer from data-dependent
    # expression u0" (the sparsifier's .item() on fake values)
    with pytest.raises(NotImplementedError, match="non-strict torch.export: SparsityBuilder.set_interm"):
        torch.export.export(model, (torch.randn(4, 16),), strict=False)
    # raised inside STen's mode, it left export's own torch function mode active for later code
    assert not torch.overrides._get_current_function_mode_stack()


@pytest.mark.parametrize("flip", ["requires_grad", "grad_mode"])
def test_unfreezing_after_compiling_gives_the_wrapper_its_gradient(flip):
    """The compiled graph was traced with frozen weights (or under no_grad);
    trained afterwards, the guards send the call back to the eager dispatcher."""
    model = sparse_mlp(requires_grad=flip == "grad_mode")
    x = torch.randn(6, 24)
    compiled = torch.compile(model)
    with torch.no_grad() if flip == "grad_mode" else torch.enable_grad():
        compiled(x)
    for p in model.parameters():
        p.requires_grad_(True)
    model.zero_grad()
    compiled(x).square().sum().backward()
    got = [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
    model.zero_grad()
    model(x).square().sum().backward()
    for g, p in zip(got, model.parameters()):
        assert g is not None
        torch.testing.assert_close(g, p.grad)


def test_check_compile_passes_for_dense_tensor_through_the_dense_path():
    assert check_compile(sten.DenseTensor) == {"compiled_impl": None, "graph_breaks": 0, "reasons": []}


KEEP_CSR = (sten.KeepAll(), sten.CsrTensor, sten.KeepAll(), sten.CsrTensor)
"""A gradient format keeping the weight's layout and pattern (the stored values' gradient)."""


def test_training_step_of_csr_weights_compiles_whole_with_eager_gradients():
    """Sparse weights that require grad with a gradient in their own layout and pattern:
    traceable wrappers (sten_core.dispatch.traceable), forward and backward in one graph
    (sten_core::wrapper_linear), gradients equal eager's and the dense ones at the pattern."""
    model = sparse_mlp()
    for name in ("0", "2"):
        lin = model.get_submodule(name)
        lin.weight = sten.SparseParameterWrapper(lin.weight.wrapped_tensor, requires_grad=True, grad_fmt=KEEP_CSR)
        assert sten.dispatch.traceable.trains_compiled(lin.weight)
    x = torch.randn(6, 24, requires_grad=True)
    run = compiled_training_grads(model, x)
    assert run["graph_breaks"] == 0, run["reasons"]
    want, got = dense_grads(run["eager"]), dense_grads(run["compiled"])
    assert type(run["compiled"][0].wrapped_tensor) is sten.CsrTensor
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    w0, w2 = model[0].weight.to_dense().detach(), model[2].weight.to_dense().detach()
    rw0, rw2 = w0.clone().requires_grad_(True), w2.clone().requires_grad_(True)
    F.linear(torch.relu(F.linear(x.detach(), rw0, model[0].bias.detach())), rw2, model[2].bias.detach()).square().sum().backward()
    torch.testing.assert_close(got[0], rw0.grad * (w0 != 0))
    torch.testing.assert_close(got[2], rw2.grad * (w2 != 0))


def test_register_traceable_layout_checks_its_arguments():
    from sten_core.plugin_api import register_traceable_layout

    with pytest.raises(TypeError, match="layout must be a class"):
        register_traceable_layout("CsrTensor", lambda t: t, lambda t, c: t)
    with pytest.raises(TypeError, match="unflatten must be callable"):
        register_traceable_layout(DenseCopyLayout, lambda t: t, None)
    with pytest.raises(ValueError, match="grad_input and grad_values go together"):
        register_traceable_layout(DenseCopyLayout, lambda t: t, lambda t, c: t, grad_input=lambda *a: a)


def test_check_compile_training_passes_for_csr():
    from sten_core.testing import check_compile_training

    assert check_compile_training(sten.CsrTensor, shapes=((4, 8, 6),)) == {"traceable": True, "graph_breaks": 0}


def test_check_compile_training_says_what_a_layout_lacks(dense_copy):
    from sten_core.testing import check_compile_training

    with pytest.raises(AssertionError, match="not traceable tensor subclasses.*register_traceable_layout"):
        check_compile_training(DenseCopyLayout, shapes=((4, 8, 6),))


@pytest.fixture
def trainable_bitmask(bitmask):
    """The example plugin's BitmaskTensor after its opt-in compiled registration
    (sten_example_plugin.compiled.register_compiled), undone afterwards."""
    from sten_example_plugin.compiled import register_compiled

    from sten_core.dispatch.traceable import unregister_traceable_layout

    class CompiledBitmask:
        sten_register = staticmethod(sten.plugins.hookimpl(register_compiled))

    assert sten.plugins.register_plugin(CompiledBitmask, name="example-compiled")
    try:
        yield bitmask
    finally:
        sten.plugins.unregister_plugin("example-compiled")
        unregister_traceable_layout(bitmask)


def test_check_compile_training_says_what_a_third_party_layout_needs(bitmask):
    """The plugin guide's BitmaskTensor before registering: the kit names every missing piece."""
    from sten_core.testing import check_compile_training

    with pytest.raises(AssertionError) as error:
        check_compile_training(bitmask, shapes=((4, 8, 6),))
    message = str(error.value)
    for piece in ("register_traceable_layout(BitmaskTensor", "flatten", "unflatten", "grad_input", "grad_values",
                  "register_compiled_impl(F.linear", "custom operator", "docs/guides/write-a-plugin.md"):
        assert piece in message, piece


def test_a_third_party_layout_trains_compiled_after_registering(trainable_bitmask):
    """After the guide's registration the example layout's training step compiles whole
    (no breaks, fullgraph) with eager's gradients and the dense ones at the kept positions."""
    from sten_core.testing import check_compile_training

    assert check_compile_training(trainable_bitmask, shapes=((4, 8, 6), (2, 16, 12))) == \
        {"traceable": True, "graph_breaks": 0}
    keep = (sten.KeepAll(), trainable_bitmask, sten.KeepAll(), trainable_bitmask)
    model = sparse_mlp(trainable_bitmask)
    for name in ("0", "2"):
        lin = model.get_submodule(name)
        lin.weight = sten.SparseParameterWrapper(lin.weight.wrapped_tensor, requires_grad=True, grad_fmt=keep)
        assert sten.dispatch.traceable.trains_compiled(lin.weight)
    x = torch.randn(6, 24, requires_grad=True)

    run = compiled_training_grads(model, x)
    assert run["graph_breaks"] == 0, run["reasons"]
    want, got = dense_grads(run["eager"]), dense_grads(run["compiled"])
    assert type(model[0].weight.grad.wrapped_tensor) is trainable_bitmask
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    gw0, gw2, _ = dense_reference_grads(model, x)
    torch.testing.assert_close(got[0], gw0 * (model[0].weight.to_dense() != 0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2], gw2 * (model[2].weight.to_dense() != 0), rtol=1e-5, atol=1e-5)


KEEP_CSC = (sten.KeepAll(), sten.CscTensor, sten.KeepAll(), sten.CscTensor)


def test_training_step_of_csc_weights_compiles_whole_with_eager_gradients():
    """CscTensor trains compiled like CsrTensor (its members are the CSR of W.t())."""
    from sten_core.testing import check_compile_training

    assert check_compile_training(sten.CscTensor, shapes=((4, 8, 6), (3, 16, 12))) == \
        {"traceable": True, "graph_breaks": 0}
    model = sparse_mlp(sten.CscTensor)
    for name in ("0", "2"):
        lin = model.get_submodule(name)
        lin.weight = sten.SparseParameterWrapper(lin.weight.wrapped_tensor, requires_grad=True, grad_fmt=KEEP_CSC)
        assert sten.dispatch.traceable.trains_compiled(lin.weight)
    x = torch.randn(2, 3, 24, requires_grad=True)

    run = compiled_training_grads(model, x)
    assert run["graph_breaks"] == 0, run["reasons"]
    want, got = dense_grads(run["eager"]), dense_grads(run["compiled"])
    assert type(model[0].weight.grad.wrapped_tensor) is sten.CscTensor
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    gw0, gw2, _ = dense_reference_grads(model, x)
    torch.testing.assert_close(got[0], gw0 * (model[0].weight.to_dense() != 0))
    torch.testing.assert_close(got[2], gw2 * (model[2].weight.to_dense() != 0))


@pytest.mark.parametrize("product", ["mm", "matmul", "at", "addmm"])
def test_weight_products_other_than_linear_on_a_trainable_weight_say_what_to_use(product):
    """x @ W.t() and friends on a weight that trains compiled: a clear error naming the
    operator and F.linear (eager densifies W and re-sparsifies its gradient, a new pattern,
    which a compiled graph cannot give back in the weight's structure)."""
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.randn(6, 8)), grad_fmt=KEEP_CSR)
    b = torch.randn(6)
    f = {"mm": lambda x: torch.mm(x, w.t()), "matmul": lambda x: torch.matmul(x, w.t()),
         "at": lambda x: x @ w.t(), "addmm": lambda x: torch.addmm(b, x, w.t())}[product]
    with pytest.raises(Exception, match=r"Tensor.t on a trainable CsrTensor weight.*F.linear\(x, W, b\)"):
        torch.compile(f, fullgraph=True)(torch.randn(3, 8))
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"Tensor.t on a trainable CsrTensor weight"):
        torch.compile(f)(torch.randn(3, 8))


DENSE_GRAD = (sten.KeepAll(), torch.Tensor, sten.KeepAll(), torch.Tensor)
"""The explicit dense gradient format: eager gives the same dense gradient as the default None."""


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CscTensor])
def test_training_step_with_dense_weight_gradients_compiles_whole(layout):
    """grad_fmt=(KeepAll(), Tensor, KeepAll(), Tensor): traceable wrappers whose compiled
    gradient is the plain dense gy.T @ x: no breaks, fullgraph, weight gradients bitwise
    equal to eager's (and to the default grad_fmt's), all equal to the dense model's."""
    model = sparse_mlp(layout)
    x = torch.randn(2, 3, 24, requires_grad=True)
    model(x).square().sum().backward()
    default_grads = [p.grad.clone() for p in model.parameters()]
    for name in ("0", "2"):
        lin = model.get_submodule(name)
        lin.weight = sten.SparseParameterWrapper(lin.weight.wrapped_tensor, requires_grad=True, grad_fmt=DENSE_GRAD)
        assert sten.dispatch.traceable.trains_compiled(lin.weight)
    run = compiled_training_grads(model, x)
    assert run["graph_breaks"] == 0, run["reasons"]
    want, got = run["eager"], run["compiled"]
    assert all(type(g) is torch.Tensor for g in got)
    for i in (0, 2):
        assert torch.equal(got[i], want[i]) and torch.equal(want[i], default_grads[i])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    gw0, gw2, gx = dense_reference_grads(model, x)
    torch.testing.assert_close(got[0], gw0)
    torch.testing.assert_close(got[2], gw2)
    torch.testing.assert_close(got[-1], gx)


def test_other_operators_on_a_frozen_traceable_weight_run_densely():
    """A traceable wrapper is a graph input even when frozen: operators without a compiled
    implementation run on its traced to_dense() (eager's dense fallback), with eager's values."""
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.randn(6, 8)), grad_fmt=KEEP_CSR)
    w.requires_grad_(False)

    def f(x):
        return torch.mm(x, w.t()) + 1

    x = torch.randn(3, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        want = f(x)
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(x), want)
    torch.testing.assert_close(want, x @ w.to_dense().t() + 1)


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CscTensor])
def test_training_with_the_default_grad_fmt_compiles_whole(layout):
    """Trainable weights with the default grad_fmt=None (SparsityBuilder's) are traceable
    parameters: no graph breaks, fullgraph, the weights' dense gradients bitwise eager's (plain
    tensors), all gradients equal eager's."""
    model = sparse_mlp(layout)
    assert all(sten.dispatch.traceable.trains_compiled(model[i].weight) for i in (0, 2))
    x = torch.randn(2, 3, 24, requires_grad=True)
    run = compiled_training_grads(model, x)
    assert run["graph_breaks"] == 0, run["reasons"]
    want, got = run["eager"], run["compiled"]
    assert all(type(g) is torch.Tensor for g in got)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(run["compiled_out"], run["eager_out"])


def test_sgd_steps_with_the_default_grad_fmt_follow_eager():
    models = sgd_steps_eager_and_compiled(lambda: sparse_mlp(seed=3), lambda: torch.randn(6, 24))
    eager, compiled = ([p.to_dense() if isinstance(p, sten.SparseTensorWrapper) else p.detach()
                        for p in m.parameters()] for m in models)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e)
    assert not torch.equal(eager[0], sparse_mlp(seed=3)[0].weight.to_dense())


def test_a_default_weight_is_a_graph_input_only_while_it_trains():
    """The class follows requires_grad (and the layout): frozen, the eager class (Dynamo's
    graph holds the layout's custom operator, as a custom backend sees it); unfrozen, traceable."""
    from sten_core.dispatch.traceable import traceable

    model = sparse_mlp()
    w = model[0].weight
    assert traceable(w)
    model.requires_grad_(False)
    assert not traceable(w) and isinstance(w, sten.SparseParameterWrapper)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch.compile(model, backend=backend, fullgraph=True)(torch.randn(3, 24))
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.sten_core.csr_mm.default) + targets.count(torch.ops.sten_core.csr_mm) == 2
    w.requires_grad = True
    assert traceable(w)
    w.wrapped_tensor = sten.CooTensor.from_dense(w.to_dense().detach())  # not traceable: the eager class
    assert not traceable(w) and w.requires_grad
    w.wrapped_tensor = sten.CsrTensor.from_dense(w.to_dense().detach())
    assert traceable(w)
    w.grad_fmt = (sten.KeepAll(), torch.Tensor, sten.ScalarFractionSparsifier(0.5), sten.CsrTensor)  # re-sparsified
    assert traceable(w)  # trains compiled too (tests/test_compile_regrad.py)
    w.grad_fmt = (sten.ScalarFractionSparsifier(0.5), torch.Tensor, sten.KeepAll(), torch.Tensor)  # masked dense
    assert not traceable(w)


def test_strict_export_of_a_model_with_trainable_default_weights_runs():
    model = sparse_mlp().eval()
    x = torch.randn(4, 24)
    program = torch.export.export(model, (x,), strict=True)
    other = torch.randn(4, 24)
    torch.testing.assert_close(program.module()(other), model(other))


def test_nn_parameter_of_a_default_wrapper_trains_compiled():
    """Module._apply's path that builds nn.Parameter(wrapper) (a detached alias flagged a parameter)."""
    from sten_core.dispatch.traceable import traceable

    w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.randn(6, 8)))
    assert not traceable(w)
    p = torch.nn.Parameter(w)
    assert isinstance(p, torch.nn.Parameter) and p.requires_grad and traceable(p)
    again = torch.nn.Parameter(p)
    assert type(again) is type(p)
