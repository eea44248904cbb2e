"""Second-order gradients (``create_graph=True``) through calls that run an implementation.

The implementations compute first-order gradients on detached inputs, and the node's backward
was ``@once_differentiable``: with a constant incoming gradient (``y.sum()``) the input's gradient
came back as a constant, so a gradient penalty never reached the sparse weight (``W.grad`` None)
and ``torch.autograd.functional.hessian`` was silently wrong (max error 0.34 for CSR). Under
``create_graph=True`` the node now re-runs the op densely on differentiable views of its inputs
(``_Call.differentiable_backward``): values of dense torch, the weight's gradient in its grad_fmt.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten

LAYOUTS = [sten.CsrTensor, sten.CscTensor, sten.CooTensor, sten.DenseTensor]


def masked(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * (torch.rand(*shape, generator=g) > 0.5)


def sparse_linear(layout, dense, keeps_layout=False, dtype=torch.float32):
    fmt = (sten.KeepAll(), layout, sten.KeepAll(), layout) if keeps_layout else None
    return sten.SparseParameterWrapper(sten.SparseTensorWrapper(
        layout.from_dense(dense.to(dtype)), requires_grad=True, grad_fmt=fmt))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("keeps_layout", [False, True], ids=["dense grad", "grad in layout"])
def test_a_gradient_penalty_reaches_the_sparse_weight(layout, keeps_layout):
    """loss + ||d loss / dx||^2 (WGAN-GP, R1): the weight's gradient and the input's equal dense
    torch's (at the stored positions when the grad_fmt keeps the layout)."""
    dense, b = masked((3, 4), 0), torch.randn(3)
    x0 = torch.randn(5, 4)
    grads = {}
    for mode in ("dense", "sparse"):
        w = dense.clone().requires_grad_() if mode == "dense" else sparse_linear(layout, dense, keeps_layout)
        x = x0.clone().requires_grad_()
        loss = F.linear(torch.tanh(x), w, b).square().sum()
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sten.DispatchWarning)  # (the kept layout's first-order .grad)
            (loss + gx.pow(2).sum()).backward()
        gw = w.grad.to_dense() if isinstance(w.grad, sten.SparseTensorWrapper) else w.grad
        grads[mode] = (gx.detach(), x.grad, gw)
    stores_zeros = layout is sten.DenseTensor  # every position is stored: its gradient is whole
    mask = (dense != 0).float() if keeps_layout and not stores_zeros else torch.ones_like(dense)
    torch.testing.assert_close(grads["sparse"][0], grads["dense"][0])
    torch.testing.assert_close(grads["sparse"][1], grads["dense"][1])
    assert grads["sparse"][2] is not None
    torch.testing.assert_close(grads["sparse"][2], grads["dense"][2] * mask)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", ["linear", "W @ x", "x @ W"])
def test_hessian_with_respect_to_the_input_is_dense_torchs(layout, op):
    dense = masked((4, 4), 1)
    w = sten.SparseTensorWrapper(layout.from_dense(dense), requires_grad=True)
    product = {"linear": lambda v, m: F.linear(v, m), "W @ x": lambda v, m: m @ v,
               "x @ W": lambda v, m: v @ m}[op]

    def f(m):
        return lambda v: product(torch.tanh(v), m).pow(2).sum()

    v = torch.randn(4)
    torch.testing.assert_close(torch.autograd.functional.hessian(f(w), v),
                               torch.autograd.functional.hessian(f(dense), v))


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CooTensor])
def test_gradgradcheck_through_a_sparse_product(layout):
    w = sten.SparseTensorWrapper(layout.from_dense(masked((3, 5), 2).double()), requires_grad=True)
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda t: torch.tanh(F.linear(t, w)), (x,))
    assert torch.autograd.gradgradcheck(lambda t: torch.mm(w, t.t()).sin(), (x,))


