"""A wrapper behaves like the tensor it stands for: values and gradients
against plain torch for the cases users hit (issue: correctness).

Every layout below is checked against the dense tensor it represents
(``layout.to_dense()``), so lossy layouts (n:m) compare at their own values.
"""

import gc
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_core import dispatch
from sten_nm import NMTensor

from fake_layouts import DenseCopyLayout

LAYOUTS = [sten.DenseTensor, sten.CooTensor, sten.CsrTensor, sten.CscTensor, NMTensor]
KEEP = (sten.KeepAll(), torch.Tensor, sten.KeepAll(), torch.Tensor)
DENSE = (sten.KeepAll, torch.Tensor)


def wrapper(layout, dense, requires_grad=True):
    return sten.SparseTensorWrapper(layout.from_dense(dense.clone()), requires_grad=requires_grad)


def dense_of(value):
    return value.to_dense() if isinstance(value, sten.SparseTensorWrapper) else value


def check_against_dense(layout, fn, shape=(4, 4), seed=0):
    """``fn(a)`` on a wrapper of ``layout`` vs on its dense tensor: values and ``a.grad``."""
    torch.manual_seed(seed)
    a = wrapper(layout, torch.randn(*shape))
    ref = dense_of(a).detach().clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        got = fn(a)
        expected = fn(ref)
        torch.testing.assert_close(dense_of(got).detach(), expected.detach())
        weights = torch.randn(expected.shape)
        torch.sum(torch.mul(got, weights)).backward()
    (expected * weights).sum().backward()
    assert a.grad is not None, "the wrapper got no gradient"
    torch.testing.assert_close(dense_of(a.grad), ref.grad)


# 1. a tensor passed twice --------------------------------------------------------------

REPEATED = {
    "mul(a, a)": lambda a: torch.mul(a, a),
    "a + a": lambda a: a + a,
    "mm(a, a)": lambda a: torch.mm(a, a),
    "linear(a, a)": lambda a: F.linear(a, a),
    "add(a, a, alpha=3)": lambda a: torch.add(a, a, alpha=3),
    "matmul(a, a)": lambda a: torch.matmul(a, a),
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", REPEATED)
def test_repeated_argument_gets_its_gradient_once(layout, name):
    check_against_dense(layout, REPEATED[name])


def test_sparsified_op_on_a_plain_tensor_passed_twice():
    b = torch.randn(3, 3, requires_grad=True)
    mul = sten.sparsified_op(torch.mul, out_fmt=KEEP, grad_out_fmt=KEEP)
    mul(b, b).sum().backward()
    torch.testing.assert_close(b.grad, 2 * b.detach())


def test_repeated_argument_through_a_registered_backward():
    """The registered CSR linear backward returns a gradient per position; they add up."""
    torch.manual_seed(0)
    t = torch.randn(5, 5)
    a = wrapper(sten.CsrTensor, t)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sten.DispatchWarning)  # the registered implementation runs
        F.linear(a, a).sum().backward()
    ref = t.clone().requires_grad_()
    F.linear(ref, ref).sum().backward()
    torch.testing.assert_close(dense_of(a.grad), ref.grad)


# 2. wrappers inside lists --------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("op", [torch.cat, torch.stack], ids=["cat", "stack"])
def test_wrappers_in_lists_keep_gradients(layout, op):
    check_against_dense(layout, lambda a: op([a, a * 2, a]))


def test_wrappers_in_lists_warn_about_the_fallback():
    a = wrapper(sten.CsrTensor, torch.randn(3, 3))
    dispatch.reset_warnings()
    with pytest.warns(sten.DispatchWarning, match="inside a list"):
        y = torch.cat([a, a])
    assert y.grad_fn is not None
    with _raise_mode():
        with pytest.raises(sten.DispatchError, match="Tensor|cat"):
            torch.stack([a, a])


class _raise_mode:
    def __enter__(self):
        self.before = dispatch.get_dispatch_failure()
        sten.set_dispatch_failure("raise")

    def __exit__(self, *exc):
        sten.set_dispatch_failure(self.before)


# 3. a conversion that does not apply is skipped -------------------------------------------

class MatrixOnly(DenseCopyLayout):
    """A layout of another plugin: 2-D only, reached by a conversion."""


