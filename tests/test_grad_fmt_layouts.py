"""A ``grad_fmt`` that names a layout without sparsifying (``(KeepAll(), L, KeepAll(), L)``) gives
the gradient at the weight's stored positions (DESIGN: "it exists only at the stored positions,
O(nnz)"), also when ``L`` is another layout than the weight's, with every plugin installed.

Before, only ``L`` = the weight's own layout did: another layout got the dense gradient
re-sparsified by its own values (an n:m weight's scipy-CSR gradient stored all 64 of 64 entries; a
CSR weight's COO gradient every nonzero of the dense gradient; a CSR weight's n:m gradient kept the
gradient's largest entries, dropping 12 of the 27 stored positions without a warning)."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_nm import NMTensor
from sten_scipy import ScipyCscTensor, ScipyCsrTensor


def weight(layout, grad_layout, seed=0, tmp_format=None):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(8, 8, generator=g)
    t = NMTensor.from_dense(dense, n=2, m=4) if layout is NMTensor else \
        layout.from_dense(dense * (torch.rand(8, 8, generator=g) > 0.5))
    fmt = (sten.KeepAll(), tmp_format or grad_layout, sten.KeepAll(), grad_layout)
    return sten.SparseParameterWrapper(sten.SparseTensorWrapper(t, requires_grad=True, grad_fmt=fmt))


def dense_grad(w):
    x, t = torch.randn(4, 8), torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)  # (the mixed pairs' dense backward)
        (F.linear(x, w) * t).sum().backward()
    return t.t() @ x


PAIRS = [(NMTensor, ScipyCsrTensor), (NMTensor, sten.CooTensor), (sten.CsrTensor, sten.CooTensor),
         (sten.CsrTensor, ScipyCscTensor), (ScipyCsrTensor, sten.CsrTensor), (sten.CooTensor, sten.CscTensor)]


@pytest.mark.parametrize("layout,grad_layout", PAIRS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("tmp_format", [None, torch.Tensor], ids=["tmp in layout", "tmp dense"])
def test_a_gradient_in_another_layout_is_at_the_stored_positions(layout, grad_layout, tmp_format):
    """``tmp dense`` is what ``set_weight_grad(name, out_format=L)`` gives: the weight's own
    (dense-gradient) backward implementation runs, and its gradient was stored whole in ``L``
    (a CSR weight's COO gradient held 192 entries for 48 stored weights)."""
    torch.manual_seed(0)
    w = weight(layout, grad_layout, tmp_format=tmp_format)
    want = dense_grad(w)
    stored = w.wrapped_tensor.to_dense() != 0
    assert type(w.grad.wrapped_tensor) is grad_layout
    got = w.grad.to_dense()
    torch.testing.assert_close(got, want * stored)
    assert int(torch.count_nonzero(got)) <= int(stored.sum())


def test_a_gradient_layout_that_cannot_hold_the_pattern_warns_as_lossy():
    """A CSR weight whose gradient is asked as n:m: the gradient at its stored positions, as much
    as n:m holds of it, with the lossy-conversion warning (it was dropped silently)."""
    torch.manual_seed(0)
    w = weight(sten.CsrTensor, NMTensor)
    x, t = torch.randn(4, 8), torch.randn(4, 8)
    sten.dispatch.reset_warnings()
    with pytest.warns(sten.DispatchWarning, match="Lossy conversion CsrTensor -> NMTensor"):
        (F.linear(x, w) * t).sum().backward()
    got, stored = w.grad.to_dense(), w.wrapped_tensor.to_dense() != 0
    assert not bool(((got != 0) & ~stored).any())   # nothing outside the weight's positions
    torch.testing.assert_close(got, (t.t() @ x) * (got != 0))


def test_set_weight_grad_in_another_layout_holds_the_gradient_at_the_stored_positions():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16))
    sb = sten.SparsityBuilder(model)
    sb.set_weight("0.weight", sten.ScalarFractionSparsifier(0.75), out_format=sten.CsrTensor)
    sb.set_weight_grad("0.weight", out_format=sten.CooTensor)
    sparse = sb.get_sparse_model()
    x = torch.randn(8, 12)
    sparse(x).pow(2).sum().backward()
    w = sparse[0].weight
    stored = w.to_dense() != 0
    dense = w.to_dense().detach().requires_grad_()
    F.linear(x, dense, sparse[0].bias.detach()).pow(2).sum().backward()
    assert type(w.grad.wrapped_tensor) is sten.CooTensor
    assert w.grad.wrapped_tensor.nnz <= int(stored.sum())
    torch.testing.assert_close(w.grad.to_dense(), dense.grad * stored)


HALF_OPS = {
    "F.linear": lambda w, x: F.linear(x, w),
    "W @ x.T": lambda w, x: w @ x.t(),
    "torch.mm(x, W.t())": lambda w, x: torch.mm(x, w.t()),
}


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CscTensor, sten.CooTensor], ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op", HALF_OPS)
def test_a_half_precision_weight_keeps_its_layout_in_its_gradient(layout, dtype, op):
    """A bf16 / fp16 CSR weight whose ``grad_fmt`` keeps its layout failed in backward inside
    torch (``sparse_sampled_addmm``: "Expected self to be a floating-point or complex tensor, but
    got BFloat16": no half kernel on the CPU); it now samples in float32. The gradient is dense
    torch's (float32 reference, rounded) at the stored positions, in the weight's layout and dtype."""
    torch.manual_seed(0)
    dense = (torch.randn(6, 8) * (torch.rand(6, 8) > 0.5)).to(dtype)
    fmt = (sten.KeepAll(), layout, sten.KeepAll(), layout)
    w = sten.SparseParameterWrapper(layout.from_dense(dense), grad_fmt=fmt)
    x, t = torch.randn(5, 8, dtype=dtype), torch.randn(6, 5).t().contiguous().to(dtype)
    ref = dense.float().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)  # (W @ x, x @ W.t(): the dense backward, re-stored)
        out = HALF_OPS[op](w, x)
        (out.float() * (t if out.shape == t.shape else t.t()).float()).sum().backward()
    ref_out = HALF_OPS[op](ref, x.float())
    (ref_out * (t if ref_out.shape == t.shape else t.t()).float()).sum().backward()
    assert type(w.grad.wrapped_tensor) is layout and w.grad.dtype == dtype
    torch.testing.assert_close(w.grad.to_dense().float(), ref.grad * (dense != 0), atol=2e-2, rtol=2e-2)


