"""Optimizer state updated with gradients of another pattern (a ``grad_fmt`` whose
sparsifier picks each step's pattern), checked against dense torch given the same
gradients at the weight's positions.

An in-place write into a wrapper that is not a parameter kept that wrapper's pattern and
dropped the rest silently: SGD's momentum buffer is a clone of the first gradient, so it kept
that gradient's pattern and lost every later gradient's values outside it (the weights
differed from dense by 0.7-1.7 after two steps). Now such a write grows the pattern where the
layout can hold the result (CSR, COO, scipy), keeps the stored zeros, and warns where it
cannot (n:m). Parameters keep their pattern, as before. Rprop's ``prev.copy_(grad)`` into an
n:m state said "load_state_dict of a checkpoint"; it names what happened.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten


def trained(grad_layout, optimizer, steps=3, **options):
    torch.manual_seed(0)
    w0 = torch.randn(8, 16)
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(w0 * (w0.abs() > 0.5)),
                                    grad_fmt=(sten.ScalarFractionSparsifier(0.7), torch.Tensor, sten.KeepAll(),
                                              grad_layout))
    ref = torch.nn.Parameter(w.to_dense().detach().clone())
    mask = ref.detach() != 0
    opt, ref_opt = optimizer([w], lr=0.01, **options), optimizer([ref], lr=0.01, **options)
    for _ in range(steps):
        x = torch.randn(4, 16)
        opt.zero_grad()
        ref_opt.zero_grad()
        F.linear(x, w).pow(2).sum().backward()
        ref.grad = w.grad.to_dense() * mask  # the same sparsified gradient, at the weight's positions
        opt.step()
        ref_opt.step()
    return w, ref, opt


@pytest.mark.parametrize("grad_layout", [sten.CsrTensor, sten.CooTensor])
@pytest.mark.parametrize("options", [{"momentum": 0.9}, {"momentum": 0.9, "foreach": True},
                                     {"momentum": 0.9, "nesterov": True}, {"momentum": 0.5, "dampening": 0.3}],
                         ids=["momentum", "foreach", "nesterov", "dampening"])
def test_sgd_momentum_with_gradients_of_changing_patterns(grad_layout, options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w, ref, opt = trained(grad_layout, torch.optim.SGD, **options)
    assert not [c for c in caught if "does not store" in str(c.message)]
    torch.testing.assert_close(w.to_dense(), ref.detach())
    assert w.wrapped_tensor.nnz == int((ref != 0).sum())  # the weight kept its pattern


@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad])
def test_optimizers_whose_state_starts_from_the_weight_still_match(optimizer):
    w, ref, _ = trained(sten.CsrTensor, optimizer)
    torch.testing.assert_close(w.to_dense(), ref.detach())


def test_a_state_write_with_another_pattern_grows_the_pattern_and_keeps_stored_zeros():
    buf = sten.SparseTensorWrapper(sten.CooTensor.from_dense(torch.tensor([[1.0, 0.0, 0.0, 0.0]])))
    zeros_at = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.tensor([[0.0, 0.0, 1.0, 0.0]])))
    zeros_at.wrapped_tensor = zeros_at.wrapped_tensor.with_values(torch.zeros(1))  # a stored zero at column 2
    grad = sten.SparseTensorWrapper(sten.CooTensor.from_dense(torch.tensor([[0.0, 2.0, 0.0, 0.0]])))
    buf.mul_(0.5).add_(grad)
    torch.testing.assert_close(buf.to_dense(), torch.tensor([[0.5, 2.0, 0.0, 0.0]]))
    zeros_at.add_(sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.tensor([[3.0, 0.0, 0.0, 0.0]]))))
    assert zeros_at.wrapped_tensor.nnz == 2  # column 0 added, the stored zero at column 2 kept
    torch.testing.assert_close(zeros_at.to_dense(), torch.tensor([[3.0, 0.0, 0.0, 0.0]]))


def test_a_parameter_keeps_its_pattern():
    w = sten.SparseParameterWrapper(sten.CooTensor.from_dense(torch.tensor([[1.0, 0.0]])))
    other = sten.SparseTensorWrapper(sten.CooTensor.from_dense(torch.tensor([[1.0, 5.0]])))
    with torch.no_grad():
        w.add_(other)
    assert w.wrapped_tensor.nnz == 1
    torch.testing.assert_close(w.to_dense(), torch.tensor([[2.0, 0.0]]))


def test_a_state_whose_layout_cannot_grow_keeps_its_pattern_and_warns():
    sten_nm = pytest.importorskip("sten_nm")
    state = sten.SparseTensorWrapper(sten_nm.NMTensor.from_dense(torch.tensor([[1.0, 2.0, 0.0, 0.0]]), 2, 4))
    grad = sten.SparseTensorWrapper(sten.CooTensor.from_dense(torch.tensor([[0.0, 0.0, 3.0, 0.0]])))
    with pytest.warns(sten.DispatchWarning, match=r"wrote 1 value\(s\) at positions it does not store"):
        state.add_(grad)
    torch.testing.assert_close(state.to_dense(), torch.tensor([[1.0, 2.0, 0.0, 0.0]]))


def test_a_state_grows_into_a_layout_that_stores_more_than_the_union():
    """1:4 gradients of two patterns: the momentum buffer (a 1:4 clone of the first) takes their
    union as a 2:4 ``NMTensor``, which fills the groups where both picked one position with a
    stored zero. Growth asked for the union's positions exactly, so such a layout (n:m, ELL,
    blocks) was refused: the values were dropped with a warning, 0.49 off dense after two steps."""
    sten_nm = pytest.importorskip("sten_nm")
    torch.manual_seed(0)
    w = sten.SparseParameterWrapper(sten_nm.NMTensor.from_dense(torch.randn(8, 16), 2, 4),
                                    grad_fmt=(sten_nm.NMSparsifier(1, 4), sten_nm.NMTensor, sten.KeepAll(),
                                              sten_nm.NMTensor))
    ref = torch.nn.Parameter(w.to_dense().detach().clone())
    mask = ref.detach() != 0
    opt, ref_opt = torch.optim.SGD([w], lr=0.01, momentum=0.9), torch.optim.SGD([ref], lr=0.01, momentum=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            x = torch.randn(4, 16)
            opt.zero_grad()
            ref_opt.zero_grad()
            F.linear(x, w).pow(2).sum().backward()
            assert w.grad.wrapped_tensor.n == 1
            ref.grad = w.grad.to_dense() * mask
            opt.step()
            ref_opt.step()
    assert not [c for c in caught if "does not store" in str(c.message)]
    torch.testing.assert_close(w.to_dense(), ref.detach())
    assert opt.state[w]["momentum_buffer"].wrapped_tensor.n == 2


def test_rprop_state_in_a_layout_that_cannot_take_the_gradient_keeps_its_pattern_and_warns():
    """Rprop's ``prev.copy_(grad)`` of an n:m weight's sparsified CSR gradient into its n:m state
    raised a ValueError; inside a step the state keeps its pattern, warned, as its other updates
    do, and the weight matches dense torch given the same gradients at its positions."""
    sten_nm = pytest.importorskip("sten_nm")
    torch.manual_seed(0)
    w = sten.SparseParameterWrapper(sten_nm.NMTensor.from_dense(torch.randn(8, 16), 2, 4),
                                    grad_fmt=(sten.ScalarFractionSparsifier(0.7), torch.Tensor, sten.KeepAll(),
                                              sten.CsrTensor))
    ref = torch.nn.Parameter(w.to_dense().detach().clone())
    mask = ref.detach() != 0
    opt, ref_opt = torch.optim.Rprop([w], lr=0.01), torch.optim.Rprop([ref], lr=0.01)
    for _ in range(3):
        x = torch.randn(4, 16)
        opt.zero_grad()
        F.linear(x, w).pow(2).sum().backward()
        ref.grad = w.grad.to_dense() * mask
        with pytest.warns(sten.DispatchWarning, match="copy_ on a NMTensor"):
            opt.step()
        ref_opt.step()
    torch.testing.assert_close(w.detach().to_dense(), ref.detach())


@pytest.mark.parametrize("update", ["lerp_", "_foreach_lerp_", "mul_add_"])
def test_an_ema_parameter_combined_with_a_parameter_of_another_pattern_warns(update):
    """``ema_w.lerp_(w)`` keeps ``ema_w``'s pattern, so ``w``'s values outside it (regrown by
    ``PruneRegrow``) were dropped silently; writes combining two parameters now say so."""
    torch.manual_seed(0)
    ema = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.randn(4, 4) * (torch.rand(4, 4) > 0.5)))
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.randn(4, 4) * (torch.rand(4, 4) > 0.5)))
    calls = {"lerp_": lambda: ema.lerp_(w, 0.5), "_foreach_lerp_": lambda: torch._foreach_lerp_([ema], [w], 0.5),
             "mul_add_": lambda: ema.mul_(0.5).add_(w, alpha=0.5)}
    want = ema.to_dense().lerp(w.to_dense(), 0.5) * (ema.to_dense() != 0)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        calls[update]()
    dropped = [str(c.message) for c in caught if issubclass(c.category, sten.DispatchWarning)
               and "at positions it does not store: they were dropped" in str(c.message)]
    assert dropped, [str(c.message) for c in caught]
    torch.testing.assert_close(ema.to_dense(), want)   # the pattern is kept, as documented
