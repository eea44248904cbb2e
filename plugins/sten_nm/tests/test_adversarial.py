"""Adversarial checks of the three n:m layouts (exact ``NMTensor``, the paper's
``ColumnGroupedNMTensor``, the 16-row ``GroupedNMTensor``) as a user reaches them: through
``SparseTensorWrapper`` / ``SparsityBuilder`` and ``F.linear`` / ``x @ W.t()`` /
``torch.matmul``, with odd shapes, strided / expanded / aliasing operands, values views at
odd offsets, in-place weight updates after a product (cached packed copies), checkpoints,
copies, dtypes, autocast, threads and every ISA; every result against the dense reference of
the kept weight (values, input gradient, weight gradient at kept positions)."""

import copy
import io
import os
import pickle
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_nm import (ColumnGroupedNMSparsifier, ColumnGroupedNMTensor, GroupedNMSparsifier, GroupedNMTensor,
                     NMSparsifier, NMTensor)

from conftest import requires_kernel

LAYOUTS = {
    "nm": (NMTensor, NMSparsifier),
    "paper": (ColumnGroupedNMTensor, ColumnGroupedNMSparsifier),
    "grouped16": (GroupedNMTensor, GroupedNMSparsifier),
}
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _layout(name: str, w: torch.Tensor, n: int = 2, m: int = 4):
    return LAYOUTS[name][0].from_dense(w, n, m)


def _param(t, sparse_grad: bool = True):
    """A trainable wrapper; ``sparse_grad``: its gradient in its own layout at its pattern."""
    L = type(t)
    fmt = (sten.KeepAll(), L, sten.KeepAll(), L) if sparse_grad else None
    return sten.SparseParameterWrapper(sten.SparseTensorWrapper(t, requires_grad=True, grad_fmt=fmt))


def _close(got, want, tol=1e-4):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    scale = max(1.0, float(want.detach().float().abs().max())) if want.numel() else 1.0
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale)


def _weight_grad(P):
    g = P.grad
    return g.wrapped_tensor.to_dense() if isinstance(g, sten.SparseTensorWrapper) else g


def _check_fwd_bwd(t, x, go_fn=torch.randn_like, op=F.linear, sparse_grad=True, tol=1e-4):
    """``op(x, W)`` forward and backward against the dense kept weight."""
    P = _param(t, sparse_grad)
    x = x.detach().requires_grad_()
    y = op(x, P)
    go = go_fn(y)
    y.backward(go)
    d = t.to_dense().detach().requires_grad_()
    xr = x.detach().requires_grad_()
    yr = op(xr, d)
    yr.backward(go)
    _close(y, yr, tol)
    _close(x.grad, xr.grad, tol)
    _close(_weight_grad(P), d.grad * t.mask() if sparse_grad else d.grad, tol)


OPS = {
    "linear": F.linear,
    "at_t": lambda x, w: x @ w.t(),
    "matmul": lambda x, w: torch.matmul(x, w.t()),
}


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("N,K", [(7, 13), (19, 41), (1, 5), (33, 70), (0, 8), (8, 0)])
@pytest.mark.parametrize("xshape", [(), (0,), (1,), (5,), (2, 3)])
def test_shapes(name, N, K, xshape):
    """1-D / batch 0, 1, odd / 3-D x; N, K not multiples of m or 16; N=0, K=0 (F.linear)."""
    t = _layout(name, torch.randn(N, K))
    _check_fwd_bwd(t, torch.randn(*xshape, K))


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("op", ["at_t", "matmul"])
@pytest.mark.parametrize("N,K,xshape", [(19, 41, ()), (19, 41, (1,)), (7, 13, (2, 3)), (0, 8, (5,)), (8, 0, (5,))])
def test_matmul_forms(name, op, N, K, xshape):
    """``x @ W.t()`` and ``torch.matmul(x, W.t())``."""
    t = _layout(name, torch.randn(N, K))
    _check_fwd_bwd(t, torch.randn(*xshape, K), op=OPS[op])