def test_refusing_conversion_is_skipped_not_raised():
    calls = []

    def to_matrix_only(layout):
        if layout.data.dim() != 2:
            raise ValueError("MatrixOnly: 2-D only")
        return MatrixOnly(layout.data)

    with sten.registry.owner("test-refusing-conversion"):
        sten.registry.register_layout(MatrixOnly)
        sten.registry.register_conversion(DenseCopyLayout, MatrixOnly, to_matrix_only)

        @sten.register_fwd_op_impl(operator=torch.sum, inp=(MatrixOnly,), out=None)
        def matrix_sum(ctx, inputs, output_sparsifiers):
            calls.append(1)
            return inputs[0].wrapped_tensor.data.sum()
    try:
        three_d = sten.SparseTensorWrapper(DenseCopyLayout.from_dense(torch.ones(2, 3, 4)))
        dispatch.reset_warnings()
        with pytest.warns(sten.DispatchWarning, match="DenseCopyLayout -> MatrixOnly refused.*2-D only"):
            assert torch.sum(three_d).item() == 24.0  # the dense fallback, not a ValueError
        two_d = sten.SparseTensorWrapper(DenseCopyLayout.from_dense(torch.ones(2, 3)))
        assert torch.sum(two_d).item() == 6.0 and calls == [1]  # the conversion applies here
    finally:
        sten.registry.remove_owner("test-refusing-conversion")


# 4. backward after a converting forward -------------------------------------------------

class Converted(DenseCopyLayout):
    pass


def test_backward_after_conversion_uses_the_converted_layouts():
    ran = []
    with sten.registry.owner("test-convert-bwd"):
        sten.registry.register_layout(Converted)
        sten.registry.register_conversion(DenseCopyLayout, Converted, lambda lay: Converted(lay.data))

        @sten.register_fwd_op_impl(operator=torch.mm, inp=(Converted, torch.Tensor), out=None)
        def fwd(ctx, inputs, output_sparsifiers):
            a, b = inputs
            ran.append("fwd")
            ctx.save_for_backward(a, b)
            return a.wrapped_tensor.data @ b

        @sten.register_bwd_op_impl(operator=torch.mm, grad_out=(torch.Tensor,), grad_inp=(DENSE, DENSE),
                                   inp=(Converted, torch.Tensor))
        def bwd(ctx, grad_outputs, input_sparsifiers):
            a, b = ctx.saved_tensors
            ran.append("bwd")
            (g,) = grad_outputs
            return g @ b.t(), a.wrapped_tensor.data.t() @ g
    try:
        t, b = torch.randn(3, 4), torch.randn(4, 2, requires_grad=True)
        a = sten.SparseTensorWrapper(DenseCopyLayout.from_dense(t), requires_grad=True)
        torch.mm(a, b).sum().backward()
        assert ran == ["fwd", "bwd"]
        torch.testing.assert_close(a.grad, torch.ones(3, 2) @ b.detach().t())
        torch.testing.assert_close(b.grad, t.t() @ torch.ones(3, 2))
    finally:
        sten.registry.remove_owner("test-convert-bwd")


# 5. alpha in add's backward ---------------------------------------------------------------

@pytest.mark.parametrize("layout", [sten.CooTensor, sten.CsrTensor, sten.CscTensor], ids=lambda c: c.__name__)
def test_add_alpha_reaches_backward(layout):
    a, b = wrapper(layout, torch.randn(3, 3)), wrapper(layout, torch.randn(3, 3))
    y = torch.add(a, b, alpha=3)
    torch.testing.assert_close(dense_of(y), dense_of(a).detach() + 3 * dense_of(b).detach())
    torch.sum(y).backward()
    torch.testing.assert_close(dense_of(b.grad), torch.full((3, 3), 3.0))
    torch.testing.assert_close(dense_of(a.grad), torch.ones(3, 3))


# 6. matmul with 1-D and 3-D operands, named-tuple results ------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("other", [(4,), (4, 3), (2, 4, 3)], ids=["1d", "2d", "3d"])
def test_matmul_sparse_by_any_rank(layout, other):
    torch.manual_seed(1)
    b = torch.randn(*other)
    check_against_dense(layout, lambda a: torch.matmul(a, b), shape=(4, 4))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("other", [(4,), (3, 4), (2, 3, 4)], ids=["1d", "2d", "3d"])
def test_matmul_any_rank_by_sparse(layout, other):
    torch.manual_seed(2)
    x = torch.randn(*other)
    check_against_dense(layout, lambda a: torch.matmul(x, a), shape=(4, 4))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: c.__name__)
