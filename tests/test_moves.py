"""A sparse model moves like a dense one: dtype and device moves keep each
layout, ``w.data = t`` takes effect (issue: a sparse model is an ordinary model)."""

import warnings

import pytest
import torch

import sten_core as sten
from sten_core.testing import check_to
from sten_nm import GroupedNMTensor, NMTensor
from sten_scipy import ScipyCscTensor, ScipyCsrTensor

from fake_layouts import DenseCopyLayout

LAYOUTS = [sten.DenseTensor, sten.CooTensor, sten.CsrTensor, sten.CscTensor, NMTensor, ScipyCsrTensor,
           ScipyCscTensor]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: c.__name__)
def test_to_conformance(layout):
    dtypes = (torch.float64,) if layout in (ScipyCsrTensor, ScipyCscTensor) else (torch.float64, torch.float16, torch.bfloat16)
    check_to(layout, dtypes=dtypes)


def test_grouped_nm_moves():
    check_to(GroupedNMTensor, shapes=((32, 64),), dtypes=(torch.float64,))


@pytest.mark.parametrize("layout", [sten.CsrTensor, NMTensor], ids=lambda c: c.__name__)
@pytest.mark.parametrize("move", ["half", "bfloat16", "double", "to"])
def test_module_moves_reach_sparse_parameters(layout, move):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    sb = sten.SparsityBuilder(model)
    sparsifier = sten.PerBlockFractionSparsifier(2, 4) if layout is NMTensor else sten.ScalarFractionSparsifier(0.5)
    sb.set_weight("0.weight", initial_sparsifier=sparsifier, out_format=layout)
    sparse = sb.get_sparse_model()
    weight = sparse[0].weight
    dtype = {"half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64, "to": torch.float64}[move]
    if move == "to":
        sparse.to(dtype)
    else:
        getattr(sparse, move)()
    assert sparse[0].weight is weight, "the parameter object must stay the same (optimizers hold it)"
    assert type(weight.wrapped_tensor) is layout and weight.dtype == dtype
    assert weight.wrapped_tensor.dtype == dtype and sparse[0].bias.dtype == dtype


def test_data_assignment_takes_effect():
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.eye(3)))
    w.data = torch.full((3, 3), 2.0, dtype=torch.float64)
    assert type(w.wrapped_tensor) is sten.CsrTensor and w.dtype == torch.float64
    assert torch.equal(w.to_dense(), torch.full((3, 3), 2.0, dtype=torch.float64))
    other = sten.SparseTensorWrapper(sten.CooTensor.from_dense(torch.eye(4)))
    w.data = other
    assert type(w.wrapped_tensor) is sten.CooTensor and w.shape == (4, 4)


def test_data_is_an_alias_without_history():
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.eye(3)))
    d = w.data
    assert isinstance(d, sten.SparseTensorWrapper) and not d.requires_grad
    d.mul_(3)
    assert torch.equal(w.to_dense(), 3 * torch.eye(3))


def test_to_float64_keeps_a_user_layout():
    """The paper's minimal layout (from_dense / to_dense only) moves through dense."""
    w = sten.SparseTensorWrapper(DenseCopyLayout.from_dense(torch.eye(2)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", sten.DispatchWarning)
        d = w.to(torch.float64)
    assert type(d.wrapped_tensor) is DenseCopyLayout and d.dtype == torch.float64
    assert torch.equal(d.to_dense(), torch.eye(2, dtype=torch.float64))


class ToDenseOnly(sten.Layout):
    def __init__(self, data):
        self.data = data

    def to_dense(self):
        return self.data


def test_a_layout_that_cannot_move_says_what_to_implement():
    w = sten.SparseTensorWrapper(ToDenseOnly(torch.eye(2)))
    with pytest.raises(TypeError, match="implement to\\(device=None, dtype=None\\)"):
        w.to(torch.float64)


class MovableLayout(DenseCopyLayout):
    def state_tensors(self):
        return (self.data,)

    @classmethod
    def from_state_tensors(cls, tensors, shape):
        return cls(tensors[0].reshape(shape))


def test_user_layout_with_state_tensors_moves():
    w = sten.SparseTensorWrapper(MovableLayout.from_dense(torch.eye(2)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", sten.DispatchWarning)
        d = w.to(torch.float64)
    assert type(d.wrapped_tensor) is MovableLayout and d.dtype == torch.float64


def test_moving_to_an_absent_device_says_so():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the move would succeed")
    w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(2)))
    with pytest.raises((RuntimeError, AssertionError), match="(?i)cuda"):
        w.cuda()


def test_to_is_differentiable():
    w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(3)), requires_grad=True)
    y = w.to(torch.float64)
    assert type(y.wrapped_tensor) is sten.CsrTensor
    torch.sum(torch.mul(y, torch.full((3, 3), 2.0, dtype=torch.float64))).backward()
    assert w.grad.dtype == torch.float32
    torch.testing.assert_close(w.grad.to_dense() if isinstance(w.grad, sten.SparseTensorWrapper) else w.grad,
                               torch.full((3, 3), 2.0))


@pytest.mark.parametrize("layout", [sten.DenseTensor, sten.CooTensor, sten.CsrTensor], ids=lambda c: c.__name__)
@pytest.mark.parametrize("source", [torch.tensor([[1, 0], [3, 5]]), torch.tensor([[True, False], [False, True]])],
                         ids=["int64", "bool"])
@pytest.mark.parametrize("cast", ["float()", "double()", "half()", "to(float64)", "to(int32)", "type(float64)"])
def test_integer_and_bool_wrappers_cast_their_values(layout, source, cast):
    """The state-tensor move casts floating-point parts only (index tensors keep int64), so an
    integer or bool layout's values kept their dtype: ``w.float()`` was a silent no-op."""
    run = {"float()": lambda t: t.float(), "double()": lambda t: t.double(), "half()": lambda t: t.half(),
           "to(float64)": lambda t: t.to(torch.float64), "to(int32)": lambda t: t.to(torch.int32),
           "type(float64)": lambda t: t.type(torch.float64)}[cast]
    moved, want = run(sten.SparseTensorWrapper(layout.from_dense(source))), run(source)
    assert isinstance(moved, sten.SparseTensorWrapper) and type(moved.wrapped_tensor) is layout
    assert moved.dtype == want.dtype and moved.to_dense().dtype == want.dtype
    torch.testing.assert_close(moved.to_dense(), want)


def test_type_keeps_the_layout_and_names_the_type():
    """``w.type(dtype)`` returned a dense tensor where ``w.to(dtype)`` keeps the layout."""
    w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(3)))
    assert w.type() == "torch.FloatTensor"
    for target in (torch.float64, "torch.DoubleTensor", torch.DoubleTensor):   # (the class raised inside .to)
        moved = w.type(target)
        assert type(moved.wrapped_tensor) is sten.CsrTensor and moved.dtype == torch.float64
    with pytest.raises(ValueError, match="tensor type name"):
        w.type("torch.NoSuchTensor")
