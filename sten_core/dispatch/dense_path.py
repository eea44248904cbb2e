"""The dense path (``native`` and ``fallback`` plans, in-place calls under
autograd): wrappers become dense through differentiable steps, the original op
runs under ordinary autograd, outputs go through their specs differentiably.
Autograd itself then handles repeated arguments, tensors in lists, views and
multiple outputs exactly as for dense tensors.

Example:
    >>> import torch, sten_core as sten
    >>> w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(2)), requires_grad=True)
    >>> with sten.dispatch.quiet_fallbacks():
    ...     torch.cat([w, w]).sum().backward()      # a list argument: the dense path
    >>> w.grad.shape
    torch.Size([2, 2])
"""

from __future__ import annotations

import time
from typing import Any

import torch

from sten_core.dispatch.autograd import (_Densify, _Sparsify, apply_function, dense_with_grad, specs_under_transform,
                                        unsupported_transform)
from sten_core.dispatch.call import CallSpecs, grad_spec, tensors_in
from sten_core.dispatch.errors import report_missing
from sten_core.dispatch.observers import active, notify
from sten_core.dispatch.plan import Plan, PlanKind
from sten_core.dispatch.sparsifier_dispatch import apply_grad_spec, apply_spec
from sten_core.dispatch.wrapper_views import guarded_views, writable_views
from sten_core.dispatch.writes import is_storage_view, write_back_warned, write_growing, writes_exactly
from sten_core.model.layouts import unshared_dense
from sten_core.model.registry import OpKey
from sten_core.model.signatures import op_name
from sten_core.model.sparsifiers import SameFormatSparsifier
from sten_core.model.spec import DENSE
from sten_core.model.tensor import (SparseTensorWrapper, densify, densify_tree, map_tensors, rebuild_seq,
                                    refuse_sharding, write_back)


def differentiable_dense(tree: Any, grad: bool, made: list | None = None) -> Any:
    """``densify_tree``, keeping the autograd graph of wrappers that require grad; each
    ``(wrapper, dense copy, its version)`` appended to ``made`` when given. With ``grad``,
    no dense tensor is a wrapper's own memory (``unshared_dense``): autograd may save it."""

    def dense(tensor: torch.Tensor) -> torch.Tensor:
        if grad and isinstance(tensor, SparseTensorWrapper):
            d = apply_function(_Densify, tensor) if tensor.requires_grad else unshared_dense(tensor.wrapped_tensor)
        else:
            d = densify(tensor)
        if made is not None and isinstance(tensor, SparseTensorWrapper):
            # inference tensors have no version counter: a snapshot to compare with instead
            made.append((tensor, d, d.clone() if d.is_inference() else d._version))
        return d

    return map_tensors(dense, tree)


def write_back_changed(made: list) -> None:
    """Each wrapper whose dense copy an out-of-place operator changed in place gets the change at
    its stored positions: ``F.embedding(..., max_norm=...)`` renormalises the looked-up rows of
    its weight (``embedding_renorm_``), which on the copy alone was lost."""
    for wrapper, d, before in made:
        if before != d._version if isinstance(before, int) else not torch.equal(before, d):
            with torch.no_grad():
                write_back(wrapper, d.detach())


def composite(op: Any, args: tuple, kwargs: dict, key: OpKey, plan: Plan, specs: CallSpecs | None,
               grad: bool) -> Any:
    """The dense path (``fallback`` and ``native`` plans): wrappers become dense
    tensors through differentiable nodes, the original op runs under ordinary
    autograd, and outputs go through their specs differentiably. Autograd
    itself then handles repeated arguments, tensors in lists, views and
    multiple outputs exactly as for dense tensors."""
    refuse_sharding((args, kwargs), op)
    if plan.kind is PlanKind.FALLBACK:
        report_missing(plan.key)
    started = time.perf_counter() if active() else 0.0
    made: list = []
    try:
        dense_args, dense_kwargs = differentiable_dense((args, kwargs), grad, made)
    except RuntimeError as error:  # a trainable wrapper's _Densify under a torch.func transform
        if "setup_context" in str(error):
            raise unsupported_transform(op, tensors_in((args, kwargs)), error) from error
        raise
    out = op(*dense_args, **dense_kwargs)
    write_back_changed(made)
    if not grad:  # a view of a wrapper's copy (w[0], w.view(-1)) writes back into the wrapper
        out = writable_views(out, made)
    else:         # ... or, under autograd, refuses in-place writes (they would be lost)
        out = guarded_views(out, made)
    if active():
        notify("op", key, plan.kind, time.perf_counter() - started)
    if specs is None:
        return out
    grad_specs = specs.grad or ()

    def finish(value: Any, i: int) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        spec = specs.out[i] if i < len(specs.out) else DENSE
        grad_spec = grad_specs[i] if i < len(grad_specs) else DENSE
        if spec == DENSE and grad_spec == DENSE:
            return value
        if grad and value.requires_grad:
            if torch._C._are_functorch_transforms_active():
                raise specs_under_transform(op)
            return apply_function(_Sparsify, value, spec, grad_spec)
        return apply_spec(value, spec)

    if isinstance(out, (tuple, list)):
        return rebuild_seq(out, [finish(v, i) for i, v in enumerate(out)])
    return finish(out, 0)


