"""torch.compile with 2:4 and block-sparse weights (issue #15): the sten_cuda24::...
custom operators, their fake implementations, no graph breaks, fullgraph, compiled
== eager == dense (values and gradients), compiled training steps, torch.export.

Every test runs on the CPU (the operators compute densely there, in the same graph);
the ``cuda`` cases check the same on a GPU (cuSPARSELt / CUTLASS / Triton, the path
asserted) and skip without one. ``FakeTensorMode`` tests trace fake CUDA tensors on
any machine: what the GPU graph holds, and the fake implementations' metadata."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import HAS_CUDA
from torch._subclasses.fake_tensor import FakeTensorMode

import sten_core as sten
from sten_core.model import torch_support
from sten_core.testing import compiled_training_grads
from sten_cuda24 import BlockSparseTensor, Sparse24Tensor, paths, sparsify_24
from sten_cuda24 import compiled as cc

LAYOUTS = ["24", "24t", "bsr"]  # 2:4, 2:4 with the transposed pair, 16x16 blocks
LAYOUT_CLS = {"24": Sparse24Tensor, "24t": Sparse24Tensor, "bsr": BlockSparseTensor}
OPS = {"24": torch.ops.sten_cuda24.linear24.default, "24t": torch.ops.sten_cuda24.linear24.default,
       "bsr": torch.ops.sten_cuda24.linear_bsr.default}
TRACEABLE = pytest.mark.skipif(
    not torch_support.TRACEABLE_WRAPPERS, reason=f"traceable wrappers are off on torch {torch.__version__} (below "
    f"{torch_support.TRACEABLE_MIN_TORCH}, sten_core.model.torch_support): compiled training runs eagerly there "
    f"(tests/test_torch_support.py); STEN_TRACEABLE_WRAPPERS=1 runs these")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (sm_80+); none in this session"))]


@pytest.fixture(autouse=True)
def fresh_dynamo(sten):
    """Every test under set_dispatch_failure("raise") (a CUDA call that goes dense raises)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def dtype_for(device):
    return torch.float16 if device == "cuda" else torch.float32


def tol(dtype):
    return dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def make_layout(kind, dense):
    if kind == "bsr":
        keep = torch.zeros(-(-dense.shape[0] // 16), -(-dense.shape[1] // 16), dtype=torch.bool)
        keep.view(-1)[::2] = True
        return BlockSparseTensor.from_dense_block_mask(dense, keep.to(dense.device), (16, 16))
    return sparsify_24(dense, transposable=kind == "24t")


def mlp(kind, device="cpu", requires_grad=False, seed=0, grad_fmt=None):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16))
    model = model.to(device=device, dtype=dtype_for(device))
    for lin in (model[0], model[2]):
        lin.weight = sten.SparseParameterWrapper(make_layout(kind, lin.weight.detach()), requires_grad=requires_grad,
                                                 grad_fmt=grad_fmt)
    return model


def keep_layout(kind):
    """The gradient format that keeps the weight's layout and pattern (the values' gradient)."""
    return (sten.KeepAll(), LAYOUT_CLS[kind], sten.KeepAll(), LAYOUT_CLS[kind])


def dense_twin(model):
    twin = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16))
    twin = twin.to(device=model[0].bias.device, dtype=model[0].bias.dtype)
    with torch.no_grad():
        for src, dst in ((model[0], twin[0]), (model[2], twin[2])):
            dst.weight.copy_(src.weight.wrapped_tensor.to_dense())
            dst.bias.copy_(src.bias)
    return twin


def assert_gpu_path(kind, device):
    """On CUDA the sparse kernel ran (the raise mode already refuses dense fallbacks)."""
    if device == "cuda":
        op = "linear_bsr" if kind == "bsr" else "linear24"
        assert paths.last[op]["path"] != "dense", paths.last[op]


def eager_and_compiled_grads(model, x):
    """One training step eager and through ``torch.compile(fullgraph=True)`` with no graph break
    (``testing.compiled_training_grads``): the gradients of what requires grad, as dense tensors."""
    run = compiled_training_grads(model, x, loss=lambda y: y.float().square().sum())
    assert run["graph_breaks"] == 0, run["reasons"]
    return [[g.to_dense() if isinstance(g, sten.SparseTensorWrapper) else g for g in run[k] if g is not None]
            for k in ("eager", "compiled")]