def _x_variants(B: int, K: int) -> dict:
    return {
        "transposed": torch.randn(K, B).t(),
        "stride2": torch.randn(B, 2 * K)[:, ::2],
        "expanded": torch.randn(1, K).expand(B, K),
        "offset1": torch.randn(B * K + 1)[1:].view(B, K),
        "3d_permuted": torch.randn(K, 3, B).permute(2, 1, 0),
        "channels_last": torch.randn(2, K, 3, B).to(memory_format=torch.channels_last).permute(0, 2, 3, 1),
    }


GO = {
    "contiguous": torch.randn_like,
    "transposed": lambda y: torch.randn(tuple(reversed(y.shape))).permute(*reversed(range(y.dim()))),
    "expanded": lambda y: torch.randn(y.shape[-1]).expand(y.shape),
}


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("xv", list(_x_variants(1, 1)))
@pytest.mark.parametrize("go", GO)
@pytest.mark.parametrize("sparse_grad", [True, False])
def test_strided_operands(name, xv, go, sparse_grad):
    """Non-contiguous, transposed, expanded, channels-last x and grad_output."""
    t = _layout(name, torch.randn(19, 41))
    _check_fwd_bwd(t, _x_variants(5, 41)[xv], go_fn=GO[go], sparse_grad=sparse_grad)


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [1, 3])
@pytest.mark.parametrize("variant", ["1", "2"])
def test_values_view_at_odd_offset(isa, name, dtype, offset, variant, monkeypatch):
    """``with_values(flat[offset:].view_as(v))``: unaligned values, every ISA, both paper-format
    loop orders (stream, tiled on packed tiles)."""
    monkeypatch.setenv("STEN_NM_CG_VARIANT", variant)
    t = _layout(name, torch.randn(40, 300).to(dtype))
    v = t.values()
    flat = torch.randn(v.numel() + offset).to(dtype)
    u = t.with_values(flat[offset:].view_as(v))
    _check_fwd_bwd(u, torch.randn(50, 300, dtype=dtype), tol=1e-4 if dtype == torch.float32 else 3e-2)


