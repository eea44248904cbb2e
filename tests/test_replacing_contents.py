"""Replacing a sparse tensor's contents keeps every value or says why it cannot.

``w.data = t`` (``vector_to_parameters``), ``w.set_(t)``, loading a checkpoint value of another
layout and ``remove_parametrizations(leave_parametrized=True)`` store ``t`` exactly in ``w``'s
layout class, or raise a ``ValueError`` naming the layout, what it cannot store and what to do
instead. Layouts that hold any pattern take ``t``'s nonzeros as their pattern. In-place
arithmetic (``copy_`` of a dense tensor included) still writes at the stored positions only.
Each test compares with the dense reference.
"""

from __future__ import annotations

import contextlib
import io
import warnings

import pytest
import torch
import torch.nn.utils.parametrize as parametrize
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import sten_core as sten

LAYOUTS = ["CsrTensor", "CooTensor", "DenseTensor", "NMTensor", "ColumnGroupedNMTensor", "ScipyCsrTensor"]
NM = ["NMTensor", "ColumnGroupedNMTensor"]
ANY_PATTERN = [name for name in LAYOUTS if name not in NM]
SHAPE = (8, 16)
NOT_EXACT = r"cannot hold the new value exactly: it has \d+ nonzero values"


def layout_class(name: str) -> type:
    """The layout class ``name``, from the core or its plugin (skipped where not installed)."""
    if name in NM:
        return getattr(pytest.importorskip("sten_nm"), name)
    if name == "ScipyCsrTensor":
        return pytest.importorskip("sten_scipy").ScipyCsrTensor
    return getattr(sten, name)


def masked(seed: int = 0, shape: tuple = SHAPE) -> torch.Tensor:
    """A random dense tensor with about half of its entries zero."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen) * (torch.rand(shape, generator=gen) > 0.5)


def full(seed: int = 1, shape: tuple = SHAPE) -> torch.Tensor:
    """A random dense tensor without zeros (no n:m layout holds it)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def weight(name: str, seed: int = 0, requires_grad: bool = True) -> sten.SparseParameterWrapper:
    """A sparse parameter of layout ``name`` (2:4 by magnitude for the n:m layouts)."""
    cls = layout_class(name)
    return sten.SparseParameterWrapper(cls.from_dense(full(seed) if name in NM else masked(seed)),
                                       requires_grad=requires_grad)


def linear(name: str, seed: int = 0) -> torch.nn.Linear:
    """A ``Linear(16, 8)`` whose weight is a sparse parameter of layout ``name``."""
    lin = torch.nn.Linear(SHAPE[1], SHAPE[0])
    lin.weight = weight(name, seed)
    return lin


def dense_of(tensor: torch.Tensor) -> torch.Tensor:
    """The dense values of a wrapper or a plain tensor, without history."""
    return (tensor.to_dense() if isinstance(tensor, sten.SparseTensorWrapper) else tensor).detach()


def no_fallback() -> contextlib.AbstractContextManager:
    """A block in which a dense fallback or a lossy conversion raises (``"raise"`` mode)
    instead of warning once per process."""
    return sten.dispatch.failure_mode("raise")


# -- w.data = t and vector_to_parameters ------------------------------------------------------

@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("scale", [1.0, 2.0])
def test_vector_to_parameters_round_trip_keeps_values_layout_and_pattern(name, scale):
    """The vector of ``parameters_to_vector`` is zero where the weight stores nothing, so every
    layout holds it: values, layout and pattern are kept, with no fallback (``t.view_as(w)``
    fell back with a warning, so the round trip raised in raise mode)."""
    lin = linear(name)
    before, layout = dense_of(lin.weight), lin.weight.wrapped_tensor
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)  # parameters_to_vector's w.view(-1)
        vector = parameters_to_vector(lin.parameters()) * scale
    with no_fallback():
        vector_to_parameters(vector, lin.parameters())
    assert type(lin.weight.wrapped_tensor) is type(layout)
    assert torch.equal(dense_of(lin.weight), before * scale)
    assert torch.equal(dense_of(lin.weight) != 0, before != 0)


