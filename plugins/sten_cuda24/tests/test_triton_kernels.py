"""The Triton kernels give the dense result (CPU under TRITON_INTERPRET=1, or the GPU)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from sten_cuda24 import BlockSparseTensor, encoding

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("activation", [None, "relu"])
def test_sparsify24_kernel_exact(kernel_device, dtype, activation):
    from sten_cuda24.triton_sparsify24 import reference_sparsify24, sparsify24

    x = torch.randn(5, 37).to(dtype).to(kernel_device)
    x[0, :8] = 0.0                                   # underfull groups
    packed, meta, dense = sparsify24(x, activation=activation, write_dense=True)
    ref = reference_sparsify24(x, activation)
    assert torch.equal(dense, ref)
    ref_packed, ref_meta = encoding.compress(ref)
    assert torch.equal(packed, ref_packed) and torch.equal(meta, ref_meta)


def test_sparsify24_kernel_gelu_close(kernel_device):
    from sten_cuda24.triton_sparsify24 import reference_sparsify24, sparsify24

    x = torch.randn(4, 32, device=kernel_device)
    _, _, dense = sparsify24(x, activation="gelu", write_dense=True)
    torch.testing.assert_close(dense, reference_sparsify24(x, "gelu"), atol=1e-5, rtol=1e-5)


def test_sparsify24_kernel_errors(kernel_device):
    from sten_cuda24.triton_sparsify24 import sparsify24

    with pytest.raises(ValueError, match="activation"):
        sparsify24(torch.zeros(2, 16, device=kernel_device), activation="tanh")
    with pytest.raises(TypeError, match="float16, bfloat16, float32"):
        sparsify24(torch.zeros(2, 16, dtype=torch.float64, device=kernel_device))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 2e-2)])
@pytest.mark.parametrize("block", [(16, 16), (32, 16), (128, 64)])
def test_bsr_kernels_match_dense(kernel_device, dtype, tol, block):
    from sten_cuda24.triton_bsr import bsr_linear, bsr_sdd

    torch.manual_seed(0)
    n, k = 40, 50   # not divisible by the block: padded inside
    grid = (-(-n // block[0]), -(-k // block[1]))
    w = BlockSparseTensor.from_dense_block_mask(torch.randn(n, k), torch.rand(grid) < 0.5, block).to(kernel_device, dtype)
    wd = w.to_dense().float()
    x = torch.randn(3, 7, k).to(kernel_device, dtype)
    b = torch.randn(n).to(kernel_device, dtype)
    y = bsr_linear(x, w, b)
    torch.testing.assert_close(y.float(), x.float() @ wd.t() + b.float(), atol=tol, rtol=tol)
    g = torch.randn(3, 7, n).to(kernel_device, dtype)
    gx = bsr_linear(g, w.transposed())
    torch.testing.assert_close(gx.float(), g.float() @ wd, atol=tol, rtol=tol)
    gw = bsr_sdd(g, x, w)
    ref = w.gather((g.reshape(-1, n).float().t() @ x.reshape(-1, k).float()).to(dtype))
    torch.testing.assert_close(gw.float(), ref.float(), atol=tol * 4, rtol=tol)


def test_bsr_kernel_errors(kernel_device):
    from sten_cuda24.triton_bsr import bsr_linear

    w = BlockSparseTensor.from_dense(torch.ones(8, 8, device=kernel_device), (8, 8))
    with pytest.raises(ValueError, match="powers of two in 16..128"):
        bsr_linear(torch.ones(2, 8, device=kernel_device), w)
    w = BlockSparseTensor.from_dense(torch.ones(16, 16, device=kernel_device), (16, 16))
    with pytest.raises(ValueError, match="expects 16"):
        bsr_linear(torch.ones(2, 15, device=kernel_device), w)


@pytest.mark.parametrize("transposable", [False, True])
@pytest.mark.parametrize("shape,tokens", [((64, 128), 40), ((37, 50), 7), ((70, 100), 33)])
def test_sampled_24_weight_gradient_matches_dense(kernel_device, shape, tokens, transposable):
    from sten_cuda24 import sparsify_24
    from sten_cuda24.triton_sdd24 import sdd24

    torch.manual_seed(0)
    w = sparsify_24(torch.randn(*shape), transposable=transposable).to(kernel_device)
    g = torch.randn(tokens, shape[0], device=kernel_device)
    x = torch.randn(tokens, shape[1], device=kernel_device)
    got = sdd24(g, x, w)
    ref = w.gather(g.t() @ x)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(w.with_values(got).mask(), w.mask())


def test_sampled_weight_gradient_through_dispatch(sten, kernel_device, monkeypatch):
    """STEN_CUDA24_SAMPLED_WGRAD=always runs the sampled kernel in the backward of F.linear."""
    import torch.nn.functional as F

    from sten_cuda24 import Sparse24Sparsifier, Sparse24Tensor, paths

    monkeypatch.setenv("STEN_CUDA24_SAMPLED_WGRAD", "always")
    torch.manual_seed(1)
    w = sten.sparsify(Sparse24Sparsifier(), torch.randn(32, 48, device=kernel_device), Sparse24Tensor)
    fmt = (sten.KeepAll(), Sparse24Tensor, sten.KeepAll(), Sparse24Tensor)
    w = sten.SparseParameterWrapper(w.wrapped_tensor, grad_fmt=fmt)
    wd = w.wrapped_tensor.to_dense().clone().requires_grad_(True)
    x = torch.randn(20, 48, device=kernel_device)
    F.linear(x, w).square().sum().backward()
    assert paths.last["grad_weight24"]["path"] == "sampled"
    (gw,) = torch.autograd.grad(F.linear(x, wd).square().sum(), (wd,))
    torch.testing.assert_close(w.grad.wrapped_tensor.to_dense(), gw * w.wrapped_tensor.mask(), atol=1e-4, rtol=1e-4)


def test_pick_faster_times_once_per_key():
    from sten_cuda24 import ops

    calls = []
    times = {"gemm+gather": 2.0, "sampled": 1.0}

    def timer(fn):
        calls.append(fn)
        return times[fn()]

    ops.WGRAD_CHOICE.pop(("k",), None)
    cands = {"gemm+gather": lambda: "gemm+gather", "sampled": lambda: "sampled"}
    assert ops.pick_faster(("k",), cands, timer) == "sampled"
    times["sampled"] = 3.0
    assert ops.pick_faster(("k",), cands, timer) == "sampled" and len(calls) == 2   # cached
    ops.WGRAD_CHOICE.pop(("k",))
    assert ops.pick_faster(("k",), cands, timer) == "gemm+gather"


def test_bfloat16_on_the_triton_interpreter_takes_the_dense_path(sten, monkeypatch):
    """Under TRITON_INTERPRET=1 on CPU the bf16 block-sparse product and the sampled 2:4 weight gradient
    gave values near 1e10 where dense gives about 20, with ``paths.last`` saying 'triton' and no warning."""
    import torch.nn.functional as F

    from sten_cuda24 import Sparse24Sparsifier, Sparse24Tensor, paths

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("STEN_CUDA24_SAMPLED_WGRAD", "always")
    torch.manual_seed(0)
    dense = torch.randn(32, 64).bfloat16()
    x = torch.randn(8, 64).bfloat16()
    block = BlockSparseTensor.from_dense(dense, (16, 16))
    y = F.linear(x, sten.SparseTensorWrapper(block))
    assert paths.last["linear_bsr"]["path"] == "dense" and "TRITON_INTERPRET" in paths.last["linear_bsr"]["why"]
    torch.testing.assert_close(y.float(), F.linear(x, block.to_dense()).float(), atol=0.1, rtol=0.02)

    w = sten.sparsify(Sparse24Sparsifier(), dense, Sparse24Tensor)
    fmt = (sten.KeepAll(), Sparse24Tensor, sten.KeepAll(), Sparse24Tensor)
    w = sten.SparseParameterWrapper(w.wrapped_tensor, grad_fmt=fmt)
    F.linear(x, w).float().square().sum().backward()
    assert paths.last["grad_weight24"]["path"] == "gemm+gather"
    wd = w.wrapped_tensor.to_dense().float().requires_grad_(True)
    (gw,) = torch.autograd.grad(F.linear(x.float(), wd).square().sum(), (wd,))
    torch.testing.assert_close(w.grad.wrapped_tensor.to_dense().float(), gw * w.wrapped_tensor.mask(), atol=2.0, rtol=0.05)
