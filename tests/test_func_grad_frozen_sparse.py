"""``torch.func.grad``, ``jacrev`` and ``vmap(grad(...))`` with respect to a dense input run over
frozen sparse weights (saliency maps, per-sample input gradients) and give dense torch's values;
a sparse operand that requires grad under a transform still raises STen's ``NotImplementedError``.
Plain ``vmap``, ``jacfwd``, ``hessian``, ``jvp`` and forward-mode AD (``torch.autograd.forward_ad``)
over frozen weights run densely too: before, the layouts' kernels were handed vmap's batched
inputs ("Cannot access data pointer of Tensor that doesn't have storage") and dropped or refused
dual tensors' tangents (a scipy weight gave a ``None`` tangent).

Before, every layout raised "STen: torch.nn.functional.linear with a sparse operand that requires
grad ... freeze the weight (requires_grad_(False))" although the weights were frozen: a call was
recorded as STen's autograd node (which functorch cannot run) whenever any operand, here the
transform's dense input, required grad."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, jacrev, vmap

import sten_core as sten
from sten_core.model.masks import stored_mask


def layouts():
    found = [(sten.DenseTensor, {}), (sten.CooTensor, {}), (sten.CsrTensor, {}), (sten.CscTensor, {})]
    try:
        import sten_nm
        import sten_scipy
    except ImportError:
        return found
    return found + [(sten_nm.NMTensor, dict(n=2, m=4)), (sten_nm.GroupedNMTensor, dict(n=2, m=4)),
                    (sten_nm.ColumnGroupedNMTensor, dict(n=1, m=4)), (sten_scipy.ScipyCsrTensor, {})]


LAYOUTS = layouts()


def frozen_pair(layout, kwargs, sizes=(8, 12, 4)):
    """A frozen dense ``Linear-Tanh-Linear`` and the same model with both weights in ``layout``."""
    torch.manual_seed(0)
    k, h, n = sizes
    dense = torch.nn.Sequential(torch.nn.Linear(k, h), torch.nn.Tanh(), torch.nn.Linear(h, n))
    sparse = copy.deepcopy(dense)
    for i in (0, 2):
        w = dense[i].weight.detach()
        sparse[i].weight = sten.SparseParameterWrapper(layout.from_dense(w * (torch.rand(w.shape) > 0.5), **kwargs))
        dense[i].weight = torch.nn.Parameter(sparse[i].weight.to_dense().detach().clone())
    return dense.requires_grad_(False), sparse.requires_grad_(False)


@pytest.mark.parametrize("layout,kwargs", LAYOUTS, ids=[layout.__name__ for layout, _ in LAYOUTS])
def test_input_gradients_over_frozen_sparse_weights_match_dense(layout, kwargs):
    dense, sparse = frozen_pair(layout, kwargs)
    x = torch.randn(5, 8)
    for transform in (lambda m: grad(lambda v: m(v).square().sum()),
                      lambda m: vmap(grad(lambda v: m(v).square().sum())),
                      lambda m: jacrev(m)):
        got, want = transform(sparse)(x), transform(dense)(x)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# what a function under a transform does with a frozen weight besides F.linear (x: [b, 8], w: [6, 8])
WEIGHT_USES = {
    "x @ w.t()": lambda v, w: v @ w.t(),
    "torch.mm(x, w.T)": lambda v, w: torch.mm(v, w.T),
    "(w @ x.t()).t()": lambda v, w: (w @ v.t()).t(),
    "x * w.sum(0)": lambda v, w: v * w.sum(0),
    "x + w[0]": lambda v, w: v + w[0],
    "linear(x, w * 2)": lambda v, w: F.linear(v, w * 2),
    "x * w.exp()[0]": lambda v, w: v * w.exp()[0],
    "x + w.to_dense()[1]": lambda v, w: v + w.to_dense()[1],
    "linear(x, relu(w))": lambda v, w: F.linear(v, torch.relu(w)),
    "einsum": lambda v, w: torch.einsum("bk,nk->bn", v, w),
    "cat": lambda v, w: torch.cat([v, w[:v.shape[-2]]], -1),
    "linear(x, w.clone().add_(1))": lambda v, w: F.linear(v, w.clone().add_(1.0)),
    "x * w.norm()": lambda v, w: v * w.norm(),
}
TRANSFORMS = {
    "jvp": lambda f, x: torch.func.jvp(f, (x,), (torch.ones_like(x),))[1],
    "grad": lambda f, x: grad(lambda v: f(v).sin().sum())(x),
    "jacrev": lambda f, x: jacrev(f)(x[:1]),
    "jacfwd": lambda f, x: torch.func.jacfwd(f)(x[:1]),
    "vmap(grad)": lambda f, x: vmap(grad(lambda v: f(v).sin().sum()))(x.unsqueeze(1)),
}


@pytest.mark.parametrize("layout,kwargs", LAYOUTS, ids=[layout.__name__ for layout, _ in LAYOUTS])
def test_functions_of_frozen_sparse_weights_under_transforms_match_dense(layout, kwargs):
    """Every use of a frozen weight in a transformed function, not only the product kernels: a call
    with no tensor of the transform runs outside it. Before, CSR / CSC weights raised "Sparse CSR
    tensors do not have strides" for all of these but ``F.linear`` and ``jvp`` of ``einsum``, and a
    scipy weight "Cannot access data pointer of Tensor that doesn't have storage" for ``w * 2``."""
    torch.manual_seed(0)
    w = torch.randn(6, 8, dtype=torch.float64)
    ws = sten.SparseParameterWrapper(layout.from_dense(w * (w.abs() > 0.5), **kwargs)).requires_grad_(False)
    wd = ws.to_dense()
    x = torch.randn(3, 8, dtype=torch.float64)
    for use_name, use in WEIGHT_USES.items():
        for name, transform in TRANSFORMS.items():
            got = transform(lambda v: use(v, ws), x)
            torch.testing.assert_close(got, transform(lambda v: use(v, wd), x), msg=f"{name} of {use_name}")


def test_a_write_into_a_captured_frozen_weight_is_not_the_transforms():
    """An in-place write into a frozen weight captured by ``grad`` runs outside the transform, as
    every call with none of its tensors does: the transform sees a constant, and the weight changes."""
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.eye(3))).requires_grad_(False)
    got = grad(lambda v: F.linear(v, w.mul_(2)).sum())(torch.ones(3))
    torch.testing.assert_close(got, torch.full((3,), 2.0))
    torch.testing.assert_close(w.to_dense(), 2 * torch.eye(3))


@pytest.mark.parametrize("keeps_layout", [False, True], ids=["dense grad", "grad in layout"])
@pytest.mark.parametrize("layout,kwargs", LAYOUTS, ids=[layout.__name__ for layout, _ in LAYOUTS])
def test_is_grads_batched_through_sparse_weights_matches_dense(layout, kwargs, keeps_layout):
    """``autograd.grad(..., is_grads_batched=True)`` runs backward under vmap: the layouts' backward
    kernels were handed the batch of gradients and crashed with unrelated errors ("Sparse CSR
    tensors do not have is_contiguous", "Tensor without CPU data"). The op's gradients are dense
    torch's, a weight's at its stored positions when its grad_fmt keeps the layout (one dense
    tensor per gradient of the batch: a layout holds one)."""
    dense, sparse = frozen_pair(layout, kwargs)
    for model in (dense, sparse):
        model[0].weight.requires_grad_(True)
    if keeps_layout:
        sparse[0].weight.grad_fmt = (sten.KeepAll(), layout, sten.KeepAll(), layout)
    x0, cotangents = torch.randn(5, 8), torch.randn(3, 5, 4)
    results = []
    for model in (sparse, dense):
        x = x0.clone().requires_grad_()
        results.append(torch.autograd.grad(model(x), [x, model[0].weight], cotangents, is_grads_batched=True))
    (gx, gw), (want_x, want_w) = results
    kept = stored_mask(sparse[0].weight) if keeps_layout else torch.tensor(True)
    torch.testing.assert_close(gx, want_x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gw, want_w * kept, atol=1e-5, rtol=1e-5)


def test_is_grads_batched_with_a_sparsifying_grad_fmt_says_why_not():
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.eye(4)))
    w.grad_fmt = (sten.ScalarFractionSparsifier(0.5), sten.CsrTensor, sten.KeepAll(), sten.CsrTensor)
    with pytest.raises(NotImplementedError, match="is_grads_batched=True"):
        torch.autograd.grad(F.linear(torch.randn(2, 4), w), [w], torch.randn(3, 2, 4), is_grads_batched=True)


def test_a_product_with_the_sparse_matrix_first_and_an_outer_backward():
    """``W @ x`` (the weight-first products) under ``grad``, and the same call under ``vmap`` with
    an input that requires grad in ordinary autograd: dense torch's values and gradients."""
    w = torch.randn(4, 6) * (torch.rand(4, 6) > 0.5)
    ws = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(w))
    x = torch.randn(3, 6)
    torch.testing.assert_close(grad(lambda v: torch.mm(ws, v.T).sin().sum())(x),
                               grad(lambda v: torch.mm(w, v.T).sin().sum())(x))
    xs, xd = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ys, yd = vmap(lambda v: F.linear(v, ws))(xs), vmap(lambda v: F.linear(v, w))(xd)
    torch.testing.assert_close(ys, yd)
    ys.sin().sum().backward()
    yd.sin().sum().backward()
    torch.testing.assert_close(xs.grad, xd.grad)