MUTATIONS = {
    "mul_": lambda v: v.mul_(-2),
    "copy_": lambda v: v.copy_(torch.randn_like(v)),
    "fill_": lambda v: v.fill_(0.5),
    "view_write": lambda v: v.view(-1).__setitem__(slice(3, 9), 100.0),
    "detach_mul_": lambda v: v.detach().mul_(3),
}


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("mutation", MUTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", ["1", "2"])
def test_in_place_value_update_after_a_product(name, mutation, dtype, variant, monkeypatch):
    """Cached copies (float32 conversion, packed tiles) follow in-place changes of the values
    (``torch.no_grad`` updates: the tensor's version counter)."""
    monkeypatch.setenv("STEN_NM_CG_VARIANT", variant)
    t = _layout(name, torch.randn(30, 300).to(dtype))
    W = sten.SparseTensorWrapper(t)
    x = torch.randn(50, 300, dtype=dtype)
    F.linear(x, W)
    with torch.no_grad():
        MUTATIONS[mutation](t.values())
    _close(F.linear(x, W), F.linear(x, t.to_dense()), 1e-4 if dtype == torch.float32 else 2e-2)


def _model(name: str, seed: int, n: int = 2, m: int = 4):
    torch.manual_seed(seed)
    L, S = LAYOUTS[name]
    sb = sten.SparsityBuilder(torch.nn.Linear(300, 30))
    sb.set_weight("weight", S(n, m), out_format=L)
    return sb.get_sparse_model()


def _dense_of(model, x):
    return F.linear(x, model.weight.wrapped_tensor.to_dense(), model.bias)


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("optim", ["sgd", "adam"])
def test_optimizer_steps_then_products(name, autocast, optim, monkeypatch):
    """Training steps update the values in place; each next product sees them (fp32 weights,
    with and without bf16 autocast: the rounded copy is rebuilt)."""
    monkeypatch.setenv("STEN_NM_CG_VARIANT", "2")
    model = _model(name, 0)
    opt = (torch.optim.SGD(model.parameters(), lr=0.5) if optim == "sgd"
           else torch.optim.Adam(model.parameters(), lr=0.1))
    x = torch.randn(64, 300)
    before = model.weight.wrapped_tensor.to_dense().clone()
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y, yr = model(x), _dense_of(model, x)
        _close(y, yr, 2e-2 if autocast else 1e-4)
        y.float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    after = model.weight.wrapped_tensor.to_dense()
    assert not torch.equal(before, after) and bool(((after != 0) <= (before != 0)).all())


@pytest.mark.parametrize("name", LAYOUTS)
def test_checkpoint_copy_pickle_then_products(name, monkeypatch):
    """load_state_dict into a model that already ran (cached copies), torch.save/load,
    deepcopy and pickle: each copy computes with its own values."""
    monkeypatch.setenv("STEN_NM_CG_VARIANT", "2")
    x = torch.randn(50, 300)
    a, b = _model(name, 0), _model(name, 1)
    a(x)
    a.load_state_dict(b.state_dict())
    _close(a(x), b(x))
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    c = _model(name, 2)
    c(x)
    c.load_state_dict(torch.load(buf))
    _close(c(x), a(x))
    d, e = copy.deepcopy(a), pickle.loads(pickle.dumps(a))
    with torch.no_grad():
        d.weight.wrapped_tensor.values().mul_(3)
    _close(d(x), _dense_of(d, x))
    _close(a(x), _dense_of(a, x))
    _close(e(x), a(x))


@pytest.mark.parametrize("name", LAYOUTS)
def test_aliasing_operands(name):
    """x that is the weight's own dense matrix or a view of its values storage; the same
    wrapper on both sides of a product."""
    t = _layout(name, torch.randn(30, 300))
    W, d = sten.SparseTensorWrapper(t), t.to_dense()
    _close(F.linear(d, W), F.linear(d, d))
    xv = t.values().reshape(-1)[: 3 * 300].view(3, 300)
    _close(F.linear(xv, W), F.linear(xv.clone(), d))
    _close(torch.matmul(W, W.t()), d @ d.t())


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("sparse_grad", [True, False])
def test_one_weight_in_several_products(name, sparse_grad):
    """One trainable weight in three products, twice in one (``W @ W.t()``): its gradients add up."""
    t = _layout(name, torch.randn(19, 41))
    P, dr = _param(t, sparse_grad), t.to_dense().requires_grad_()
    x1, x2 = torch.randn(5, 41), torch.randn(3, 2, 41)
    for w in (P, dr):
        (F.linear(x1, w).square().sum() + (x2 @ w.t()).sin().sum() + torch.matmul(w, w.t()).sum()).backward()
    _close(_weight_grad(P), dr.grad * t.mask() if sparse_grad else dr.grad)


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("amp", [None, torch.bfloat16, torch.float16])
def test_dtype_and_autocast_match_dense(name, dtype, amp):
    """Weight and x of one dtype, with and without CPU autocast: dense's result dtype and values."""
    t = _layout(name, torch.randn(19, 41).to(dtype))
    W, d = sten.SparseTensorWrapper(t), t.to_dense()
    x = torch.randn(5, 41).to(dtype)
    with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
        y, yr = F.linear(x, W), F.linear(x, d)
    low = torch.float16 in (y.dtype, dtype) or torch.bfloat16 in (y.dtype, dtype)
    _close(y, yr, 2e-2 if low else 1e-5)


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("sparse_grad", [True, False])
def test_gradcheck_float64(name, sparse_grad):
    """gradcheck of x and bias; the weight gradient in float64 equals dense's at kept positions."""
    t = _layout(name, torch.randn(7, 10, dtype=torch.float64))
    W = sten.SparseTensorWrapper(t)
    x = torch.randn(3, 10, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, b: F.linear(x, W, b), (x, b))
    _check_fwd_bwd(t, torch.randn(3, 10, dtype=torch.float64), sparse_grad=sparse_grad, tol=1e-10)


@requires_kernel
@pytest.mark.parametrize("name", LAYOUTS)
def test_thread_counts_agree(isa, name):
    t = _layout(name, torch.randn(70, 300))
    W, x = sten.SparseTensorWrapper(t), torch.randn(33, 300)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            _close(F.linear(x, W), F.linear(x, t.to_dense()))
    finally:
        torch.set_num_threads(before)


def test_sparse_weight_gradient_keeps_the_pattern_without_the_kernel():
    """Without the C extension (the products run densely: STen's fallback or a conversion), a
    weight whose ``grad_fmt`` keeps its layout still gets its gradient at its own pattern, as
    with the kernels (was: the dense gradient re-sparsified by magnitude into a new n:m
    pattern, silently another gradient). Every layout, float32 and bfloat16."""
    code = """
        import warnings, torch, torch.nn.functional as F
        import sten_core as sten
        from sten_nm import ColumnGroupedNMTensor, GroupedNMTensor, NMTensor, _kernel
        assert not _kernel.available()[0]
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        for L in (NMTensor, ColumnGroupedNMTensor, GroupedNMTensor):
            for dtype in (torch.float32, torch.bfloat16):
                t = L.from_dense(torch.randn(16, 40).to(dtype), 2, 4)
                P = sten.SparseParameterWrapper(sten.SparseTensorWrapper(
                    t, requires_grad=True, grad_fmt=(sten.KeepAll(), L, sten.KeepAll(), L)))
                x = torch.randn(3, 40, dtype=dtype)
                F.linear(x, P).sum().backward()
                d = t.to_dense().requires_grad_()
                F.linear(x, d).sum().backward()
                g = P.grad.wrapped_tensor
                assert type(g) is L and g.same_pattern(t), (L, dtype, "gradient in another pattern")
                torch.testing.assert_close(g.to_dense(), d.grad * t.mask(), rtol=1e-2, atol=1e-2)
        print("ok")
    """
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "STEN_NM_LIBRARY": "/nonexistent/libstennm.so"}, cwd=os.path.dirname(HERE))
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr


