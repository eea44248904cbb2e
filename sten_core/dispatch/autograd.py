"""The autograd side of dispatch: the node a call with an implementation
records (``_DispatchFunction``), and the differentiable densify / sparsify
steps the dense path uses.

Example:
    >>> import torch, sten_core as sten
    >>> w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(2)), requires_grad=True)
    >>> sten.dispatch.dense_with_grad(w).requires_grad
    True
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from sten_core.dispatch.call import _Call, grad_spec, tensors_in
from sten_core.dispatch.graph_keeping import keeping_graph
from sten_core.dispatch.sparsifier_dispatch import apply_grad_spec, apply_spec, grad_positions
from sten_core.model.layouts import holds_transform_tensors, unshared_dense
from sten_core.model.signatures import op_name
from sten_core.model.spec import DENSE, OutputSpec
from sten_core.model.tensor import WRAPPER_TYPES, SparseTensorWrapper, densify, map_tensors

_NoTorchFunction = torch._C.DisableTorchFunctionSubclass


class _DispatchFunction(torch.autograd.Function):
    """The autograd node of a call that runs an implementation."""

    @staticmethod
    def forward(fctx: Any, call: _Call, *tensors: torch.Tensor) -> Any:
        fctx.call = call
        out = call.forward()
        if isinstance(out, tuple):
            fctx.mark_non_differentiable(*[o for o in out if isinstance(o, torch.Tensor) and not o.is_floating_point()])
        call.stash(fctx, out)
        return out

    @staticmethod
    def backward(fctx: Any, *grads: Any) -> Any:
        call = fctx.call
        templates = call.unstash(call.saved(fctx.saved_tensors))  # raises if an input changed in place since
        try:
            if torch.is_grad_enabled():  # create_graph=True: gradients with a graph of their own
                return (None, *call.differentiable_backward(grads, fctx.needs_input_grad[1:]))
            return (None, *call.backward(grads, fctx.needs_input_grad[1:]))
        finally:
            call.restash(templates)


class _Densify(torch.autograd.Function):
    """A wrapper as a dense tensor, differentiably: its gradient comes back in
    the wrapper's ``grad_fmt``. The dense tensor never shares the layout's memory
    (``unshared_dense``), so an operator that saved it (``sin``, ``pow``) is not broken
    by a write through ``w.data``."""

    @staticmethod
    def forward(fctx: Any, wrapper: SparseTensorWrapper) -> torch.Tensor:
        fctx.spec, fctx.wrapper = grad_spec(wrapper), wrapper
        return unshared_dense(wrapper.wrapped_tensor).detach()

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> Any:
        return apply_grad_spec(grad, fctx.spec, fctx.wrapper)


class _Sparsify(torch.autograd.Function):
    """An output run through its spec, differentiably: the gradient flowing
    into it is sparsified by ``grad_spec``, then made dense for the dense op."""

    @staticmethod
    def forward(fctx: Any, dense: torch.Tensor, spec: OutputSpec, grad_spec: OutputSpec) -> Any:
        fctx.grad_spec = grad_spec
        out = apply_spec(dense, spec)
        return out.view_as(out) if out is dense else out

    @staticmethod
    def backward(fctx: Any, grad: Any) -> Any:
        if fctx.grad_spec is not DENSE:
            spec = fctx.grad_spec
            grad = keeping_graph(lambda g: apply_spec(g, spec), grad, spec.out_format, grad_positions(spec, None))
        if isinstance(grad, SparseTensorWrapper) and grad.requires_grad:  # create_graph=True
            return dense_with_grad(grad), None, None
        return densify(grad), None, None


def dense_with_grad(wrapper: SparseTensorWrapper) -> torch.Tensor:
    """``wrapper`` as a dense tensor whose gradient flows back to it (in its ``grad_fmt``)."""
    return apply_function(_Densify, wrapper)


# ``Function.apply`` without its Python wrapper (default-argument binding and a
# functorch check, about half the cost of recording a node); used while no
# functorch transform is active, as ``Function.apply`` itself does.
_apply_function = super(torch.autograd.Function, _DispatchFunction).apply
_unwrap_if_dead = getattr(torch._C._functorch, "unwrap_if_dead", lambda tensor: tensor)


def apply_function(function: type, *args: Any) -> Any:
    """``function.apply(*args)`` with wrappers among ``args`` (no ``__torch_function__``)."""
    if torch._C._are_functorch_transforms_active():
        with _NoTorchFunction():
            return function.apply(*args)
    return super(torch.autograd.Function, function).apply(*args)


def record(call: _Call) -> Any:
    """Run ``call`` as one autograd node whose inputs are its distinct tensor arguments; under a
    ``torch.func`` transform with no sparse operand that requires grad, densely instead
    (``dense_under_transform``)."""
    unique = call.dedupe()
    try:
        if functorch_active():
            if not _sparse_requires_grad(unique):
                return dense_under_transform(call, unique)
            with _NoTorchFunction():
                return _DispatchFunction.apply(call, *unique)
        if _forward_ad._current_level >= 0 and not _sparse_requires_grad(unique):
            dense = batched_under_transform(call)   # dual inputs: forward-mode AD of the dense op
            if dense is not None:
                return dense
        return _apply_function(call, *[v if type(v) in WRAPPER_TYPES else _unwrap_if_dead(v) for v in unique])
    except RuntimeError as error:
        if "setup_context" in str(error) or "jvp" in str(error):
            raise unsupported_transform(call.op, unique, error) from error
        raise


def _sparse_requires_grad(operands: list) -> bool:
    """Whether a wrapper among ``operands`` requires grad."""
    with _NoTorchFunction():
        return any(isinstance(v, SparseTensorWrapper) and v.requires_grad for v in operands)


def dense_under_transform(call: _Call, operands: list) -> Any:
    """``call`` under a ``torch.func`` transform that tracks a dense operand (``grad`` or ``jacrev``
    of the input, ``vmap(grad)``: saliency, per-sample input gradients) while every sparse operand
    is frozen: the original operator on the wrappers' dense values, which the transform
    differentiates as dense torch (it cannot see through a layout's kernels, nor through STen's
    autograd node). Output specs that sparsify a result or a gradient cannot be kept there."""
    specs = call.specs
    if specs is not None and any(s != DENSE for s in (*specs.out, *(specs.grad or ()))):
        raise specs_under_transform(call.op)
    with _NoTorchFunction():
        dense = {id(v): unshared_dense(v.wrapped_tensor) for v in operands if isinstance(v, SparseTensorWrapper)}

    def swap(tensor: torch.Tensor) -> torch.Tensor:
        return dense.get(id(tensor), tensor)

    return call.op(*map_tensors(swap, call.args), **map_tensors(swap, call.kwargs))


_forward_ad = torch.autograd.forward_ad
functorch_active = torch._C._are_functorch_transforms_active


def _tangent(tensor: torch.Tensor) -> Any:
    """``tensor``'s forward-mode tangent at the current dual level, or ``None``."""
    return _forward_ad.unpack_dual(tensor).tangent if _forward_ad._current_level >= 0 else None


