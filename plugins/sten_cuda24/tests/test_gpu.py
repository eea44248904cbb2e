"""GPU tests: cuSPARSELt / CUTLASS 2:4 matmuls, the nvcc/ctypes sparsifier, padding,
training through the dispatcher. Skipped (with the reason) without a CUDA GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sten_cuda24 import BlockSparseTensor, Sparse24Sparsifier, Sparse24Tensor, _compat, encoding, sparsify_24

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (sm_80+); none in this session")

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


def test_alg_search_cached():
    _backend_or_skip("cusparselt")
    from sten_cuda24 import backends

    w = sparsify_24(torch.randn(256, 256, device="cuda", dtype=torch.float16))
    x = torch.randn(64, 256, device="cuda", dtype=torch.float16)
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
    assert torch.equal(encoding.decompress(packed_t, meta_t, shape[0]), ref.t())


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
    torch.testing.assert_close(x.grad.float(), gx, atol=0.5, rtol=5e-2)
    mask = lin.weight.wrapped_tensor.mask()
    torch.testing.assert_close(lin.weight.grad.wrapped_tensor.to_dense().float(), gw * mask, atol=1.0, rtol=5e-2)


def test_block_sparse_linear_on_gpu():
    import sten_core as sten

    dense = torch.randn(512, 1024, device="cuda", dtype=torch.float16)
    w = sten.sparsify(sten.BlockwiseFractionSparsifier(0.9, (64, 64)), dense, BlockSparseTensor)
    x = torch.randn(256, 1024, device="cuda", dtype=torch.float16)
    y = F.linear(x, w)
    torch.testing.assert_close(y.float(), x.float() @ w.wrapped_tensor.to_dense().float().t(), atol=5e-2, rtol=1e-2)


def test_cpu_tensor_to_gpu_weight_is_a_clear_error():
    from sten_cuda24 import backends

    w = sparsify_24(torch.randn(64, 64, device="cuda", dtype=torch.float16))
    with pytest.raises(ValueError, match="is on cpu"):
        backends.linear(torch.randn(4, 64, dtype=torch.float16), w)
