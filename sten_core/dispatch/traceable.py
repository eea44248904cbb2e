"""Traceable wrappers: compiled training steps whose sparse weights require grad.

A layout registered here (``register_traceable_layout``) gets wrappers that are
traceable tensor subclasses (``__tensor_flatten__`` names the layout's member
tensors, its integer constants and the wrapper's ``grad_fmt`` are constants), so
Dynamo and AOTAutograd take a wrapper as a graph input and compute its gradient.
While Dynamo traces, ``F.linear(x, W, b)`` with such a ``W`` that requires grad
becomes one ``sten_core::wrapper_linear(x, W, b)`` node: its autograd formula
gives ``x``'s gradient and ``W``'s, the latter a wrapper of the same layout and
pattern holding the gradient of the stored values; below autograd, the
wrapper's ``__torch_dispatch__`` runs the layout's own custom operators on its
members (its compiled ``F.linear`` implementation, ``grad_input`` and
``grad_values``).

Two gradient formats compile whole: the layout's own with its pattern kept (the
values' gradient: ``SparsityBuilder.set_weight_grad(name, tmp_format=Layout,
out_format=Layout)``), and the explicit dense one (``grad_fmt=(KeepAll(),
torch.Tensor, KeepAll(), torch.Tensor)``): the autograd formula
then returns ``gy.T @ x`` as a plain tensor, which AOTAutograd (torch 2.13) hands
back as the wrapper's gradient. The default ``grad_fmt=None`` (dense, the same
gradient) does too while the weight trains (a parameter that requires grad). Formats
that re-sparsify the gradient into a sparse layout (a new pattern per step) give the
dense gradient out of the graph in a marker wrapper, which the weight's hook converts
before accumulation (``sten_core.dispatch.compiled_regrad``).

Example:
    >>> import torch, torch.nn.functional as F, sten_core as sten
    >>> from sten_core.dispatch.traceable import traceable
    >>> traceable(sten.SparseTensorWrapper(sten.DenseTensor.from_dense(torch.ones(2, 2))))
    False
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from sten_core.dispatch.compiled_regrad import pending_grad, register_marker, resparsifies
from sten_core.model.helpers import bias_grad
from sten_core.model.tensor import _HANDLERS, _PASS, TRACEABLE_LAYOUTS, TRACED_OPS, SparseTensorWrapper, services

Tensor = torch.Tensor
_GRADS: dict = {}  # layout class -> (grad_input(gy, x, layout), grad_values(gy, x, layout))


def register_traceable_layout(layout: type, flatten: Callable, unflatten: Callable,
                              grad_input: Optional[Callable] = None, grad_values: Optional[Callable] = None,
                              values_index: int = 0) -> None:
    """Make ``layout``'s wrappers traceable tensor subclasses.

    Args:
        layout: the layout class.
        flatten: ``layout_object -> (list of member tensors, list of ints)``.
        unflatten: ``(tensors, ints) -> layout_object``; must not read tensor values
            (it runs on fake tensors).
        grad_input, grad_values: ``(gy, x, layout_object) -> tensor``: for ``F.linear``
            ``y = x @ W.T``, ``gy @ W`` (shaped like ``x``) and the gradient of the stored
            values (shaped like the first member), each one custom operator. With both,
            a compiled training step of a ``layout`` weight that requires grad (its
            ``grad_fmt`` its own layout) compiles whole.
        values_index: which of ``flatten``'s tensors holds the stored values (the
            gradient's layout is ``unflatten`` with the values' gradient there).
    """
    if not isinstance(layout, type):
        raise TypeError(f"layout must be a class, got {type(layout).__name__}")
    for name, fn in (("flatten", flatten), ("unflatten", unflatten)):
        if not callable(fn):
            raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
    if (grad_input is None) != (grad_values is None):
        raise ValueError("grad_input and grad_values go together: give both or neither")
    if grad_input is not None:
        _GRADS[layout] = (grad_input, grad_values, values_index)
    TRACEABLE_LAYOUTS[layout] = (flatten, unflatten,
                                 lambda grad_fmt, requires_grad=False: takes(layout, grad_fmt, requires_grad))
    register_marker()  # the compiled gradient of re-sparsified formats (compiled_regrad)


def takes(layout: type, grad_fmt: Any, requires_grad: bool = False) -> bool:
    """Whether a new wrapper of ``layout`` is the traceable class: its ``grad_fmt`` keeps the
    layout and pattern, or is the explicit dense format ``(KeepAll(), torch.Tensor, KeepAll(), torch.Tensor)`` (its layout having
    gradient kernels). The default ``grad_fmt=None`` (dense too) and formats that re-sparsify the
    gradient into a sparse layout (``compiled_regrad.resparsifies``) only while the wrapper
    ``requires_grad`` (a trainable parameter): a frozen one keeps the eager class, so strict
    ``torch.export`` and custom backends see the layout's own operators (see docs/compile.md)."""
    if keeps_layout(grad_fmt, layout):
        return True
    if grad_fmt is None or resparsifies(grad_fmt):  # dense or re-sparsified: traceable only while it trains
        return requires_grad and layout in _GRADS
    return layout in _GRADS and is_dense_grad(grad_fmt)