def test_a_trainable_sparse_weight_under_grad_still_names_sten():
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.randn(4, 6)))
    with pytest.raises(NotImplementedError, match=r"sparse operand that requires grad \(CsrTensor\)"):
        grad(lambda v: F.linear(v, w).sum())(torch.randn(2, 6))


def test_a_sparsified_output_under_grad_says_so():
    """An output spec would sparsify a result the transform must differentiate: a clear error."""
    sparse_add = sten.sparsified_op(torch.add, (sten.KeepAll(), torch.Tensor, sten.KeepAll(), sten.CooTensor))
    w = sten.SparseTensorWrapper(sten.CooTensor.from_dense(torch.eye(3)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        with pytest.raises(NotImplementedError, match="sparse output specs"):
            grad(lambda v: sparse_add(v, w).to_dense().sum())(torch.ones(3, 3))


# large enough for the n:m kernels (small products run densely), in float64 for jacfwd / hessian
KERNEL_SIZES = (128, 64, 32)


@pytest.mark.parametrize("layout,kwargs", LAYOUTS, ids=[layout.__name__ for layout, _ in LAYOUTS])
def test_plain_vmap_over_frozen_sparse_weights_matches_dense(layout, kwargs):
    dense, sparse = frozen_pair(layout, kwargs, KERNEL_SIZES)
    x = torch.randn(3, 5, KERNEL_SIZES[0])
    torch.testing.assert_close(vmap(sparse)(x), vmap(dense)(x), atol=1e-5, rtol=1e-5)
    w, wd = sparse[0].weight, dense[0].weight
    for f in (lambda v, m: v @ m.t(), lambda v, m: torch.matmul(v, m.T), lambda v, m: F.linear(v, m) * 2):
        torch.testing.assert_close(vmap(lambda v: f(v, w))(x), vmap(lambda v: f(v, wd))(x), atol=1e-5, rtol=1e-5)
    # the weight alone inside vmap (no batched operand) keeps its layout
    seen = []
    vmap(lambda v: seen.append(w.clone()) or v)(x)
    assert type(seen[0].wrapped_tensor) is type(w.wrapped_tensor)


@pytest.mark.parametrize("layout,kwargs", LAYOUTS, ids=[layout.__name__ for layout, _ in LAYOUTS])
def test_forward_mode_over_frozen_sparse_weights_matches_dense(layout, kwargs):
    from torch.func import hessian, jacfwd, jvp
    import torch.autograd.forward_ad as fwad

    dense, sparse = frozen_pair(layout, kwargs, KERNEL_SIZES)
    dense, sparse = dense.double(), sparse.double()
    x, t = torch.randn(2, KERNEL_SIZES[0], dtype=torch.float64), torch.randn(2, KERNEL_SIZES[0], dtype=torch.float64)

    def tangent(model, requires_grad):
        with fwad.dual_level():
            out = model(fwad.make_dual(x.clone().requires_grad_(requires_grad), t))
            return fwad.unpack_dual(out).tangent

    for requires_grad in (False, True):   # the second records the call for reverse mode too
        got = tangent(sparse, requires_grad)
        assert got is not None
        torch.testing.assert_close(got, tangent(dense, requires_grad))
    torch.testing.assert_close(jvp(sparse, (x,), (t,)), jvp(dense, (x,), (t,)))
    torch.testing.assert_close(jacfwd(sparse)(x[0]), jacfwd(dense)(x[0]))
    f = {m: (lambda v, m=m: m(v).tanh().sum()) for m in (dense, sparse)}
    torch.testing.assert_close(hessian(f[sparse])(x[0]), hessian(f[dense])(x[0]))


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("layout,kwargs", LAYOUTS, ids=[layout.__name__ for layout, _ in LAYOUTS])
def test_a_dual_sparse_weight_carries_its_tangent(layout, kwargs, requires_grad):
    """``fwAD.make_dual(w, t)`` (a Jacobian-vector product with respect to the weight): the result
    is dense torch's dual tensor; it was a writable view of the wrapper without the tangent."""
    import torch.autograd.forward_ad as fwad

    torch.manual_seed(0)
    w = sten.SparseTensorWrapper(layout.from_dense(torch.randn(32, 64), **kwargs), requires_grad=requires_grad)
    x, t = torch.randn(4, 64), torch.randn(32, 64)
    with fwad.dual_level(), warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        got = fwad.unpack_dual(F.linear(x, fwad.make_dual(w, t))).tangent
        want = fwad.unpack_dual(F.linear(x, fwad.make_dual(w.to_dense().detach(), t))).tangent
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("layout,kwargs", LAYOUTS, ids=[layout.__name__ for layout, _ in LAYOUTS])
def test_jit_trace_refuses_sparse_wrappers_clearly(layout, kwargs):
    """The tracer records torch operators only: a layout's kernel was baked in as a constant (scipy)
    or as the uninitialised buffer it fills (n:m), and the traced module returned wrong values."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    lin.weight = sten.SparseParameterWrapper(layout.from_dense(lin.weight.detach(), **kwargs))
    lin.requires_grad_(False)
    with pytest.raises(NotImplementedError, match="torch.jit.trace or make_fx .* is not supported.*torch.export"):
        torch.jit.trace(lin, (torch.randn(4, 64),))


@pytest.mark.parametrize("layout,kwargs", LAYOUTS, ids=[layout.__name__ for layout, _ in LAYOUTS])
def test_make_fx_and_linearize_refuse_sparse_wrappers_clearly(layout, kwargs):
    """``make_fx`` on real tensors (and ``torch.func.linearize``, which traces with it) records torch
    operators only: an n:m model's graph replayed uninitialised memory (errors of 1e31, NaN from
    linearize's jvp_fn), a scipy one a constant from the trace-time input, and a CSR one raised
    "Sparse CSR tensors do not have strides"."""
    from torch.fx.experimental.proxy_tensor import make_fx

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    lin.weight = sten.SparseParameterWrapper(layout.from_dense(lin.weight.detach(), **kwargs))
    lin.requires_grad_(False)
    x = torch.randn(4, 64)
    with pytest.raises(NotImplementedError, match="make_fx .* is not supported.*torch.export"):
        make_fx(lin)(x)
    with pytest.raises(NotImplementedError, match="make_fx .* is not supported.*torch.func.jvp"):
        torch.func.linearize(lin, x)
    _, tangent = torch.func.jvp(lin, (x,), (torch.ones_like(x),))  # the supported spelling
    torch.testing.assert_close(tangent, F.linear(torch.ones_like(x), lin.weight.to_dense()))


COMPILED = [(layout, kwargs) for layout, kwargs in LAYOUTS
            if layout.__name__ in ("CsrTensor", "NMTensor", "ColumnGroupedNMTensor", "ScipyCsrTensor")]


@pytest.mark.parametrize("layout,kwargs", COMPILED, ids=[layout.__name__ for layout, _ in COMPILED])
def test_compiled_vmap_over_frozen_sparse_weights_matches_eager(layout, kwargs):
    """``torch.compile(vmap(model))`` and of ``vmap(grad(...))``: the layouts' custom operators have no
    batching rules, so under the transform the compiled path runs densely, as eager does (it raised
    "Batching rule not implemented for sten_nm::nm_linear" while compiling)."""
    torch._dynamo.reset()
    dense, sparse = frozen_pair(layout, kwargs, KERNEL_SIZES)
    x = torch.randn(5, KERNEL_SIZES[0])
    for make in (vmap, lambda m: vmap(grad(lambda v: m(v).sin().sum()))):
        got = torch.compile(make(sparse), backend="aot_eager")(x)
        torch.testing.assert_close(got, make(dense)(x), atol=1e-5, rtol=1e-5)


class _Flat(sten.Layout):
    """A layout of one tensor, densified as a new tensor (``to_dense`` is differentiable)."""

    def __init__(self, data):
        self.data = data

    @classmethod
    def from_dense(cls, tensor):
        return cls(tensor)

    def to_dense(self):
        return self.data * 1

    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype)
    device = property(lambda self: self.data.device)


class _InDict(_Flat):
    def __init__(self, data):
        self.parts = {"data": data}

    data = property(lambda self: self.parts["data"])


class _Nested(_Flat):
    def __init__(self, data):
        self.inner = _Flat(data)

    data = property(lambda self: self.inner.data)


@pytest.mark.parametrize("layout", [_Flat, _InDict, _Nested], ids=["attribute", "in a dict", "nested layout"])
def test_a_layout_holding_a_transform_tensor_is_densified_inside_the_transform(layout):
    """A layout made inside ``grad`` from its tensor stays inside it wherever it keeps the tensor:
    one looked only at attributes and their lists, so a dict or a nested layout was densified
    outside the transform, and its gradient silently 0."""
    from sten_core.model.layouts import to_dense_tensor

    x = torch.randn(4, 8)
    torch.testing.assert_close(grad(lambda v: to_dense_tensor(layout(v * 1.0)).pow(2).sum())(x), 2 * x)


def test_random_operators_on_a_frozen_weight_keep_vmaps_randomness():
    """A call with none of vmap's tensors runs outside it, except a random one: vmap's ``randomness``
    decides (``"error"`` raises, ``"different"`` draws per element), as for dense torch."""
    w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.randn(4, 4)))
    xs = torch.ones(3, 4)
    with pytest.raises(RuntimeError, match="randomness"):
        vmap(lambda x: F.dropout(w, 0.5, training=True) @ x, randomness="error")(xs)
    torch.manual_seed(0)
    out = vmap(lambda x: F.dropout(w, 0.5, training=True) @ x, randomness="different")(xs)
    assert not (torch.equal(out[0], out[1]) and torch.equal(out[1], out[2]))


def test_an_in_place_write_of_a_transform_tensor_into_a_wrapper_names_stens_limit():
    """torch's "must override the setup_context staticmethod" named only STen's private node."""
    w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(4)))
    with pytest.raises(NotImplementedError, match="STen: Tensor.add_ with a sparse operand"):
        grad(lambda x: w.clone().add_(x[0]).sum())(torch.randn(3, 4))


@pytest.mark.parametrize("layout,kwargs", LAYOUTS, ids=[layout.__name__ for layout, _ in LAYOUTS])
def test_jvp_with_respect_to_a_sparse_weight_in_a_parameter_dict_matches_dense(layout, kwargs):
    """``jvp`` makes its primals dual (``_make_dual``) inside the transform: run outside it, as other
    calls with none of its tensors are, the weight's tangent was lost without an error."""
    from torch.func import functional_call, jvp

    dense, sparse = frozen_pair(layout, kwargs, KERNEL_SIZES)
    params = {k: v.detach() for k, v in sparse.named_parameters()}
    dense_params = {k: v.detach() for k, v in dense.named_parameters()}
    tangents = {k: torch.randn(v.shape) for k, v in params.items()}
    x = torch.randn(3, KERNEL_SIZES[0])
    got = jvp(lambda p: functional_call(sparse, p, (x,)), (params,), (tangents,))
    want = jvp(lambda p: functional_call(dense, p, (x,)), (dense_params,), (tangents,))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("transform", ["grad", "jacrev", "vjp", "jvp", "jacfwd", "hessian"])
@pytest.mark.parametrize("layout,kwargs", LAYOUTS[:5], ids=[layout.__name__ for layout, _ in LAYOUTS[:5]])
def test_transforms_with_respect_to_a_sparse_argument_match_dense(layout, kwargs, transform):
    """A wrapper as the differentiated argument runs the dense path; ``jvp`` raised for CSR ("do not
    have strides") and n:m (the C decompress got a transform's tensor)."""
    torch.manual_seed(0)
    x = torch.randn(3, 8, dtype=torch.float64)
    d = torch.randn(6, 8, dtype=torch.float64)
    w = sten.SparseTensorWrapper(layout.from_dense(d * (torch.rand(6, 8) > 0.5), **kwargs))
    f = lambda ww: F.linear(x, ww).sin().sum()
    make = {"grad": torch.func.grad, "jacrev": torch.func.jacrev, "jacfwd": torch.func.jacfwd,
            "hessian": torch.func.hessian,
            "vjp": lambda g: (lambda a: torch.func.vjp(g, a)[1](torch.tensor(1.0, dtype=torch.float64))[0]),
            "jvp": lambda g: (lambda a: torch.func.jvp(g, (a,), (torch.ones(6, 8, dtype=torch.float64),))[1])}[transform]
    got = make(f)(w)
    got = got.to_dense() if isinstance(got, sten.SparseTensorWrapper) else got
    torch.testing.assert_close(got, make(f)(w.to_dense()))
