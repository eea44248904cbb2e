"""torch.t / .T / transpose and torch.sum: values and gradients against dense."""

import pytest
import torch

import sten_core as sten
from sten_scipy import ScipyCscTensor, ScipyCsrTensor

from conftest import LAYOUTS, check_against_dense, sample, sparse_fmt, sparse_param

OTHER = {ScipyCsrTensor: ScipyCscTensor, ScipyCscTensor: ScipyCsrTensor}
T_FORMS = {
    "torch.t": torch.t,
    "Tensor.t": lambda a: a.t(),
    "T": lambda a: a.T,
    "mT": lambda a: a.mT,
    "transpose": lambda a: torch.transpose(a, 0, 1),
    "Tensor.transpose": lambda a: a.transpose(-1, -2),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("form", T_FORMS, ids=str)
def test_transpose(layout, form):
    w = sample((4, 7))
    out = check_against_dense(lambda a: T_FORMS[form](a) * torch.arange(4.0), [sparse_param(layout, w)])
    assert isinstance(out.wrapped_tensor, OTHER[layout])
    t = T_FORMS[form](sten.SparseTensorWrapper(layout.from_dense(w)))
    assert isinstance(t.wrapped_tensor, OTHER[layout]) and t.shape == (7, 4)
    assert t.wrapped_tensor.data.indices is layout.from_dense(w).data.indices or torch.equal(t.to_dense(), w.t())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_transpose_then_linear(layout):
    w = sample((5, 8))
    x = torch.randn(3, 5)
    check_against_dense(lambda a, b: torch.mm(a, b.t()), [x.clone().requires_grad_(), sparse_param(layout, w.t().contiguous())])
    check_against_dense(lambda a, b: torch.mm(a, b.t()), [x.clone().requires_grad_(), sparse_param(layout, w.t().contiguous(), sparse_fmt(layout))],
                        masks={1: w.t() != 0})


def test_transpose_identity_and_bad_dims():
    w = sten.SparseTensorWrapper(ScipyCsrTensor.from_dense(sample((3, 4))))
    assert isinstance(torch.transpose(w, 1, 1).wrapped_tensor, ScipyCsrTensor)
    with pytest.raises(ValueError, match=r"dims must be in \[-2, 1\]"):
        torch.transpose(w, 0, 2)


SUM_FORMS = {
    "all": lambda a: torch.sum(a),
    "method": lambda a: a.sum(),
    "dim0": lambda a: torch.sum(a, 0),
    "dim1": lambda a: a.sum(dim=1),
    "dim-1 keepdim": lambda a: a.sum(-1, keepdim=True),
    "dims (0,1)": lambda a: a.sum((0, 1)),
    "keepdim all": lambda a: torch.sum(a, dim=(0, 1), keepdim=True),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("form", SUM_FORMS, ids=str)
@pytest.mark.parametrize("sparse_grad", [False, True])
def test_sum(layout, form, sparse_grad):
    w = sample((5, 6), torch.float64)
    fmt = sparse_fmt(layout) if sparse_grad else None
    out = check_against_dense(SUM_FORMS[form], [sparse_param(layout, w, fmt)], masks={0: w != 0} if sparse_grad else None)
    assert out.dtype == torch.float64 and not isinstance(out, sten.SparseTensorWrapper)


def test_sum_dtype():
    w = sten.SparseTensorWrapper(ScipyCsrTensor.from_dense(sample((3, 3))))
    out = torch.sum(w, dtype=torch.float64)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, w.to_dense().sum(dtype=torch.float64))
    with pytest.raises(ValueError, match="dim must be in"):
        w.sum(dim=2)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dims", [(0, 0), (0, -2), (1, -1)])
def test_sum_over_a_repeated_dim_is_an_error_as_in_torch(layout, dims):
    """``w.sum((0, -2))`` summed over dim 0 once where torch raises "dim 0 appears multiple times"
    (the core CSR too: its ``sum`` is converted to scipy's)."""
    w = sten.SparseTensorWrapper(layout.from_dense(torch.eye(3)))
    with pytest.raises(RuntimeError, match="appears multiple times"):
        torch.eye(3).sum(dims)
    with pytest.raises(RuntimeError, match="appears multiple times"):
        w.sum(dims)
