"""Operators and sparsifiers through STen's dispatch, on CPU (dense paths and,
under TRITON_INTERPRET=1, the Triton kernels), compared with dense references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sten_cuda24 import BlockSparseTensor, Sparse24Sparsifier, Sparse24Tensor
from sten_cuda24 import encoding, plugin


def test_plugin_info_reports_reason():
    info = plugin.sten_plugin_info()
    assert info["name"] == "cuda24" and info["version"]
    if not torch.cuda.is_available():
        assert info["available"] is False and "CUDA" in info["reason"]


def test_plugin_registered(sten):
    report = {r["name"]: r for r in sten.plugins.plugin_report()}
    assert {"Sparse24Tensor", "BlockSparseTensor"} <= set(report["cuda24"]["layouts"])


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("sparse_grad", [False, True])
def test_linear24_forward_backward(sten, bias, sparse_grad):
    torch.manual_seed(0)
    w = sten.sparsify(Sparse24Sparsifier(), torch.randn(12, 20), Sparse24Tensor)
    grad_fmt = (sten.KeepAll(), Sparse24Tensor, sten.KeepAll(), Sparse24Tensor) if sparse_grad else None
    w = sten.SparseParameterWrapper(w.wrapped_tensor, grad_fmt=grad_fmt)
    wd = w.wrapped_tensor.to_dense().clone().requires_grad_(True)
    x = torch.randn(2, 3, 20, requires_grad=True)
    b = torch.randn(12, requires_grad=True) if bias else None
    y = F.linear(x, w, b)
    ref = F.linear(x, wd, b)
    torch.testing.assert_close(y, ref)
    gx_ref, gw_ref = torch.autograd.grad(ref.square().sum(), (x, wd))
    y.square().sum().backward()
    torch.testing.assert_close(x.grad, gx_ref)
    grad = w.grad.wrapped_tensor.to_dense() if hasattr(w.grad, "wrapped_tensor") else w.grad
    mask = w.wrapped_tensor.mask()
    if sparse_grad:
        assert isinstance(w.grad.wrapped_tensor, Sparse24Tensor)
        torch.testing.assert_close(grad, gw_ref * mask)   # only at the kept positions
    else:
        torch.testing.assert_close(grad, gw_ref)


def test_per_block_fraction_maps_to_24(sten):
    x = torch.randn(8, 16)
    w = sten.sparsify(sten.PerBlockFractionSparsifier(2, 4), x, Sparse24Tensor)
    assert isinstance(w.wrapped_tensor, Sparse24Tensor)
    torch.testing.assert_close(w.wrapped_tensor.to_dense(), x * encoding.row_mask(x))
    w1 = sten.sparsify(sten.PerBlockFractionSparsifier(1, 4), x, Sparse24Tensor)
    assert int((w1.wrapped_tensor.to_dense() != 0).sum()) == 8 * 4
    with pytest.raises(ValueError, match="m == 4 and n <= 2"):
        sten.sparsify(sten.PerBlockFractionSparsifier(3, 4), x, Sparse24Tensor)


def test_transposable_sparsifier(sten):
    w = sten.sparsify(Sparse24Sparsifier(transposable=True), torch.randn(16, 32), Sparse24Tensor)
    assert w.wrapped_tensor.transposable
    x = torch.randn(5, 32, requires_grad=True)
    F.linear(x, w).sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(5, 16) @ w.wrapped_tensor.to_dense())


def test_mm24(sten):
    a = sten.sparsify(Sparse24Sparsifier(), torch.randn(8, 16), Sparse24Tensor)
    b = torch.randn(16, 5, requires_grad=True)
    y = torch.mm(a, b)
    torch.testing.assert_close(y, a.wrapped_tensor.to_dense() @ b)
    y.sum().backward()
    torch.testing.assert_close(b.grad, a.wrapped_tensor.to_dense().t() @ torch.ones(8, 5))


def test_blockwise_fraction_maps_to_bsr(sten):
    x = torch.randn(64, 96)
    w = sten.sparsify(sten.BlockwiseFractionSparsifier(0.5, (16, 32)), x, BlockSparseTensor)
    layout = w.wrapped_tensor
    assert isinstance(layout, BlockSparseTensor) and layout.block_shape == (16, 32)
    assert layout.num_blocks == 6
    torch.testing.assert_close(layout.to_dense(), x * sten.BlockwiseFractionSparsifier(0.5, (16, 32)).mask(x))


@pytest.mark.parametrize("sparse_grad", [False, True])
def test_linear_bsr_forward_backward(sten, sparse_grad):
    torch.manual_seed(1)
    layout = BlockSparseTensor.from_dense_block_mask(torch.randn(40, 48), torch.rand(3, 3) < 0.6, (16, 16))
    grad_fmt = (sten.KeepAll(), BlockSparseTensor, sten.KeepAll(), BlockSparseTensor) if sparse_grad else None
    w = sten.SparseParameterWrapper(layout, grad_fmt=grad_fmt)
    wd = layout.to_dense().clone().requires_grad_(True)
    x = torch.randn(7, 48, requires_grad=True)
    b = torch.randn(40, requires_grad=True)
    y = F.linear(x, w, b)
    ref = F.linear(x, wd, b)
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
    gx_ref, gw_ref = torch.autograd.grad(ref.square().sum(), (x, wd))
    y.square().sum().backward()
    torch.testing.assert_close(x.grad, gx_ref, atol=1e-4, rtol=1e-4)
    grad = w.grad.wrapped_tensor.to_dense() if sparse_grad else w.grad
    expect = gw_ref * (layout.to_dense() != 0) if sparse_grad else gw_ref
    torch.testing.assert_close(grad, expect, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("act", ["relu", "gelu", "silu"])
def test_fused_activation_inline_sparsifier(sten, act):
    fn = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}[act]
    op = sten.sparsified_op(fn, out_fmt=(Sparse24Sparsifier(), Sparse24Tensor, sten.KeepAll(), Sparse24Tensor), grad_out_fmt=None)
    x = torch.randn(4, 24, requires_grad=True)
    y = op(x)
    assert isinstance(y.wrapped_tensor, Sparse24Tensor)
    ref = fn(x.detach())
    ref = ref * encoding.row_mask(ref)
    torch.testing.assert_close(y.wrapped_tensor.to_dense(), ref, atol=1e-5, rtol=1e-5)
    w = torch.randn(6, 24, requires_grad=True)
    out = F.linear(y, w)       # 2:4 activation x dense weight
    torch.testing.assert_close(out, ref @ w.detach().t(), atol=1e-5, rtol=1e-5)
    out.sum().backward()
    xx = x.detach().requires_grad_(True)
    mask = y.wrapped_tensor.mask()
    (fn(xx) * mask @ w.detach().t()).sum().backward()
    torch.testing.assert_close(x.grad, xx.grad, atol=1e-5, rtol=1e-5)


def test_gpu_only_paths_refuse_cpu_tensors():
    from sten_cuda24 import backends
    s = Sparse24Tensor.from_dense(torch.zeros(32, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="CUDA tensors only"):
        backends.linear(torch.zeros(4, 64, dtype=torch.float16), s)
    with pytest.raises(ValueError, match="expects 64"):
        backends.linear(torch.zeros(4, 63, dtype=torch.float16), s)
    with pytest.raises(TypeError, match="dtype"):
        backends.linear(torch.zeros(4, 64), s)
    with pytest.raises(ValueError, match="2-D"):
        backends.linear(torch.zeros(4, 64, dtype=torch.float16), Sparse24Tensor.from_dense(torch.zeros(2, 32, 64, dtype=torch.float16)))
    from sten_cuda24.cuda_lib import sparsify24_cuda
    with pytest.raises(ValueError, match="CUDA tensors only"):
        sparsify24_cuda(torch.zeros(4, 16))
    with pytest.raises(TypeError, match="float16, bfloat16, float32"):
        sparsify24_cuda(torch.zeros(4, 16, dtype=torch.float64))


@pytest.mark.parametrize("kind", ["24", "bsr"])
def test_one_dtype_rule(sten, kind):
    """The input must have the weight's dtype on every device (as dense F.linear);
    under autocast everything runs in the autocast dtype."""
    torch.manual_seed(0)
    dense = torch.randn(32, 64)
    if kind == "24":
        w = sten.sparsify(Sparse24Sparsifier(), dense.half(), Sparse24Tensor)
    else:
        w = sten.SparseTensorWrapper(BlockSparseTensor.from_dense_block_mask(dense.half(), torch.tensor([[True, False], [False, True]]), (16, 32)))
    x = torch.randn(4, 64)
    with pytest.raises(TypeError, match=r"input dtype float32 differs from the sparse weight's dtype float16; cast the input"):
        F.linear(x, w)
    with pytest.raises(TypeError, match="bias dtype"):
        F.linear(x.half(), w, torch.zeros(32))
    y = F.linear(x.half(), w)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float(), x.half().float() @ w.wrapped_tensor.to_dense().float().t(), atol=1e-2, rtol=1e-2)
    with torch.autocast("cpu", dtype=torch.float16):
        ya = F.linear(x, w, torch.zeros(32))
    assert ya.dtype == torch.float16
    torch.testing.assert_close(ya.float(), y.float(), atol=1e-2, rtol=1e-2)


def test_gpu_matmul_names_the_same_dtype_rule():
    from sten_cuda24 import backends

    s = Sparse24Tensor.from_dense(torch.zeros(32, 64, dtype=torch.float16))
    with pytest.raises(TypeError, match="input dtype float32 differs from the sparse weight's dtype float16"):
        backends._check_operands(torch.zeros(4, 64), s, None)


@pytest.mark.parametrize("sparse_grad", [False, True])
def test_paths_are_recorded(sten, sparse_grad):
    """Every operator call records its path; CPU tensors compute densely without a warning."""
    import warnings

    from sten_cuda24 import paths

    layout = BlockSparseTensor.from_dense_block_mask(torch.randn(32, 32), torch.tensor([[True, False], [True, True]]), (16, 16))
    grad_fmt = (sten.KeepAll(), BlockSparseTensor, sten.KeepAll(), BlockSparseTensor) if sparse_grad else None
    w = sten.SparseParameterWrapper(layout, grad_fmt=grad_fmt)
    x = torch.randn(3, 32, requires_grad=True)
    paths.last.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        F.linear(x, w).sum().backward()
    from sten_cuda24 import _compat

    expect = "triton" if _compat.triton_interpret() and _compat.has_triton() else "dense"
    assert paths.last["linear_bsr"]["path"] == expect
    assert paths.last["grad_input_bsr"]["path"] == expect
    assert paths.last["grad_weight_bsr"]["path"] == (expect if sparse_grad else "dense")


def test_cuda_dense_fallback_warns_or_raises(sten):
    """A CUDA call that cannot use the sparse kernel is a dense fallback: DispatchError
    under set_dispatch_failure("raise") (the fixture), one DispatchWarning under "warn"."""
    import types
    import warnings

    from sten_cuda24 import paths

    on_gpu = types.SimpleNamespace(device=torch.device("cuda"))
    with pytest.raises(sten.DispatchError, match="linear_bsr: the sparse kernel cannot run \\(triton is not installed\\)"):
        paths.dense("linear_bsr", on_gpu, "triton is not installed")
    assert paths.last["linear_bsr"] == {"path": "dense", "why": "triton is not installed"}
    sten.set_dispatch_failure("warn")
    paths._warned.discard(("linear_bsr", "test reason"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paths.dense("linear_bsr", on_gpu, "test reason")
        paths.dense("linear_bsr", on_gpu, "test reason")
    assert [w.category for w in caught] == [sten.DispatchWarning]
    paths.dense("linear_bsr", torch.zeros(1), "tensors on cpu")   # CPU: the designed path, silent


@pytest.mark.parametrize("sampled", ["never", "always"])
def test_mm24_sparse_grad_of_the_2_4_operand(sten, sampled, monkeypatch):
    monkeypatch.setenv("STEN_CUDA24_SAMPLED_WGRAD", sampled)
    torch.manual_seed(2)
    a = sten.sparsify(Sparse24Sparsifier(transposable=True), torch.randn(16, 32), Sparse24Tensor)
    fmt = (sten.KeepAll(), Sparse24Tensor, sten.KeepAll(), Sparse24Tensor)
    a = sten.SparseParameterWrapper(a.wrapped_tensor, grad_fmt=fmt)
    ad = a.wrapped_tensor.to_dense().clone().requires_grad_(True)
    b = torch.randn(32, 20, requires_grad=True)
    torch.mm(a, b).square().sum().backward()
    ga, gb = torch.autograd.grad(torch.mm(ad, b).square().sum(), (ad, b))
    assert isinstance(a.grad.wrapped_tensor, Sparse24Tensor)
    torch.testing.assert_close(a.grad.wrapped_tensor.to_dense(), ga * a.wrapped_tensor.mask(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(b.grad, gb, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_24_weight_times_float32_is_float32_as_in_torch(sten, dtype):
    """``W * x`` kept the 2:4 weight's dtype: bf16 * float32 came back bf16, the product rounded
    (1 + 2^-12 became 1.0), where torch promotes to float32."""
    d = torch.tensor([[1.0, 0.0, 3.0, 0.0]]).repeat(2, 2).to(dtype)
    x = torch.full((2, 8), 1.0 + 2 ** -12)
    W = sten.SparseTensorWrapper(Sparse24Tensor.from_dense(d))
    for got in (W * x, torch.mul(W, x)):
        assert isinstance(got.wrapped_tensor, Sparse24Tensor) and got.dtype == torch.float32
        torch.testing.assert_close(got.to_dense(), d * x, rtol=0, atol=0)
    with pytest.raises(TypeError, match="float16, bfloat16, float32; got float64"):
        torch.zeros_like(W, dtype=torch.float64)  # a dtype 2:4 cannot store: said, not ignored
    assert torch.zeros_like(W, dtype=torch.float32).dtype == torch.float32


@pytest.mark.parametrize("write", ["mul_ bool", "mul_ int", "masked_fill_"])
def test_block_sparse_in_place_writes_take_bool_and_int_operands(sten, write):
    """``W.mul_(mask)`` (applying a pruning mask) raised "BlockSparseTensor supports ...; got
    torch.bool": reading an operand at the stored positions checked it as if it were stored."""
    torch.manual_seed(0)
    d = torch.randn(8, 8)
    d[:4, :4] = 0
    W = sten.SparseTensorWrapper(BlockSparseTensor.from_dense(d, (4, 4)))
    keep = d <= 0
    with torch.no_grad():
        if write == "mul_ bool":
            W.mul_(keep)
        elif write == "mul_ int":
            W.mul_(keep.to(torch.int64))
        else:
            W.masked_fill_(~keep, 0.0)
    assert isinstance(W.wrapped_tensor, BlockSparseTensor) and W.dtype == torch.float32
    torch.testing.assert_close(W.to_dense(), d * keep)


def test_explain_says_a_cpu_product_ran_densely(sten):
    """On CPU the layouts' products are dense torch products (documented): ``sten explain`` said nothing
    of it ("0 dense fallbacks", no note), so a CPU user could not see where the time went."""
    import torch.nn.functional as F

    from sten_core.tools.explain import format_report
    from sten_cuda24 import Sparse24Sparsifier, Sparse24Tensor

    w = sten.sparsify(Sparse24Sparsifier(), torch.randn(8, 16), Sparse24Tensor)
    with sten.explain() as report:
        F.linear(torch.randn(2, 16), w)
    assert "chose: sten_cuda24 linear24: dense torch product (tensors on cpu)" in format_report(report)