def batched_under_transform(call: _Call) -> Any:
    """``call`` densely (``dense_under_transform``) when one of its dense operands belongs to an
    active ``torch.func`` transform (``vmap``'s batched inputs, ``jacfwd``'s) or carries a forward-mode
    tangent (``torch.autograd.forward_ad``), with nothing that requires grad; ``None`` otherwise.
    A layout's kernels read storage, which batched tensors have none of, and drop tangents.

    Example: ``torch.func.vmap(lambda x: F.linear(x, frozen_nm_weight))(xs)``."""
    functorch, forward = functorch_active(), _forward_ad._current_level >= 0
    if not (functorch or forward):
        return None
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    operands = tensors_in((call.args, call.kwargs))
    with _NoTorchFunction():
        dense = [v for v in operands if not isinstance(v, SparseTensorWrapper)]
        if not any((functorch and wrapped(v)) or (forward and _tangent(v) is not None) for v in dense):
            return None
    return dense_under_transform(call, operands)


_RANDOM_OPS = frozenset({
    "dropout", "dropout_", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "alpha_dropout_",
    "feature_alpha_dropout", "feature_alpha_dropout_", "feature_dropout", "feature_dropout_", "rrelu", "rrelu_",
    "rand_like", "randn_like", "randint_like", "bernoulli", "bernoulli_", "multinomial", "normal", "normal_",
    "poisson", "uniform_", "random_", "exponential_", "geometric_", "cauchy_", "log_normal_"})
