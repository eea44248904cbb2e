"""Operands of the built-in products as dense torch takes them: ``addmm``'s ``beta=0`` ignores
``input`` (NaN there stayed in the result), a bias of the output's shape gets a gradient of its
shape (the backward returned ``[N]`` and autograd raised), and operands of different dtypes are
refused as dense torch refuses them (the weight was cast to the input's dtype: a float64 weight
rounded to float32, the result's dtype depending on whether a bias was given)."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten

LAYOUTS = [sten.CooTensor, sten.CsrTensor, sten.CscTensor]


def wrapper(layout, dense, requires_grad=False):
    return sten.SparseTensorWrapper(layout.from_dense(dense), requires_grad=requires_grad)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fill", [float("nan"), float("inf")])
def test_addmm_with_beta_zero_ignores_input(layout, fill):
    w = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    x, c = torch.ones(1, 2), torch.full((1, 2), fill)
    want = torch.addmm(c, x, w, beta=0.0)
    torch.testing.assert_close(torch.addmm(c, x, wrapper(layout, w), beta=0.0), want)
    torch.testing.assert_close(torch.addmm(c, x, wrapper(layout, w), beta=0, alpha=2.0),
                               torch.addmm(c, x, w, beta=0, alpha=2.0))


@pytest.mark.parametrize("layout", LAYOUTS + [sten.DenseTensor])
def test_a_bias_of_the_outputs_shape_gets_a_gradient_of_its_shape(layout):
    torch.manual_seed(0)
    x, w = torch.randn(3, 8), torch.randn(6, 8)
    for bias_shape in [(3, 6), (1, 6), (6,)]:
        b = torch.randn(bias_shape, requires_grad=True)
        F.linear(x, w, b).pow(2).sum().backward()
        want = b.grad.clone()
        b.grad = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sten.DispatchWarning)
            y = F.linear(x, wrapper(layout, w, requires_grad=True), b)
        torch.testing.assert_close(y, F.linear(x, w, b))
        y.pow(2).sum().backward()
        torch.testing.assert_close(b.grad, want)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_operands_of_different_dtypes_are_refused_as_dense_torch_refuses_them(layout):
    x, w = torch.randn(2, 4), torch.randn(3, 4)
    W64, W, Wt = wrapper(layout, w.double()), wrapper(layout, w), wrapper(layout, w.t().contiguous())
    cases = [
        (lambda: F.linear(x, W64), "input float32, weight float64"),
        (lambda: F.linear(x.bfloat16(), W), "input bfloat16, weight float32"),
        (lambda: F.linear(x, W, torch.zeros(3, dtype=torch.float64)), "bias float64"),
        (lambda: torch.mm(W64, x.t()), "input float64, other float32"),
        (lambda: torch.mm(x, W64.t()), "same dtype"),   # (w.t() of COO runs densely: torch's message)
        (lambda: torch.addmm(torch.zeros(3, dtype=torch.float64), x, Wt), "input float64, mat1 float32"),
    ]
    for call, names in cases:
        with pytest.raises(RuntimeError, match=rf"same dtype.*{names}|{names}"):
            call()
    torch.testing.assert_close(F.linear(x.double(), W64), F.linear(x.double(), w.double()))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_autocast_casts_before_the_dtype_check(layout):
    x, w = torch.randn(2, 4), torch.randn(3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = F.linear(x, wrapper(layout, w), torch.zeros(3))
        want = F.linear(x, w, torch.zeros(3))
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
