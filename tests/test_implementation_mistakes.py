"""Mistakes a plugin author makes, caught where they are made instead of turning into a
silently untrained weight or another plugin's broken calls.

- A backward implementation returning fewer gradients than the inputs that need one (or
  ``None`` for all of them, a forgotten ``return``) left ``w.grad`` at ``None``: the weight
  never trained, silently. It is a ``TypeError`` naming the implementation.
- An implementation whose signature cannot take ``(ctx, inputs, output_sparsifiers)`` failed
  at its first call with Python's bare "takes 2 positional arguments but 3 were given"; it is
  refused when registered.
- A ``sten_resolve_op`` hook answering something that is not an implementation (a string)
  made calls on *other* plugins' layouts raise ``'str' object is not callable``; the answer is
  warned about, naming the plugin, and skipped.
- A forward implementation returning ``None`` (out of place), a numpy / scipy array, or a number or
  list for an operator that returns tensors (``F.linear``) gave the user that object as the
  operator's result; it is a ``TypeError`` naming the implementation.
"""

import types
import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_core.plugin_api import PluginHookWarning, register_weight_product
from fake_layouts import DenseCopyLayout

OWNER = "test-implementation-mistakes"


class Forgetful(DenseCopyLayout):
    """A layout whose F.linear backward returns what each test gives it."""


@pytest.fixture
def backward_returning():
    returned = {}

    def fwd(ctx, inputs, outs):
        x, w = inputs[0], inputs[1]
        ctx.save_for_backward(x, w)
        return F.linear(x, w.wrapped_tensor.data)

    def bwd(ctx, grad_outputs, sparsifiers):
        x, w = ctx.saved_tensors
        g = grad_outputs[0]
        return returned["fn"](g @ w.wrapped_tensor.data, g.t() @ x)

    try:
        with sten.registry.owner(OWNER):
            sten.registry.register_layout(Forgetful)
            register_weight_product(sten.registry, F.linear, Forgetful, fwd, bwd)
        yield returned
    finally:
        sten.registry.remove_owner(OWNER)


@pytest.mark.parametrize("returns", ["grad x only", "None"])
def test_a_backward_missing_a_needed_gradient_is_an_error(backward_returning, returns):
    backward_returning["fn"] = (lambda gx, gw: (gx,)) if returns == "grad x only" else (lambda gx, gw: None)
    w = sten.SparseParameterWrapper(Forgetful.from_dense(torch.randn(3, 5)))
    x = torch.randn(2, 5, requires_grad=True)
    with pytest.raises(TypeError, match=r"returned 1 gradient, but argument 1 of torch.nn.functional.linear needs one"):
        F.linear(x, w).sum().backward()


@pytest.mark.parametrize("returns, error, says", [
    ("a transposed weight gradient", ValueError,
     r"returned a gradient of shape \(5, 3\) for argument 1 of torch.nn.functional.linear, of shape \(3, 5\)"),
    ("one gradient too many", TypeError, r"returned 4 gradients, but torch.nn.functional.linear was called with 3"),
])
def test_a_backward_returning_a_wrong_gradient_names_the_implementation(backward_returning, returns, error, says):
    """torch said "Function _DispatchFunctionBackward returned an invalid gradient at index 1",
    naming neither the implementation nor the argument; a gradient too many went unnoticed."""
    backward_returning["fn"] = {"a transposed weight gradient": lambda gx, gw: (gx, gw.t()),
                                "one gradient too many": lambda gx, gw: (gx, gw, None, None)}[returns]
    w = sten.SparseParameterWrapper(Forgetful.from_dense(torch.randn(3, 5)))
    x = torch.randn(2, 5, requires_grad=True)
    with pytest.raises(error, match=rf"the backward implementation .*bwd of .*{says}"):
        F.linear(x, w).sum().backward()