def test_set_weight_grad_keeping_a_bf16_csr_layout_trains():
    """The builder's spelling of the same (``set_weight_grad`` naming ``CsrTensor``), one SGD step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4)).to(torch.bfloat16)
    sb = sten.SparsityBuilder(model)
    sb.set_weight("0.weight", initial_sparsifier=sten.ScalarFractionSparsifier(0.5), out_format=sten.CsrTensor)
    sb.set_weight_grad("0.weight", inline_sparsifier=sten.KeepAll(), tmp_format=sten.CsrTensor,
                       external_sparsifier=sten.KeepAll(), out_format=sten.CsrTensor)
    sparse = sb.get_sparse_model()
    w = sparse[0].weight
    before = w.to_dense().float()
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    sparse(x).float().sum().backward()
    assert type(w.grad.wrapped_tensor) is sten.CsrTensor and w.grad.dtype == torch.bfloat16
    expected = (torch.ones(3, 4).t() @ x.float()) * (before != 0)
    torch.testing.assert_close(w.grad.to_dense().float(), expected, atol=3e-2, rtol=2e-2)
    torch.optim.SGD(sparse.parameters(), lr=0.1).step()
    assert type(w.wrapped_tensor) is sten.CsrTensor
    torch.testing.assert_close(w.to_dense().float(), before - 0.1 * w.grad.to_dense().float(), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("grad_layout", [sten.CooTensor, sten.CsrTensor])
def test_a_weight_used_twice_sums_its_gradients_in_the_grad_fmts_layout(grad_layout):
    """Each use's gradient is sparsified by the ``grad_fmt`` (its own pattern); autograd's sum of
    the two was a plain dense tensor. It is now in the layout, on the union of the patterns."""
    torch.manual_seed(0)
    fmt = (sten.KeepAll(), torch.Tensor, sten.ScalarFractionSparsifier(0.5), grad_layout)
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.randn(8, 8)), grad_fmt=fmt)
    x = torch.randn(4, 8)
    h = F.linear(x, w)
    parts = []
    h.register_hook(lambda g: parts.append(("h", g)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        F.linear(h, w).sum().backward()
    assert type(w.grad.wrapped_tensor) is grad_layout
    # the reference: each use's dense gradient sparsified on its own, then summed
    outer = torch.ones(4, 8).t() @ h.detach()     # F.linear(h, w)'s gradient for w
    inner = parts[0][1].t() @ x                   # F.linear(x, w)'s

    def half(t):
        return sten.sparsify(sten.ScalarFractionSparsifier(0.5), t, grad_layout).to_dense()

    torch.testing.assert_close(w.grad.to_dense(), half(outer) + half(inner))


VIEW_FIRST = {
    "w[1:3] * c": lambda a, c: a * c,
    "w[1:3] + c": lambda a, c: a + c,
    "F.linear(w[1:3], c)": lambda a, c: F.linear(a, c),
    "torch.cat([w[1:3], c])": lambda a, c: torch.cat([a, c]),
    "torch.addcmul(w[1:3], w[1:3], c)": lambda a, c: torch.addcmul(a, a, c),
}


@pytest.mark.parametrize("view_requires_grad", [False, True], ids=["frozen view", "view that requires grad"])
@pytest.mark.parametrize("name", VIEW_FIRST)
def test_a_view_of_another_wrapper_first_in_a_call_keeps_the_wrappers_grad_fmt(name, view_requires_grad):
    """A view of a wrapper (``w[1:3]``: ``WrapperView`` / ``GradView``) first in a call ran the call
    plainly, so ``c`` was densified below autograd: its gradient came back dense, with values off
    its pattern, its ``grad_fmt`` ignored. The call now reaches ``c``'s dispatch."""
    torch.manual_seed(0)
    wd, cd = torch.randn(4, 6), torch.randn(2, 6) * (torch.rand(2, 6) > 0.5)
    w = sten.sparsify(sten.KeepAll(), wd, sten.CsrTensor).requires_grad_(view_requires_grad)
    c = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(cd), requires_grad=True,
                                 grad_fmt=(sten.KeepAll(), sten.CsrTensor, sten.KeepAll(), sten.CsrTensor))
    w_ref, c_ref = wd.clone().requires_grad_(view_requires_grad), cd.clone().requires_grad_(True)
    out, ref = VIEW_FIRST[name](w[1:3], c), VIEW_FIRST[name](w_ref[1:3], c_ref)
    out = out.to_dense() if isinstance(out, sten.SparseTensorWrapper) else out
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(ref)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    assert isinstance(c.grad, sten.SparseTensorWrapper) and isinstance(c.grad.wrapped_tensor, sten.CsrTensor)
    torch.testing.assert_close(c.grad.to_dense(), c_ref.grad * (cd != 0))
    if view_requires_grad:
        torch.testing.assert_close(w.grad.to_dense() if isinstance(w.grad, sten.SparseTensorWrapper) else w.grad,
                                   w_ref.grad)
