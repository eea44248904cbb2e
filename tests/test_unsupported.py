"""Implementations that decline a call (``sten.Unsupported``), and the built-in products' edge cases.

An implementation registered for a layout may meet inputs its kernel lacks (a rank, a dtype):
it raises ``sten.Unsupported(reason)`` and the call takes the dense path with a
``DispatchWarning`` naming the reason. Before, the built-in COO / CSR products crashed on a 1-D or
3-D COO operand (``IndexError``), on integer CSR / CSC weights (MKL: "not implemented for
'Long'"), and the sparse-sparse ``F.linear`` (paper A.1) under CPU autocast or in half precision.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_core.plugin_api import register_weight_product
from fake_layouts import DenseCopyLayout

OWNER = "test-unsupported"


class Picky(DenseCopyLayout):
    """A layout whose F.linear kernel takes float32 only."""


@pytest.fixture
def picky():
    calls = []

    def fwd(ctx, inputs, outs):
        x, w = inputs[0], inputs[1]
        if x.dtype != torch.float32:
            raise sten.Unsupported(f"{x.dtype} input (the kernel takes float32)")
        calls.append("fwd")
        ctx.save_for_backward(x, w)
        return F.linear(x, w.wrapped_tensor.data)

    def bwd(ctx, grad_outputs, sparsifiers):
        x, w = ctx.saved_tensors
        if x.shape[0] > 4:
            raise sten.Unsupported("more than 4 rows in backward")
        calls.append("bwd")
        g = grad_outputs[0]
        return g @ w.wrapped_tensor.data, g.t() @ x

    try:
        with sten.registry.owner(OWNER):
            sten.registry.register_layout(Picky)
            register_weight_product(sten.registry, F.linear, Picky, fwd, bwd)
        sten.dispatch.reset_warnings()
        yield calls
    finally:
        sten.registry.remove_owner(OWNER)
        sten.dispatch.reset_warnings()


def picky_weight(dtype=torch.float32):
    torch.manual_seed(0)
    return sten.SparseTensorWrapper(Picky.from_dense(torch.randn(3, 5, dtype=dtype)), requires_grad=True)


@pytest.mark.parametrize("grad", [False, True], ids=["no grad", "grad"])
def test_a_declined_forward_runs_dense_and_says_why(picky, grad):
    w = picky_weight(torch.float64)
    w.requires_grad_(grad)
    x = torch.randn(2, 5, dtype=torch.float64, requires_grad=grad)
    for attempt in range(2):  # the second call takes the cached fast path
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = F.linear(x, w)
        messages = [str(c.message) for c in caught if issubclass(c.category, sten.DispatchWarning)]
        assert (len(messages) == 1) == (attempt == 0), messages  # once per key
        if messages:
            assert "declined (torch.float64 input (the kernel takes float32))" in messages[0]
        torch.testing.assert_close(y, F.linear(x, w.to_dense()))
    assert picky == []
    if grad:
        y.sum().backward()
        torch.testing.assert_close(w.grad, torch.ones(2, 3, dtype=torch.float64).t() @ x.detach())


def test_a_declined_backward_gives_the_dense_gradients(picky):
    w = picky_weight()
    x = torch.randn(6, 5, requires_grad=True)
    with pytest.warns(sten.DispatchWarning, match="more than 4 rows in backward"):
        F.linear(x, w).square().sum().backward()
    assert picky == ["fwd"]
    wr, xr = w.to_dense().detach().requires_grad_(), x.detach().requires_grad_()
    F.linear(xr, wr).square().sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad, wr.grad)


def test_a_declined_call_raises_in_raise_mode(picky):
    w = picky_weight(torch.float64)
    with sten.dispatch.failure_mode("raise"), pytest.raises(sten.DispatchError, match="declined"):
        F.linear(torch.randn(2, 5, dtype=torch.float64), w)


def test_an_accepted_call_runs_the_implementation(picky):
    w = picky_weight()
    x = torch.randn(2, 5, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        F.linear(x, w).sum().backward()
    assert picky == ["fwd", "bwd"]


# the built-in products ------------------------------------------------------------------------

def coo(t):
    return sten.SparseTensorWrapper(sten.CooTensor.from_dense(t), requires_grad=True)


CASES = {
    "matmul(1-D, 2-D)": (lambda: (torch.randn(5) * (torch.rand(5) > 0.3), torch.randn(5, 3)), 0, torch.matmul),
    "matmul(2-D, 1-D)": (lambda: (torch.randn(3, 5), torch.randn(5) * (torch.rand(5) > 0.3)), 1, torch.matmul),
    "matmul(3-D, 2-D)": (lambda: (torch.randn(2, 3, 5) * (torch.rand(2, 3, 5) > 0.3), torch.randn(5, 4)), 0,
                         torch.matmul),
    "linear(x, 1-D weight)": (lambda: (torch.randn(4, 5), torch.randn(5) * (torch.rand(5) > 0.3)), 1, F.linear),
}


@pytest.mark.parametrize("case", CASES)
def test_coo_operands_that_are_not_matrices_run_dense(case):
    make, at, op = CASES[case]
    torch.manual_seed(0)
    dense = list(make())
    args = [coo(t) if i == at else t.clone().requires_grad_() for i, t in enumerate(dense)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        y = op(*args)
        y.square().sum().backward()
    ref = [t.clone().requires_grad_() for t in dense]
    op(*ref).square().sum().backward()
    torch.testing.assert_close(y, op(*dense))
    for got, want in zip(args, ref):
        torch.testing.assert_close(got.grad, want.grad)


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CscTensor, sten.CooTensor])
def test_integer_weights_multiply_like_dense(layout):
    torch.manual_seed(0)
    W, x = torch.randint(-3, 3, (4, 6)), torch.randint(-3, 3, (2, 6))
    w = sten.SparseTensorWrapper(layout.from_dense(W))
    assert torch.equal(F.linear(x, w), F.linear(x, W))
    assert torch.equal(w @ x.T, W @ x.T)


@pytest.mark.parametrize("precision", ["autocast bf16", "half", "bfloat16"])
def test_sparse_times_sparse_linear_in_half_precision(precision):
    """Paper A.1's sparse input times sparse weight: torch has no half-precision sparse-sparse
    product on the CPU (it raised under autocast and after ``.half()``)."""
    torch.manual_seed(0)
    xd, wd = torch.randn(6, 8) * (torch.rand(6, 8) > 0.5), torch.randn(4, 8) * (torch.rand(4, 8) > 0.5)
    dtype = {"autocast bf16": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16}[precision]
    x = sten.SparseTensorWrapper(sten.CooTensor.from_dense(xd.to(dtype)))
    w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(wd.to(dtype)), requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast bf16"):
        y = F.linear(x, w)
    want = torch.bfloat16 if precision == "autocast bf16" else dtype
    assert y.dtype == want
    torch.testing.assert_close(y.float(), F.linear(xd, wd), rtol=2e-2, atol=5e-2)
    y.float().sum().backward()
    torch.testing.assert_close(w.grad.float(), torch.ones(6, 4).t() @ xd.to(want).float(), rtol=2e-2, atol=5e-2)


class PickyCsr(sten.CsrTensor):
    """A CSR layout (its dense form a copy) whose in-place ``mul_`` takes positive factors only."""


class PickyCopy(DenseCopyLayout):
    """A layout without the stored-values protocol, with the same picky ``mul_``."""


@pytest.fixture
def picky_mul_():
    calls = []

    def mul_(ctx, inputs, outs):
        w, factor = inputs[0], inputs[1]
        if not isinstance(factor, (int, float)) or factor <= 0:
            raise sten.Unsupported(f"factor {factor} (the kernel scales by positive numbers)")
        calls.append(factor)
        layout = w.wrapped_tensor
        if isinstance(layout, PickyCsr):
            w.wrapped_tensor = layout.with_values(layout.values() * factor)
        else:
            w.wrapped_tensor = type(layout)(layout.data * factor)
        return w   # the target as the implementation got it (a detached twin when w requires grad)

    try:
        with sten.registry.owner(OWNER):
            for layout in (PickyCsr, PickyCopy):
                sten.registry.register_layout(layout)
                sten.registry.register_fwd_op_impl(torch.Tensor.mul_, (layout, None), None, mul_)
        sten.dispatch.reset_warnings()
        yield calls
    finally:
        sten.registry.remove_owner(OWNER)
        sten.dispatch.reset_warnings()


@pytest.mark.parametrize("layout", [PickyCsr, PickyCopy], ids=lambda c: c.__name__)
@pytest.mark.parametrize("trained", [False, True], ids=["frozen", "requires grad, under no_grad"])
def test_a_declined_in_place_call_runs_dense_into_its_target(picky_mul_, layout, trained):
    """A declined in-place implementation raised ``Unsupported`` out of ``w.mul_(-3)`` (a wrapper
    that requires grad, under ``no_grad``), or ran the dense op on a copy and returned it instead
    of writing ``w`` (a frozen wrapper, the cached fast path). Now it falls back as other calls do:
    the dense op, written into ``w`` (at its stored positions), ``w`` returned, one warning."""
    torch.manual_seed(0)
    start = torch.randn(4, 5) * (torch.rand(4, 5) > 0.4)
    w = sten.SparseTensorWrapper(layout.from_dense(start.clone()), requires_grad=trained)
    ref = start.clone()
    messages = []
    with torch.no_grad():
        for factor in (2.0, -3.0, -3.0, 0.5):  # the second -3 takes the cached call shape
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = w.mul_(factor)
            messages += [str(c.message) for c in caught if issubclass(c.category, sten.DispatchWarning)]
            ref.mul_(factor)
            assert out is w
            torch.testing.assert_close(w.to_dense(), ref)
    assert picky_mul_ == [2.0, 0.5]
    assert len(messages) == 1 and "declined (factor -3.0 (the kernel scales by positive numbers))" in messages[0]
    assert type(w.wrapped_tensor) is layout and w.requires_grad == trained


def test_a_declined_in_place_call_raises_in_raise_mode(picky_mul_):
    w = sten.SparseTensorWrapper(PickyCsr.from_dense(torch.eye(3)), requires_grad=True)
    with torch.no_grad(), sten.dispatch.failure_mode("raise"):
        with pytest.raises(sten.DispatchError, match="declined"):
            w.mul_(-1.0)
    torch.testing.assert_close(w.to_dense(), torch.eye(3))


def test_an_in_place_implementation_returning_its_input_returns_the_target(picky_mul_):
    """An in-place implementation gets the detached twin of a wrapper that requires grad: its
    write into that twin (``inputs[0].wrapped_tensor = ...``) did not reach ``w``, and returning
    the twin gave the caller a new wrapper, not ``w`` (``w.mul_(2).mul_(2)`` left ``w`` as it was).
    Now the twin shares ``w``'s layout, the call returns ``w`` and bumps its version."""
    w = sten.SparseTensorWrapper(PickyCsr.from_dense(torch.eye(3)), requires_grad=True)
    with torch.no_grad():
        out = w.mul_(2.0).mul_(2.0)
    assert out is w and w._version > 0
    torch.testing.assert_close(w.to_dense(), 4 * torch.eye(3))
