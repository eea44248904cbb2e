"""Element-wise calls and views that gave silent wrong answers against dense torch:

- an in-place write through a view of a wrapper that requires grad (``h[1:].mul_(10)`` with
  ``h = w * 2``) changed a dense copy: ``h`` kept its values and ``w.grad`` was the unwritten
  one; it is now a ``RuntimeError`` saying what to do (reads of the view work as before);
- ``a / b`` of two wrappers with one pattern gave 0 where dense torch gives 0 / 0 = NaN;
- ``w.fill_(v)`` and ``w.masked_fill_(m, v)`` dropped the values put off the pattern without the
  ``DispatchWarning`` that ``w[m] = v`` gives.
"""

import warnings

import numpy as np
import pytest
import torch

import sten_core as sten
from sten_core.model.tensor import densify

DENSE = torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, 0.0], [4.0, 0.0, 5.0]])
LAYOUTS = [sten.CsrTensor, sten.CooTensor, sten.DenseTensor]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        yield


@pytest.mark.parametrize("write", ["slice mul_", "index iadd", "T mul_", "diagonal mul_", "view mul_"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_in_place_write_through_a_view_under_autograd_is_refused(layout, write):
    w = sten.SparseTensorWrapper(layout.from_dense(DENSE), requires_grad=True)
    h = w * 2
    writes = {"slice mul_": lambda: h[1:].mul_(10.0), "index iadd": lambda: h[0].__iadd__(1.0),
              "T mul_": lambda: h.T.mul_(torch.ones(3)), "diagonal mul_": lambda: h.diagonal().mul_(2.0),
              "view mul_": lambda: h.view(-1).mul_(3.0)}
    with pytest.raises(RuntimeError, match=r"writes in place through a view of a sparse wrapper that requires grad"):
        writes[write]()
    torch.testing.assert_close(h.to_dense(), DENSE * 2)   # unchanged, and it says so


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reads_of_views_under_autograd_match_dense(layout):
    w = sten.SparseTensorWrapper(layout.from_dense(DENSE), requires_grad=True)
    d = DENSE.clone().requires_grad_()
    got = (w * 2)[1:].T.sum(0) * torch.arange(2.0)
    want = (d * 2)[1:].T.sum(0) * torch.arange(2.0)
    torch.testing.assert_close(got, want)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(w.grad.to_dense() if isinstance(w.grad, sten.SparseTensorWrapper) else w.grad, d.grad)


def test_views_without_autograd_still_write_back():
    h = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(DENSE))
    with torch.no_grad():
        h[1:].mul_(10.0)
    torch.testing.assert_close(h.to_dense(), DENSE * torch.tensor([[1.0], [10.0], [10.0]]))


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CooTensor])
def test_dividing_by_a_wrapper_gives_nan_at_its_unstored_zeros(layout):
    a = sten.SparseTensorWrapper(layout.from_dense(DENSE))
    b = sten.SparseTensorWrapper(layout.from_dense(2 * DENSE))
    for got, want in [(a / b, DENSE / (2 * DENSE)), (torch.div(a, a), DENSE / DENSE),
                      (a.div(b, rounding_mode="floor"), DENSE.div(2 * DENSE, rounding_mode="floor"))]:
        got = got.to_dense() if isinstance(got, sten.SparseTensorWrapper) else got
        torch.testing.assert_close(got, want, equal_nan=True)
    full = sten.SparseTensorWrapper(sten.DenseTensor.from_dense(DENSE + 1))   # stores every position
    torch.testing.assert_close((full / full).to_dense(), torch.ones(3, 3))


@pytest.mark.parametrize("fill", ["fill_", "masked_fill_"])
@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CooTensor])
def test_fills_into_a_temporary_reach_every_position(layout, fill):
    """A temporary filled in place is filled everywhere, as a dense tensor (a weight keeps its
    pattern: the next test)."""
    t = sten.SparseTensorWrapper(layout.from_dense(DENSE))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*positions it does not store", sten.DispatchWarning)
        if fill == "fill_":
            t.fill_(9.0)
        else:
            t.masked_fill_(torch.ones(3, 3, dtype=torch.bool), 9.0)
    torch.testing.assert_close(t.to_dense(), torch.full((3, 3), 9.0))
    t.fill_(0.0)
    torch.testing.assert_close(t.to_dense(), torch.zeros(3, 3))