def unregister_traceable_layout(layout: type) -> None:
    """Undo ``register_traceable_layout`` (wrappers made afterwards are the eager classes)."""
    TRACEABLE_LAYOUTS.pop(layout, None)
    _GRADS.pop(layout, None)


def is_dense_grad(grad_fmt: Any) -> bool:
    """Whether ``grad_fmt`` is the explicit dense gradient format ``(KeepAll(), torch.Tensor,
    KeepAll(), torch.Tensor)`` (eager gives the same dense gradient as
    for ``None``).

    >>> import torch, sten_core as sten
    >>> is_dense_grad((sten.KeepAll(), torch.Tensor, sten.KeepAll(), torch.Tensor)), is_dense_grad(None)
    (True, False)
    """
    if grad_fmt is None:
        return False
    from sten_core.model.spec import OutputSpec

    spec = OutputSpec.coerce(grad_fmt, "grad_fmt")
    return spec.out_format is torch.Tensor and spec.tmp_format is torch.Tensor and spec.keeps_all


def gives_dense_grad(grad_fmt: Any) -> bool:
    """Whether a weight's gradient in ``grad_fmt`` is the plain dense tensor: the default ``None``
    or the explicit dense format.

    >>> gives_dense_grad(None)
    True
    """
    return grad_fmt is None or is_dense_grad(grad_fmt)


def keeps_layout(grad_fmt: Any, layout: type) -> bool:
    """Whether ``grad_fmt`` asks for the values' gradient at the weight's pattern:
    ``(KeepAll(), layout, KeepAll(), layout)``.

    >>> import torch, sten_core as sten
    >>> keeps_layout((sten.KeepAll(), sten.CsrTensor, sten.KeepAll(), sten.CsrTensor), sten.CsrTensor)
    True
    >>> keeps_layout(None, sten.CsrTensor)
    False
    """
    if grad_fmt is None:
        return False
    from sten_core.model.spec import OutputSpec

    spec = OutputSpec.coerce(grad_fmt, "grad_fmt")
    return spec.out_format is layout and spec.tmp_format is layout and spec.keeps_all


def traceable(value: Any) -> bool:
    """Whether ``value`` is a wrapper that Dynamo takes as a graph input."""
    return isinstance(value, SparseTensorWrapper) and hasattr(type(value), "__tensor_flatten__")


