"""A layout whose ``to_dense()`` returns a strided view (a slice of padded storage, a transpose)
gives dense torch's values and gradients through ops that read strides (``as_strided``, ``view``):
the core makes the dense tensor contiguous, as the wrapper's own strides say it is.

Before, the view went through unchanged: ``torch.as_strided(w, ...)`` read the padding and
``w.view(-1)`` raised (or, for a transposed ``DenseTensor``, read the values in the wrong order),
silently wrong values and gradients."""

import warnings

import pytest
import torch

import sten_core as sten
from sten_core.model.layouts import to_dense_tensor


class PaddedLayout(sten.Layout):
    """The values in the middle of a larger buffer (as 2:4 and block-sparse kernels pad them);
    ``to_dense()`` is a non-contiguous slice of it with a storage offset."""

    def __init__(self, padded: torch.Tensor, shape: tuple):
        self.padded, self._shape = padded, torch.Size(shape)

    @classmethod
    def from_dense(cls, tensor: torch.Tensor) -> "PaddedLayout":
        rows, cols = tensor.shape
        padded = torch.full((rows + 1, cols + 3), 99.0, dtype=tensor.dtype)
        padded[1:, 2:2 + cols] = tensor
        return cls(padded, tensor.shape)

    def to_dense(self) -> torch.Tensor:
        rows, cols = self._shape
        return self.padded[1:, 2:2 + cols]

    shape = property(lambda self: self._shape)
    dtype = property(lambda self: self.padded.dtype)
    device = property(lambda self: self.padded.device)


def layouts(dense: torch.Tensor) -> list:
    """``dense`` as a padded layout and as a ``DenseTensor`` holding a transposed tensor."""
    return [PaddedLayout.from_dense(dense), sten.DenseTensor(dense.t().contiguous().t())]


OPS = {
    "as_strided": lambda t: torch.as_strided(t, (3, 2), (1, 2)),
    "as_strided offset": lambda t: t.as_strided((2, 2), (4, 1), 1),
    "view": lambda t: t.view(-1),
    "view as rows": lambda t: t.view(2, 6),
}


def run(name: str, w: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)   # (no implementation: the dense path)
        return OPS[name](w)


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("which", [0, 1], ids=["padded slice", "transposed DenseTensor"])
@pytest.mark.parametrize("requires_grad", [False, True], ids=["frozen", "trainable"])
def test_stride_reading_ops_match_dense(name, which, requires_grad):
    dense = torch.arange(12.0).reshape(3, 4)
    layout = layouts(dense)[which]
    assert not layout.to_dense().is_contiguous()
    w = sten.SparseTensorWrapper(layout, requires_grad=requires_grad)
    ref = dense.clone().requires_grad_(requires_grad)
    got, want = run(name, w), OPS[name](ref)
    torch.testing.assert_close(got, want)
    if requires_grad:
        weights = torch.randn(want.shape)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sten.DispatchWarning)
            (got * weights).sum().backward()
        (want * weights).sum().backward()
        torch.testing.assert_close(w.grad.to_dense(), ref.grad)


def test_to_dense_tensor_copies_only_a_strided_view():
    layout = PaddedLayout.from_dense(torch.ones(2, 3))
    dense = to_dense_tensor(layout)
    assert dense.is_contiguous() and torch.equal(dense, torch.ones(2, 3))
    contiguous = sten.DenseTensor(torch.ones(2, 3))
    assert to_dense_tensor(contiguous) is contiguous.to_dense()   # no copy where none is needed