def test_a_backward_may_return_a_broadcast_gradient_that_sums_to_its_argument(backward_returning):
    backward_returning["fn"] = lambda gx, gw: (gx.expand(3, *gx.shape), gw)
    w = sten.SparseParameterWrapper(Forgetful.from_dense(torch.randn(3, 5)))
    x = torch.randn(2, 5, requires_grad=True)
    F.linear(x, w).sum().backward()
    torch.testing.assert_close(x.grad, 3 * torch.ones(2, 3) @ w.to_dense())


def test_a_backward_may_return_none_for_an_input_that_needs_no_gradient(backward_returning):
    backward_returning["fn"] = lambda gx, gw: (None, gw)
    w = sten.SparseParameterWrapper(Forgetful.from_dense(torch.randn(3, 5)))
    x = torch.randn(2, 5)
    F.linear(x, w).sum().backward()
    torch.testing.assert_close(w.grad, torch.ones(2, 3).t() @ x)


@pytest.mark.parametrize("register", ["fwd", "bwd"])
def test_an_implementation_that_cannot_take_three_arguments_is_refused_when_registered(register):
    def two(ctx, inputs):
        return None

    with pytest.raises(TypeError, match=r"<locals>.two\(ctx, inputs\) cannot be called as impl\(ctx, "):
        if register == "fwd":
            sten.registry.register_fwd_op_impl(torch.tanh, (Forgetful,), None, two)
        else:
            sten.registry.register_bwd_op_impl(torch.tanh, (torch.Tensor,), ((sten.KeepAll, torch.Tensor),),
                                               (Forgetful,), two)
    assert not any(key.op is torch.tanh and Forgetful in key.inp for key in sten.registry.impls)