# -- layouts as member tensors ----------------------------------------------------------------
@pytest.mark.parametrize("kind", LAYOUTS)
def test_members_rebuild_the_same_layout(kind):
    layout = make_layout(kind, torch.randn(24, 40))
    if kind == "24t":
        assert layout.transposable
    tensors, consts = cc.members(layout)
    back = (cc.rebuild_bsr if kind == "bsr" else cc.rebuild24)(tensors, consts)
    assert type(back) is type(layout) and back.shape == layout.shape
    assert torch.equal(back.to_dense(), layout.to_dense())
    if kind != "bsr":
        assert back.transposable == layout.transposable
        assert (back.live is None) == (layout.live is None)


def test_members_of_a_layout_with_fillers_keep_the_live_mask():
    dense = torch.zeros(4, 16)
    dense[:, 0] = 1.0  # one value per group: fillers in every group
    layout = Sparse24Tensor.from_dense_masked(dense, dense != 0)
    tensors, consts = cc.members(layout)
    assert consts[:2] == [0, 1] and len(tensors) == 3
    assert torch.equal(cc.rebuild24(tensors, consts).mask(), layout.mask())


def test_members_name_the_layouts_they_take():
    with pytest.raises(TypeError, match="Sparse24Tensor or BlockSparseTensor"):
        cc.members(sten.CsrTensor.from_dense(torch.eye(3)))


# -- the operators: values, gradients, fake implementations, opcheck --------------------------
def op_args(kind, bias=True, grad=False, batch=(2, 3)):
    torch.manual_seed(1)
    layout = make_layout(kind, torch.randn(20, 48))
    tensors, consts = cc.members(layout)
    vi = 2 if kind == "bsr" else 0
    if grad:
        tensors = list(tensors)
        tensors[vi] = tensors[vi].clone().requires_grad_(True)
    x = torch.randn(*batch, 48, requires_grad=grad)
    b = torch.randn(20, requires_grad=grad) if bias else None
    return layout, tensors, consts, x, b, vi


@pytest.mark.parametrize("kind", LAYOUTS)
def test_operator_values_and_gradients_equal_the_dense_product(kind):
    layout, tensors, consts, x, b, vi = op_args(kind, grad=True)
    out = OPS[kind](x, tensors, consts, b)
    g = torch.randn_like(out)
    gv, gx, gb = torch.autograd.grad(out, (tensors[vi], x, b), g)
    w = layout.to_dense().requires_grad_(True)
    rx, rb = x.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
    ref = F.linear(rx, w, rb)
    torch.testing.assert_close(out, ref.detach(), **tol(torch.float32))
    rw, rgx, rgb = torch.autograd.grad(ref, (w, rx, rb), g)
    torch.testing.assert_close(gx, rgx, **tol(torch.float32))
    torch.testing.assert_close(gb, rgb)
    mask = layout.mask() if kind != "bsr" else layout.with_values(torch.ones_like(layout.blocks)).to_dense().bool()
    torch.testing.assert_close(layout.with_values(gv.detach()).to_dense(), rw * mask, **tol(torch.float32))


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("bias", [True, False])
def test_operators_pass_opcheck(kind, bias):
    _, tensors, consts, x, b, _ = op_args(kind, bias=bias, grad=True)
    torch.library.opcheck(OPS[kind], (x, tensors, consts, b))
    _, tensors, consts, x, b, _ = op_args(kind, bias=bias, grad=False)
    torch.library.opcheck(OPS[kind], (x, tensors, consts, b))
    name = "linear_bsr" if kind == "bsr" else "linear24"
    gy = torch.randn(*x.shape[:-1], 20)
    for suffix in ("_grad_input", "_grad_values"):
        torch.library.opcheck(getattr(torch.ops.sten_cuda24, name + suffix).default, (gy, x, tensors, consts))


