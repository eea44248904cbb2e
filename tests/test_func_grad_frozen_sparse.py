"""``torch.func.grad``, ``jacrev`` and ``vmap(grad(...))`` with respect to a dense input run over
frozen sparse weights (saliency maps, per-sample input gradients) and give dense torch's values;
a sparse operand that requires grad under a transform still raises STen's ``NotImplementedError``.

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


def layouts():
    found = [(sten.DenseTensor, {}), (sten.CooTensor, {}), (sten.CsrTensor, {}), (sten.CscTensor, {})]
    try:
        import sten_nm
        import sten_scipy
    except ImportError:
        return found
    return found + [(sten_nm.NMTensor, dict(n=2, m=4)), (sten_scipy.ScipyCsrTensor, {})]


LAYOUTS = layouts()


def frozen_pair(layout, kwargs):
    """A frozen dense ``Linear-Tanh-Linear`` and the same model with both weights in ``layout``."""
    torch.manual_seed(0)
    dense = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Tanh(), torch.nn.Linear(12, 4))
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
