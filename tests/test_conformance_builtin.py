"""The built-in layouts pass the conformance kit that plugins use."""

import pytest
import torch

import sten_core as sten
from sten_core.testing import check_layout, check_linear


@pytest.mark.parametrize("layout", [sten.DenseTensor, sten.CooTensor, sten.CsrTensor, sten.CscTensor])
def test_layout_conformance(layout):
    check_layout(layout)


def test_coo_conformance_nd():
    check_layout(sten.CooTensor, shapes=((2, 3, 4), (5,)))


@pytest.mark.parametrize("layout", [sten.CooTensor, sten.CsrTensor, sten.CscTensor])
def test_linear_conformance(layout):
    check_linear(layout)


@pytest.mark.parametrize("layout", [sten.CooTensor, sten.CsrTensor, sten.CscTensor])
def test_mm_both_sides(layout):
    torch.manual_seed(0)
    w = torch.randn(6, 5) * (torch.rand(6, 5) > 0.5)
    ws = sten.SparseTensorWrapper(layout.from_dense(w), requires_grad=True)
    wd = w.clone().requires_grad_(True)
    a = torch.randn(5, 3, requires_grad=True)
    b = torch.randn(4, 6, requires_grad=True)
    ad, bd = a.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
    out = torch.mm(ws, a).sum() + torch.matmul(b, ws).square().sum()
    ref = torch.mm(wd, ad).sum() + torch.matmul(bd, wd).square().sum()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    out.backward()
    ref.backward()
    torch.testing.assert_close(a.grad, ad.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(b.grad, bd.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ws.grad, wd.grad, rtol=1e-4, atol=1e-5)