def test_act24_linear_operator_values_gradients_and_opcheck():
    a = sparsify_24(torch.randn(2, 3, 32))
    tensors, consts = cc.members(a)
    values = tensors[0].clone().requires_grad_(True)
    w = torch.randn(12, 32, requires_grad=True)
    b = torch.randn(12, requires_grad=True)
    out = torch.ops.sten_cuda24.act24_linear(([values] + tensors[1:]), consts, w, b)
    ref_x = a.to_dense().requires_grad_(True)
    rw, rb = w.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
    ref = F.linear(ref_x, rw, rb)
    torch.testing.assert_close(out, ref.detach(), **tol(torch.float32))
    g = torch.randn_like(out)
    gv, gw, gb = torch.autograd.grad(out, (values, w, b), g)
    rgx, rgw, rgb = torch.autograd.grad(ref, (ref_x, rw, rb), g)
    torch.testing.assert_close(gw, rgw, **tol(torch.float32))
    torch.testing.assert_close(gb, rgb, **tol(torch.float32))
    torch.testing.assert_close(a.with_values(gv).to_dense(), rgx * a.mask(), **tol(torch.float32))
    torch.library.opcheck(torch.ops.sten_cuda24.act24_linear.default, ([values] + tensors[1:], consts, w, b))
    torch.library.opcheck(torch.ops.sten_cuda24.act24_linear.default, (tensors, consts, w.detach(), None))


@pytest.mark.parametrize("transposable,activation", [(False, None), (True, None), (False, "relu")])
def test_sparsify24_operator_equals_the_sparsifier_and_passes_opcheck(transposable, activation):
    x = torch.randn(8, 40)
    packed, meta, meta_t, live = torch.ops.sten_cuda24.sparsify24(x, transposable, activation)
    want = sparsify_24(x, transposable=transposable, activation=activation)
    assert torch.equal(packed, want.packed) and torch.equal(meta, want.meta)
    assert torch.equal(meta_t, want.meta_t) if transposable else meta_t.numel() == 0
    assert torch.equal(live, want.live if want.live is not None else torch.ones_like(want.packed, dtype=torch.bool))
    torch.library.opcheck(torch.ops.sten_cuda24.sparsify24.default, (x, transposable, activation))