@pytest.mark.parametrize("name", NM)
def test_vector_to_parameters_keeps_an_nm_weights_n_and_m(name):
    """A 1:4 weight's round trip fits 2:4 as well: ``from_dense`` (2:4 by default) must not
    make it a 2:4 weight, which stores twice the values; the weight's own pattern is kept."""
    cls = layout_class(name)
    lin = torch.nn.Linear(SHAPE[1], SHAPE[0], bias=False)
    lin.weight = sten.SparseParameterWrapper(cls.from_dense(full(), 1, 4))
    before, layout = dense_of(lin.weight), lin.weight.wrapped_tensor
    vector_to_parameters(parameters_to_vector(lin.parameters()), lin.parameters())
    after = lin.weight.wrapped_tensor
    assert (after.n, after.m, after.nnz) == (1, 4, layout.nnz)
    assert after.same_pattern(layout) and torch.equal(dense_of(lin.weight), before)


@pytest.mark.parametrize("name", NM)
def test_assigning_a_value_an_nm_layout_cannot_hold_raises(name):
    """``vector_to_parameters(torch.randn(...))`` into an n:m weight re-pruned by magnitude and
    dropped half the values silently; it raises now, naming the layout, and the weight is unchanged."""
    lin = linear(name)
    before = dense_of(lin.weight)
    numel = SHAPE[0] * SHAPE[1]
    with pytest.raises(ValueError, match=rf"w\.data = t: {name}\(.*n=2, m=4.*{NOT_EXACT}.*"
                                         rf"{name}\.from_dense keeps {numel // 2} of them.*w\.copy_\(t\)"):
        vector_to_parameters(full(5).reshape(-1), [lin.weight])
    assert torch.equal(dense_of(lin.weight), before)


@pytest.mark.parametrize("name", ANY_PATTERN)
def test_assigning_to_an_any_pattern_layout_takes_the_values_nonzeros(name):
    """The documented behaviour: a dense ``t``'s own nonzeros make the pattern."""
    w = weight(name)
    t = masked(seed=7)
    w.data = t.clone()
    assert type(w.wrapped_tensor) is layout_class(name)
    assert torch.equal(dense_of(w), t)
    if name != "DenseTensor":
        assert w.wrapped_tensor.nnz == int(torch.count_nonzero(t))


@pytest.mark.parametrize("name", NM)
def test_assigning_an_nm_value_of_another_pattern_is_exact(name):
    """A value the layout holds (an n:m tensor with another pattern) is stored exactly."""
    w = weight(name)
    t = layout_class(name).from_dense(full(seed=9)).to_dense()
    w.data = t
    assert type(w.wrapped_tensor) is layout_class(name) and torch.equal(dense_of(w), t)


# -- w.set_(t) --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ANY_PATTERN)
def test_set_replaces_the_contents_exactly(name):
    """``w.set_(t)`` stored ``t`` at ``w``'s old positions only (a masked copy); dense torch makes
    ``w`` equal ``t``, and so does the wrapper now, in its layout, seen by autograd (version)."""
    w = weight(name)
    t = full(seed=3)
    version = w._version
    with torch.no_grad():
        out = w.set_(t.clone())
    assert out is w and type(w.wrapped_tensor) is layout_class(name)
    assert torch.equal(dense_of(w), t) and w._version > version


@pytest.mark.parametrize("name", NM)
def test_set_of_a_value_an_nm_layout_cannot_hold_raises(name):
    w = weight(name)
    before = dense_of(w)
    with torch.no_grad(), pytest.raises(ValueError, match=rf"w\.set_\(t\): {name}\(.*{NOT_EXACT}.*sten\.sparsify"):
        w.set_(full(seed=3))
    assert torch.equal(dense_of(w), before)


