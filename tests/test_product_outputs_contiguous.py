"""A product with a sparse operand returns a contiguous result, as dense torch's products do.

Before, ``F.linear`` with a ``CsrTensor`` / ``CooTensor`` / scipy weight returned ``(W xᵀ)ᵀ`` as a
transposed view: ``y.view(b, -1)`` raised ("view size is not compatible with input tensor's size and
stride") where the dense model works, and ``nn.Dropout`` after it drew another mask than the dense
model under the same seed (``bernoulli_`` fills in memory order), so no run with dropout matched
its dense reference."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten


def layouts() -> list:
    found = [(sten.CsrTensor, {}), (sten.CooTensor, {}), (sten.CscTensor, {}), (sten.DenseTensor, {})]
    try:
        import sten_nm
        import sten_scipy
    except ImportError:
        return found
    return found + [(sten_nm.NMTensor, dict(n=2, m=4)), (sten_nm.ColumnGroupedNMTensor, dict(n=2, m=4)),
                    (sten_scipy.ScipyCsrTensor, {}), (sten_scipy.ScipyCscTensor, {})]


LAYOUTS = layouts()


def products(w: torch.Tensor, bias: torch.Tensor) -> dict:
    """Products users write with a weight ``w`` [N, K] (sparse or dense), by name."""
    g = torch.Generator().manual_seed(3)
    x2, x3 = torch.randn(6, w.shape[1], generator=g), torch.randn(2, 3, w.shape[1], generator=g)
    y2, c = torch.randn(5, w.shape[0], generator=g), torch.randn(w.shape[1], generator=g)
    return {
        "linear": lambda: F.linear(x2, w),
        "linear+bias": lambda: F.linear(x2, w, bias),
        "linear 3-D": lambda: F.linear(x3, w, bias),
        "x @ w.t()": lambda: torch.matmul(x2, w.t()),
        "w @ xᵀ": lambda: torch.mm(w, x2.t()),
        "matmul(y, w)": lambda: torch.matmul(y2, w),
        "addmm": lambda: torch.addmm(c, y2, w),
    }


@pytest.mark.parametrize("layout,kwargs", LAYOUTS, ids=[layout.__name__ for layout, _ in LAYOUTS])
def test_products_are_contiguous_and_dropout_matches_dense(layout, kwargs):
    torch.manual_seed(0)
    weight = torch.randn(16, 32) * (torch.rand(16, 32) > 0.5)
    w = sten.SparseTensorWrapper(layout.from_dense(weight, **kwargs))
    dense, bias = w.to_dense(), torch.randn(16)
    ours, theirs = products(w, bias), products(dense, bias)
    for name in ours:
        torch.manual_seed(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sten.DispatchWarning)
            got = ours[name]()
        torch.manual_seed(1)
        want = theirs[name]()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=name)
        assert got.is_contiguous(), f"{name}: strides {got.stride()} for shape {tuple(got.shape)}"
        got.view(-1)   # what flatten-before-head code does
        torch.manual_seed(2)
        a = F.dropout(got, 0.5)
        torch.manual_seed(2)
        torch.testing.assert_close(a, F.dropout(want, 0.5), atol=1e-5, rtol=1e-5, msg=f"{name}, dropout mask")