def _fake_cuda(t):
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch", [(5,), (2, 3), ()])
def test_fake_implementations_on_cuda_give_the_dense_formulas_metadata(kind, dtype, batch):
    """Under FakeTensorMode (no GPU needed) every operator on fake CUDA tensors gives
    F.linear's output shape, dtype and device (contiguous), and its gradients' the
    shapes of the input and of the stored values."""
    layout, tensors, consts, _, _, vi = op_args(kind, bias=False)
    layout = layout.to(dtype=dtype)
    tensors, consts = cc.members(layout)
    name = "linear_bsr" if kind == "bsr" else "linear24"
    with FakeTensorMode(allow_non_fake_inputs=True):
        ft = [_fake_cuda(t) for t in tensors]
        x = torch.empty(*batch, 48, dtype=dtype, device="cuda")
        b = torch.empty(20, dtype=dtype, device="cuda")
        want = F.linear(torch.empty(*batch, 48, dtype=dtype, device="meta"), torch.empty(20, 48, dtype=dtype, device="meta"))
        for bias in (None, b):
            y = getattr(torch.ops.sten_cuda24, name)(x, ft, consts, bias)
            assert (y.shape, y.dtype, y.device.type) == (want.shape, dtype, "cuda")
            assert y.is_contiguous()
        gy = torch.empty(*batch, 20, dtype=dtype, device="cuda")
        gx = getattr(torch.ops.sten_cuda24, name + "_grad_input")(gy, x, ft, consts)
        gv = getattr(torch.ops.sten_cuda24, name + "_grad_values")(gy, x, ft, consts)
        assert (gx.shape, gx.dtype, gx.device.type, gx.stride()) == (x.shape, dtype, "cuda", x.stride())
        assert (gv.shape, gv.dtype, gv.device.type) == (ft[vi].shape, dtype, "cuda") and gv.is_contiguous()
        with pytest.raises(TypeError, match="differs from the sparse weight's dtype"):
            getattr(torch.ops.sten_cuda24, name)(x.to(torch.float64), ft, consts, None)
        with pytest.raises(ValueError, match="last dimension is 48"):
            getattr(torch.ops.sten_cuda24, name)(torch.empty(3, 47, dtype=dtype, device="cuda"), ft, consts, None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fake_implementations_of_the_activation_and_sparsify_operators_on_cuda(dtype):
    a = sparsify_24(torch.randn(2, 3, 32, dtype=dtype))
    tensors, consts = cc.members(a)
    reals = {t: sparsify_24(torch.randn(40, 36, dtype=dtype), transposable=t) for t in (False, True)}
    with FakeTensorMode(allow_non_fake_inputs=True):
        ft = [_fake_cuda(t) for t in tensors]
        w = torch.empty(12, 32, dtype=dtype, device="cuda")
        y = torch.ops.sten_cuda24.act24_linear(ft, consts, w, None)
        assert (y.shape, y.dtype, y.device.type) == ((2, 3, 12), dtype, "cuda")
        gv, gw = torch.ops.sten_cuda24.act24_linear_backward(torch.empty(2, 3, 12, dtype=dtype, device="cuda"), ft, consts, w)
        assert gv.shape == ft[0].shape and gw.shape == w.shape
        x = torch.empty(40, 36, dtype=dtype, device="cuda")
        for transposable in (False, True):
            packed, meta, meta_t, live = torch.ops.sten_cuda24.sparsify24(x, transposable, None)
            real = reals[transposable]
            assert (packed.shape, packed.dtype, meta.shape, meta.dtype) == (real.packed.shape, dtype, real.meta.shape, torch.int16)
            assert live.shape == packed.shape and live.dtype == torch.bool
            assert meta_t.shape == (real.meta_t.shape if transposable else (0,))


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("grad", [False, pytest.param(True, marks=[TRACEABLE, pytest.mark.skipif(
    not torch.version.cuda, reason="autograd on fake CUDA tensors needs a CUDA build of torch (a CPU build aborts "
    "in AccumulateGrad); the training step is traced on real CPU tensors in the tests below")])])
def test_a_model_on_fake_cuda_tensors_traces_whole_with_the_custom_operators(kind, grad):
    """What the GPU graph holds, checked without a GPU: Dynamo traces an inference MLP
    (and, on a CUDA build of torch, a training step of traceable weights) on fake CUDA
    tensors with no graph break, one sten_cuda24 operator per sparse Linear."""
    cpu = mlp(kind)
    with FakeTensorMode(allow_non_fake_inputs=True):
        if True:
            model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16))
            for src, lin in ((cpu[0], model[0]), (cpu[2], model[2])):
                layout = src.weight.wrapped_tensor.to(dtype=torch.float16)
                tensors, consts = cc.members(layout)
                fake = (cc.rebuild_bsr if kind == "bsr" else cc.rebuild24)([_fake_cuda(t) for t in tensors], consts)
                lin.weight = sten.SparseParameterWrapper(fake, requires_grad=grad, grad_fmt=keep_layout(kind) if grad else None)
                lin.bias = torch.nn.Parameter(_fake_cuda(src.bias.detach().half()))
            x = torch.empty(4, 32, dtype=torch.float16, device="cuda")
            with torch.set_grad_enabled(grad):
                explained = torch._dynamo.explain(model)(x)
            assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
            code = explained.graphs[0].code
            op = "sten_core.wrapper_linear" if grad else f"sten_cuda24.{'linear_bsr' if kind == 'bsr' else 'linear24'}"
            assert code.count(op) == 2, code
            torch._dynamo.reset()