"""Random operators: under ``vmap`` they stay inside it, whose ``randomness`` says what they do
(``"error"`` raises, ``"different"`` draws per batch element)."""


_DUAL_OPS = frozenset({"_make_dual", "_unpack_dual"})
"""Forward-mode AD's own operators: ``jvp`` makes its primals dual with them, inside it (run
outside, ``jvp`` over a parameter dict holding a sparse weight lost the weight's tangent)."""


def _under_vmap() -> bool:
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    return any(i.key() == torch._C._functorch.TransformType.Vmap for i in retrieve_all_functorch_interpreters())


def outside_transform(args: tuple, kwargs: dict, op: Any = None) -> Any:
    """Where a call under an active ``torch.func`` transform runs: outside the transform
    (``torch._C._DisableFuncTorch``) when none of its tensors is the transform's, which then sees
    its result as the constant it is; inside it (``nullcontext``) otherwise. torch's own sparse
    tensors refuse every operation inside one ("Sparse CSR tensors do not have strides": ``w.t()``,
    ``w * 2``, ``w.to_dense()`` of a frozen CSR weight under ``torch.func.grad``), tensors made
    there are the transform's (a scipy layout's values then have no storage), and an in-place
    write there into a wrapper's copy made outside is refused as a write into a captured tensor.
    A random ``op`` under ``vmap`` stays inside it (``_RANDOM_OPS``), and so do forward-mode AD's
    own operators (``_DUAL_OPS``).

    Example: ``torch.func.grad(lambda x: (x @ frozen_csr_w.t()).sum())(x)``."""
    name = getattr(op, "__name__", None)
    if not functorch_active() or name in _DUAL_OPS or (name in _RANDOM_OPS and _under_vmap()):
        return contextlib.nullcontext()
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    with _NoTorchFunction():
        held = any(holds_transform_tensors(v.wrapped_tensor) if isinstance(v, SparseTensorWrapper) else wrapped(v)
                   for v in tensors_in((args, kwargs)))
    return contextlib.nullcontext() if held else torch._C._DisableFuncTorch()


def specs_under_transform(op: Any) -> NotImplementedError:
    """What a call whose output specs sparsify a result or its gradient raises under a ``torch.func``
    transform that differentiates that result."""
    return NotImplementedError(
        f"STen: {op_name(op)} with sparse output specs (sparsified_op, set_interm) under a torch.func transform "
        "(vmap, grad, jacrev, jacfwd) is not supported: the transform cannot differentiate through the "
        "sparsified outputs. Use torch.autograd.grad / torch.autograd.functional.jacobian, or run the transform "
        "on the dense model.")


def unsupported_transform(op: Any, operands: list, error: Exception) -> NotImplementedError:
    """What a ``torch.func`` transform (``vmap``, ``grad``, ``jacrev``, ``jacfwd``) over a call with
    a trainable sparse operand, or forward-mode AD over a recorded call, raises: torch's own
    message names STen's private node only ("must override the setup_context staticmethod",
    "must implement the jvp function")."""
    with _NoTorchFunction():
        sparse = [v for v in operands if isinstance(v, SparseTensorWrapper)]
        trainable = [v for v in sparse if v.requires_grad]
    functorch = "setup_context" in str(error)
    transform = "a torch.func transform (vmap, grad, jacrev, jacfwd)" if functorch else "forward-mode AD"
    names = ", ".join(type(v.wrapped_tensor).__name__ for v in trainable or sparse) or "a sparse wrapper"
    what = f"a sparse operand that requires grad ({names})" if trainable else f"a sparse operand ({names})"
    freeze = "freeze the weight (requires_grad_(False)) for vmap and grad with respect to dense inputs, " \
        if trainable else ""
    return NotImplementedError(
        f"STen: {op_name(op)} with {what} under {transform} is not supported: STen records reverse-mode "
        f"autograd nodes only. Use torch.autograd.grad / torch.autograd.functional.jacobian or hessian (reverse "
        f"mode, second order included), {freeze}or run the transform on the dense model (w.to_dense()). "
        f"torch said: {str(error).splitlines()[0]}")


def _any_requires_grad_py(*args: Any) -> bool:
    with _NoTorchFunction():
        return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


# whether any argument is a tensor that requires grad, read without entering
# __torch_function__ (torch's own C helper where it exists)
any_requires_grad = getattr(torch._C, "_any_requires_grad", _any_requires_grad_py)