@requires_kernel
@pytest.mark.parametrize("name", ["nm", "paper"])   # the tuned layouts (the 16-row one has no choice)
def test_tuning_fresh_cache_then_foreign_choices(name, monkeypatch, tmp_path):
    """Tuning on with a fresh cache file: forward and backward equal dense; a cache whose
    choices name no candidate of this version (hand-edited, another version's names) is
    re-tuned, not a crash (was: ``KeyError`` in the paper format's forward)."""
    import json

    from sten_nm import tuning

    path = tmp_path / "fresh" / "tuning.json"
    monkeypatch.setenv("STEN_NM_TUNE", "1")
    monkeypatch.setenv("STEN_NM_TUNE_CACHE", str(path))
    tuning.forget()
    try:
        t = _layout(name, torch.randn(40, 64))
        _check_fwd_bwd(t, torch.randn(20, 64))
        saved = json.loads(path.read_text())
        assert saved["choices"] and saved["build"] == tuning.build()
        tuning.forget()
        saved["choices"] = {k: {**v, "choice": "bogus"} for k, v in saved["choices"].items()}
        path.write_text(json.dumps(saved))
        monkeypatch.setattr(tuning, "_loaded_from", None)   # read the file again
        _check_fwd_bwd(t, torch.randn(20, 64))
        assert all(v["choice"] != "bogus" for v in tuning.choices().values())
    finally:
        tuning.forget()