def test_named_tuple_results(layout):
    a = wrapper(layout, torch.randn(4, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        result = torch.max(a, 1)
        std, mean = torch.std_mean(a, 0)
        median = torch.median(a, 0)
    dense = dense_of(a).detach()
    assert type(result) is type(torch.max(dense, 1)) and torch.equal(result.values.detach(), dense.max(1).values)
    torch.testing.assert_close(median.values.detach(), dense.median(0).values)
    torch.testing.assert_close(std.detach(), dense.std(0))
    (result.values.sum() + mean.sum()).backward()
    assert a.grad is not None


# 7. in-place updates ----------------------------------------------------------------------

@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.DenseTensor, NMTensor], ids=lambda c: c.__name__)
def test_in_place_change_after_use_is_caught_by_autograd(layout):
    w = wrapper(layout, torch.randn(4, 4))
    x = torch.randn(4, 2, requires_grad=True)
    y = torch.mm(w, x) if layout is not NMTensor else F.linear(x.t(), w)
    with torch.no_grad():
        w.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_plain_tensor_changed_in_place_after_use_is_caught():
    w = wrapper(sten.CsrTensor, torch.randn(4, 4))
    x = torch.randn(4, 2, requires_grad=True)
    y = torch.mm(w, x)
    with torch.no_grad():
        x.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


class CopyingLayout(DenseCopyLayout):
    """``to_dense`` returns a copy and there is no stored-values protocol."""

    def to_dense(self):
        return self.data.clone()


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CooTensor, CopyingLayout, NMTensor],
                         ids=lambda c: c.__name__)
def test_copy_into_a_detached_alias_reaches_the_wrapper(layout):
    """DDP's initial broadcast does ``p.detach().copy_(src)``."""
    torch.manual_seed(3)
    w = sten.SparseParameterWrapper(layout.from_dense(torch.randn(4, 4)))
    source = dense_of(w).detach() * 3
    with torch.no_grad():
        w.detach().copy_(source)
    torch.testing.assert_close(dense_of(w).detach(), source)


@pytest.mark.parametrize("layout", [sten.DenseTensor, sten.CsrTensor], ids=lambda c: c.__name__)
def test_gradient_through_in_place_ops(layout):
    a = wrapper(layout, torch.randn(3, 3))
    h = a * 2  # a non-leaf wrapper
    h.zero_()
    torch.sum(h + torch.ones(3, 3)).backward()
    torch.testing.assert_close(dense_of(a.grad), torch.zeros(3, 3))
    b = wrapper(layout, torch.randn(3, 3))
    ref = dense_of(b).detach().clone().requires_grad_()
    h, h_ref = b * 1, ref * 1
    h.mul_(torch.full((3, 3), 5.0))
    h_ref.mul_(5.0)
    torch.sum(h).backward()
    h_ref.sum().backward()
    torch.testing.assert_close(dense_of(b.grad), ref.grad)


def test_in_place_on_a_leaf_that_requires_grad_raises_like_torch():
    a = wrapper(sten.CsrTensor, torch.randn(3, 3))
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        a.mul_(2)


class NoFromDense(sten.Layout):
    """A user layout that is only built by its own sparsifier implementation."""

    def __init__(self, data):
        self.data = data

    def to_dense(self):
        return self.data.clone()

    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype)
    device = property(lambda self: self.data.device)


def test_in_place_on_a_user_layout_uses_its_same_format_sparsifier():
    used = []
    with sten.registry.owner("test-same-format"):
        @sten.register_sparsifier_implementation(sparsifier=sten.SameFormatSparsifier, inp=torch.Tensor,
                                                 out=NoFromDense)
        def same(sparsifier, tensor, grad_fmt=None):
            used.append(1)
            mask = sparsifier.ref.wrapped_tensor.data != 0
            return sten.SparseTensorWrapper(NoFromDense(tensor * mask))
    try:
        w = sten.SparseTensorWrapper(NoFromDense(torch.tensor([[1.0, 0.0], [0.0, 2.0]])))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sten.DispatchWarning)
            w.add_(torch.ones(2, 2))
        assert used and torch.equal(w.to_dense(), torch.tensor([[2.0, 0.0], [0.0, 3.0]]))
    finally:
        sten.registry.remove_owner("test-same-format")
    w = sten.SparseTensorWrapper(NoFromDense(torch.eye(2)))
    with pytest.raises(sten.DispatchError, match="SameFormatSparsifier"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sten.DispatchWarning)
            w.add_(torch.ones(2, 2))
    assert torch.equal(w.to_dense(), torch.eye(2))  # nothing lost


# 8. error types ---------------------------------------------------------------------------

class NoMask(sten.Sparsifier):
    pass


