"""Padding slots (stored slots past the logical shape) stay 0 through element-wise updates
of the stored values: an in-place division by a dense tensor gathered 0 there (0/0 = NaN),
which ``to_dense()`` cropped but the kernels multiplied into the product (NaN * 0 = NaN):
F.linear returned NaN after ``W.div_(D)`` or two Adagrad steps."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_nm import ColumnGroupedNMTensor, GroupedNMTensor, NMTensor

LAYOUTS = {
    "NMTensor": lambda d: NMTensor.from_dense(d, 2, 4),
    "NMTensor dim=0": lambda d: NMTensor.from_dense(d, 1, 4, dim=0),
    "GroupedNMTensor": lambda d: GroupedNMTensor.from_dense(d, 2, 4),
    "ColumnGroupedNMTensor": lambda d: ColumnGroupedNMTensor.from_dense(d, 2, 4),
    "ColumnGroupedNMTensor 1:10": lambda d: ColumnGroupedNMTensor.from_dense(d, 1, 10),
}
SHAPES = [(7, 13), (17, 10), (33, 7), (32, 16), (5, 3)]   # none a multiple of every group and chunk

UPDATES = {
    "div_ dense": lambda w, d: w.div_(d),
    "addcdiv_": lambda w, d: w.addcdiv_(torch.ones_like(d), d),
    "div_ then mul_": lambda w, d: w.div_(d).mul_(3.0),
}


def product_matches_dense(W, K):
    x = torch.randn(4, K)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = F.linear(x, W)
        yt = torch.mm(x, W.t())
    ref = F.linear(x, W.to_dense())
    assert torch.isfinite(y).all() and torch.isfinite(yt).all()
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(yt, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("update", list(UPDATES))
def test_updates_on_stored_values_keep_the_padding_zero(layout, shape, update):
    torch.manual_seed(0)
    W = sten.SparseTensorWrapper(LAYOUTS[layout](torch.randn(*shape)))
    D = torch.rand(*shape) + 0.5
    ref = W.to_dense().clone()
    with torch.no_grad():
        UPDATES[update](ref, D)
        UPDATES[update](W, D)
    stored = W.wrapped_tensor.values()
    assert not stored.isnan().any()
    mask = W.wrapped_tensor.to_dense() != 0
    torch.testing.assert_close(W.to_dense(), ref * mask)
    product_matches_dense(W, shape[1])


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("opt", ["Adagrad", "RMSprop"])
def test_adagrad_and_rmsprop_steps_keep_the_product_finite(layout, opt):
    torch.manual_seed(0)
    W = sten.SparseParameterWrapper(LAYOUTS[layout](torch.randn(17, 10)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o = getattr(torch.optim, opt)([W], lr=0.01)
        for _ in range(3):
            F.linear(torch.randn(4, 10), W).square().sum().backward()
            o.step()
            o.zero_grad()
    product_matches_dense(W, 10)


def test_with_values_zeroes_only_the_padding():
    w = NMTensor.from_dense(torch.randn(3, 5), 2, 4)       # the second group: 1 column + 3 padding
    v = torch.full_like(w.values(), float("nan"))
    got = w.with_values(v).values()
    pad = w.columns() >= 5
    assert pad.any() and (got[pad] == 0).all() and got[~pad].isnan().all()
    full = NMTensor.from_dense(torch.randn(3, 8), 2, 4)     # no padding: values kept as given
    v = torch.full_like(full.values(), float("nan"))
    assert full.with_values(v).values().isnan().all()