def test_a_resolve_hook_answering_a_non_implementation_is_skipped_and_named():
    sten.dispatch.reset_warnings()

    @sten.hookimpl
    def sten_resolve_op(key):
        return "oops"

    plugin = types.SimpleNamespace(sten_resolve_op=sten_resolve_op)
    sten.plugins.register_plugin(plugin, name="answers-a-string")
    try:
        w = sten.SparseTensorWrapper(sten.CooTensor.from_dense(torch.randn(3, 4)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = torch.tanh(w)
        messages = [str(c.message) for c in caught if issubclass(c.category, PluginHookWarning)]
        assert any("'answers-a-string'" in m and "returned 'oops', not an implementation" in m for m in messages)
        torch.testing.assert_close(got, torch.tanh(w.to_dense()))
    finally:
        sten.plugins.unregister_plugin("answers-a-string")
        sten.dispatch.reset_warnings()


class _Picks(sten.Sparsifier):
    """A sparsifier whose implementation into ``Forgetful`` returns what a test gives it."""


@pytest.mark.parametrize("returns", ["a COO wrapper", "the dense tensor"])
def test_a_sparsifier_implementation_returning_another_format_is_an_error(returns):
    """``sten.sparsify(S(), A, L)`` returned the COO wrapper, and ``set_weight(out_format=L)``
    made a plain dense parameter, silently."""
    made = {"a COO wrapper": lambda t: sten.SparseTensorWrapper(sten.CooTensor.from_dense(t)),
            "the dense tensor": lambda t: t}[returns]
    try:
        with sten.registry.owner(OWNER):
            sten.registry.register_layout(Forgetful)
            sten.registry.register_sparsifier_implementation(_Picks, torch.Tensor, Forgetful,
                                                             lambda sp, t, grad_fmt=None: made(t))
        with pytest.raises(TypeError, match=r"registered for out=Forgetful, returned a (CooTensor|Tensor): return a "
                                            r"Forgetful"):
            sten.sparsify(_Picks(), torch.randn(3, 4), Forgetful)
    finally:
        sten.registry.remove_owner(OWNER)


def test_a_sparsifier_implementation_returning_another_shape_is_an_error():
    """A transposed result was taken: ``Linear(6, 4).weight`` became [6, 4], and the model failed
    later with a size error naming neither the sparsifier nor its implementation."""
    try:
        with sten.registry.owner(OWNER):
            sten.registry.register_layout(Forgetful)
            sten.registry.register_sparsifier_implementation(_Picks, torch.Tensor, Forgetful,
                                                             lambda sp, t: Forgetful.from_dense(t.t()))
        with pytest.raises(ValueError, match=r"returned shape \(4, 3\) for an input of shape \(3, 4\)"):
            sten.sparsify(_Picks(), torch.randn(3, 4), Forgetful)
        sb = sten.SparsityBuilder()
        sb.set_weight("weight", initial_sparsifier=_Picks(), out_format=Forgetful)
        with pytest.raises(ValueError, match=r"returned shape \(6, 4\) for an input of shape \(4, 6\)"):
            sb.get_sparse_model(torch.nn.Linear(6, 4))
    finally:
        sten.registry.remove_owner(OWNER)


@pytest.mark.parametrize("returns", ["None", "a numpy array", "a scipy matrix"])
def test_an_implementation_returning_none_or_an_array_is_an_error(returns):
    """A forgotten ``return`` made ``torch.tanh(w)`` give ``None``, and a layout's numpy storage
    returned unwrapped came back as the operator's result: both failed far from their cause."""
    import numpy as np
    import scipy.sparse

    made = {"None": lambda w: None, "a numpy array": lambda w: np.tanh(w.wrapped_tensor.data.numpy()),
            "a scipy matrix": lambda w: scipy.sparse.csr_matrix(w.wrapped_tensor.data.numpy())}[returns]
    try:
        with sten.registry.owner(OWNER):
            sten.registry.register_layout(Forgetful)
            sten.registry.register_fwd_op_impl(torch.tanh, (Forgetful,), None, lambda ctx, inputs, outs: made(inputs[0]))
        w = sten.SparseTensorWrapper(Forgetful.from_dense(torch.randn(3, 4)))
        got = {"None": "None", "a numpy array": "a numpy.ndarray", "a scipy matrix": r"a scipy.csr_matrix"}[returns]
        with pytest.raises(TypeError, match=rf"implementation .* of .*tanh.* returned {got}: an implementation returns"):
            torch.tanh(w)
    finally:
        sten.registry.remove_owner(OWNER)


@pytest.mark.parametrize("returns", ["int", "list"])
def test_an_implementation_returning_a_number_or_list_for_a_tensor_is_an_error(returns):
    """``torch.mm`` returns a tensor (its aten schemas say so): an implementation returning ``3``
    or ``[y]`` gave the user that value, or ``'int' object has no attribute 'shape'`` under autograd."""
    made = {"int": lambda w, x: 3, "list": lambda w, x: [w.wrapped_tensor.data @ x]}[returns]
    try:
        with sten.registry.owner(OWNER):
            sten.registry.register_layout(Forgetful)
            sten.registry.register_fwd_op_impl(torch.mm, (Forgetful, torch.Tensor), None,
                                               lambda ctx, inputs, outs: made(*inputs))
        for requires_grad in (False, True):
            w = sten.SparseTensorWrapper(Forgetful.from_dense(torch.randn(3, 4)), requires_grad=requires_grad)
            with pytest.raises(TypeError, match=rf"implementation .* of .*torch.mm.* returned a value of type {returns}"):
                torch.mm(w, torch.ones(4, 2))
    finally:
        sten.registry.remove_owner(OWNER)


def test_an_implementation_of_an_operator_returning_a_number_may_return_one():
    try:
        with sten.registry.owner(OWNER):
            sten.registry.register_layout(Forgetful)
            sten.registry.register_fwd_op_impl(torch.Tensor.dim, (Forgetful,), None, lambda ctx, inputs, outs: 2)
        assert sten.SparseTensorWrapper(Forgetful.from_dense(torch.zeros(2, 2))).dim() == 2
    finally:
        sten.registry.remove_owner(OWNER)


def test_an_in_place_implementation_may_return_none():
    def add_(ctx, inputs, outs):
        target, other = inputs[0], inputs[1]
        target.wrapped_tensor.data.add_(other)
        return None

    try:
        with sten.registry.owner(OWNER):
            sten.registry.register_layout(Forgetful)
            sten.registry.register_fwd_op_impl(torch.Tensor.add_, (Forgetful, torch.Tensor), None, add_)
        w = sten.SparseTensorWrapper(Forgetful.from_dense(torch.zeros(2, 2)))
        w.add_(torch.ones(2, 2))
        torch.testing.assert_close(w.to_dense(), torch.ones(2, 2))
    finally:
        sten.registry.remove_owner(OWNER)


@pytest.mark.parametrize("returns", ["another shape", "another dtype", "a layout of another shape", "two results"])
def test_an_implementation_returning_another_shape_or_dtype_than_the_operator_is_an_error(returns):
    """A forward's result was taken as it came: an ``F.linear`` of shape ``[3, 5]`` where torch gives
    ``[3, 4]`` (broadcasting then hid it), an ``add`` of float32 tensors giving float16, a ``mul``
    returning a layout object of another shape."""
    def linear(ctx, inputs, outs):
        y = F.linear(inputs[0], inputs[1].wrapped_tensor.data)
        if returns == "another shape":
            return torch.cat([y, y[:, :1]], 1)
        if returns == "another dtype":
            return y.half()
        if returns == "a layout of another shape":
            return Forgetful.from_dense(y.t())
        return y, y

    try:
        with sten.registry.owner(OWNER):
            sten.registry.register_layout(Forgetful)
            sten.registry.register_fwd_op_impl(F.linear, (torch.Tensor, Forgetful), None, linear)
        w = sten.SparseTensorWrapper(Forgetful.from_dense(torch.randn(4, 6)))
        says = {"another shape": r"shape \(3, 5\) float32", "another dtype": r"shape \(3, 4\) float16",
                "a layout of another shape": r"shape \(4, 3\) float32",
                "two results": r"\(shape \(3, 4\) float32, shape \(3, 4\) float32\)"}[returns]
        with pytest.raises(ValueError, match=rf"implementation .*linear of fwd torch.nn.functional.linear .*returned "
                                             rf"{says} where torch.nn.functional.linear gives shape \(3, 4\) float32"):
            F.linear(torch.randn(3, 6), w)
    finally:
        sten.registry.remove_owner(OWNER)


def test_results_are_checked_for_each_signature_and_a_correct_one_passes():
    """The check runs once per argument signature: a kernel wrong for a batch of one only is caught there."""
    def linear(ctx, inputs, outs):
        y = F.linear(inputs[0], inputs[1].wrapped_tensor.data)
        return y.t() if y.shape[0] == 1 else y   # a "vector" special case returning a column

    try:
        with sten.registry.owner(OWNER):
            sten.registry.register_layout(Forgetful)
            sten.registry.register_fwd_op_impl(F.linear, (torch.Tensor, Forgetful), None, linear)
        dense = torch.randn(4, 6)
        w = sten.SparseTensorWrapper(Forgetful.from_dense(dense))
        for _ in range(2):
            torch.testing.assert_close(F.linear(torch.ones(3, 6), w), F.linear(torch.ones(3, 6), dense))
        with pytest.raises(ValueError, match=r"returned shape \(4, 1\) float32 where .* gives shape \(1, 4\)"):
            F.linear(torch.ones(1, 6), w)
    finally:
        sten.registry.remove_owner(OWNER)


def test_the_packages_of_this_repository_are_not_checked_at_run_time():
    from sten_core.dispatch.result_check import checks

    sten.plugins.ensure_loaded()
    owners = {sten.registry.owner_of("impls", key): checks(key) for key in sten.registry.impls}
    assert owners and not any(checked for owner, checked in owners.items() if owner in ("builtin", "nm", "scipy"))
    try:
        with sten.registry.owner(OWNER):
            sten.registry.register_layout(Forgetful)
            sten.registry.register_fwd_op_impl(torch.tanh, (Forgetful,), None, lambda ctx, inputs, outs: None)
        key = next(key for key in sten.registry.impls if sten.registry.owner_of("impls", key) == OWNER)
        assert checks(key)
    finally:
        sten.registry.remove_owner(OWNER)