def test_sparsifier_without_mask_is_a_dispatch_fallback():
    dispatch.reset_warnings()
    with pytest.warns(sten.DispatchWarning, match="register_sparsifier_implementation"):
        out = sten.sparsify(NoMask(), torch.randn(3, 3), sten.CsrTensor)
    assert type(out.wrapped_tensor) is sten.CsrTensor
    with _raise_mode(), pytest.raises(sten.DispatchError, match="NoMask"):
        sten.sparsify(NoMask(), torch.randn(3, 3), sten.CooTensor)


def test_fallback_to_a_layout_without_from_dense_is_a_dispatch_fallback():
    dispatch.reset_warnings()
    with pytest.warns(sten.DispatchWarning, match="NoFromDense"):
        out = sten.sparsify(sten.ScalarFractionSparsifier(0.5), torch.randn(3, 3), NoFromDense)
    assert isinstance(out, torch.Tensor)
    with _raise_mode(), pytest.raises(sten.DispatchError, match="NoFromDense"):
        sten.sparsify(sten.RandomFractionSparsifier(0.5), torch.randn(3, 3), NoFromDense)


# 9. no silent re-pruning --------------------------------------------------------------------

def test_lossy_layout_after_a_sparsifier_warns_and_raises():
    torch.manual_seed(4)
    weight = torch.randn(32, 64)
    dispatch.reset_warnings()
    with pytest.warns(sten.DispatchWarning, match=r"NMTensor.from_dense kept \d+ of the 1024"):
        sten.sparsify(sten.ScalarFractionSparsifier(0.5), weight, NMTensor)
    with _raise_mode(), pytest.raises(sten.DispatchError, match="PerBlockFractionSparsifier|NMSparsifier"):
        sten.sparsify(sten.ScalarFractionSparsifier(0.9), weight, NMTensor)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sten.DispatchWarning)  # lossless: no warning
        sten.sparsify(sten.PerBlockFractionSparsifier(2, 4), weight, NMTensor)


def test_builder_reports_lossy_weights():
    model = torch.nn.Sequential(torch.nn.Linear(64, 32))
    sb = sten.SparsityBuilder(model)
    sb.set_weight("0.weight", initial_sparsifier=sten.ScalarFractionSparsifier(0.5), out_format=NMTensor)
    dispatch.reset_warnings()
    with pytest.warns(sten.DispatchWarning, match="Lossy"):
        sb.get_sparse_model()


# 10. explain() does not use up warnings ---------------------------------------------------------

def test_fallback_warns_after_explain_saw_it_first():
    dispatch.reset_warnings()
    a = wrapper(sten.CsrTensor, torch.randn(3, 3), requires_grad=False)
    with sten.explain() as report:
        torch.sin(a)
    assert report.fallbacks
    with pytest.warns(sten.DispatchWarning, match="sin"):
        torch.sin(a)


# 11. the node keeps only what backward needs, through save_for_backward ------------------------

def test_node_frees_its_inputs_after_backward():
    w = wrapper(sten.CsrTensor, torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    h = x * 2  # an intermediate only the sparse node holds
    ref = weakref.ref(h)
    y = F.linear(h, w)
    del h
    gc.collect()
    assert ref() is not None  # saved for backward
    y.sum().backward()
    gc.collect()
    assert ref() is None, "the autograd node kept its input after backward"
    assert y.grad_fn is not None


# the paper's A.1 combination: a sparse input times a sparse weight ------------------------------

@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lead", [(6,), (2, 3)], ids=["2d", "3d"])
def test_linear_coo_input_csr_weight(bias, lead):
    torch.manual_seed(5)
    x_dense = torch.randn(*lead, 8) * (torch.rand(*lead, 8) > 0.5)
    w_dense = torch.randn(4, 8) * (torch.rand(4, 8) > 0.5)
    b = torch.randn(4, requires_grad=True) if bias else None
    x = sten.SparseTensorWrapper(sten.CooTensor.from_dense(x_dense), requires_grad=True)
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(w_dense))
    with _raise_mode():
        y = F.linear(x, w, b)
        y.backward(torch.ones(*lead, 4))
    rx, rw = x_dense.clone().requires_grad_(), w_dense.clone().requires_grad_()
    rb = b.detach().clone().requires_grad_() if bias else None
    ref = F.linear(rx, rw, rb)
    ref.backward(torch.ones(*lead, 4))
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(dense_of(x.grad), rx.grad)
    torch.testing.assert_close(dense_of(w.grad), rw.grad)
    if bias:
        torch.testing.assert_close(b.grad, rb.grad)


# found in review -----------------------------------------------------------------------------

