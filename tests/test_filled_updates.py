"""Scalar updates of wrappers that are not parameters (temporaries, optimizer state) change the
positions they do not store too, as on a dense tensor: ``t.add_(eps)`` makes a ``FilledTensor``
(the stored values updated, ``eps`` everywhere else).

Updating the stored values only left zeros where dense torch has ``eps``: Adamax's
``grad.abs().add_(eps)``, with a ``grad_fmt`` that picks each step's pattern, then divided 0 by
0 into the weight (NaN in the weights after the first step, without a warning). A parameter
keeps its pattern, as before, and Adam's ``param.addcdiv_(exp_avg, denom)`` stays on the
stored values.
"""

import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import sten_core as sten
from sten_core.builtin.filled import FilledTensor

OPTIMIZERS = {
    "SGD": lambda p, **o: torch.optim.SGD(p, lr=0.01, momentum=0.9, **o),
    "Adam": lambda p, **o: torch.optim.Adam(p, lr=0.01, **o),
    "AdamW": lambda p, **o: torch.optim.AdamW(p, lr=0.01, **o),
    "Adamax": lambda p, **o: torch.optim.Adamax(p, lr=0.01, **o),
    "NAdam": lambda p, **o: torch.optim.NAdam(p, lr=0.01, **o),
    "RAdam": lambda p, **o: torch.optim.RAdam(p, lr=0.01, **o),
    "RMSprop": lambda p, **o: torch.optim.RMSprop(p, lr=0.01, **o),
    "RMSprop-centered": lambda p, **o: torch.optim.RMSprop(p, lr=0.01, centered=True, momentum=0.5, **o),
    "Adagrad": lambda p, **o: torch.optim.Adagrad(p, lr=0.01, **o),
    "Adadelta": lambda p, **o: torch.optim.Adadelta(p, lr=0.5, **o),
    "ASGD": lambda p, **o: torch.optim.ASGD(p, lr=0.01, **o),
}


def sparse(dense, layout=sten.CsrTensor):
    return sten.SparseTensorWrapper(layout.from_dense(dense))


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizers_with_gradients_of_a_changing_pattern_match_dense(name, foreach):
    """Each step's gradient sparsified by magnitude (another pattern each step), against dense
    torch given the same gradients at the weight's positions."""
    torch.manual_seed(0)
    w0 = torch.randn(8, 16)
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(w0 * (w0.abs() > 0.5)),
                                    grad_fmt=(sten.ScalarFractionSparsifier(0.7), torch.Tensor, sten.KeepAll(),
                                              sten.CsrTensor))
    ref = torch.nn.Parameter(w.to_dense().detach().clone())
    mask = ref.detach() != 0
    opt, ref_opt = OPTIMIZERS[name]([w], foreach=foreach), OPTIMIZERS[name]([ref], foreach=foreach)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)  # foreach calls on wrappers run densely
        for _ in range(3):
            x = torch.randn(4, 16)
            opt.zero_grad()
            ref_opt.zero_grad()
            F.linear(x, w).pow(2).sum().backward()
            ref.grad = w.grad.to_dense() * mask
            opt.step()
            ref_opt.step()
    got = w.to_dense()
    assert not got.isnan().any()
    torch.testing.assert_close(got, ref.detach())
    assert w.wrapped_tensor.nnz == int(mask.sum())  # the weight kept its pattern


def test_a_scalar_update_of_a_temporary_reaches_every_position():
    dense = torch.tensor([[0.0, 2.0], [-3.0, 0.0]])
    t = sparse(dense)
    t.add_(0.5)
    assert isinstance(t.wrapped_tensor, FilledTensor)
    torch.testing.assert_close(t.to_dense(), dense + 0.5)
    t.mul_(2.0).clamp_(min=0.5)  # further scalar updates: values and fill, still a FilledTensor
    assert isinstance(t.wrapped_tensor, FilledTensor) and t.wrapped_tensor.fill == 1.0
    torch.testing.assert_close(t.to_dense(), ((dense + 0.5) * 2).clamp(min=0.5))
    t.sub_(1.0)  # the fill back to zero: the inner layout again
    assert isinstance(t.wrapped_tensor, sten.CsrTensor)
    torch.testing.assert_close(t.to_dense(), ((dense + 0.5) * 2).clamp(min=0.5) - 1)


@pytest.mark.parametrize("update", ["mul_", "abs_", "sqrt_", "zero_", "neg_"])
def test_updates_that_keep_zeros_keep_the_layout(update):
    dense = torch.tensor([[0.0, 4.0], [9.0, 0.0]])
    t = sparse(dense)
    args = (3.0,) if update == "mul_" else ()
    getattr(t, update)(*args)
    assert isinstance(t.wrapped_tensor, sten.CsrTensor)
    torch.testing.assert_close(t.to_dense(), getattr(dense.clone(), update)(*args))


