"""Built-in layouts and the wrapper: round trips, nnz, conversions, pickling, metadata."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sten_core as sten

LAYOUTS = (sten.DenseTensor, sten.CooTensor, sten.CsrTensor, sten.CscTensor)
ANY_DIM = (sten.DenseTensor, sten.CooTensor)
DTYPES = (torch.float32, torch.float64, torch.bfloat16)
PROFILE = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])

sizes = st.sampled_from([0, 1, 2, 3, 5, 8])
shapes_2d = st.tuples(sizes, sizes)


def sample(shape: tuple, dtype: torch.dtype, seed: int, density: float = 0.4) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x = x * (torch.rand(shape, generator=g, dtype=torch.float64) < density)
    return x.to(dtype)


def layouts_for(x: torch.Tensor) -> tuple:
    return LAYOUTS if x.dim() == 2 else ANY_DIM


def expected_nnz(layout: type, x: torch.Tensor) -> int:
    return x.numel() if layout is sten.DenseTensor else int(torch.count_nonzero(x))


# -- round trips and nnz ---------------------------------------------------------------

@PROFILE
@given(shape=st.one_of(st.tuples(sizes), shapes_2d, st.tuples(sizes, sizes, sizes)),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_round_trip_and_nnz(shape, dtype, seed):
    x = sample(shape, dtype, seed)
    for layout in layouts_for(x):
        obj = layout.from_dense(x)
        assert obj.shape == x.shape and obj.dtype == dtype and obj.device == x.device
        back = obj.to_dense()
        assert back.layout is torch.strided and back.dtype == dtype
        assert torch.equal(back, x)
        assert obj.nnz == expected_nnz(layout, x)


def test_from_dense_does_not_alias_or_track_grad():
    x = torch.randn(3, 4, requires_grad=True)
    for layout in LAYOUTS:
        obj = layout.from_dense(x)
        assert not obj.to_dense().requires_grad
    d = sten.DenseTensor.from_dense(x)
    with torch.no_grad():
        x.mul_(0)
    assert d.to_dense().abs().sum() > 0, "DenseTensor.from_dense copies"


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CscTensor])
def test_compressed_layouts_need_2d(layout):
    with pytest.raises(ValueError, match="2-D"):
        layout.from_dense(torch.ones(2, 2, 2))


# -- stored-values protocol ----------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_stored_values_protocol(layout):
    x = sample((5, 7), torch.float32, 3)
    obj = layout.from_dense(x)
    values = obj.values()
    assert values.numel() == obj.nnz
    doubled = obj.with_values(values * 2)
    assert torch.equal(doubled.to_dense(), x * 2)
    assert doubled.same_pattern(obj) and obj.same_pattern(doubled)
    other = torch.arange(35.0).reshape(5, 7)
    assert torch.equal(obj.with_values(obj.gather(other)).to_dense(),
                       other * (torch.ones_like(x) if layout is sten.DenseTensor else (x != 0)))
    if layout is not sten.DenseTensor:  # a dense layout stores every position
        assert not obj.same_pattern(layout.from_dense(sample((5, 7), torch.float32, 4)))


# -- conversions -------------------------------------------------------------------------

@PROFILE
@given(shape=shapes_2d, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_conversions_among_builtins_are_lossless(shape, dtype, seed):
    x = sample(shape, dtype, seed)
    for src in LAYOUTS:
        w = sten.SparseTensorWrapper(src.from_dense(x))
        for dst in LAYOUTS:
            c = sten.convert(w, dst)
            assert isinstance(c, sten.SparseTensorWrapper)
            assert type(c.wrapped_tensor) is dst
            assert c.shape == x.shape and c.dtype == dtype
            assert torch.equal(c.to_dense(), x)
            if src is not sten.DenseTensor and dst is not sten.DenseTensor:
                assert c.wrapped_tensor.nnz == w.wrapped_tensor.nnz
        dense = sten.convert(w, torch.Tensor)
        assert type(dense) is torch.Tensor and torch.equal(dense, x)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_convert_dense_tensor_into_layout(layout):
    x = sample((4, 6), torch.float32, 1)
    c = sten.convert(x, layout)
    assert type(c.wrapped_tensor) is layout and torch.equal(c.to_dense(), x)


def test_a_lossy_conversion_through_dense_warns_once_and_raises_in_raise_mode():
    """No registered path from CSR to n:m: the round trip through dense prunes, which
    sten.convert says (a lossy step is a fallback) instead of losing values silently."""
    from sten_nm import NMTensor

    x = sample((8, 16), torch.float32, 3)
    w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(x))
    sten.dispatch.reset_warnings()
    had = int(torch.count_nonzero(x))
    with pytest.warns(sten.DispatchWarning, match=rf"Lossy conversion CsrTensor -> NMTensor.*kept \d+ of the {had} "):
        c = sten.convert(w, NMTensor)
    torch.testing.assert_close(c.to_dense(), NMTensor.from_dense(x).to_dense())
    with warnings.catch_warnings():
        warnings.simplefilter("error", sten.DispatchWarning)
        sten.convert(w, NMTensor)                                # once per pair of layouts
        sten.convert(sten.SparseTensorWrapper(NMTensor.from_dense(x)), sten.CsrTensor)   # lossless: silent
    sten.set_dispatch_failure("raise")
    try:
        sten.dispatch.reset_warnings()
        with pytest.raises(sten.DispatchError, match="Lossy conversion"):
            sten.convert(w, NMTensor)
    finally:
        sten.set_dispatch_failure("warn")


def test_conversion_path_has_several_steps():
    # DenseTensor -> CooTensor -> CsrTensor: no direct conversion is registered
    path = sten.dispatch.conversion_path(sten.DenseTensor, sten.CsrTensor)
    assert path is not None and len(path) == 2


# -- pickling --------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_pickle_layout_and_wrapper(layout, dtype):
    x = sample((4, 5), dtype, 7)
    obj = layout.from_dense(x)
    obj2 = pickle.loads(pickle.dumps(obj))
    assert type(obj2) is layout and torch.equal(obj2.to_dense(), x) and obj2.nnz == obj.nnz

    w = sten.SparseTensorWrapper(obj, requires_grad=True)
    w2 = pickle.loads(pickle.dumps(w))
    assert type(w2) is type(w) and isinstance(w2, sten.SparseTensorWrapper) and type(w2.wrapped_tensor) is layout
    assert w2.requires_grad
    assert w2.shape == x.shape and w2.dtype == dtype and torch.equal(w2.to_dense(), x)

    p = sten.SparseParameterWrapper(layout.from_dense(x))
    p2 = pickle.loads(pickle.dumps(p))
    assert isinstance(p2, sten.SparseParameterWrapper) and type(p2) is type(p) and p2.requires_grad
    assert torch.equal(p2.to_dense(), x)


def test_pickle_keeps_grad_fmt():
    grad_fmt = (sten.KeepAll(), torch.Tensor, sten.ScalarFractionSparsifier(0.5), sten.CooTensor)
    w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(3)), grad_fmt=grad_fmt)
    assert pickle.loads(pickle.dumps(w)).grad_fmt == grad_fmt


@pytest.mark.parametrize("layout", LAYOUTS)
def test_torch_save_load_state_dict(layout):
    m = torch.nn.Linear(5, 4)
    x = sample((4, 5), torch.float32, 2)
    m.weight = sten.SparseParameterWrapper(layout.from_dense(x))
    for weights_only in (False, True):
        buf = io.BytesIO()
        torch.save(m.state_dict(), buf)
        buf.seek(0)
        state = torch.load(buf, weights_only=weights_only)
        assert type(state["weight"].wrapped_tensor) is layout
        assert torch.equal(state["weight"].to_dense(), x)


# -- wrapper metadata --------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_wrapper_metadata(layout, dtype):
    x = sample((3, 7), dtype, 5)
    w = sten.SparseTensorWrapper(layout.from_dense(x))
    assert w.shape == torch.Size([3, 7]) and w.size() == torch.Size([3, 7])
    assert w.size(1) == 7 and w.size(-2) == 3
    assert w.dim() == 2 and w.ndim == 2 and w.numel() == 21 and len(w) == 3
    assert w.dtype == dtype and w.device == torch.device("cpu")
    assert w.requires_grad is False and w.is_leaf
    assert isinstance(w, torch.Tensor) and type(w.wrapped_tensor) is layout
    assert w.is_floating_point()
    text = repr(w)
    assert text.startswith("SparseTensorWrapper(") and layout.__name__ in text
    assert "(3, 7)" in text and str(dtype) in text
    w.requires_grad_(True)
    assert w.requires_grad and "requires_grad=True" in repr(w)


def test_wrapper_construction_forms():
    x = sample((4, 4), torch.float32, 9).requires_grad_()
    obj = sten.CooTensor.from_dense(x)
    w = sten.SparseTensorWrapper.wrapped_from_dense(obj, x)
    assert w.wrapped_tensor is obj and w.requires_grad
    fmt = (sten.KeepAll(), torch.Tensor, sten.KeepAll(), sten.CsrTensor)
    w = sten.SparseTensorWrapper.wrapped_from_dense(obj, x.detach(), grad_fmt=fmt)
    assert not w.requires_grad and w.grad_fmt == fmt


def test_wrapper_of_a_layout_without_metadata():
    class Bare:  # only from_dense / to_dense, like the paper's MyCscTensor
        def __init__(self, t):
            self.t = t

        @staticmethod
        def from_dense(t):
            return Bare(t.clone())

        def to_dense(self):
            return self.t

    w = sten.SparseTensorWrapper(Bare.from_dense(torch.ones(2, 5, dtype=torch.float64)))
    assert w.shape == (2, 5) and w.dtype == torch.float64 and w.device.type == "cpu"


def test_detach_and_deepcopy_keep_layout():
    x = sample((3, 3), torch.float32, 1)
    w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(x), requires_grad=True)
    d = w.detach()
    assert type(d.wrapped_tensor) is sten.CsrTensor and not d.requires_grad
    c = copy.deepcopy(w)
    assert c.wrapped_tensor is not w.wrapped_tensor and torch.equal(c.to_dense(), x) and c.requires_grad


# -- as a module parameter ------------------------------------------------------------------

@pytest.mark.parametrize("layout", [sten.CooTensor, sten.CsrTensor, sten.CscTensor])
def test_usable_as_module_parameter(layout):
    torch.manual_seed(0)
    m = torch.nn.Linear(6, 4)
    dense_w = m.weight.detach() * (torch.rand(4, 6) < 0.5)
    m.weight = sten.SparseParameterWrapper(layout.from_dense(dense_w))
    assert [n for n, _ in m.named_parameters()] == ["weight", "bias"]
    assert isinstance(m.weight, torch.nn.Parameter) or m.weight._is_param
    x = torch.randn(3, 6)
    y = m(x)
    ref = x @ dense_w.t() + m.bias.detach()
    assert torch.allclose(y, ref, atol=1e-6)
    y.sum().backward()
    assert m.weight.grad is not None and m.bias.grad is not None
    assert torch.allclose(m.bias.grad, torch.full((4,), 3.0))
    g = m.weight.grad.to_dense() if isinstance(m.weight.grad, sten.SparseTensorWrapper) else m.weight.grad
    assert torch.allclose(g, torch.ones(3, 4).t() @ x, atol=1e-5)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    opt.step()
    assert type(m.weight.wrapped_tensor) is layout
    stepped = m.weight.to_dense()
    assert torch.allclose(stepped[dense_w != 0], (dense_w - 0.1 * g)[dense_w != 0], atol=1e-5)
    m2 = copy.deepcopy(m)
    assert isinstance(m2.weight, sten.SparseParameterWrapper) and type(m2.weight) is type(m.weight)
