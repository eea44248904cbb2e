"""F.linear, torch.mm and torch.matmul: values and gradients against dense."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_core.testing import check_linear

from conftest import LAYOUTS, check_against_dense, sample, sparse_fmt, sparse_param
from sten_scipy import ScipyCscTensor, ScipyCsrTensor


@pytest.mark.parametrize("layout", LAYOUTS)
def test_conformance_kit(layout):
    check_linear(layout)
    check_linear(layout, dtype=torch.float64, shapes=((5, 6, 4),))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("x_shape", [(9, 12), (2, 3, 12), (12,)])
def test_linear(layout, bias, x_shape):
    w_dense = sample((7, 12))
    w = sparse_param(layout, w_dense)
    x = torch.randn(x_shape, requires_grad=True)
    b = torch.randn(7, requires_grad=True) if bias else None
    check_against_dense(F.linear, [x, w, b])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("grad_layout", LAYOUTS)
def test_linear_sparse_weight_grad_is_sampled(layout, grad_layout):
    w_dense = sample((6, 10))
    w = sparse_param(layout, w_dense, grad_fmt=sparse_fmt(grad_layout))
    x = torch.randn(4, 10, requires_grad=True)
    b = torch.randn(6, requires_grad=True)
    check_against_dense(F.linear, [x, w, b], masks={1: w_dense != 0})
    assert isinstance(w.grad.wrapped_tensor, grad_layout) and w.grad.wrapped_tensor.nnz == int((w_dense != 0).sum())


def test_sparse_weight_grad_never_densifies(monkeypatch):
    """The sampled path does not form g.T @ x."""
    import sten_scipy.linear as lin

    w = sparse_param(sten.registry.layout("ScipyCsrTensor"), sample((5, 8)), grad_fmt=sparse_fmt(sten.registry.layout("ScipyCsrTensor")))
    x = torch.randn(3, 8)
    seen = []
    original = lin.sampled
    monkeypatch.setattr(lin, "sampled", lambda *a: seen.append(1) or original(*a))
    F.linear(x, w).sum().backward()
    assert seen == [1]


def test_linear_float64():
    layout = LAYOUTS[0]
    w = sparse_param(layout, sample((5, 6), torch.float64))
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    out = check_against_dense(F.linear, [x, w, None], tol={"rtol": 1e-10, "atol": 1e-12})
    assert out.dtype == torch.float64


MM_OPS = [torch.mm, torch.matmul, lambda a, b: a @ b, lambda a, b: a.mm(b), lambda a, b: a.matmul(b)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", MM_OPS, ids=["mm", "matmul", "at", "Tensor.mm", "Tensor.matmul"])
@pytest.mark.parametrize("sparse_grad", [False, True])
def test_mm_both_orders(layout, op, sparse_grad):
    a_dense = sample((6, 9))
    fmt = sparse_fmt(layout) if sparse_grad else None
    masks = {0: a_dense != 0} if sparse_grad else None
    check_against_dense(op, [sparse_param(layout, a_dense, fmt), torch.randn(9, 4, requires_grad=True)], masks=masks)
    masks = {1: a_dense != 0} if sparse_grad else None
    check_against_dense(op, [torch.randn(5, 6, requires_grad=True), sparse_param(layout, a_dense, fmt)], masks=masks)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_matmul_vectors_and_batches(layout):
    a_dense = sample((6, 9))
    check_against_dense(torch.matmul, [sparse_param(layout, a_dense), torch.randn(9, requires_grad=True)])
    check_against_dense(torch.matmul, [torch.randn(6, requires_grad=True), sparse_param(layout, a_dense)])
    check_against_dense(torch.matmul, [torch.randn(2, 3, 6, requires_grad=True), sparse_param(layout, a_dense)])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_grad_forward(layout):
    w_dense = sample((4, 5))
    w = sten.SparseTensorWrapper(layout.from_dense(w_dense))
    x = torch.randn(3, 5)
    with torch.no_grad():
        torch.testing.assert_close(F.linear(x, w), F.linear(x, w_dense))
        torch.testing.assert_close(torch.mm(w, x.t()), w_dense @ x.t())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bad_input(layout):
    w = sten.SparseTensorWrapper(layout.from_dense(sample((4, 5))))
    with pytest.raises(ValueError, match=r"in_features 5.*input shape \(3, 6\)"):
        F.linear(torch.randn(3, 6), w)
    with pytest.raises(TypeError, match="input dtype torch.float64 does not match.*torch.float32"):
        F.linear(torch.randn(3, 5, dtype=torch.float64), w)
    with pytest.raises(ValueError, match=r"bias must have shape \(4,\)"):
        F.linear(torch.randn(3, 5), w, torch.randn(5))
    with pytest.raises(ValueError, match="inner dims must match"):
        torch.mm(w, torch.randn(4, 2))
    with pytest.raises(ValueError, match="inner dims must match"):
        torch.mm(torch.randn(2, 3), w)
    with pytest.raises(ValueError, match="both operands must be 2-D"):
        torch.mm(w, torch.randn(5))



@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(5,), (5, 3), (2, 5, 3), (0, 5, 3)])
def test_matmul_broadcasts_like_dense(layout, shape):
    dense = sample((4, 5))
    w = sten.SparseTensorWrapper(layout.from_dense(dense), requires_grad=True)
    b = torch.randn(*shape, requires_grad=True)
    y = torch.matmul(w, b)
    ref_w, ref_b = dense.clone().requires_grad_(), b.detach().clone().requires_grad_()
    ref = torch.matmul(ref_w, ref_b)
    torch.testing.assert_close(y, ref)
    g = torch.randn(ref.shape)
    y.backward(g)
    ref.backward(g)
    torch.testing.assert_close(b.grad, ref_b.grad)
    torch.testing.assert_close(w.grad, ref_w.grad)


@pytest.mark.parametrize("shape", [(8, 0), (0, 16)])
@pytest.mark.parametrize("layout", [ScipyCsrTensor, ScipyCscTensor])
def test_linear_with_an_empty_weight_is_dense_torchs(layout, shape):
    """``x.reshape(-1, 0)`` raised for a weight with a 0-sized dimension."""
    w = sten.SparseTensorWrapper(layout.from_dense(torch.zeros(*shape)), requires_grad=True)
    x = torch.randn(3, shape[1], requires_grad=True)
    y = F.linear(x, w)
    y.sum().backward()
    assert y.shape == (3, shape[0])
    assert x.grad.shape == x.shape and not x.grad.any()


def test_a_csc_wrappers_dense_form_is_row_major():
    """Its ``to_dense()`` was column-major, so ``w.view(-1)`` raised on a wrapper that reports
    itself contiguous."""
    d = torch.randn(4, 6)
    w = sten.SparseTensorWrapper(ScipyCscTensor.from_dense(d))
    assert w.to_dense().is_contiguous()
    with sten.dispatch.failure_mode("warn"), warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)  # (view runs densely)
        torch.testing.assert_close(w.view(-1), d.reshape(-1))


@pytest.mark.parametrize("layout", [ScipyCsrTensor, ScipyCscTensor])
@pytest.mark.parametrize("op", ["linear", "x @ W", "W @ x.T", "mm"])
def test_a_bfloat16_input_under_cpu_autocast_is_computed_in_float32(layout, op):
    """Under CPU autocast the layer before a scipy weight (a dense Linear, attention) gives bfloat16:
    the scipy product raised a dtype mismatch where the dense model runs. The input is cast to the
    weight's float32 (scipy ignores autocast); values and gradients are the dense model's at bf16
    tolerance."""
    torch.manual_seed(0)
    dense = torch.randn(8, 8) * (torch.rand(8, 8) > 0.5)
    x0 = torch.randn(4, 8)
    product = {"linear": lambda h, w: F.linear(h, w), "x @ W": lambda h, w: h @ w,
               "W @ x.T": lambda h, w: w @ h.t(), "mm": lambda h, w: torch.mm(h, w)}[op]
    results = []
    for w in (sten.SparseParameterWrapper(layout.from_dense(dense)), dense.clone().requires_grad_()):
        x = x0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = F.linear(x, torch.eye(8))
            assert h.dtype == torch.bfloat16
            y = product(h, w)
        y.float().pow(2).sum().backward()
        gw = w.grad.to_dense() if isinstance(w.grad, sten.SparseTensorWrapper) else w.grad * (dense != 0)
        results.append((y.float(), x.grad, gw))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
