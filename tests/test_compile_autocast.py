"""Compiled products under CPU ``torch.autocast`` return eager's dtype (issue #15).

The layouts' custom operators have no autocast rule: before, a compiled ``F.linear`` / ``x @ W``
with a sparse weight under ``torch.autocast("cpu", dtype=torch.bfloat16)`` silently returned
float32 where eager (and dense torch) return bfloat16 (``sten_core.dispatch.compiled.autocast_result``).
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_core.dispatch.compiled import autocast_result

BF16 = dict(rtol=1.6e-2, atol=2e-2)
PRODUCTS = {
    "F.linear(x, W, b)": lambda w, x, b: F.linear(x, w, b),
    "x @ W.t() via F.linear, 3-D x": lambda w, x, b: F.linear(x.unsqueeze(0).expand(2, -1, -1), w),
    "x @ W": lambda w, x, b: x[:, : w.shape[0]] @ w,
    "torch.matmul(x, W)": lambda w, x, b: torch.matmul(x[:, : w.shape[0]], w),
    "W.matmul(x.t())": lambda w, x, b: w.matmul(x.t()),
}

EAGER_IGNORES_AUTOCAST = {"x @ W", "W.matmul(x.t())"}


def _weight(layout: type, trainable: bool) -> sten.SparseParameterWrapper:
    g = torch.Generator().manual_seed(3)
    dense = torch.randn(12, 16, generator=g) * (torch.rand(12, 16, generator=g) > 0.5)
    return sten.SparseParameterWrapper(layout.from_dense(dense), requires_grad=trainable)


def _run(fn, w, x, b, compiled: bool):
    xi = x.clone().requires_grad_(True)
    torch._dynamo.reset()
    with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.bfloat16):
        warnings.simplefilter("ignore")
        y = torch.compile(lambda t: fn(w, t, b), fullgraph=True)(xi) if compiled else fn(w, xi, b)
    torch._dynamo.reset()
    y.float().square().sum().backward()
    wgrad = w.grad if isinstance(w, torch.Tensor) and w.requires_grad else None
    wgrad = wgrad.to_dense() if isinstance(wgrad, sten.SparseTensorWrapper) else wgrad
    return y, xi.grad, wgrad


TRAINABLE_PRODUCTS = ("F.linear(x, W, b)", "x @ W.t() via F.linear, 3-D x")  # the others: frozen weights


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CscTensor])
@pytest.mark.parametrize("product, trainable", [(p, False) for p in PRODUCTS] + [(p, True) for p in TRAINABLE_PRODUCTS])
def test_compiled_products_under_cpu_autocast_return_eagers_dtype(layout, product, trainable):
    fn = PRODUCTS[product]
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(7))
    b = torch.linspace(-1, 1, 12)
    w = _weight(layout, trainable)
    eager = _run(fn, w, x, b, compiled=False)
    w.grad = None
    compiled = _run(fn, w, x, b, compiled=True)
    dense_w = torch.nn.Parameter(w.to_dense().detach().clone(), requires_grad=trainable)
    dense = _run(fn, dense_w, x, b, compiled=False)
    assert dense[0].dtype == torch.bfloat16
    assert compiled[0].dtype == torch.bfloat16, f"{layout.__name__} {product}: compiled gave {compiled[0].dtype}"
    # eager's x @ W and W.matmul(x) with a CSR/CSC weight ignore autocast (float32; torch.matmul and
    # F.linear do not): the dense model is the reference there
    references = ((dense, "dense"),) if product in EAGER_IGNORES_AUTOCAST else ((eager, "eager"), (dense, "dense"))
    for got, name in references:
        torch.testing.assert_close(compiled[0].float(), got[0].float(), **BF16, msg=lambda m: f"{name}: {m}")
        _close_in_scale(compiled[1], got[1], f"x's gradient vs {name}")
        if trainable:
            _close_in_scale(compiled[2], got[2], f"W's gradient vs {name}")


def _close_in_scale(got: torch.Tensor, want: torch.Tensor, case: str) -> None:
    """Equal within bfloat16's precision of the tensor's scale (gradients are sums of bf16 products:
    one ulp of the output moves a small entry's relative error a lot)."""
    assert got.dtype == want.dtype, f"{case}: dtype {got.dtype} vs {want.dtype}"
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * want.abs().max().item(), msg=lambda m: f"{case}: {m}")


def test_autocast_result_leaves_float64_and_autocast_off_alone():
    y = torch.ones(1, 3)
    assert autocast_result(F.linear, (torch.ones(1, 2),), y) is y  # autocast off
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_result(F.linear, (torch.ones(1, 2, dtype=torch.float64),), y) is y
        assert autocast_result(torch.Tensor.t, (y,), y) is y  # not a product
        assert autocast_result(F.linear, (torch.ones(1, 2),), y).dtype == torch.bfloat16


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CscTensor])
@pytest.mark.parametrize("backend", ["explain", "eager", "aot_eager"])
def test_graphs_run_by_dynamos_eager_backends_under_autocast(layout, backend):
    """``torch._dynamo.explain`` and ``backend="eager"`` run Dynamo's graph with autocast still on:
    the CSR custom operators then ran ``torch.sparse.mm`` on float32 operands cast to bfloat16 by
    autocast (``NotImplementedError: "addmm_out_sparse_csr_impl_mkl" not implemented for 'BFloat16'``);
    they now compute with autocast off, in the dtypes the graph gives them."""
    ws = [_weight(layout, False) for _ in range(2)]
    ws[1] = sten.SparseParameterWrapper(layout.from_dense(ws[1].to_dense()[:, :12]), requires_grad=False)
    fn = lambda t: F.linear(F.linear(t, ws[0]).relu(), ws[1])
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(7))
    torch._dynamo.reset()
    with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.bfloat16):
        warnings.simplefilter("ignore")
        eager = fn(x)
        if backend == "explain":
            assert torch._dynamo.explain(fn)(x).graph_break_count == 0
            compiled = torch.compile(fn, backend="eager")(x)
        else:
            compiled = torch.compile(fn, backend=backend, fullgraph=True)(x)
    torch._dynamo.reset()
    assert compiled.dtype == eager.dtype == torch.bfloat16
    torch.testing.assert_close(compiled.float(), eager.float(), **BF16)
