"""Layouts: round trips, dtype, metadata, the stored-values protocol, pickling,
bad input, and the core's conformance kit."""

import pickle

import numpy as np
import pytest
import scipy.sparse
import torch

import sten_core as sten
from sten_core.testing import check_layout
from sten_scipy import ScipyCscTensor, ScipyCsrTensor

from conftest import LAYOUTS, sample


@pytest.mark.parametrize("layout", LAYOUTS)
def test_conformance_kit(layout):
    check_layout(layout)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_round_trip_keeps_dtype(layout, dtype):
    dense = sample((6, 9), dtype)
    x = layout.from_dense(dense)
    assert x.dtype == dtype and x.data.dtype == np.dtype(str(dtype).split(".")[1])
    assert x.shape == (6, 9) and x.nnz == int((dense != 0).sum()) and x.device == torch.device("cpu")
    assert x.data.format == layout.format and x.data.has_canonical_format
    assert torch.equal(x.to_dense(), dense)
    np.testing.assert_array_equal(x.data.toarray(), dense.numpy())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_from_dense_edge_shapes(layout):
    for shape in ((0, 3), (3, 0), (1, 1), (4, 4)):
        dense = torch.zeros(shape)
        assert torch.equal(layout.from_dense(dense).to_dense(), dense)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_wraps_existing_scipy_arrays(layout):
    dense = sample((5, 4))
    for source in (scipy.sparse.csr_matrix(dense.numpy()), scipy.sparse.coo_array(dense.numpy())):
        x = layout(source)
        assert isinstance(x.data, layout.array_type)
        assert torch.equal(x.to_dense(), dense)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_values_share_memory(layout):
    dense = sample((5, 7))
    x = layout.from_dense(dense)
    values = x.values()
    values.mul_(2)
    assert torch.equal(x.to_dense(), dense * 2)  # the scipy array changed in place
    y = x.with_values(torch.arange(x.nnz, dtype=torch.float32))
    assert y.same_pattern(x) and not y.same_pattern(layout.from_dense(sample((5, 7), seed=3)))
    assert torch.equal(y.gather(y.to_dense()), torch.arange(x.nnz, dtype=torch.float32))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_optimizer_step_keeps_pattern(layout):
    dense = sample((6, 5))
    w = sten.SparseParameterWrapper(layout.from_dense(dense))
    data = w.wrapped_tensor.data
    opt = torch.optim.Adam([w], lr=0.1)
    x = torch.randn(3, 5)
    ref = dense.clone().requires_grad_(True)
    ref_opt = torch.optim.Adam([ref], lr=0.1)
    mask = dense != 0
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.linear(x, w).sum().backward()
        opt.step()
        ref_opt.zero_grad()
        (torch.nn.functional.linear(x, ref).sum()).backward()
        ref.grad *= mask  # the sparse weight only ever updates its kept positions
        ref_opt.step()
    assert isinstance(w.wrapped_tensor, layout) and w.wrapped_tensor.nnz == int(mask.sum())
    torch.testing.assert_close(w.to_dense(), ref.detach() * mask, rtol=1e-4, atol=1e-5)
    assert np.shares_memory(w.wrapped_tensor.data.indices, data.indices)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pickle_and_torch_save(layout, tmp_path):
    w = sten.SparseTensorWrapper(layout.from_dense(sample((4, 6), torch.float64)))
    again = pickle.loads(pickle.dumps(w))
    assert isinstance(again.wrapped_tensor, layout) and torch.equal(again.to_dense(), w.to_dense())
    torch.save(w, tmp_path / "w.pt")
    loaded = torch.load(tmp_path / "w.pt", weights_only=False)
    assert torch.equal(loaded.to_dense(), w.to_dense()) and loaded.dtype == torch.float64


@pytest.mark.parametrize("layout", LAYOUTS)
def test_transpose_is_the_other_layout(layout):
    dense = sample((3, 8))
    x = layout.from_dense(dense).transpose()
    assert type(x) is (ScipyCscTensor if layout is ScipyCsrTensor else ScipyCsrTensor)
    assert torch.equal(x.to_dense(), dense.t())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_move_to_an_unsupported_dtype_says_so(layout, dtype):
    """Module.half() / .bfloat16() of a model with a scipy weight: the dtype named (bf16 raised
    numpy's "Got unsupported ScalarType BFloat16" before); the weight is left as it was."""
    import sten_core as sten

    model = torch.nn.Linear(4, 4)
    w = sten.SparseParameterWrapper(layout.from_dense(torch.randn(4, 4)))
    model.weight = w
    before = w.to_dense().clone()
    with pytest.raises(TypeError, match=f"{layout.__name__}: dtype must be float32 or float64, got {dtype}"):
        model.to(dtype)
    assert w.dtype == torch.float32 and torch.equal(w.to_dense(), before)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_zeros_like_in_an_unsupported_dtype_says_so(layout, dtype):
    """``torch.zeros_like(w, dtype=torch.bfloat16)`` raised numpy's bare "Got unsupported ScalarType
    BFloat16" (new values of an unsupported dtype, through ``with_values``)."""
    import sten_core as sten

    w = sten.SparseTensorWrapper(layout.from_dense(torch.randn(4, 4)))
    with pytest.raises(TypeError, match=f"{layout.__name__}: dtype must be float32 or float64, got {dtype}"):
        torch.zeros_like(w, dtype=dtype)
    assert torch.zeros_like(w, dtype=torch.float64).dtype == torch.float64


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bad_input_is_named(layout):
    with pytest.raises(ValueError, match=r"must be 2-D.*\(2, 3, 4\)"):
        layout.from_dense(torch.ones(2, 3, 4))
    with pytest.raises(ValueError, match="must be 2-D"):
        layout.from_dense(torch.ones(3))
    with pytest.raises(TypeError, match="float32 or float64, got torch.int64"):
        layout.from_dense(torch.ones(2, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="float32 or float64, got torch.float16"):
        layout.from_dense(torch.ones(2, 2, dtype=torch.float16))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        layout.from_dense(np.ones((2, 2)))
    with pytest.raises(TypeError, match="scipy.sparse array"):
        layout(torch.ones(2, 2))
    with pytest.raises(TypeError, match="float32 or float64"):
        layout(scipy.sparse.csr_array(np.eye(2, dtype=np.int32)))
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        layout.from_dense(torch.eye(2)).with_values(torch.ones(3))
