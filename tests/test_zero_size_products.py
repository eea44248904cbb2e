"""Products with a zero-size operand match dense torch (empty results, values and gradients).

``torch.matmul(W, x)`` with a 3-D ``x`` and ``W`` of shape [8, 0] raised "cannot reshape tensor of
0 elements into shape [0, -1]" in the forward ([0, 8]: in the backward), and the bias gradient of a
zero-width ``F.linear`` / ``addmm`` output the same: ``reshape(-1, 0)`` has no size to infer.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_core.plugin_api import bias_grad

LAYOUTS = [sten.DenseTensor, sten.CooTensor, sten.CsrTensor, sten.CscTensor]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        yield


@pytest.mark.parametrize("shape", [(0, 8), (8, 0)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_batched_matmul_with_an_empty_sparse_matrix(layout, shape):
    w = torch.randn(shape)
    x = torch.randn(2, shape[1], 3, requires_grad=True)
    W = sten.SparseTensorWrapper(layout.from_dense(w), requires_grad=True)
    got = torch.matmul(W, x)
    dx = torch.randn(got.shape)
    (got * dx).sum().backward()
    wd, xd = w.clone().requires_grad_(), x.detach().clone().requires_grad_()
    want = torch.matmul(wd, xd)
    (want * dx).sum().backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(x.grad, xd.grad)
    torch.testing.assert_close(W.grad.to_dense() if isinstance(W.grad, sten.SparseTensorWrapper) else W.grad, wd.grad)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_linear_with_a_zero_width_output_has_an_empty_bias_gradient(layout):
    W = sten.SparseTensorWrapper(layout.from_dense(torch.randn(0, 8)))
    b = torch.randn(0, requires_grad=True)
    F.linear(torch.randn(3, 8), W, b).sum().backward()
    assert b.grad is not None and b.grad.shape == (0,)


def test_bias_grad_sums_every_dimension_but_the_last():
    g = torch.randn(2, 3, 4)
    torch.testing.assert_close(bias_grad(g), g.sum((0, 1)))
    torch.testing.assert_close(bias_grad(g[0, 0]), g[0, 0])
    assert bias_grad(torch.randn(5, 0)).shape == (0,)
