"""torch.add and torch.mul with scipy operands: values and gradients against dense."""

import warnings

import pytest
import torch

import sten_core as sten
from sten_scipy import ScipyCscTensor, ScipyCsrTensor

from conftest import LAYOUTS, check_against_dense, sample, sparse_fmt, sparse_param

ADD_FORMS = {
    "torch.add": lambda a, b: torch.add(a, b),
    "alpha": lambda a, b: torch.add(a, b, alpha=0.5),
    "operator": lambda a, b: a + b,
    "Tensor.add": lambda a, b: a.add(b, alpha=2),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("form", ADD_FORMS, ids=str)
def test_add_sparse_dense(layout, form):
    op = ADD_FORMS[form]
    w = sample((5, 6))
    out = check_against_dense(op, [sparse_param(layout, w), torch.randn(5, 6, requires_grad=True)])
    assert not isinstance(out, sten.SparseTensorWrapper)
    check_against_dense(op, [torch.randn(5, 6, requires_grad=True), sparse_param(layout, w)])
    check_against_dense(op, [sparse_param(layout, w), torch.randn(6, requires_grad=True)])  # broadcast


@pytest.mark.parametrize("layout", LAYOUTS)
def test_add_scalar_is_dense(layout):
    w = sample((4, 4))
    out = check_against_dense(lambda a: a + 2.5, [sparse_param(layout, w)])
    assert torch.equal(out, w + 2.5)
    check_against_dense(lambda a: 1.0 + a, [sparse_param(layout, w)])


@pytest.mark.parametrize("la", LAYOUTS)
@pytest.mark.parametrize("lb", LAYOUTS)
@pytest.mark.parametrize("form", ADD_FORMS, ids=str)
def test_add_sparse_sparse_union(la, lb, form):
    op = ADD_FORMS[form]
    a, b = sample((6, 7), seed=1), sample((6, 7), seed=2)
    out = check_against_dense(op, [sparse_param(la, a), sparse_param(lb, b)])
    assert isinstance(out.wrapped_tensor, la)  # the first operand's layout by default
    assert out.wrapped_tensor.nnz == int(((a != 0) | (b != 0)).sum())


@pytest.mark.parametrize("out_layout", LAYOUTS + (torch.Tensor,))
def test_add_keep_all_into_each_layout(out_layout):
    a, b = sample((5, 5), seed=3), sample((5, 5), seed=4)
    op = sten.sparsified_op(torch.add, out_fmt=(sten.KeepAll(), out_layout, sten.KeepAll(), out_layout))
    args = [sparse_param(ScipyCsrTensor, a), sparse_param(ScipyCscTensor, b)]
    out = check_against_dense(op, args, ref_fn=torch.add)
    if out_layout is not torch.Tensor:
        assert isinstance(out.wrapped_tensor, out_layout)
        assert out.wrapped_tensor.nnz == int(((a != 0) | (b != 0)).sum())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_add_sparse_grads(layout):
    a, b = sample((5, 6), seed=1), sample((5, 6), seed=2)
    args = [sparse_param(layout, a, sparse_fmt(layout)), sparse_param(layout, b, sparse_fmt(layout))]
    check_against_dense(lambda x, y: torch.add(x, y, alpha=3), args, masks={0: a != 0, 1: b != 0})
    args = [sparse_param(layout, a, sparse_fmt(layout)), torch.randn(5, 6, requires_grad=True)]
    check_against_dense(torch.add, args, masks={0: a != 0})


MUL_FORMS = {
    "torch.mul": lambda a, b: torch.mul(a, b),
    "operator": lambda a, b: a * b,
    "Tensor.mul": lambda a, b: a.mul(b),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("form", MUL_FORMS, ids=str)
def test_mul_dense_keeps_pattern(layout, form):
    op = MUL_FORMS[form]
    w = sample((5, 6))
    for other in (torch.randn(5, 6), torch.randn(6), torch.tensor(3.0)):
        out = check_against_dense(op, [sparse_param(layout, w), other.clone().requires_grad_()])
        assert isinstance(out.wrapped_tensor, layout) and out.wrapped_tensor.same_pattern(layout.from_dense(w))
        out = check_against_dense(op, [other.clone().requires_grad_(), sparse_param(layout, w)])
        assert isinstance(out.wrapped_tensor, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mul_scalar(layout):
    w = sample((4, 7))
    for op in (lambda a: a * 2.5, lambda a: 2.5 * a, lambda a: torch.mul(a, -1)):
        out = check_against_dense(op, [sparse_param(layout, w)])
        assert isinstance(out.wrapped_tensor, layout)
    out = check_against_dense(lambda a: a * 3, [sparse_param(layout, w, sparse_fmt(layout))], masks={0: w != 0})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mul_sparse_grad_and_dense_output(layout):
    w = sample((5, 6))
    check_against_dense(torch.mul, [sparse_param(layout, w, sparse_fmt(layout)), torch.randn(5, 6, requires_grad=True)],
                        masks={0: w != 0})
    op = sten.sparsified_op(torch.mul, out_fmt=(sten.KeepAll(), torch.Tensor, sten.KeepAll(), torch.Tensor))
    out = check_against_dense(op, [sparse_param(layout, w), torch.randn(5, 6, requires_grad=True)], ref_fn=torch.mul)
    assert not isinstance(out, sten.SparseTensorWrapper)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mul_broadcasting_to_a_larger_shape_is_dense(layout):
    w = sample((5, 6))
    out = check_against_dense(torch.mul, [sparse_param(layout, w), torch.randn(2, 5, 6, requires_grad=True)])
    assert out.shape == (2, 5, 6)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bad_input(layout):
    w = sten.SparseTensorWrapper(layout.from_dense(sample((4, 5))))
    v = sten.SparseTensorWrapper(layout.from_dense(sample((5, 4))))
    with pytest.raises(ValueError, match=r"same shape, got \(4, 5\) and \(5, 4\)"):
        w + v
    with pytest.raises(RuntimeError):
        w + torch.randn(3, 3)  # torch's own broadcasting error
    dense = w.to_dense()
    for other in (torch.full((4, 5), 1j, dtype=torch.complex64), 1j):  # dense torch's complex result, warned
        with sten.dispatch.failure_mode("raise"), pytest.raises(sten.DispatchError, match="other is complex"):
            torch.mul(w, other)
        sten.dispatch.reset_warnings()
        with sten.dispatch.failure_mode("warn"), pytest.warns(sten.DispatchWarning, match="other is complex"):
            torch.testing.assert_close(torch.mul(w, other), dense * other)
        with sten.dispatch.failure_mode("warn"), warnings.catch_warnings():
            warnings.simplefilter("ignore", sten.DispatchWarning)
            torch.testing.assert_close(w * other, dense * other)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mul_by_inf_or_nan_is_nan_at_the_unstored_positions(layout):
    """``0 * inf`` is NaN: the scipy product kept 0 at the unstored positions."""
    d = torch.tensor([[1.0, 0.0, 2.0, 0.0], [0.0, 3.0, 0.0, 4.0]])
    w = sten.SparseTensorWrapper(layout.from_dense(d))
    for factor in (float("inf"), torch.full((4,), float("nan")), torch.tensor([1.0, float("inf"), 1.0, 1.0])):
        got = w * factor
        got = got.to_dense() if isinstance(got, sten.SparseTensorWrapper) else got
        torch.testing.assert_close(got, d * factor, equal_nan=True)
