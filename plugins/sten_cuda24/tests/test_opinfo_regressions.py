"""Regressions found by running PyTorch's OpInfo samples through the plugin's layouts
(``tests/test_opinfo_plugins.py`` at the repository root), each checked against dense torch
on the wrapped value's dense form.

- empty tensors (``K == 0`` or no rows) raised ``cannot reshape tensor of 0 elements``
  from ``reshape(-1, K)`` in 2:4 construction, pruning and products;
- ``to_dense()`` of a padded 2:4 or block-sparse tensor was a strided view of the padded
  storage: ``w.view(-1)`` raised, ``as_strided`` read the padding, ``as_strided_scatter``
  hit an internal assert;
- ``torch.matmul(W24, x)`` with a vector ``x`` raised in backward (``g.t() @ b.t()`` of
  1-D tensors), and with a batch ``x`` raised in forward (``b.t()`` of a 3-D tensor);
- 2:4 pruning of a tensor holding inf/NaN: ``y * mask`` turned a pruned inf into NaN and
  NaN magnitudes ranked neither above nor below the others (three kept per group), so
  ``sparsify_24`` raised ``tensor is not 2:4 sparse``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from sten_cuda24 import BlockSparseTensor, Sparse24Tensor, encoding
from sten_cuda24.sparsifiers import sparsify_24
from sten_cuda24.triton_sparsify24 import reference_sparsify24

INF, NAN = float("inf"), float("nan")


def _dense_of(value):
    return value.to_dense() if hasattr(value, "wrapped_tensor") else value


def _block(dense: torch.Tensor, block=(2, 2)) -> BlockSparseTensor:
    """Keep every other block (a pruned, padded block-sparse tensor)."""
    bh, bw = block
    grid = (-(-dense.shape[0] // bh), -(-dense.shape[1] // bw))
    keep = (torch.arange(grid[0] * grid[1]).reshape(grid) % 2 == 0)
    return BlockSparseTensor.from_dense_block_mask(dense, keep, block)


@pytest.mark.parametrize("shape", [(0, 3), (3, 0), (0, 0), (2, 0, 4), (2, 3, 0)])
def test_sparse24_empty_tensors(shape):
    t = torch.randn(shape)
    for layout in (Sparse24Tensor.from_dense(t), sparsify_24(t), Sparse24Tensor.from_dense_masked(t, t != 0)):
        assert layout.shape == t.shape and layout.nnz == 0
        assert torch.equal(layout.to_dense(), t)
        assert layout.values().numel() == layout.gather(t).numel()
    assert encoding.row_mask(t).shape == t.shape
    if t.dim() == 2:
        assert torch.equal(Sparse24Tensor.from_dense(t, transposable=True).to_dense(), t)
        assert torch.equal(sparsify_24(t, transposable=True).to_dense(), t)


@pytest.mark.parametrize("shape", [(0, 3), (4, 0), (0, 0)])
@pytest.mark.parametrize("op", ["linear", "matmul", "mm"])
def test_sparse24_empty_products_match_dense(sten, shape, op):
    w = sten.SparseTensorWrapper(sparsify_24(torch.randn(shape)), requires_grad=True)
    wd = w.to_dense().detach().clone().requires_grad_()
    x = torch.randn(5, shape[1]) if op == "linear" else torch.randn(shape[1], 5)
    xd = x.clone().requires_grad_()
    x.requires_grad_()
    fn = {"linear": torch.nn.functional.linear, "matmul": torch.matmul, "mm": torch.mm}[op]
    y, yd = fn(x, w) if op == "linear" else fn(w, x), fn(xd, wd) if op == "linear" else fn(wd, xd)
    assert y.shape == yd.shape
    y.sum().backward()
    yd.sum().backward()
    torch.testing.assert_close(_dense_of(w.grad), wd.grad)
    torch.testing.assert_close(x.grad, xd.grad)


@pytest.fixture
def dense_fallbacks(sten):
    """``view`` / ``as_strided`` have no implementation: they run densely (warned)."""
    sten.set_dispatch_failure("warn")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield sten


@pytest.mark.parametrize("make", ["sparse24", "block"])
def test_padded_dense_form_is_contiguous(dense_fallbacks, make):
    sten = dense_fallbacks
    torch.manual_seed(0)
    t = torch.randn(3, 3)  # K = 3: 2:4 pads to 16 columns, 2 x 2 blocks to 4 x 4
    layout = sparsify_24(t) if make == "sparse24" else _block(t)
    dense = layout.to_dense()
    assert dense.is_contiguous()
    w = sten.SparseTensorWrapper(layout, requires_grad=True)
    wd = dense.clone().requires_grad_()
    torch.testing.assert_close(w.view(-1), dense.view(-1))  # raised: a view of padded storage
    weights = torch.randn(2, 2)
    got = torch.as_strided(w, (2, 2), (1, 2), 1)  # read the padding instead of the values
    want = torch.as_strided(wd, (2, 2), (1, 2), 1)
    torch.testing.assert_close(_dense_of(got), want)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    torch.testing.assert_close(_dense_of(w.grad), wd.grad)
    src = torch.randn(2, 2)
    torch.testing.assert_close(_dense_of(torch.as_strided_scatter(w, src, (2, 2), (1, 2), 1)),
                               torch.as_strided_scatter(wd.detach(), src, (2, 2), (1, 2), 1))


@pytest.mark.parametrize("x_shape", [(12,), (12, 3), (2, 12, 3), (0, 12, 3), (2, 1, 12, 4)])
@pytest.mark.parametrize("sparse_grad", [False, True])
def test_sparse24_matmul_vector_and_batch_match_dense(sten, x_shape, sparse_grad):
    torch.manual_seed(0)
    grad_fmt = (sten.KeepAll(), Sparse24Tensor, sten.KeepAll(), Sparse24Tensor) if sparse_grad else None
    layout = sparsify_24(torch.randn(5, 12))
    w = sten.SparseTensorWrapper(layout, requires_grad=True, grad_fmt=grad_fmt)
    wd = layout.to_dense().clone().requires_grad_()
    x = torch.randn(x_shape, requires_grad=True)
    xd = x.detach().clone().requires_grad_()
    y, yd = torch.matmul(w, x), torch.matmul(wd, xd)
    torch.testing.assert_close(y, yd)
    g = torch.randn(yd.shape)
    (y * g).sum().backward()
    (yd * g).sum().backward()
    torch.testing.assert_close(x.grad, xd.grad)
    want = wd.grad * layout.mask() if sparse_grad else wd.grad  # a sparse grad_fmt: at the kept positions
    torch.testing.assert_close(_dense_of(w.grad), want)
    if x.dim() == 2:
        torch.testing.assert_close(torch.mm(w, x.detach()), torch.mm(wd.detach(), x.detach()))


ROWS = torch.tensor([
    [NAN, 1., 2., 3.], [1., NAN, NAN, 3.], [-INF, -INF, -INF, 1.], [INF, INF, INF, INF],
    [2., -INF, 0., 1.], [0., 0., 0., 5.], [NAN, NAN, NAN, NAN], [1., 2., INF, NAN],
])


def _dense_prune(x: torch.Tensor) -> torch.Tensor:
    """Two largest |x| per group of 4 along the last dim, NaN largest, ties to the lower index."""
    out = torch.zeros_like(x)
    for r in range(x.shape[0]):
        for g in range(0, x.shape[1], 4):
            group = x[r, g:g + 4]
            key = [(-(INF if v != v else abs(v)), i) for i, v in enumerate(group.tolist())]
            for _, i in sorted(key)[:2]:
                out[r, g + i] = group[i]
    return out


def test_sparse24_pruning_with_inf_and_nan():
    want = _dense_prune(ROWS)
    for got in (reference_sparsify24(ROWS), sparsify_24(ROWS).to_dense(),
                ROWS.masked_fill(~encoding.row_mask(ROWS), 0)):
        torch.testing.assert_close(got, want, equal_nan=True)
    # a mask leaving an inf out stores 0 there (not inf * 0 = NaN), fillers included
    mask = torch.zeros_like(ROWS, dtype=torch.bool)
    mask[:, 3] = True
    stored = Sparse24Tensor.from_dense_masked(ROWS, mask).to_dense()
    torch.testing.assert_close(stored, ROWS.masked_fill(~mask, 0), equal_nan=True)
    # the transposable mask ranks NaN first as well and never keeps more than 2 per row or column
    square = torch.cat([ROWS[:4], ROWS[4:]], dim=1)  # 4 x 8
    keep = encoding.transposable_mask(square)
    assert int(keep.reshape(4, 2, 4).sum(-1).max()) <= 2 and int(keep.reshape(1, 4, 8).sum(1).max()) <= 2
    assert keep[0, 0] and keep[3, 7]  # a NaN is visited first in its tile (NaN as compared would be last)
    torch.testing.assert_close(sparsify_24(square, transposable=True).to_dense(), square.masked_fill(~keep, 0),
                               equal_nan=True)


@pytest.mark.parametrize("w_shape, x_shape", [((3, 0), (0, 4)), ((0, 3), (3, 2)), ((3, 4), (2, 4, 0)), ((3, 0), (0,))])
def test_block_sparse_empty_products_match_dense(sten, w_shape, x_shape):
    """``W @ x`` runs the layout's ``F.linear`` (``F.linear(x.mT, W).mT``); its backward
    raised ``cannot reshape tensor of 0 elements`` for an empty ``K`` or batch."""
    layout = _block(torch.randn(w_shape))
    w = sten.SparseTensorWrapper(layout, requires_grad=True)
    wd = layout.to_dense().clone().requires_grad_()
    x = torch.randn(x_shape, requires_grad=True)
    xd = x.detach().clone().requires_grad_()
    y, yd = torch.matmul(w, x), torch.matmul(wd, xd)
    torch.testing.assert_close(y, yd)
    y.sum().backward()
    yd.sum().backward()
    torch.testing.assert_close(_dense_of(w.grad), wd.grad)
    torch.testing.assert_close(x.grad, xd.grad)
