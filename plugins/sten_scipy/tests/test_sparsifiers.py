"""Every built-in sparsifier into both scipy layouts equals the core's dense result."""

import pytest
import torch

import sten_core as sten
from sten_scipy import ScipyCscTensor, ScipyCsrTensor

from conftest import LAYOUTS, sample

SPARSIFIERS = [
    sten.KeepAll(),
    sten.ScalarThresholdSparsifier(0.5),
    sten.ScalarFractionSparsifier(0.7),
    sten.BlockwiseFractionSparsifier(0.5, (2, 2)),
    sten.PerBlockFractionSparsifier(2, 4),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sparsifier", SPARSIFIERS, ids=lambda s: type(s).__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_dense_mask(layout, sparsifier, dtype):
    dense = sample((8, 12), dtype, fraction=0.1)
    out = sten.sparsify(sparsifier, dense, layout)
    assert isinstance(out.wrapped_tensor, layout) and out.dtype == dtype
    expected = sten.sparsify(sparsifier, dense, torch.Tensor) if type(sparsifier) is not sten.KeepAll else dense
    assert torch.equal(out.to_dense(), expected)
    assert out.wrapped_tensor.nnz == int((expected != 0).sum())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_random_fraction(layout):
    dense = torch.randn(40, 50) + 10  # no zeros
    torch.manual_seed(0)
    out = sten.sparsify(sten.RandomFractionSparsifier(0.7), dense, layout)
    kept = out.to_dense() != 0
    assert 0.25 < kept.float().mean() < 0.35
    assert torch.equal(out.to_dense(), dense * kept)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ref_layout", LAYOUTS + (sten.CsrTensor,))
def test_same_format(layout, ref_layout):
    ref = sten.SparseTensorWrapper(ref_layout.from_dense(sample((6, 6), seed=1)))
    dense = torch.randn(6, 6)
    out = sten.sparsify(sten.SameFormatSparsifier(ref), dense, layout)
    assert isinstance(out.wrapped_tensor, layout)
    assert torch.equal(out.to_dense(), dense * (ref.to_dense() != 0))


def test_grad_fmt_is_attached():
    fmt = (sten.KeepAll(), ScipyCsrTensor, sten.KeepAll(), ScipyCsrTensor)
    out = sten.sparsify(sten.ScalarFractionSparsifier(0.5), torch.randn(4, 4), ScipyCscTensor, grad_fmt=fmt)
    assert out.grad_fmt == fmt


def test_registered_for_every_builtin_sparsifier():
    for layout in LAYOUTS:
        for sp in sten.model.sparsifiers.BUILTIN_SPARSIFIERS:
            key = sten.OpKey("sparsifier", sp, (torch.Tensor,), layout)
            assert key in sten.registry.impls, key.describe()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bad_input(layout):
    with pytest.raises(ValueError, match="must be 2-D"):
        sten.sparsify(sten.ScalarFractionSparsifier(0.5), torch.randn(2, 3, 4), layout)
    with pytest.raises(TypeError, match="float32 or float64"):
        sten.sparsify(sten.ScalarThresholdSparsifier(0.5), torch.ones(3, 3, dtype=torch.int32), layout)