@pytest.mark.parametrize("name", LAYOUTS)
def test_set_of_a_value_the_layout_holds_is_exact(name):
    w = weight(name)
    t = layout_class(name).from_dense(full(seed=4) if name in NM else masked(seed=4)).to_dense()
    with torch.no_grad():
        w.set_(t)
    assert type(w.wrapped_tensor) is layout_class(name) and torch.equal(dense_of(w), t)


def test_set_takes_the_new_shape_and_a_wrappers_layout():
    """As on a dense tensor, ``set_`` may change the shape; a wrapper's layout is taken as it is."""
    w = weight("CsrTensor")
    with torch.no_grad():
        w.set_(torch.ones(2, 5))
    assert w.shape == (2, 5) and torch.equal(dense_of(w), torch.ones(2, 5))
    coo = sten.SparseTensorWrapper(sten.CooTensor.from_dense(3 * torch.eye(3)))
    with torch.no_grad():
        w.set_(coo)
    assert w.wrapped_tensor is coo.wrapped_tensor and w.shape == (3, 3)


def test_set_on_a_leaf_that_requires_grad_raises_as_in_dense_torch():
    w = weight("CsrTensor")
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        w.set_(full())


# -- loading a checkpoint of another layout ---------------------------------------------------

def checkpoint(name: str, value: torch.Tensor) -> dict:
    """A ``state_dict`` of a ``Linear(16, 8)`` whose weight is ``value`` in layout ``name``,
    saved and read back with the default ``torch.load``."""
    lin = torch.nn.Linear(SHAPE[1], SHAPE[0])
    lin.weight = sten.SparseParameterWrapper(layout_class(name).from_dense(value))
    buffer = io.BytesIO()
    torch.save(lin.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer)


@pytest.mark.parametrize("name", LAYOUTS)
def test_loading_a_csr_checkpoint_that_fits_is_exact(name):
    """A CSR checkpoint whose values the model's layout holds loads exactly, in the model's layout."""
    value = layout_class(name).from_dense(full(seed=2) if name in NM else masked(seed=2)).to_dense()
    state = checkpoint("CsrTensor", value)
    lin = linear(name)
    with no_fallback():
        lin.load_state_dict(state)
    assert type(lin.weight.wrapped_tensor) is layout_class(name)
    assert torch.equal(dense_of(lin.weight), value)


@pytest.mark.parametrize("source", ["CsrTensor", "CooTensor", "DenseTensor", "ScipyCsrTensor"])
@pytest.mark.parametrize("name", NM)
def test_loading_a_checkpoint_an_nm_model_cannot_hold_raises_every_time(source, name):
    """A lossy conversion into n:m was warned once per process and then silent; it raises on
    every load, naming the key, both layouts and what to do instead. The model is unchanged."""
    state = checkpoint(source, masked(seed=2))
    lin = linear(name)
    before = dense_of(lin.weight)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=rf'"weight".*{source} value.*{name}\(.*{NOT_EXACT}.*'
                                               rf"checkpoint's layout \({source}\)"):
            lin.load_state_dict(state)
    assert torch.equal(dense_of(lin.weight), before)


@pytest.mark.parametrize("name", NM)
def test_copying_a_sparse_value_an_nm_tensor_cannot_hold_raises_a_value_error(name):
    """``w.copy_(sparse)`` (what loading calls) raises the ``ValueError`` itself."""
    w = weight(name)
    src = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(masked(seed=2)))
    with torch.no_grad(), pytest.raises(ValueError, match=rf"copy_ of a CsrTensor value.*{NOT_EXACT}"):
        w.copy_(src)


@pytest.mark.parametrize("source", ["CooTensor", "ScipyCsrTensor"])
@pytest.mark.parametrize("name", ["CsrTensor", "ScipyCsrTensor"])
def test_loading_keeps_the_checkpoints_explicit_zeros(source, name):
    """A registered lossless conversion keeps the saved pattern, stored zeros included."""
    dense = masked(seed=2)
    lin = torch.nn.Linear(SHAPE[1], SHAPE[0])
    layout = layout_class(source).from_dense(dense)
    lin.weight = sten.SparseParameterWrapper(layout)
    with torch.no_grad():
        lin.weight.mul_(0.0)  # every stored value zero: the pattern is in the stored positions only
    model = linear(name)
    model.load_state_dict(lin.state_dict())
    assert model.weight.wrapped_tensor.nnz == layout.nnz
    assert torch.equal(dense_of(model.weight), torch.zeros(SHAPE))