@pytest.mark.parametrize("fill", ["fill_", "masked_fill_"])
@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CooTensor])
def test_fills_off_the_pattern_warn_with_the_count(layout, fill):
    w = sten.SparseParameterWrapper(layout.from_dense(DENSE))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if fill == "fill_":
            w.fill_(9.0)
        else:
            w.masked_fill_(torch.ones(3, 3, dtype=torch.bool), 9.0)
    assert any("wrote 4 value(s) at positions it does not store" in str(c.message) for c in caught)
    torch.testing.assert_close(w.to_dense(), torch.where(DENSE != 0, 9.0, 0.0))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", sten.DispatchWarning)
        w.fill_(0.0)                                          # nothing off the pattern: no warning
        w.masked_fill_(DENSE != 0, 1.0)


def test_a_detached_view_may_be_made_to_require_grad():
    """``requires_grad_`` changes no values (a dense backward re-run calls it on a saved view of a
    weight's copy: the n:m layouts without their kernel raised here)."""
    w = sten.SparseTensorWrapper(sten.CooTensor.from_dense(DENSE), requires_grad=True)
    view = w.T.detach()
    view.requires_grad_(True)
    (view * 2).sum().backward()
    torch.testing.assert_close(view.grad, torch.full((3, 3), 2.0))


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CooTensor, sten.DenseTensor])
def test_type_as_takes_the_dtype_of_any_tensor(layout):
    """``w.type_as(t)`` takes ``t``'s dtype whatever its shape (``weight.type_as(hidden_states)``):
    ``t`` was read as an element-wise operand, so shapes that do not broadcast raised."""
    w = sten.SparseParameterWrapper(layout.from_dense(DENSE))
    for other in (torch.zeros(2, dtype=torch.float64), torch.zeros((), dtype=torch.float64),
                  torch.zeros(5, 7, dtype=torch.float32)):
        out = w.type_as(other)
        assert out.dtype == other.dtype and type(out.wrapped_tensor) is layout
        torch.testing.assert_close(out.to_dense(), DENSE.to(other.dtype))
    out = w.type_as(torch.zeros(2, dtype=torch.float64))
    (out * torch.arange(9.0, dtype=torch.float64).view(3, 3)).sum().backward()
    torch.testing.assert_close(densify(w.grad), torch.arange(9.0).view(3, 3))


@pytest.mark.parametrize("op", [lambda w, x, out: torch.mul(w, x, out=out), lambda w, x, out: torch.sqrt(w.abs(), out=out),
                                lambda w, x, out: torch.div(w, x, out=out)], ids=["mul", "sqrt", "div"])
def test_out_of_another_shape_is_resized_as_dense_torch_does(op):
    """A dense ``out=`` of another shape reached the stored-values implementation as an operand,
    whose broadcast check raised "Attempting to broadcast a dimension"; dense torch resizes it."""
    w = sten.sparsify(sten.ScalarFractionSparsifier(0.5), torch.randn(4, 6), sten.CsrTensor)
    x = torch.rand(4, 6) + 1
    out, want = torch.empty(0), torch.empty(0)
    op(w, x, out)
    op(densify(w), x, want)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("scalar, op", [(np.float32("inf"), "mul"), (np.float16("nan"), "mul"), (np.float32(0), "div"),
                                        (np.int64(0), "div"), (complex("inf"), "mul")],
                         ids=["f32 inf", "f16 nan", "f32 zero", "i64 zero", "complex inf"])
def test_a_numpy_scalar_turning_unstored_zeros_into_nan_gives_dense_torchs_values(scalar, op):
    """Only Python ints and floats were checked: ``w * np.float32(inf)`` gave 0 where dense torch gives
    NaN (``0 * inf``)."""
    dense = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(dense))
    fn = (lambda a: a * scalar) if op == "mul" else (lambda a: a / scalar)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        got = fn(w)
    torch.testing.assert_close(densify(got), fn(dense), equal_nan=True)


def test_a_product_whose_promoted_dtype_the_layout_cannot_hold_runs_dense():
    """``torch.mul(w, x)`` of a float32 n:m weight and a complex tensor raised the layout's
    ``values must be a floating-point ...``; dense torch gives complex64 (``w * x`` did, by accident)."""
    sten_nm = pytest.importorskip("sten_nm")
    dense = torch.tensor([[1.0, 2.0, 0.0, 0.0]])
    w = sten.SparseTensorWrapper(sten_nm.NMTensor.from_dense(dense, 2, 4))
    x = torch.full((1, 4), 1j, dtype=torch.complex64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        for got in (torch.mul(w, x), w.mul(x), w * x):
            assert densify(got).dtype == torch.complex64
            torch.testing.assert_close(densify(got), dense * x)
