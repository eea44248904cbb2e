"""A call whose backward re-runs the operator densely (a ``DenseTensor`` weight with its
layout-keeping ``grad_fmt``, and any implementation without a backward) is differentiated in the
dtypes its forward computed in under CPU autocast, as dense torch's is.

Before, the re-run ran outside the forward's autocast state: in a two-layer MLP under
``torch.autocast("cpu", torch.bfloat16)`` the second layer's saved input was bfloat16 and its
weight float32, and backward raised "mat1 and mat2 must have the same dtype, but got BFloat16 and
Float". The other layouts' kept-layout gradients (own backward implementations) are checked too."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten

BF16 = dict(atol=3e-2, rtol=3e-2)


def layouts():
    found = [(sten.DenseTensor, {}), (sten.CooTensor, {}), (sten.CsrTensor, {}), (sten.CscTensor, {})]
    try:
        import sten_nm
    except ImportError:
        return found
    return found + [(sten_nm.NMTensor, dict(n=2, m=4)), (sten_nm.GroupedNMTensor, dict(n=2, m=4))]


LAYOUTS = layouts()


def pair(layout, kwargs, keep):
    """A dense ``Linear-ReLU-Linear`` and the same model with both weights in ``layout``."""
    torch.manual_seed(0)
    dense = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    sparse = copy.deepcopy(dense)
    for i in (0, 2):
        w = dense[i].weight.detach()
        keep_mask = torch.rand(w.shape) > 0.5
        fmt = (sten.KeepAll(), layout, sten.KeepAll(), layout) if keep else None
        sparse[i].weight = sten.SparseParameterWrapper(layout.from_dense(w * keep_mask, **kwargs), grad_fmt=fmt)
        dense[i].weight = torch.nn.Parameter(sparse[i].weight.to_dense().detach().clone())
    return dense, sparse


def run(model, x, backward_in_autocast):
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
        if backward_in_autocast:
            y.float().square().sum().backward()
    if not backward_in_autocast:
        y.float().square().sum().backward()
    return y, x.grad


def stored(w):
    """The positions whose gradient a kept-layout ``grad_fmt`` holds."""
    return w.to_dense() != 0


@pytest.mark.parametrize("layout,kwargs", LAYOUTS, ids=[layout.__name__ for layout, _ in LAYOUTS])
@pytest.mark.parametrize("keep", [True, False], ids=["keep layout grad", "dense grad"])
@pytest.mark.parametrize("backward_in_autocast", [False, True], ids=["backward after", "backward inside"])
def test_mlp_under_bf16_autocast_matches_dense(layout, kwargs, keep, backward_in_autocast):
    dense, sparse = pair(layout, kwargs, keep)
    x = torch.randn(5, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)   # (DenseTensor's dense backward)
        y, gx = run(sparse, x, backward_in_autocast)
    y_ref, gx_ref = run(dense, x, backward_in_autocast)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    torch.testing.assert_close(y, y_ref, **BF16)
    assert gx.dtype == gx_ref.dtype
    torch.testing.assert_close(gx, gx_ref, **BF16)
    for i in (0, 2):
        w, g, g_ref = sparse[i].weight, sparse[i].weight.grad, dense[i].weight.grad
        assert g.dtype == g_ref.dtype == torch.float32
        if keep:
            assert type(g.wrapped_tensor) is layout
        at = stored(w)
        torch.testing.assert_close(g.to_dense()[at], g_ref[at], **BF16)
        torch.testing.assert_close(sparse[i].bias.grad, dense[i].bias.grad, **BF16)


def test_the_dense_backward_re_runs_in_the_forward_dtypes():
    """The kept-layout ``DenseTensor`` gradient has no backward implementation: its dense re-run
    computes ``F.linear`` in bfloat16, as the forward did, and gives dense torch's gradient
    exactly (the same bf16 products)."""
    w = torch.randn(4, 6)
    x = torch.randn(3, 6, dtype=torch.bfloat16)    # an activation autocast made bf16
    fmt = (sten.KeepAll(), sten.DenseTensor, sten.KeepAll(), sten.DenseTensor)
    ws = sten.SparseParameterWrapper(sten.DenseTensor.from_dense(w), grad_fmt=fmt)
    wd = torch.nn.Parameter(w.clone())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ys, yd = F.linear(x, ws), F.linear(x, wd)
    t = torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        (ys.float() * t).sum().backward()
    (yd.float() * t).sum().backward()
    assert ys.dtype == yd.dtype == torch.bfloat16
    assert ws.grad.dtype == wd.grad.dtype == torch.float32
    torch.testing.assert_close(ws.grad.to_dense(), wd.grad, atol=0, rtol=0)


def test_second_order_gradients_under_autocast_match_dense():
    """``create_graph=True`` re-runs the op densely too (every layout): in the forward's dtypes."""
    w = torch.randn(4, 6) * (torch.rand(4, 6) > 0.5)
    ws = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(w))
    wd = torch.nn.Parameter(w.clone())
    x = torch.randn(3, 6, dtype=torch.bfloat16)
    grads = []
    for weight in (ws, wd):
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = F.linear(xi, weight)
        (gx,) = torch.autograd.grad(y.float().sin().sum(), xi, create_graph=True)
        gx.float().square().sum().backward()
        grads.append((gx, weight.grad.to_dense() if weight is ws else weight.grad))
    (gx_s, gw_s), (gx_d, gw_d) = grads
    assert gx_s.dtype == gx_d.dtype
    torch.testing.assert_close(gx_s, gx_d, **BF16)
    torch.testing.assert_close(gw_s, gw_d, **BF16)
