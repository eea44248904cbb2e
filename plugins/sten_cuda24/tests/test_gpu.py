"""GPU tests: cuSPARSELt / CUTLASS 2:4 matmuls, the nvcc/ctypes sparsifier, padding,
block-sparse Triton kernels (forward and backward), in-place operand refresh, and
20-step training per layout through the dispatcher. Skipped (with the reason)
without a CUDA GPU; the nvcc sparsifier tests also need nvcc.

Tests that take the ``sten`` fixture run under ``set_dispatch_failure("raise")``:
a CUDA call that would compute densely raises, and ``paths.last`` says which
kernel ran."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sten_cuda24 import BlockSparseTensor, Sparse24Sparsifier, Sparse24Tensor, _compat, encoding, paths, sparsify_24

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (sm_80+); none in this session")
requires_nvcc = pytest.mark.skipif(_compat.nvcc_path() is None, reason="nvcc not found (set STEN_NVCC or CUDA_HOME, or put nvcc on PATH)")
requires_triton = pytest.mark.skipif(not _compat.has_triton(), reason="triton is not installed")

BACKENDS = ["cusparselt", "cutlass"]


def _backend_or_skip(name: str) -> None:
    ok = {"cusparselt": _compat.has_cusparselt, "cutlass": _compat.has_cutlass}[name]()
    if not ok:
        pytest.skip(f"{name} is not available in torch {torch.__version__}")


def test_plugin_available():
    from sten_cuda24 import plugin

    info = plugin.sten_plugin_info()
    assert info["available"], info["reason"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(128, 256, 64), (100, 72, 7), (4096, 4096, 333)])  # (N, K, tokens); odd ones are padded
@pytest.mark.parametrize("bias", [False, True])
def test_semi_structured_linear(backend, dtype, shape, bias):
    _backend_or_skip(backend)
    from sten_cuda24 import backends

    n, k, t = shape
    w = sparsify_24(torch.randn(n, k, device="cuda", dtype=dtype))
    x = torch.randn(t, k, device="cuda", dtype=dtype)
    b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    y = backends.linear(x, w, b, backend=backend)
    assert backends.last_path["path"] == backend
    ref = F.linear(x.float(), w.to_dense().float(), None if b is None else b.float())
    torch.testing.assert_close(y.float(), ref, atol=0.1 * (k ** 0.5) / 8, rtol=2e-2)


def test_alg_search_cached(monkeypatch):
    _backend_or_skip("cusparselt")
    from sten_cuda24 import backends

    monkeypatch.setenv("STEN_CUDA24_CSLT_SEARCH", "1")   # opt-in; bf16 (an fp16 search broke the context on torch 2.11)
    w = sparsify_24(torch.randn(256, 256, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    backends.ALG_CACHE.clear()
    backends.linear(x, w, backend="cusparselt")
    assert len(backends.ALG_CACHE) == 1
    backends.linear(x, w, backend="cusparselt")
    assert len(backends.ALG_CACHE) == 1


def test_fp32_one_of_two_uses_cutlass_else_dense():
    _backend_or_skip("cutlass")
    from sten_cuda24 import backends

    dense = torch.randn(64, 128, device="cuda")
    one2 = dense * torch.zeros(64, 64, 2, device="cuda", dtype=torch.bool).scatter_(-1, torch.randint(0, 2, (64, 64, 1), device="cuda"), True).reshape(64, 128)
    x = torch.randn(32, 128, device="cuda")
    y = backends.linear(x, Sparse24Tensor.from_dense(one2))
    assert backends.last_path["path"] == "cutlass"
    torch.testing.assert_close(y, x @ one2.t(), atol=1e-2, rtol=1e-2)
    w = sparsify_24(dense)
    y = backends.linear(x, w)
    assert backends.last_path["path"] == "dense"
    torch.testing.assert_close(y, x @ w.to_dense().t(), atol=1e-3, rtol=1e-3)


@requires_nvcc
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(64, 128), (37, 50), (1024, 4096)])
def test_cuda_sparsifier_matches_reference(dtype, shape):
    from sten_cuda24.cuda_lib import sparsify24_cuda

    x = torch.randn(*shape, device="cuda").to(dtype)
    packed, meta, _, _, dense = sparsify24_cuda(x, write_dense=True)
    ref = x * encoding.row_mask(x)
    assert torch.equal(dense, ref)
    rp, rm = encoding.compress(ref)
    assert torch.equal(packed, rp) and torch.equal(meta, rm)
    # transposable: both orientations 2:4, equal to the torch reference
    packed, meta, packed_t, meta_t, dense = sparsify24_cuda(x, transposable=True, write_dense=True)
    ref = x * encoding.transposable_mask(x)
    assert torch.equal(dense, ref)
    assert torch.equal(encoding.decompress(packed, meta, shape[1]), ref)
    assert torch.equal(encoding.decompress(packed_t, meta_t, shape[0]), ref.t())   # fillers hold zeros
    s = sparsify_24(x, transposable=True)
    assert torch.equal(s.mask(), (ref != 0).cpu().to(s.mask().device)) and torch.equal(s.to_dense(), ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_sparsifier_on_gpu(dtype):
    from sten_cuda24.triton_sparsify24 import reference_sparsify24, sparsify24

    x = torch.randn(300, 1000, device="cuda", dtype=dtype)
    for act in (None, "relu"):
        packed, meta, dense = sparsify24(x, activation=act, write_dense=True)
        ref = reference_sparsify24(x, act)
        assert torch.equal(dense, ref)
        assert torch.equal(meta, encoding.compress(ref)[1])


@pytest.mark.parametrize("transposable", [False, True])
def test_training_step_through_dispatch(transposable):
    import sten_core as sten

    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 256, device="cuda", dtype=torch.bfloat16)
    w = sten.sparsify(Sparse24Sparsifier(transposable=transposable), lin.weight.detach(), Sparse24Tensor)
    fmt = (sten.KeepAll(), Sparse24Tensor, sten.KeepAll(), Sparse24Tensor)
    lin.weight = sten.SparseParameterWrapper(w.wrapped_tensor, grad_fmt=fmt)
    wd = w.wrapped_tensor.to_dense().float().requires_grad_(True)
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = lin(x)
    ref = F.linear(x.float(), wd, lin.bias.float())
    torch.testing.assert_close(y.float(), ref, atol=0.1, rtol=2e-2)
    y.float().square().sum().backward()
    gx, gw = torch.autograd.grad(ref.square().sum(), (x, wd))
    torch.testing.assert_close(x.grad.float(), gx.float(), atol=0.5, rtol=5e-2)
    mask = lin.weight.wrapped_tensor.mask()
    torch.testing.assert_close(lin.weight.grad.wrapped_tensor.to_dense().float(), gw * mask, atol=1.0, rtol=5e-2)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block", [(64, 64), (128, 128), (32, 128), (16, 16)])
@pytest.mark.parametrize("shape", [(512, 1024, 256), (200, 300, 33)])   # (N, K, tokens); the second is padded
def test_block_sparse_forward_backward_on_gpu(sten, dtype, block, shape):
    torch.manual_seed(0)
    n, k, t = shape
    dense = torch.randn(n, k, device="cuda", dtype=dtype)
    w = sten.sparsify(sten.BlockwiseFractionSparsifier(0.9 if block[0] <= 64 else 0.75, block), dense, BlockSparseTensor)
    layout = w.wrapped_tensor
    fmt = (sten.KeepAll(), BlockSparseTensor, sten.KeepAll(), BlockSparseTensor)
    w = sten.SparseParameterWrapper(layout, grad_fmt=fmt)
    wd = layout.to_dense().float().requires_grad_(True)
    x = torch.randn(t, k, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(n, device="cuda", dtype=dtype, requires_grad=True)
    paths.last.clear()
    y = F.linear(x, w, b)
    assert paths.last["linear_bsr"]["path"] == "triton", paths.last
    ref = F.linear(x.float(), wd, b.float())
    tol = dict(atol=1e-3 * k ** 0.5, rtol=1e-3) if dtype == torch.float32 else dict(atol=3e-2 * k ** 0.5 / 4, rtol=2e-2)
    torch.testing.assert_close(y.float(), ref, **tol)
    gy = torch.randn_like(y)
    y.backward(gy)
    assert paths.last["grad_input_bsr"]["path"] == "triton" and paths.last["grad_weight_bsr"]["path"] == "triton", paths.last
    gx, gw = torch.autograd.grad(ref, (x, wd), gy.float())
    torch.testing.assert_close(x.grad.float(), gx.float(), **tol)
    tol_w = dict(atol=tol["atol"] * (t / k) ** 0.5 + tol["atol"], rtol=tol["rtol"])
    torch.testing.assert_close(w.grad.wrapped_tensor.to_dense().float(), gw * (layout.to_dense() != 0), **tol_w)


@requires_triton
def test_block_sparse_matches_torch_bsr_dense_mm(sten):
    from torch.sparse._triton_ops import bsr_dense_mm

    dense = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    layout = sten.sparsify(sten.BlockwiseFractionSparsifier(0.9, (64, 64)), dense, BlockSparseTensor).wrapped_tensor
    x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    ours = F.linear(x, sten.SparseTensorWrapper(layout))
    assert paths.last["linear_bsr"]["path"] == "triton"
    theirs = bsr_dense_mm(layout.to_torch_bsr(), x.t().contiguous()).t()
    torch.testing.assert_close(ours.float(), theirs.float(), atol=0.1, rtol=2e-2)


def test_cpu_tensor_to_gpu_weight_is_a_clear_error():
    from sten_cuda24 import backends

    w = sparsify_24(torch.randn(64, 64, device="cuda", dtype=torch.float16))
    with pytest.raises(ValueError, match="is on cpu"):
        backends.linear(torch.randn(4, 64, dtype=torch.float16), w)


def rel_close(got: torch.Tensor, want: torch.Tensor, what: str, rel: float = 3e-2) -> None:
    """Relative Frobenius error below ``rel`` (half-precision rounding, not a loose atol)."""
    err = float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))
    assert err < rel, f"{what}: relative error {err:.3g} >= {rel}"


def _layout_for(kind: str, sten, dense: torch.Tensor):
    if kind == "bsr":
        return sten.sparsify(sten.BlockwiseFractionSparsifier(0.75, (64, 64)), dense, BlockSparseTensor).wrapped_tensor
    return sten.sparsify(Sparse24Sparsifier(transposable=kind == "24t"), dense, Sparse24Tensor).wrapped_tensor


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["24", "24t", "bsr"])
def test_twenty_training_steps_per_layout(sten, kind, dtype):
    """20 SGD-momentum steps of a 2-layer MLP with a sparse first layer. Every step, the sparse
    forward, input gradient and weight gradient match the dense computation with the
    *current* weight (no drift), the mask never changes, fillers stay zero, the loss falls,
    and the sparse kernels are the ones that ran."""
    if kind == "bsr" and not _compat.has_triton():
        pytest.skip("triton is not installed")
    from sten_cuda24 import backends

    torch.manual_seed(0)
    cls = BlockSparseTensor if kind == "bsr" else Sparse24Tensor
    layout = _layout_for(kind, sten, torch.randn(512, 256, device="cuda", dtype=dtype) * 0.05)
    fmt = (sten.KeepAll(), cls, sten.KeepAll(), cls)
    w1 = sten.SparseParameterWrapper(layout, grad_fmt=fmt)
    w2 = torch.nn.Parameter(torch.randn(64, 512, device="cuda", dtype=dtype) * 0.05)
    opt = torch.optim.SGD([w1, w2], lr=0.05, momentum=0.9, weight_decay=1e-4)   # Adam's eps underflows in fp16
    x = torch.randn(128, 256, device="cuda", dtype=dtype)
    target = torch.randn(128, 64, device="cuda", dtype=dtype)
    mask0 = layout.mask() if kind != "bsr" else layout.to_dense() != 0
    losses = []
    for step in range(20):
        cur = w1.wrapped_tensor
        wd = cur.to_dense().float().requires_grad_(True)
        xx = x.clone().requires_grad_(True)
        opt.zero_grad()
        h = F.linear(xx, w1)
        loss = (F.linear(F.relu(h), w2) - target).float().square().sum(1).mean()
        loss.backward()
        losses.append(loss.item())
        ref_h = F.linear(xx.detach().float().requires_grad_(True), wd)
        rel_close(h, ref_h, f"step {step} forward")
        if kind == "bsr":
            assert paths.last["linear_bsr"]["path"] == "triton" and paths.last["grad_input_bsr"]["path"] == "triton", paths.last
        else:
            assert paths.last["linear24"]["path"] in ("cusparselt", "cutlass"), paths.last
            if kind == "24t":
                assert paths.last["grad_input24"]["path"] in ("cusparselt", "cutlass"), paths.last
        # the dense gradients of the same loss at the current weight
        xr = x.float().requires_grad_(True)
        hr = F.linear(xr, wd)
        lr = (F.linear(F.relu(hr).to(dtype).float(), w2.detach().float()) - target.float()).square().sum(1).mean()
        gx, gw = torch.autograd.grad(lr, (xr, wd))
        rel_close(xx.grad, gx, f"step {step} input grad")
        rel_close(w1.grad.wrapped_tensor.to_dense(), gw * mask0, f"step {step} weight grad")
        opt.step()
        now = w1.wrapped_tensor
        assert torch.equal((now.mask() if kind != "bsr" else now.to_dense() != 0) | mask0, mask0), f"step {step}: mask grew"
        assert not bool(now.to_dense()[~mask0].any()), f"step {step}: a filler became nonzero"
    assert losses[-1] < losses[0], losses
    if kind != "bsr":
        backend = _compat.semi_structured_backend()
        prep = w1.wrapped_tensor._cache[("prepared", backend)][1]
        assert prep.refresh in ("view", "copy", "prefix", "scatter", "recompress"), prep.refresh
        print(f"{kind} {dtype}: operand refresh per step = {prep.refresh}")


def test_cusparselt_refresh_in_place_matches_recompress():
    _backend_or_skip("cusparselt")
    from sten_cuda24 import backends

    w = sparsify_24(torch.randn(256, 512, device="cuda", dtype=torch.bfloat16))
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    backends.linear(x, w, backend="cusparselt")
    for _ in range(3):
        w.values().add_(torch.randn_like(w.values()))
        w = w.with_values(w.values())
        y = backends.linear(x, w, backend="cusparselt")
        prep = w._cache[("prepared", "cusparselt")][1]
        fresh = torch._cslt_compress(w.to_dense())          # every slot nonzero: the same metadata
        assert torch.equal(prep.compressed.view(torch.uint8), fresh.view(torch.uint8)), "refreshed buffer != recompressed"
        xt = x.t().contiguous()
        ours = torch._cslt_sparse_mm(prep.compressed, xt, transpose_result=True)
        torch.testing.assert_close(ours, torch._cslt_sparse_mm(fresh, xt, transpose_result=True), atol=0, rtol=0)
        rel_close(y, F.linear(x.float(), w.to_dense().float()), "refreshed product vs dense")
    print(f"cuSPARSELt buffer layout: {prep.refresh}")
    assert prep.refresh in ("prefix", "scatter"), f"cuSPARSELt's buffer was not a permutation of the values: {prep.refresh}"