# -- remove_parametrizations(leave_parametrized=True) -----------------------------------------

class AddOne(torch.nn.Module):
    """A parametrization that does not keep zeros."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w + 1


class Double(torch.nn.Module):
    """A zero-preserving parametrization."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * 2


def parametrized(name: str, parametrization: torch.nn.Module, requires_grad: bool) -> torch.nn.Linear:
    lin = torch.nn.Linear(SHAPE[1], SHAPE[0])
    lin.weight = weight(name, requires_grad=requires_grad)
    parametrize.register_parametrization(lin, "weight", parametrization)
    return lin


@pytest.mark.parametrize("requires_grad", [True, False])
@pytest.mark.parametrize("name", LAYOUTS)
def test_remove_parametrizations_leaves_exactly_the_parametrized_value(name, requires_grad):
    """torch stores the parametrized value by ``original.set_(value)``, or, for a traceable
    wrapper (a trainable CSR, n:m or scipy weight), by ``torch.utils.swap_tensors``, which
    replaces the parameter object's contents with a dense ``Parameter`` without calling STen.
    ``set_`` kept COO's old pattern and dropped the other values; now it is exact in the layout
    or, where the layout cannot hold the value (n:m), a ``ValueError``."""
    lin = parametrized(name, AddOne(), requires_grad)
    original = lin.parametrizations.weight.original
    want = dense_of(original) + 1
    swapped = is_traceable_wrapper_subclass(original)
    if name in NM and not swapped:
        with pytest.raises(ValueError, match=rf"w\.set_\(t\): {name}\(.*{NOT_EXACT}"):
            parametrize.remove_parametrizations(lin, "weight", leave_parametrized=True)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        parametrize.remove_parametrizations(lin, "weight", leave_parametrized=True)
    assert lin.weight is original and torch.equal(dense_of(lin.weight), want)
    if not swapped:
        assert type(lin.weight.wrapped_tensor) is layout_class(name)


@pytest.mark.parametrize("requires_grad", [True, False])
@pytest.mark.parametrize("name", LAYOUTS)
def test_remove_a_zero_preserving_parametrization_keeps_the_layout(name, requires_grad):
    lin = parametrized(name, Double(), requires_grad)
    want = dense_of(lin.parametrizations.weight.original) * 2
    parametrize.remove_parametrizations(lin, "weight", leave_parametrized=True)
    assert type(lin.weight.wrapped_tensor) is layout_class(name)
    assert torch.equal(dense_of(lin.weight), want)


# -- what stays as it was: in-place writes keep the pattern -----------------------------------

@pytest.mark.parametrize("name", LAYOUTS)
def test_copy_of_a_dense_tensor_still_writes_at_the_stored_positions(name):
    w = weight(name)
    kept = dense_of(w) != 0 if name != "DenseTensor" else torch.ones(SHAPE, dtype=torch.bool)  # stores all
    t = full(seed=6)
    with torch.no_grad():
        w.copy_(t)
    assert type(w.wrapped_tensor) is layout_class(name)
    assert torch.equal(dense_of(w), torch.where(kept, t, torch.zeros(())))


def test_the_documented_way_to_keep_the_layout_when_removing_a_parametrization():
    """docs/concepts.md: take the value, remove with ``leave_parametrized=False``, assign ``.data``."""
    lin = parametrized("CsrTensor", AddOne(), requires_grad=True)
    with torch.no_grad():
        value = lin.weight
    parametrize.remove_parametrizations(lin, "weight", leave_parametrized=False)
    lin.weight.data = value
    assert type(lin.weight.wrapped_tensor) is sten.CsrTensor and torch.equal(dense_of(lin.weight), value)
