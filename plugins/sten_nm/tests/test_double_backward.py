"""Second-order gradients (``create_graph=True``) through the n:m products: a gradient penalty and
the Hessian with respect to the input equal dense torch's (the core's differentiable backward)."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_nm import GroupedNMTensor, NMTensor

from conftest import requires_kernel

pytestmark = requires_kernel


@pytest.mark.parametrize("layout", [NMTensor, GroupedNMTensor])
def test_gradient_penalty_and_hessian_through_an_nm_weight(layout):
    torch.manual_seed(0)
    t = layout.from_dense(torch.randn(8, 16), n=2, m=4)
    dense = t.to_dense()
    fmt = (sten.KeepAll(), layout, sten.KeepAll(), layout)
    x0 = torch.randn(3, 16)
    grads = {}
    for mode in ("dense", "nm"):
        w = dense.clone().requires_grad_() if mode == "dense" else \
            sten.SparseParameterWrapper(sten.SparseTensorWrapper(t, requires_grad=True, grad_fmt=fmt))
        x = x0.clone().requires_grad_()
        loss = F.linear(torch.tanh(x), w).square().sum()
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sten.DispatchWarning)
            (loss + gx.pow(2).sum()).backward()
        gw = w.grad.to_dense() if isinstance(w.grad, sten.SparseTensorWrapper) else w.grad
        grads[mode] = (gx.detach(), x.grad, gw)
        v = x0[0]
        grads[mode] += (torch.autograd.functional.hessian(lambda u: F.linear(torch.tanh(u), w).pow(2).sum(), v),)
    mask = (dense != 0).float()
    for i, (a, b) in enumerate(zip(grads["nm"], grads["dense"])):
        torch.testing.assert_close(a, b * mask if i == 2 else b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", [NMTensor, GroupedNMTensor])
def test_a_penalty_on_an_nm_weights_own_gradient_reaches_it(layout):
    """loss + ||d loss / dW||^2 with W's gradient kept n:m: that gradient keeps its graph (it was
    a new NMTensor without one, and the penalty's terms were lost silently)."""
    torch.manual_seed(1)
    t = layout.from_dense(torch.randn(8, 16), n=2, m=4)
    dense = t.to_dense()
    mask = (dense != 0).float()
    fmt = (sten.KeepAll(), layout, sten.KeepAll(), layout)
    x0 = torch.randn(3, 16)
    results = {}
    for mode in ("dense", "nm"):
        w = dense.clone().requires_grad_() if mode == "dense" else \
            sten.SparseParameterWrapper(sten.SparseTensorWrapper(t, requires_grad=True, grad_fmt=fmt))
        x = x0.clone().requires_grad_()
        loss = torch.tanh(F.linear(x, w)).pow(2).sum()
        (gw,) = torch.autograd.grad(loss, (w,), create_graph=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sten.DispatchWarning)
            penalty = (gw * gw).sum() if mode == "nm" else (gw * mask).pow(2).sum()
            (loss + penalty).backward()
        gw_dense = gw.to_dense() if mode == "nm" else gw * mask
        total = w.grad.to_dense() if mode == "nm" else w.grad * mask
        results[mode] = (gw_dense.detach(), total, x.grad)
    for got, want in zip(results["nm"], results["dense"]):
        torch.testing.assert_close(got, want)
