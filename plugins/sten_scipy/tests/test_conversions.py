"""Lossless conversions to and from the core's torch-native layouts."""

import pytest
import torch

import sten_core as sten
from sten_scipy import ScipyCscTensor, ScipyCsrTensor

from conftest import LAYOUTS, sample

TORCH_LAYOUTS = (sten.CsrTensor, sten.CscTensor, sten.CooTensor)


@pytest.mark.parametrize("src", LAYOUTS)
@pytest.mark.parametrize("dst", TORCH_LAYOUTS + LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_to_and_back(src, dst, dtype):
    dense = sample((7, 5), dtype)
    w = sten.SparseTensorWrapper(src.from_dense(dense))
    out = sten.convert(w, dst)
    assert isinstance(out.wrapped_tensor, dst) and out.dtype == dtype
    assert torch.equal(out.to_dense(), dense)
    back = sten.convert(out, src)
    assert isinstance(back.wrapped_tensor, src) and torch.equal(back.to_dense(), dense)


@pytest.mark.parametrize("src", TORCH_LAYOUTS)
@pytest.mark.parametrize("dst", LAYOUTS)
def test_from_torch_layouts(src, dst):
    dense = sample((4, 9), torch.float64)
    out = sten.convert(sten.SparseTensorWrapper(src.from_dense(dense)), dst)
    assert isinstance(out.wrapped_tensor, dst) and out.dtype == torch.float64
    assert torch.equal(out.to_dense(), dense) and out.wrapped_tensor.data.has_canonical_format


@pytest.mark.parametrize("layout", LAYOUTS)
def test_explicit_zeros_survive(layout):
    """A stored zero (e.g. after an optimizer step) is kept: the pattern is lossless."""
    x = layout.from_dense(torch.tensor([[1., 0.], [2., 3.]]))
    x = x.with_values(torch.tensor([0., 2., 3.]))
    for dst in TORCH_LAYOUTS:
        out = sten.convert(sten.SparseTensorWrapper(x), dst)
        assert out.wrapped_tensor.nnz == 3
        back = sten.convert(out, layout)
        assert back.wrapped_tensor.nnz == 3 and back.wrapped_tensor.same_pattern(x)


def test_conversions_copy_values():
    x = ScipyCsrTensor.from_dense(torch.eye(3))
    y = sten.convert(sten.SparseTensorWrapper(x), sten.CsrTensor)
    y.wrapped_tensor.values().mul_(5)
    assert torch.equal(x.to_dense(), torch.eye(3))


def test_registered_through_the_registry():
    pairs = set(sten.registry.conversions)
    for a, b in ((ScipyCsrTensor, sten.CsrTensor), (sten.CsrTensor, ScipyCsrTensor), (ScipyCscTensor, sten.CscTensor),
                 (sten.CscTensor, ScipyCscTensor), (sten.CooTensor, ScipyCsrTensor), (ScipyCscTensor, sten.CooTensor)):
        assert (a, b) in pairs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dst", [ScipyCsrTensor, ScipyCscTensor])
def test_a_half_precision_source_gets_the_layouts_dtype_error(dst, dtype):
    """numpy's "Got unsupported ScalarType BFloat16" named neither the layout nor the fix."""
    w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.randn(4, 8).to(dtype)))
    with pytest.raises(TypeError, match=rf"{dst.__name__}: dtype must be float32 or float64, got {dtype}.*\.float\(\)"):
        sten.convert(w, dst)