class _InPlace(torch.autograd.Function):
    """An in-place op on a wrapper under autograd: the dense op, its result written into the
    wrapper exactly, its pattern grown to hold it (a temporary: ``writes.writes_exactly``), or at
    its stored positions (a weight; a layout that cannot hold the result, with a warning).
    Backward is the dense op's, with the write-back's adjoint where it applies:

    - the other operands' gradients are taken where their values landed (everywhere when the
      pattern grew; at the stored positions otherwise: ``h.add_(x)`` then drops ``x``
      elsewhere, so ``x``'s gradient there is 0);
    - the target's own gradient is the dense one everywhere, as for the same op out of
      place (``h.mul_(3)`` as ``h * 3``: 3 at the unstored positions, as dense torch;
      an entry stored there would have been written). A dense ``grad_fmt`` keeps it
      (RigL's growth reads it), a sparse one drops it. Masking it too gave 0 there.

    The target's value before the write comes in as ``before``, a differentiable dense
    view of it (``dense_with_grad``): its gradient reaches the target's history through
    that view, and under ``create_graph=True`` the gradients returned have a graph through
    it and the other operands (a gradient penalty through ``h.mul_(s)``;
    ``once_differentiable`` dropped those terms silently when the incoming gradient did not
    itself require grad)."""

    @staticmethod
    def forward(fctx: Any, call: tuple, target: SparseTensorWrapper, before: torch.Tensor,
                *others: torch.Tensor) -> Any:
        op, args, kwargs = call
        dense_args, dense_kwargs = densify_tree((args, kwargs))
        written = dense_args[0].clone()
        op(written, *dense_args[1:], **dense_kwargs)
        exact = writes_exactly(target, others, recorded=True)
        target.__dict__["_sten_recorded_writes"] = target.__dict__.get("_sten_recorded_writes", 0) + 1
        if exact and write_growing(target, written, op, lossy=False) is not None:
            landed = torch.ones_like(written, dtype=torch.bool)   # every value: a temporary's pattern grew
        else:
            if exact:   # a temporary whose layout cannot hold the result (n:m)
                write_back_warned(target, written, op)
            else:
                write_back(target, written)
            landed = SameFormatSparsifier(target).mask(written)
        fctx.mark_dirty(target)
        fctx.call, fctx.target, fctx.others = call, target, others
        fctx.save_for_backward(before, landed)
        return target

    @staticmethod
    def backward(fctx: Any, grad: Any) -> Any:
        op, args, kwargs = fctx.call
        before, stored = fctx.saved_tensors
        create_graph = torch.is_grad_enabled()
        target, needs = fctx.target, fctx.needs_input_grad
        leaves = {id(target): before if create_graph else before.detach().requires_grad_(needs[2])}
        for o, need in zip(fctx.others, needs[3:]):
            if create_graph:
                wrapper = isinstance(o, SparseTensorWrapper)
                leaves[id(o)] = dense_with_grad(o) if wrapper and o.requires_grad else densify(o)
            else:
                dense = densify(o).detach()
                leaves[id(o)] = dense.requires_grad_(need and (dense.is_floating_point() or dense.is_complex()))

        def swap(tensor: torch.Tensor) -> torch.Tensor:
            return leaves[id(tensor)] if id(tensor) in leaves else densify(tensor)

        inputs = [leaves[id(target)], *[leaves[id(o)] for o in fctx.others]]
        wanted = [t for t, need in zip(inputs, needs[2:]) if need and t.requires_grad]
        grads: dict[int, Any] = {}
        if wanted:
            with torch.enable_grad():
                dense_args, dense_kwargs = map_tensors(swap, (args, kwargs))
                result = dense_args[0].clone()
                op(result, *dense_args[1:], **dense_kwargs)
            dense_grad = densify(grad)
            # the target's gradient in full, the others' at the stored positions
            for group, cotangent in ((wanted[:1] if wanted[0] is inputs[0] else [], dense_grad),
                                     ([t for t in wanted if t is not inputs[0]], dense_grad * stored)):
                if group:
                    found = torch.autograd.grad(result, group, cotangent, allow_unused=True, retain_graph=True,
                                                create_graph=create_graph)
                    grads.update({id(t): g for t, g in zip(group, found)})
        # the target's gradient goes to ``before`` (its dense view formats it in the target's
        # grad_fmt on the way back), the others' in their own grad_fmt
        others = [None if grads.get(id(t)) is None else apply_grad_spec(grads[id(t)], grad_spec(o), o)
                  for t, o in zip(inputs[1:], fctx.others)]
        return (None, None, grads.get(id(inputs[0])), *others)