# -- compiled models ---------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("shape", [(5, 32), (2, 3, 32)])
def test_inference_compiles_whole_and_equals_eager_and_dense(device, kind, shape):
    model = mlp(kind, device).eval()
    x = torch.randn(*shape, device=device, dtype=dtype_for(device))
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(x)
        assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
        torch._dynamo.reset()
        want = model(x)
        got = torch.compile(model, fullgraph=True)(x)
        assert_gpu_path(kind, device)
        dense = dense_twin(model)(x)
    assert type(got) is torch.Tensor and got.dtype == x.dtype
    torch.testing.assert_close(got, want, **tol(x.dtype))
    torch.testing.assert_close(got, dense, **tol(x.dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", LAYOUTS)
def test_frozen_sparse_weights_train_compiled_whole_with_eager_gradients(device, kind):
    model = mlp(kind, device)
    x = torch.randn(6, 32, device=device, dtype=dtype_for(device), requires_grad=True)
    want, got = eager_and_compiled_grads(model, x)
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol(x.dtype))
    rx = x.detach().clone().requires_grad_(True)
    dense_twin(model)(rx).float().square().sum().backward()
    torch.testing.assert_close(got[-1], rx.grad, **tol(x.dtype))


@TRACEABLE
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", LAYOUTS)
def test_training_step_of_sparse_weights_compiles_whole_with_eager_and_dense_gradients(device, kind):
    """Weights that require grad with their gradient in their own layout: traceable
    wrappers, forward and backward in one graph (sten_core::wrapper_linear over
    sten_cuda24's operators); gradients equal eager's and the dense ones at the kept positions."""
    model = mlp(kind, device, requires_grad=True, grad_fmt=keep_layout(kind))
    assert sten.dispatch.traceable.trains_compiled(model[0].weight)
    x = torch.randn(6, 32, device=device, dtype=dtype_for(device), requires_grad=True)
    want, got = eager_and_compiled_grads(model, x)
    assert_gpu_path(kind, device)
    assert type(model[0].weight.grad.wrapped_tensor) is LAYOUT_CLS[kind]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol(x.dtype))
    dense = dense_twin(model)
    rx = x.detach().clone().requires_grad_(True)
    dense(rx).float().square().sum().backward()
    for lin, ref, g in ((model[0], dense[0], got[0]), (model[2], dense[2], got[2])):
        layout = lin.weight.wrapped_tensor
        mask = layout.with_values(torch.ones_like(layout.values())).to_dense() != 0
        torch.testing.assert_close(g, ref.weight.grad * mask, **tol(x.dtype))
    torch.testing.assert_close(got[-1], rx.grad, **tol(x.dtype))


@TRACEABLE
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["24t", "bsr"])
def test_compiled_optimizer_steps_follow_eager(device, kind):
    """Three SGD steps, eager and compiled from the same start: the same weights (the
    in-place update is seen by the compiled graph, the cached GPU operand refreshed)."""
    def run(compile_it):
        model = mlp(kind, device, requires_grad=True, grad_fmt=keep_layout(kind))
        step = torch.compile(model, fullgraph=True) if compile_it else model
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        torch.manual_seed(1)
        for _ in range(3):
            opt.zero_grad()
            step(torch.randn(6, 32, device=device, dtype=dtype_for(device))).float().square().sum().backward()
            opt.step()
        return [p.to_dense() if isinstance(p, sten.SparseTensorWrapper) else p.detach().clone()
                for p in model.parameters()]

    eager, compiled = run(False), run(True)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, **tol(dtype_for(device)))
    assert not torch.equal(eager[0], mlp(kind, device)[0].weight.to_dense())  # the steps changed it


@pytest.mark.parametrize("device", DEVICES)
def test_mm_and_matmul_with_a_24_first_operand_compile_whole(device):
    dtype = dtype_for(device)
    a = sten.SparseTensorWrapper(sparsify_24(torch.randn(24, 32, device=device, dtype=dtype)))
    b = torch.randn(32, 5, device=device, dtype=dtype)
    v = torch.randn(32, device=device, dtype=dtype)

    def f(b, v):
        return torch.mm(a, b) + 2 * torch.matmul(a, b), torch.matmul(a, v)

    explained = torch._dynamo.explain(f)(b, v)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True)(b, v)
    want = f(b, v)
    dense = a.wrapped_tensor.to_dense()
    for g, w, d in zip(got, want, (3 * dense @ b, dense @ v)):
        torch.testing.assert_close(g, w, **tol(dtype))
        torch.testing.assert_close(g, d, **tol(dtype))