@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CooTensor, sten.DenseTensor], ids=lambda c: c.__name__)
@pytest.mark.parametrize("op", ["add_", "mul_", "copy_"])
def test_in_place_into_a_temporary_is_dense_torchs_values_and_gradients(layout, op):
    """``h.add_(x)`` on a temporary ``h = a * 1`` takes dense torch's result everywhere (its
    pattern grows), so ``x``'s gradient is dense torch's too (they were taken at ``h``'s stored
    positions, where the write kept its pattern); h's own gradient is the dense one everywhere
    (``h.mul_(x)`` as ``h * x``), so the weight behind h gets dense torch's."""
    torch.manual_seed(6)
    w = torch.randn(4, 4) * (torch.rand(4, 4) > 0.5)
    a = wrapper(layout, w)
    x = torch.randn(4, 4, requires_grad=True)
    h = a * 1
    getattr(h, op)(x)
    g = torch.randn(4, 4)
    torch.sum(torch.mul(h, g)).backward()
    ref_a, ref_x = dense_of(a).detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    written = (ref_a * 1).clone()
    getattr(written, op)(ref_x)
    (written * g).sum().backward()
    torch.testing.assert_close(dense_of(h).detach(), written.detach())
    torch.testing.assert_close(x.grad, ref_x.grad)
    torch.testing.assert_close(dense_of(a.grad), ref_a.grad)


def test_in_place_into_an_n_m_temporary_warns_and_takes_gradients_where_values_landed():
    """An n:m temporary cannot hold ``h.add_(x)``'s result: it keeps its pattern, warns how many
    values it dropped, and ``x``'s gradient is taken at the stored positions (where ``x`` landed)."""
    from sten_nm import NMTensor

    torch.manual_seed(6)
    a = sten.SparseTensorWrapper(NMTensor.from_dense(torch.randn(4, 8)), requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    h = a * 1
    with pytest.warns(sten.DispatchWarning, match="positions it does not store"):
        h.add_(x)
    g = torch.randn(4, 8)
    torch.sum(torch.mul(h, g)).backward()
    kept = dense_of(a).detach() != 0
    torch.testing.assert_close(dense_of(h).detach(), torch.where(kept, dense_of(a).detach() + x.detach(), 0.0))
    torch.testing.assert_close(x.grad, g * kept)


def test_an_in_place_write_keeps_the_weights_dense_gradient_at_unstored_positions():
    """``(W * 2).mul_(3)`` has ``W * 6``'s values and, as in dense torch, its gradient: 6 at
    every position (the in-place node took the incoming gradient at the stored positions only,
    0 elsewhere, which RigL-style growth reads)."""
    base = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    got = []
    for inplace in (False, True):
        w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(base), requires_grad=True)
        h = w * 2
        out = h.mul_(3) if inplace else h * 3
        out.to_dense().sum().backward()
        got.append(w.grad)
    torch.testing.assert_close(got[0], torch.full((2, 2), 6.0))
    torch.testing.assert_close(got[1], got[0])


def test_in_place_into_a_dense_tensor_gives_a_wrapper_its_grad_fmt():
    w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(3)), requires_grad=True,
                                 grad_fmt=(sten.KeepAll(), sten.CsrTensor, sten.KeepAll(), sten.CsrTensor))
    h = torch.ones(3, 3, requires_grad=True) * 1
    h.add_(w)
    h.sum().backward()
    assert isinstance(w.grad, sten.SparseTensorWrapper) and type(w.grad.wrapped_tensor) is sten.CsrTensor


def test_saved_tensor_hooks_see_plain_tensors_only():
    w = wrapper(sten.CsrTensor, torch.randn(4, 4))
    x = torch.randn(4, 3, requires_grad=True)
    with torch.autograd.graph.save_on_cpu():
        y = torch.mm(w, x)
    y.sum().backward()
    torch.testing.assert_close(x.grad, dense_of(w).detach().t() @ torch.ones(4, 3))


def test_converted_inputs_are_not_kept_by_the_node():
    calls = []
    with sten.registry.owner("test-convert-leak"):
        sten.registry.register_layout(Converted)
        sten.registry.register_conversion(DenseCopyLayout, Converted, lambda lay: Converted(lay.data))

        @sten.register_fwd_op_impl(operator=torch.mm, inp=(Converted, torch.Tensor), out=None)
        def fwd(ctx, inputs, output_sparsifiers):
            calls.append(1)
            return inputs[0].wrapped_tensor.data @ inputs[1]
    try:
        a = sten.SparseTensorWrapper(DenseCopyLayout.from_dense(torch.randn(3, 4)), requires_grad=True)
        y = torch.mm(a, torch.randn(4, 2))
        assert calls and y.grad_fn.call.converted is None
    finally:
        sten.registry.remove_owner("test-convert-leak")