NO_VALUE_WRITES = frozenset({torch.Tensor.share_memory_})
"""In-place by name, but they change where a tensor's values live, not the values:
autograd records nothing (``w.share_memory_()`` on a sparse parameter that requires grad)."""


def inplace_with_grad(op: Any, args: tuple, kwargs: dict, bound: list, key: OpKey, plan: Plan) -> Any:
    """An in-place call that autograd must record. A wrapper target: ``_InPlace``
    (on a leaf that requires grad it raises, as torch does). A dense target: the
    op runs on it under ordinary autograd, wrappers among the other arguments made
    dense differentiably (their gradients come back in their ``grad_fmt``)."""
    if op in NO_VALUE_WRITES:  # nothing for autograd to record (as torch, on a leaf that requires grad too)
        with torch.no_grad():
            return op(*args, **kwargs)
    if kwargs.get("out") is not None:  # as torch
        raise RuntimeError(f"{op_name(op)}(): functions with out=... arguments don't support automatic "
                           "differentiation, but one of the arguments requires grad.")
    if plan.kind is PlanKind.FALLBACK:
        report_missing(plan.key)
    started = time.perf_counter() if active() else 0.0
    target = bound[0]
    if isinstance(target, SparseTensorWrapper):
        if target.requires_grad and target.is_leaf:
            raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
        if target.requires_grad and is_storage_view(target):
            raise RuntimeError(
                f"STen: {op_name(op)} writes in place into a view of a {type(target.wrapped_tensor).__name__} "
                "wrapper that requires grad (h.t() sharing h's arrays): autograd would not see the write reach h. "
                "Write into h itself, compute out of place, or write under torch.no_grad()")
        others, seen = [], {id(target)}
        for v in tensors_in((args, kwargs)):
            if id(v) not in seen:
                seen.add(id(v))
                others.append(v)
        before = (dense_with_grad(target) if target.requires_grad else densify(target)).clone()  # (may alias)
        try:
            result = apply_function(_InPlace, (op, args, kwargs), target, before, *others)
        except RuntimeError as error:
            # w.clone().add_(x) under torch.func.grad of x: torch's message names only STen's node
            if "setup_context" in str(error):
                raise unsupported_transform(op, [target, *others], error) from error
            raise
    else:
        if isinstance(target, (list, tuple)) and any(isinstance(t, SparseTensorWrapper) for t in target):
            raise RuntimeError(f"{op_name(op)}(): an in-place write into sparse wrappers inside a list is not "
                               "recorded by autograd (it would be lost); call it under torch.no_grad(), as "
                               "optimizers and clip_grad_norm_ do")
        dense_args, dense_kwargs = differentiable_dense((args, kwargs), True)
        result = op(*dense_args, **dense_kwargs)
    if active():
        notify("op", key, plan.kind, time.perf_counter() - started)
    return result