def test_first_order_gradients_under_create_graph_equal_the_plain_backward():
    dense = masked((6, 4), 3)
    x0 = torch.randn(2, 4)
    got = []
    for create_graph in (False, True):
        w = sparse_linear(sten.CsrTensor, dense)
        x = x0.clone().requires_grad_()
        F.linear(x, w).square().sum().backward(create_graph=create_graph)
        got.append((x.grad.detach(), w.grad.detach()))
    for a, b in zip(*got):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("keeps_layout", [False, True], ids=["dense grad", "grad in layout"])
@pytest.mark.parametrize("api", ["autograd.grad", "backward(create_graph=True)"])
def test_a_penalty_on_the_weights_own_gradient_reaches_it(layout, keeps_layout, api):
    """loss + ||d loss / dW||^2 with W's gradient in its grad_fmt: a gradient stored in a sparse
    layout was a new wrapper without a graph (a DispatchWarning said so) and the penalty's
    terms were lost (W.grad and x.grad silently wrong). The sparse gradient keeps the graph
    now; dense torch on the gradient at the stored positions is the reference."""
    torch.manual_seed(0)   # (unseeded, the draws depended on the tests run before: some exceeded float32's tolerance)
    dense, x0 = masked((3, 4), 4), torch.randn(2, 4)
    stores_all = not keeps_layout or layout is sten.DenseTensor
    kept = torch.ones_like(dense) if stores_all else (dense != 0).float()
    results = {}
    for mode in ("dense", "sparse"):
        w = dense.clone().requires_grad_() if mode == "dense" else sparse_linear(layout, dense, keeps_layout)
        x = x0.clone().requires_grad_()
        loss = torch.tanh(F.linear(x, w)).pow(2).sum()
        if api == "autograd.grad":
            (gw,) = torch.autograd.grad(loss, (w,), create_graph=True)
        else:
            loss.backward(create_graph=True)
            gw, w.grad, x.grad = w.grad, None, None
        gw = gw.to_dense() if isinstance(gw, sten.SparseTensorWrapper) else gw * kept
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sten.DispatchWarning)  # (dense fallbacks of the penalty's ops)
            (loss + gw.pow(2).sum()).backward()
        total = w.grad.to_dense() if isinstance(w.grad, sten.SparseTensorWrapper) else w.grad * kept
        results[mode] = (gw.detach(), total, x.grad)
    for got, want in zip(results["sparse"], results["dense"]):
        torch.testing.assert_close(got, want)


class _TanhThenSin(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.randn(5, 6, generator=torch.Generator().manual_seed(3)))

    def forward(self, x):
        return torch.sin(torch.tanh(x @ self.w.t()) * 2).sum()


@pytest.mark.parametrize("out_format", [sten.CooTensor, sten.CsrTensor, torch.Tensor])
def test_a_penalty_on_a_sparse_intermediate_gradient_reaches_the_input(out_format):
    """An intermediate whose gradient is sparsified (``set_interm_grad``) keeps that gradient's
    graph under ``create_graph=True`` (``_Sparsify``'s backward stored it in a layout without
    one): the input's second-order terms are dense torch's with the gradient masked there (the
    mask taken as a constant, as for any pruning mask)."""
    sparsifier = sten.ScalarFractionSparsifier(0.5)
    sb = sten.SparsityBuilder(_TanhThenSin())
    sb.set_interm_grad("tanh", sparsifier, out_format=out_format)
    model = sb.get_sparse_model()
    dense_model = _TanhThenSin()

    def at_kept(g):
        return g * (sten.sparsify(sparsifier, g.detach(), sten.CooTensor).to_dense() != 0)

    x0 = torch.randn(4, 6)
    results = {}
    for mode in ("dense", "sparse"):
        x = x0.clone().requires_grad_()
        if mode == "sparse":
            out = model(x)
        else:
            h = torch.tanh(x @ dense_model.w.t())
            h.register_hook(at_kept)
            out = torch.sin(h * 2).sum()
        (gx,) = torch.autograd.grad(out, x, create_graph=True)
        gx.pow(2).sum().backward()
        results[mode] = (gx.detach(), x.grad)
    for got, want in zip(results["sparse"], results["dense"]):
        torch.testing.assert_close(got, want)