def test_a_parameter_keeps_its_pattern_under_a_scalar_update():
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.tensor([[0.0, 2.0], [3.0, 0.0]])))
    with torch.no_grad():
        w.add_(1.0)
    assert isinstance(w.wrapped_tensor, sten.CsrTensor) and w.wrapped_tensor.nnz == 2
    torch.testing.assert_close(w.to_dense(), torch.tensor([[0.0, 3.0], [4.0, 0.0]]))


def test_a_parameter_update_reads_a_filled_divisor_of_its_pattern_at_its_positions():
    """Adam's step: the divisor's fill lies where the weight stores nothing."""
    dense = torch.tensor([[0.0, 2.0], [3.0, 0.0]])
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(dense))
    denom = sparse(dense.abs()).add_(1.0)
    numer = sparse(dense)
    with torch.no_grad():
        w.addcdiv_(numer, denom, value=-1.0)
    assert isinstance(w.wrapped_tensor, sten.CsrTensor) and w.wrapped_tensor.nnz == 2
    torch.testing.assert_close(w.to_dense(), dense - dense / (dense.abs() + 1) * (dense != 0))


def test_a_filled_operand_of_another_pattern_is_read_with_its_fill():
    """Adamax's ``maximum(exp_inf * beta2, grad.abs().add_(eps), out=exp_inf)`` with a gradient
    of another pattern than the state."""
    state = sparse(torch.tensor([[0.2, 0.0, 0.0]]))
    tmp = sparse(torch.tensor([[0.0, 0.0, 5.0]])).add_(0.25)
    torch.testing.assert_close(tmp.to_dense(), torch.tensor([[0.25, 0.25, 5.25]]))
    torch.maximum(state.mul_(0.5), tmp, out=state)
    torch.testing.assert_close(state.to_dense()[0, 0], torch.tensor(0.25))  # not max(0.1, 0)


def test_an_update_with_a_tensor_turns_it_back_into_its_layout_grown():
    t = sparse(torch.tensor([[0.0, 2.0, 0.0]])).add_(1.0)
    t.mul_(torch.tensor([[2.0, 3.0, 0.0]]))
    assert isinstance(t.wrapped_tensor, sten.CsrTensor)
    torch.testing.assert_close(t.to_dense(), torch.tensor([[2.0, 9.0, 0.0]]))


def test_a_layout_that_cannot_grow_warns_what_it_dropped():
    sten_nm = pytest.importorskip("sten_nm")
    t = sten.SparseTensorWrapper(sten_nm.NMTensor.from_dense(torch.tensor([[1.0, 2.0, 0.0, 0.0]]), 2, 4))
    t.add_(1.0)
    assert isinstance(t.wrapped_tensor, FilledTensor)
    torch.testing.assert_close(t.to_dense(), torch.tensor([[2.0, 3.0, 1.0, 1.0]]))
    with pytest.warns(sten.DispatchWarning, match=r"wrote 2 value\(s\) at positions it does not store"):
        t.mul_(torch.tensor([[1.0, 1.0, 2.0, 3.0]]))
    torch.testing.assert_close(t.to_dense(), torch.tensor([[2.0, 3.0, 0.0, 0.0]]))


def test_a_filled_temporary_computes_like_its_dense_tensor():
    dense = torch.tensor([[0.0, 4.0], [9.0, 0.0]])
    t = sparse(dense).add_(1.0)
    expected = dense + 1
    torch.testing.assert_close(t.sqrt(), expected.sqrt())
    torch.testing.assert_close(t * 2, expected * 2)
    x = torch.randn(3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        torch.testing.assert_close(x @ t, x @ expected)
    assert t.wrapped_tensor.fill == 1.0  # out-of-place ops left it as it was


def test_a_filled_temporary_copies_pickles_and_moves():
    t = sparse(torch.tensor([[0.0, 4.0], [9.0, 0.0]])).add_(0.5)
    expected = t.to_dense()
    torch.testing.assert_close(copy.deepcopy(t).to_dense(), expected)
    torch.testing.assert_close(t.clone().to_dense(), expected)
    buffer = io.BytesIO()
    torch.save(t, buffer)
    buffer.seek(0)
    torch.testing.assert_close(torch.load(buffer, weights_only=False).to_dense(), expected)
    moved = t.to(torch.float64)
    assert moved.dtype == torch.float64
    torch.testing.assert_close(moved.to_dense(), expected.double())


SCALAR_UPDATES = [
    ("add_", (0.5,)), ("sub_", (1.5,)), ("mul_", (-2.0,)), ("div_", (4.0,)), ("clamp_", (-0.5, 0.75)),
    ("clamp_min_", (0.25,)), ("clamp_max_", (-0.25,)), ("pow_", (2,)), ("abs_", ()), ("neg_", ()),
]


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 5), cols=st.integers(1, 6), density=st.floats(0.0, 1.0),
       updates=st.lists(st.sampled_from(SCALAR_UPDATES), min_size=1, max_size=5),
       layout=st.sampled_from([sten.CsrTensor, sten.CooTensor]), seed=st.integers(0, 2**16))