def trains_compiled(wrapper: Any) -> bool:
    """Whether a compiled ``F.linear`` with this weight computes its gradient in the graph:
    a traceable wrapper whose layout has gradient kernels and whose ``grad_fmt`` keeps its own
    layout and pattern, ``(KeepAll(), Layout, KeepAll(), Layout)`` (the eager backward then gives
    the values' gradient at the weight's pattern too), is dense, or re-sparsifies the dense
    gradient into a sparse layout (a new pattern: converted after the compiled step by the
    weight's hook, ``compiled_regrad``)."""
    if not traceable(wrapper):
        return False
    layout_cls = type(wrapper.wrapped_tensor)
    fmt = wrapper.grad_fmt
    return layout_cls in _GRADS and (gives_dense_grad(fmt) or keeps_layout(fmt, layout_cls) or resparsifies(fmt))


# -- the operators on wrappers ---------------------------------------------------------
@torch.library.custom_op("sten_core::wrapper_linear", mutates_args=())
def wrapper_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``F.linear(x, weight, bias)`` for a traceable wrapper ``weight`` (run by its
    ``__torch_dispatch__``; never reached with a plain tensor)."""
    raise TypeError(f"sten_core::wrapper_linear: weight must be a traceable sparse wrapper, got {type(weight).__name__}")


@wrapper_linear.register_fake
def _(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    dtype = torch.promote_types(x.dtype, weight.dtype)
    if bias is not None:
        dtype = torch.promote_types(dtype, bias.dtype)
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=dtype)


@torch.library.custom_op("sten_core::wrapper_linear_grad_input", mutates_args=())
def wrapper_linear_grad_input(gy: Tensor, x: Tensor, weight: Tensor) -> Tensor:
    """``gy @ weight`` shaped like ``x`` (run by the wrapper's ``__torch_dispatch__``)."""
    raise TypeError(f"sten_core::wrapper_linear_grad_input: weight must be a traceable sparse wrapper, "
                    f"got {type(weight).__name__}")


@wrapper_linear_grad_input.register_fake
def _(gy: Tensor, x: Tensor, weight: Tensor) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("sten_core::wrapper_linear_grad_weight", mutates_args=())
def wrapper_linear_grad_weight(gy: Tensor, x: Tensor, weight: Tensor) -> Tensor:
    """The gradient of ``weight``: a wrapper of its layout and pattern holding the values' gradient."""
    raise TypeError(f"sten_core::wrapper_linear_grad_weight: weight must be a traceable sparse wrapper, "
                    f"got {type(weight).__name__}")


@wrapper_linear_grad_weight.register_fake
def _(gy: Tensor, x: Tensor, weight: Tensor) -> Tensor:
    return torch.empty_like(weight)


def dense_weight_grad(gy: Tensor, x: Tensor, weight: Tensor) -> Tensor:
    """The dense gradient ``gy.T @ x`` [out, in] of a weight whose ``grad_fmt`` is dense (the
    default), as the eager backward computes it: plain graph ops on plain tensors, so
    AOTAutograd records a plain-tensor gradient for the wrapper input (torch >= 2.6 takes a
    subclass input's gradient structure from the traced gradient, not from the input)."""
    g2, x2 = gy.reshape(-1, gy.shape[-1]), x.reshape(-1, x.shape[-1])
    return (g2.t() @ x2.to(g2.dtype)).to(weight.dtype)


def _setup(ctx: Any, inputs: tuple, output: Tensor) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _backward(ctx: Any, gy: Tensor) -> tuple:
    x, weight = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad
    gx = torch.ops.sten_core.wrapper_linear_grad_input(gy, x, weight) if need_x else None
    gw = None
    if need_w:
        fmt = weight.grad_fmt
        if gives_dense_grad(fmt):
            gw = dense_weight_grad(gy, x, weight)
        elif keeps_layout(fmt, type(weight.wrapped_tensor)):
            gw = torch.ops.sten_core.wrapper_linear_grad_weight(gy, x, weight)
        else:  # re-sparsified: the dense gradient, converted by the weight's hook before accumulation
            gw = pending_grad(dense_weight_grad(gy, x, weight), fmt)
    gb = bias_grad(gy) if ctx.has_bias and need_b else None
    return gx, gw, gb


wrapper_linear.register_autograd(_backward, setup_context=_setup)


class _Holder:
    """What a compiled implementation reads: ``.wrapped_tensor`` (no autograd)."""

    def __init__(self, layout: Any):
        self.wrapped_tensor = layout


def _linear_below_autograd(x: Tensor, weight: SparseTensorWrapper, bias: Optional[Tensor] = None) -> Tensor:
    from sten_core.model.registry import registry

    layout = weight.wrapped_tensor
    key = (F.linear, (Tensor, type(layout), Tensor) if bias is not None else (Tensor, type(layout)))
    impl = registry.compiled.get(key)
    if impl is None:
        raise TypeError(f"F.linear with a {type(layout).__name__} weight has no compiled implementation")
    return impl(x, _Holder(layout), bias)


def _grad_input_below_autograd(gy: Tensor, x: Tensor, weight: SparseTensorWrapper) -> Tensor:
    layout = weight.wrapped_tensor
    return _GRADS[type(layout)][0](gy, x, layout)


def _grad_weight_below_autograd(gy: Tensor, x: Tensor, weight: SparseTensorWrapper) -> SparseTensorWrapper:
    layout = weight.wrapped_tensor
    return SparseTensorWrapper(traced_with_values(layout, _GRADS[type(layout)][1](gy, x, layout)), False,
                               weight.grad_fmt)


def traced_with_values(layout: Any, values: Tensor) -> Any:
    """``layout.with_values(values)`` through the layout's flatten/unflatten, so it works on fake
    members while compiling (``with_values`` of a torch CSR layout builds a sparse tensor, which
    cannot be faked): e.g. the sum of a weight's two gradients at its pattern (used twice)."""
    flatten, unflatten, _ = TRACEABLE_LAYOUTS[type(layout)]
    tensors, consts = flatten(layout)
    tensors = list(tensors)
    tensors[_GRADS[type(layout)][2]] = values
    return unflatten(tensors, list(consts))


def traced_sum(a: Any, b: Any) -> Any:
    """``a + b`` of two layouts on fake members sharing every member but the values (two
    gradients of one weight at its pattern, while compiling; their data cannot be compared), or
    ``None`` when they do not."""
    flatten = TRACEABLE_LAYOUTS[type(a)][0]
    (ta, ca), (tb, cb) = flatten(a), flatten(b)
    index = _GRADS[type(a)][2]
    if list(ca) != list(cb) or len(ta) != len(tb) or any(x is not y for i, (x, y) in enumerate(zip(ta, tb)) if i != index):
        return None
    return traced_with_values(a, ta[index] + tb[index])


services.install(traced_sum=traced_sum)


for _packet, _impl in ((torch.ops.sten_core.wrapper_linear, _linear_below_autograd),
                       (torch.ops.sten_core.wrapper_linear_grad_input, _grad_input_below_autograd),
                       (torch.ops.sten_core.wrapper_linear_grad_weight, _grad_weight_below_autograd)):
    TRACED_OPS[_packet.default] = _impl  # below autograd: the layout's kernels
    _HANDLERS[_packet] = _HANDLERS[_packet.default] = _PASS  # above it: the operator's own autograd
# a strict torch.export program reads a traceable weight's members with this operator: as on any tensor
_HANDLERS[torch.ops.export.access_subclass_inner_tensor] = _PASS
_HANDLERS[torch.ops.export.access_subclass_inner_tensor.default] = _PASS


def linear_training(x: Tensor, weight: Any, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear`` while compiling a training step whose weight requires grad: one
    ``sten_core::wrapper_linear`` node (the weight a graph input, its gradient in the graph)."""
    return torch.ops.sten_core.wrapper_linear(x, weight, bias)


importlib.import_module("sten_core.dispatch.dense_view")  # its custom operators are registered with these
