"""Compiled training with re-sparsified weight gradients (a new pattern each step).

A trainable weight whose ``grad_fmt`` re-sparsifies its dense gradient into a sparse
layout, e.g. ``(KeepAll(), torch.Tensor, ScalarFractionSparsifier(0.5), CsrTensor)`` or
``(KeepAll(), torch.Tensor, KeepAll(), NMTensor)``, gets eagerly a wrapper of a new pattern
per step: its number of stored values depends on the values, which no compiled graph can
give as the gradient of a graph input. So the compiled backward computes the dense gradient
``gy.T @ x`` (as eager does) and hands it out of the graph wrapped in a
``CompiledDenseGrad`` layout (a marker only a compiled step makes), and a tensor hook on the
weight (``register_hook``: it runs on the incoming gradient *before* autograd accumulates
it into ``.grad``) re-sparsifies it with the weight's ``grad_fmt`` through the eager
dispatcher (``apply_grad_spec``, the call eager's backward makes). Autograd then accumulates a
wrapper of the same layout and pattern as eager's, the same way (first step: stored;
later steps without zeroing: ``grad += new``, as eager). Gradients that reach the hook in
any other form (eager's, already in the weight's format, or eager's plain sum when a
weight is used twice in one step) pass unchanged, so eager behaves as before.

Example:
    >>> import torch, sten_core as sten
    >>> fmt = (sten.KeepAll(), torch.Tensor, sten.ScalarFractionSparsifier(0.5), sten.CsrTensor)
    >>> resparsifies(fmt), resparsifies(None)
    (True, False)
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from sten_core.dispatch.eager_only import never_compiled
from sten_core.dispatch.errors import UnsupportedTrainingOp
from sten_core.dispatch.sparsifier_dispatch import apply_grad_spec, apply_spec
from sten_core.model.spec import OutputSpec
from sten_core.model.tensor import TRACEABLE_LAYOUTS, WRAPPER_TYPES, SparseTensorWrapper, services


class CompiledDenseGrad:
    """The dense gradient a compiled step hands out for a weight whose ``grad_fmt``
    re-sparsifies it: a marker layout (``to_dense()`` is the gradient) that the weight's
    hook turns into the weight's gradient format before accumulation. Users never see it.

    Example:
        >>> CompiledDenseGrad(torch.ones(2, 3)).shape
        torch.Size([2, 3])
    """

    def __init__(self, dense: torch.Tensor):
        self.dense = dense

    @property
    def shape(self) -> torch.Size:
        return self.dense.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.dense.dtype

    @property
    def device(self) -> torch.device:
        return self.dense.device

    def to_dense(self) -> torch.Tensor:
        """Refused: a compiled backward densifies the marker only to add it to another gradient of
        the same weight (a weight used twice in one step), which eager re-sparsifies once per use
        and then adds; the hook sees only the sum, so the compiled gradient would differ."""
        raise UnsupportedTrainingOp(
            "torch.compile: a trainable weight whose grad_fmt re-sparsifies its gradient is used more than once "
            "in one compiled step (or by an operator other than F.linear): eager re-sparsifies each use's gradient "
            "and adds them, which the compiled step cannot reproduce; use the weight once per step, give it a "
            "dense or pattern-keeping grad_fmt, or run this step eagerly. See docs/compile.md")

    def __repr__(self) -> str:
        return f"CompiledDenseGrad(shape={tuple(self.shape)}, dtype={self.dtype})"


def resparsifies(grad_fmt: Any, layout: Any = None) -> bool:
    """Whether ``grad_fmt`` gives a weight a sparse gradient of a new pattern: its ``out_format``
    is a sparse layout, and (given the weight's ``layout`` class) it is not the pattern-keeping
    ``(KeepAll(), layout, KeepAll(), layout)`` (``traceable.keeps_layout``). Formats whose
    ``out_format`` is ``torch.Tensor`` but sparsify on the way (a masked dense gradient) are not
    covered: eager's gradient is then a plain tensor, which the hook could not tell from a
    compiled one (such weights keep the eager class)."""
    if grad_fmt is None:
        return False
    spec = OutputSpec.coerce(grad_fmt, "grad_fmt")
    keeps = spec.out_format is layout and spec.tmp_format is layout and spec.keeps_all
    return spec.out_format is not torch.Tensor and not keeps


def pending_grad(dense: torch.Tensor, grad_fmt: Any) -> SparseTensorWrapper:
    """The compiled backward's gradient of a weight whose ``grad_fmt`` re-sparsifies: ``dense``
    in a ``CompiledDenseGrad`` wrapper carrying the format (a traceable wrapper, so
    AOTAutograd hands it out of the graph as such)."""
    return SparseTensorWrapper(CompiledDenseGrad(dense), False, grad_fmt)


def resparsify_pending(grad: Any, weight: Any = None) -> Any:
    """The weight's tensor hook: a ``CompiledDenseGrad`` gradient becomes the weight's gradient
    format (``apply_grad_spec``, as eager's backward: a ``grad_fmt`` naming a layout without
    sparsifying holds it at ``weight``'s stored positions); any other gradient passes unchanged
    (``None``)."""
    if type(grad) in WRAPPER_TYPES and type(grad.wrapped_tensor) is CompiledDenseGrad:
        spec = OutputSpec.coerce(grad.grad_fmt, "grad_fmt")
        dense = grad.wrapped_tensor.dense
        return apply_spec(dense, spec) if weight is None else apply_grad_spec(dense, spec, weight)
    return None


def watch_gradient(wrapper: SparseTensorWrapper) -> None:
    """Give a traceable ``wrapper`` that requires grad and whose ``grad_fmt`` re-sparsifies the
    hook ``resparsify_pending`` (once per wrapper object)."""
    if wrapper.__dict__.get("_sten_regrad_hook") or not wrapper.requires_grad:
        return
    if not resparsifies(wrapper.grad_fmt, type(wrapper.wrapped_tensor)):
        return
    with torch._C.DisableTorchFunctionSubclass():
        if not wrapper.is_leaf:  # a non-leaf's gradient is never accumulated: nothing to convert
            return
        torch.Tensor.register_hook(wrapper, functools.partial(_regrad_hook, wrapper._cell))
    wrapper.__dict__["_sten_regrad_hook"] = True


def _regrad_hook(cell: list, grad: Any) -> Any:
    """``resparsify_pending`` for the weight whose layout cell (``_cell``, shared with its
    aliases) is ``cell``. The hook holds the cell, not the weight: it lives on the weight (a
    strong reference would be a cycle through autograd), and a weak one made
    ``torch.utils.swap_tensors`` refuse the weight (``register_parametrization`` swaps traceable
    wrappers). Dynamo never compiles it (``never_compiled``): a compiled backward calls it, and
    compiling it as a frame of its own failed on the wrapper's ``__dict__``."""
    weight = SparseTensorWrapper(cell[0])
    weight._cell = cell
    return resparsify_pending(grad, weight)


never_compiled(_regrad_hook)


def _flatten(layout: CompiledDenseGrad) -> tuple[list, list]:
    return [layout.dense], []


def _unflatten(tensors: list, consts: list) -> CompiledDenseGrad:
    return CompiledDenseGrad(tensors[0])


def register_marker() -> None:
    """Make ``CompiledDenseGrad`` wrappers traceable (AOTAutograd hands them out of a compiled
    backward); called by ``register_traceable_layout``, so ``TRACEABLE_LAYOUTS`` stays empty, and
    the wrapper loads the plugins on first use, until a real layout is registered."""
    TRACEABLE_LAYOUTS.setdefault(CompiledDenseGrad, (_flatten, _unflatten, lambda grad_fmt, requires_grad=False: True))


services.install(watch_gradient=watch_gradient)