def test_the_matmul_operator_with_a_sparse_left_operand_compiles_correctly():
    """``W @ x`` (Dynamo once swapped the operands: x @ W, silently wrong for square ones)."""
    a = sten.SparseTensorWrapper(sparsify_24(torch.randn(16, 16)))
    b = torch.randn(16, 16)
    explained = torch._dynamo.explain(lambda a, b: a @ b)(a, b)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    torch._dynamo.reset()
    got = torch.compile(lambda a, b: a @ b, fullgraph=True)(a, b)
    torch.testing.assert_close(got, a.wrapped_tensor.to_dense() @ b, **tol(b.dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_linear_with_a_24_activation_compiles_whole(device):
    dtype = dtype_for(device)
    a = sten.SparseTensorWrapper(sparsify_24(torch.randn(6, 32, device=device, dtype=dtype)))
    lin = torch.nn.Linear(32, 16).to(device=device, dtype=dtype)

    def f(w, b):
        return F.linear(a, w, b)

    w, b = lin.weight.detach().requires_grad_(True), lin.bias.detach().requires_grad_(True)
    explained = torch._dynamo.explain(f)(w, b)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True)(w, b)
    gw, gb = torch.autograd.grad(got.float().square().sum(), (w, b))
    rw, rb = w.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
    ref = F.linear(a.wrapped_tensor.to_dense(), rw, rb)
    torch.testing.assert_close(got, ref, **tol(dtype))
    rgw, rgb = torch.autograd.grad(ref.float().square().sum(), (rw, rb))
    torch.testing.assert_close(gw, rgw, **tol(dtype))
    torch.testing.assert_close(gb, rgb, **tol(dtype))


@pytest.mark.parametrize("kind", LAYOUTS)
def test_strict_export_holds_the_custom_operator_and_runs(kind):
    model = mlp(kind).eval()
    x = torch.randn(5, 32)
    with torch.no_grad():
        program = torch.export.export(model, (x,), strict=True)
        torch.testing.assert_close(program.module()(x), model(x), **tol(x.dtype))
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert targets.count(OPS[kind]) == 2


def test_compiled_autocast_follows_eager():
    """Under CPU autocast (bf16) the compiled call casts input, bias and stored values
    like eager does: same dtype, same values."""
    model = mlp("24").eval()
    x = torch.randn(5, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(x)
        got = torch.compile(model, fullgraph=True)(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)


def test_compiled_calls_reject_bad_inputs_naming_them():
    model = mlp("24").eval()
    with pytest.raises(Exception, match="last dimension is 32"):
        torch.compile(model, fullgraph=True)(torch.randn(2, 31))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="input dtype float64 differs from the sparse weight's dtype float32"):
        torch.compile(model, fullgraph=True)(torch.randn(2, 32, dtype=torch.float64))
    a = sten.SparseTensorWrapper(sparsify_24(torch.randn(8, 32)))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="other must have 32 rows"):
        torch.compile(lambda b: torch.matmul(a, b), fullgraph=True)(torch.randn(31, 2))


@TRACEABLE
@pytest.mark.parametrize("device", DEVICES)
def test_the_operand_is_built_once_per_weight(device):
    """A compiled model rebuilds each weight's layout (and its GPU operand) once, not per call."""
    model = mlp("24t", device, requires_grad=True, grad_fmt=keep_layout("24t"))
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(4, 32, device=device, dtype=dtype_for(device))
    compiled(x).float().sum().backward()
    before = cc.REBUILT["count"]
    for _ in range(3):
        compiled(x).float().sum().backward()
    assert cc.REBUILT["count"] == before


@pytest.mark.parametrize("layout", [Sparse24Tensor, BlockSparseTensor])
def test_the_conformance_kit_finds_the_layouts_compile_ready(layout):
    from sten_core.testing import check_compile, check_compile_training

    sparsifier = sten.PerBlockFractionSparsifier(2, 4) if layout is Sparse24Tensor else sten.ScalarFractionSparsifier(0.5)
    report = check_compile(layout, require_compiled_impl=True, sparsifier=sparsifier)
    assert report["compiled_impl"].endswith("_compiled") and report["graph_breaks"] == 0
    assert check_compile_training(layout, shapes=((4, 16, 12),), sparsifier=sparsifier) == \
        {"traceable": True, "graph_breaks": 0}