class _ScaledThenLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(3, 4, bias=False)
        self.second = torch.nn.Linear(4, 1, bias=False)

    def forward(self, x):
        return self.second(self.first(x) * 1.0)


@pytest.mark.parametrize("out_format", [sten.CooTensor, sten.CsrTensor])
def test_a_gradient_kept_whole_in_a_layout_differentiates_at_its_exact_zeros(out_format):
    """A ``KeepAll`` gradient format drops nothing: where the gradient is exactly zero (a zero
    weight downstream) the layout stores nothing, yet the gradient's derivative there is not
    zero. A penalty on ``first.weight``'s gradient reaches ``second.weight`` at that zero too."""
    torch.manual_seed(0)
    dense_model = _ScaledThenLinear()
    with torch.no_grad():
        dense_model.second.weight[0, 1] = 0.0          # dL/dh[:, 1] == 0 exactly
    sb = sten.SparsityBuilder(dense_model)
    sb.set_interm_grad(".mul", out_format=out_format)
    sparse_model = sb.get_sparse_model()
    x = torch.randn(2, 3)
    results = []
    for model in (dense_model, sparse_model):
        (g,) = torch.autograd.grad(model(x).sum(), model.first.weight, create_graph=True)
        results.append(torch.autograd.grad(g.sum(), model.second.weight)[0])
    assert results[0][0, 1] != 0
    torch.testing.assert_close(results[1], results[0])


WRITES = [(layout, write) for layout in LAYOUTS for write in ("mul_(s)", "div_(s)", "mul_(v)", "addcmul_(v, v)")]


@pytest.mark.parametrize(("layout", "write"), WRITES)
@pytest.mark.parametrize("loss", ["h * x", "sum"], ids=["grad needs grad", "constant grad"])
def test_a_gradient_penalty_through_an_in_place_write_on_a_wrapper(layout, write, loss):
    """``h.mul_(s)`` on a wrapper under autograd, then a penalty on ``d loss / d s``: the in-place
    node's backward was ``once_differentiable``, which raised when the incoming gradient needed
    grad and, with a constant one (``h.sum()``), returned constants: ``W.grad`` then missed the
    penalty's terms silently. Dense torch on the same values is the reference: ``h`` is a
    temporary, so the write is exact (its pattern would grow to hold the result), and so are
    the gradients, ``W``'s (the penalty's alone, through ``s``'s and ``v``'s gradients) included:
    they were taken at ``h``'s stored positions when the write kept its pattern."""
    dense, x0, v0 = masked((4, 5), 5), torch.randn(4, 5), torch.rand(4, 5) + 0.5
    results = {}
    for mode in ("dense", "sparse"):
        w = dense.clone().requires_grad_() if mode == "dense" else sten.SparseTensorWrapper(
            layout.from_dense(dense), requires_grad=True)
        s, v = torch.tensor(1.5, requires_grad=True), v0.clone().requires_grad_()
        x = x0.clone().requires_grad_()
        h = w * 1.0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sten.DispatchWarning)
            {"mul_(s)": lambda: h.mul_(s), "div_(s)": lambda: h.div_(s), "mul_(v)": lambda: h.mul_(v),
             "addcmul_(v, v)": lambda: h.addcmul_(v, v)}[write]()
            out = (h * x).sum() if loss == "h * x" else h.sum() + (s * s * x).sum()
            gs, gv = torch.autograd.grad(out, (s, v), create_graph=True, allow_unused=True)
            penalty = sum(g.pow(2).sum() for g in (gs, gv) if g is not None)
            penalty.backward()
        gw = w.grad.to_dense() if isinstance(w.grad, sten.SparseTensorWrapper) else w.grad
        results[mode] = [t.detach() if t is not None else None for t in (gs, gv, gw, x.grad, s.grad, v.grad)]
    for got, want in zip(results["sparse"], results["dense"]):
        assert (got is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(got, want)