def test_scalar_update_sequences_equal_dense(rows, cols, density, updates, layout, seed):
    generator = torch.Generator().manual_seed(seed)
    dense = torch.randn(rows, cols, generator=generator)
    dense = dense * (torch.rand(rows, cols, generator=generator) < density)
    t, ref = sparse(dense, layout), dense.clone()
    for name, args in updates:
        getattr(t, name)(*args)
        getattr(ref, name)(*args)
    torch.testing.assert_close(t.to_dense(), ref)


def test_a_wrapper_that_requires_grad_keeps_its_pattern_under_a_scalar_update():
    """A trainable leaf that is not an ``nn.Parameter`` is a weight too."""
    w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.tensor([[0.0, 2.0]])), requires_grad=True)
    with torch.no_grad():
        w.add_(1.0)
    assert isinstance(w.wrapped_tensor, sten.CsrTensor)
    torch.testing.assert_close(w.to_dense(), torch.tensor([[0.0, 3.0]]))


@pytest.mark.parametrize("grad_fmt", [None, "keep"])
def test_state_updated_with_a_filled_divisor_keeps_the_weights_pattern(grad_fmt):
    """RMSprop with momentum: ``buf.mul_(m).addcdiv_(grad, square_avg.sqrt().add_(eps))``. The
    buffer is updated at its stored positions with the divisor read there (as a dense gradient
    is): grown to every position, it made a step 60x slower and the buffer dense."""
    torch.manual_seed(0)
    w0 = torch.randn(8, 16)
    fmt = (sten.KeepAll(), sten.CsrTensor, sten.KeepAll(), sten.CsrTensor) if grad_fmt else None
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(w0 * (w0.abs() > 0.5)), grad_fmt=fmt)
    ref = torch.nn.Parameter(w.to_dense().detach().clone())
    mask = ref.detach() != 0
    opt = torch.optim.RMSprop([w], lr=0.01, momentum=0.9)
    ref_opt = torch.optim.RMSprop([ref], lr=0.01, momentum=0.9)
    for _ in range(3):
        x = torch.randn(4, 16)
        opt.zero_grad()
        ref_opt.zero_grad()
        F.linear(x, w).pow(2).sum().backward()
        F.linear(x, ref).pow(2).sum().backward()
        ref.grad.mul_(mask)
        opt.step()
        ref_opt.step()
    torch.testing.assert_close(w.to_dense(), ref.detach())
    assert opt.state[w]["momentum_buffer"].wrapped_tensor.nnz == int(mask.sum())


def test_padded_layouts_fill_the_positions_they_do_not_store():
    """A layout storing padding among its values (16 rows sharing an n:m pattern) has as many
    values as positions: counting values took it for one that stores every position, and the
    fill was dropped."""
    sten_nm = pytest.importorskip("sten_nm")
    torch.manual_seed(0)
    dense = torch.randn(4, 16)
    t = sten.SparseTensorWrapper(sten_nm.GroupedNMTensor.from_dense(dense, 2, 4))
    expected = t.to_dense() + 1
    t.add_(1.0)
    torch.testing.assert_close(t.to_dense(), expected)


def test_scalar_updates_on_the_meta_device():
    t = sten.SparseTensorWrapper(sten.CooTensor.from_dense(torch.eye(3))).to("meta")
    t.mul_(2.0).add_(1.0).zero_()
    assert t.device.type == "meta" and t.shape == (3, 3)


def test_a_filled_buffer_saves_as_its_layout_and_loads_with_weights_only():
    t = sparse(torch.tensor([[0.0, 4.0], [9.0, 0.0]])).add_(0.5)
    buffer = io.BytesIO()
    torch.save({"buf": t}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)   # weights_only (torch's default): a registered layout
    assert isinstance(loaded["buf"].wrapped_tensor, sten.CsrTensor)
    torch.testing.assert_close(loaded["buf"].to_dense(), t.to_dense())



def test_a_filled_nm_buffer_saves_dense_and_loads_with_weights_only():
    """n:m cannot store every position: the checkpoint holds a ``DenseTensor`` (it failed to load
    with ``weights_only``, the unregistered ``FilledTensor`` pickled whole)."""
    sten_nm = pytest.importorskip("sten_nm")
    t = sten.SparseTensorWrapper(sten_nm.NMTensor.from_dense(torch.randn(4, 8), 2, 4)).add_(0.5)
    buffer = io.BytesIO()
    torch.save(t, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert isinstance(loaded.wrapped_tensor, sten.DenseTensor)
    torch.testing.assert_close(loaded.to_dense(), t.to_dense())
