"""Optimizers on scipy-layout weights and gradients: every implementation (per-tensor, foreach,
fused) gives dense torch's step at the stored positions. ``ScipyCscTensor.to_dense()`` is
column-major, and torch's CPU fused kernels read their lists as contiguous whatever the strides:
fused Adam / AdamW / SGD / Adagrad updated a CSC weight at transposed positions (up to 2*lr off
after one step) until the in-place path's dense copies were made contiguous."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_scipy import ScipyCscTensor, ScipyCsrTensor

OPTIMIZERS = {
    "Adam": lambda ps, **kw: torch.optim.Adam(ps, lr=0.05, **kw),
    "AdamW": lambda ps, **kw: torch.optim.AdamW(ps, lr=0.05, **kw),
    "SGD": lambda ps, **kw: torch.optim.SGD(ps, lr=0.05, momentum=0.9, **kw),
    "Adagrad": lambda ps, **kw: torch.optim.Adagrad(ps, lr=0.05, **kw),
}
PAIRS = [(sten.CsrTensor, ScipyCscTensor), (ScipyCscTensor, sten.CsrTensor), (ScipyCscTensor, None),
         (ScipyCsrTensor, ScipyCscTensor)]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("impl", ["fused", "foreach", "for-loop"])
@pytest.mark.parametrize("weight_layout,grad_layout", PAIRS)
def test_optimizer_steps_on_scipy_layouts_equal_dense(name, impl, weight_layout, grad_layout):
    sten.set_dispatch_failure("warn")  # the mixed-layout products and optimizer ops run densely
    torch.manual_seed(0)
    d = torch.randn(8, 6) * (torch.rand(8, 6) > 0.5)
    fmt = (sten.KeepAll(), grad_layout, sten.KeepAll(), grad_layout) if grad_layout else None
    p = sten.SparseParameterWrapper(weight_layout.from_dense(d), grad_fmt=fmt)
    r = torch.nn.Parameter(d.clone())
    kw = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    opt, ref = OPTIMIZERS[name]([p], **kw), OPTIMIZERS[name]([r])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(2):
            x, t = torch.randn(4, 6), torch.randn(4, 8)
            for o in (opt, ref):
                o.zero_grad()
            (F.linear(x, p) * t).sum().backward()
            (F.linear(x, r) * t).sum().backward()
            r.grad *= (d != 0)  # the gradient at the stored positions
            opt.step()
            ref.step()
            with torch.no_grad():
                r *= (d != 0)   # the dense model's weight stays at the pattern
    torch.testing.assert_close(p.to_dense(), r.detach())
