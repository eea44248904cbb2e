"""In-place calls on wrappers without an in-place implementation: what the call wrote
into (its first argument, ``out=``, the tensors of ``_foreach_mul_``'s or
``_fused_adam_``'s lists) is found by comparing the dense copies the op ran on with
snapshots, and written back into those wrappers: a weight at its stored positions
(``write_back``), a temporary exactly, its pattern grown to hold the result
(``writes_exactly``, ``write_growing``). Writing back only the first argument lost writes
through ``out=`` and into tensor lists (foreach and fused optimizers left sparse weights
unchanged).

Example:
    >>> import torch, sten_core as sten
    >>> w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.eye(2)))
    >>> t = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(2)))
    >>> with torch.no_grad(), sten.dispatch.quiet_fallbacks():
    ...     _ = torch.mul(torch.full((2, 2), 3.0), 2.0, out=w)
    ...     _ = torch.mul(torch.full((2, 2), 3.0), 2.0, out=t)
    >>> w.to_dense().tolist(), t.to_dense().tolist()
    ([[6.0, 0.0], [0.0, 6.0]], [[6.0, 6.0], [6.0, 6.0]])
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from sten_core.dispatch.errors import DispatchWarning, fail
from sten_core.dispatch.optimizer_steps import in_optimizer_step
from sten_core.model.layouts import builds_from_dense, pattern_of_mask, supports_values, to_dense_tensor, values_layout
from sten_core.model.masks import stored_mask
from sten_core.model.signatures import op_name
from sten_core.model.tensor import (SparseTensorWrapper, densify, is_weight, map_tensors, rebuild_seq, refuse_sharding,
                                    write_back)
from sten_core.user_frames import user_stacklevel

ASSIGNMENTS = frozenset({
    torch.Tensor.__setitem__, torch.Tensor.index_put_, torch.Tensor.index_fill_, torch.Tensor.index_copy_,
    torch.Tensor.masked_fill_, torch.Tensor.masked_scatter_, torch.Tensor.scatter_, torch.Tensor.put_,
    torch.Tensor.fill_diagonal_})
"""In-place writes that set values at positions they choose (``mask[rows] = 1``): values they put
where a wrapper stores nothing are dropped, and a ``DispatchWarning`` says so. Updates of the
stored values (``add_``, ``mul_``, an optimizer's step) and ``copy_`` (documented as a write at
the stored positions) keep the pattern without a word."""


_FROM_TORCH = ("; torch wrote it (a collective, DistributedDataParallel's copy of its averaged gradient into an "
               "n:m .grad): ranks whose patterns differ (a grad_fmt with a sparsifier picks each rank's own) drift "
               "apart; use sten.sparse_ddp, which reduces before it sparsifies")


def warn_if_dropped(func: Any, wrapper: SparseTensorWrapper, dense: torch.Tensor) -> None:
    """A ``DispatchWarning`` where ``write_back(wrapper, dense)`` dropped values ``func`` wrote
    at positions ``wrapper`` does not store (its pattern is kept)."""
    kept = densify(wrapper)
    dropped = int(((kept != dense) & ~(kept.isnan() & dense.isnan())).sum())
    if dropped:
        warnings.warn(
            f"{op_name(func)} on a {type(wrapper.wrapped_tensor).__name__} wrapper (or a view of it) wrote "
            f"{dropped} value(s) at positions it does not store: they were dropped (the layout keeps its "
            "pattern). Write into a dense tensor (w.to_dense()) and sparsify it to change the pattern"
            + (_FROM_TORCH if isinstance(func, torch._ops.OpOverload) else ""),
            DispatchWarning, stacklevel=user_stacklevel())


def _wait_for(raw: Any) -> None:
    """Wait for the collectives in a call's result (c10d's ``allreduce_`` returns its tensors and a
    ``Work``): their values are written back into the wrappers once they are there."""
    for item in raw if isinstance(raw, (tuple, list)) else (raw,):
        if isinstance(item, _WORK):
            item.wait()


_WORK = getattr(getattr(torch._C, "_distributed_c10d", None), "Work", ())  # () where torch has no c10d


def run_dense_in_place(op: Any, args: tuple, kwargs: dict) -> Any:
    """``op`` on dense copies of the call's wrappers (one copy per wrapper, so aliasing is
    as in dense: ``torch.add(a, b, out=a)``); each wrapper whose copy the op changed gets
    the result at its stored positions. Changes are found by comparing each copy with a
    snapshot: version counters miss the fused optimizer kernels (``torch._fused_adam_``
    writes its lists without bumping them). Returns ``op``'s result with each copy
    replaced by its wrapper (``add_`` and ``out=`` return their target, as in torch). The copies
    are contiguous: torch's CPU fused optimizer kernels read their lists as contiguous whatever
    the strides (scipy CSC's column-major ``to_dense()`` was updated at transposed positions)."""
    refuse_sharding((args, kwargs), op)
    refuse_shape_change(op, args)
    copies: dict[int, tuple] = {}

    def dense(tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, SparseTensorWrapper):
            return tensor
        hit = copies.get(id(tensor))
        if hit is None:
            d = densify(tensor).contiguous()
            hit = copies[id(tensor)] = (tensor, d, d.clone())
        return hit[1]

    dense_args, dense_kwargs = map_tensors(dense, (args, kwargs))
    raw = op(*dense_args, **dense_kwargs)
    _wait_for(raw)
    back = {}
    for wrapper, d, before in copies.values():
        if d.shape != before.shape:
            raise RuntimeError(_reshaped(op, wrapper))
        if not torch.equal(d, before):
            if writes_exactly(wrapper, partners(op, args, kwargs, wrapper)):
                write_growing(wrapper, d, op)  # _foreach_add_(bufs, grads): SGD's momentum, foreach
                back[id(d)] = wrapper
                continue
            write_back(wrapper, d)
            if op in ASSIGNMENTS or isinstance(op, torch._ops.OpOverload) or view_of_temporary(wrapper) \
                    or (is_weight(wrapper) and another_params_pattern(wrapper, partners(op, args, kwargs, wrapper))):
                warn_if_dropped(op, wrapper, d)   # (an aten call: from torch itself)
        back[id(d)] = wrapper
    return map_tensors(lambda t: back.get(id(t), t), raw)


SHAPE_CHANGING = frozenset({"t_", "transpose_", "swapdims_", "swapaxes_", "squeeze_", "unsqueeze_", "as_strided_",
                            "resize_", "resize_as_", "set_"})
"""In-place ops that change a tensor's shape or strides, not its values (torch tags the aten ones
``inplace_view``)."""


def refuse_shape_change(op: Any, args: tuple) -> None:
    """The ``RuntimeError`` of an in-place op that would change a wrapper's shape (``w.t_()``,
    ``w.unsqueeze_(0)``): a wrapper's layout has a fixed shape. A ``DenseTensor`` wrapper's
    layout was transposed while the wrapper kept its shape, and later calls saw two shapes."""
    if args and isinstance(args[0], SparseTensorWrapper) and _changes_shape(op) and not _same_size(op, args):
        raise RuntimeError(_reshaped(op, args[0]))


def _same_size(op: Any, args: tuple) -> bool:
    """Whether a ``resize_`` / ``resize_as_`` call asks for the wrapper's own shape (a no-op, as in
    torch: the OpInfo samples resize to the same shape too)."""
    name = getattr(op, "__name__", "") if not isinstance(op, torch._ops.OpOverload) else op._schema.name.split("::")[-1]
    rest = args[1:]
    if name == "resize_as_" and rest and isinstance(rest[0], torch.Tensor):
        return tuple(rest[0].shape) == tuple(args[0].shape)
    if name == "resize_" and rest:
        sizes = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)) else rest
        return all(isinstance(n, int) for n in sizes) and tuple(sizes) == tuple(args[0].shape)
    return False


def _changes_shape(op: Any) -> bool:
    if isinstance(op, torch._ops.OpOverload):
        return torch.Tag.inplace_view in op.tags
    return getattr(op, "__name__", None) in SHAPE_CHANGING


def _reshaped(op: Any, wrapper: SparseTensorWrapper) -> str:
    name = op_name(op)
    out_of_place = name.rsplit(".", 1)[-1].rstrip("_")
    return (f"{name} would change the shape of a {type(wrapper.wrapped_tensor).__name__} wrapper in place "
            f"(shape {tuple(wrapper.shape)}); a wrapper's layout keeps its shape. Use the out-of-place "
            f"w.{out_of_place}(...) (w = w.{out_of_place}(...)), or a dense tensor (w.to_dense())")


def into_target(raw: Any, kwargs: dict, bound: list) -> Any:
    """An implementation's result written into what the call names as its target
    (``out=``, or the first argument with ``inplace=True``) when the implementation
    computed it out of place; other calls' results as they are."""
    if not kwargs:
        return raw
    target = kwargs.get("out")
    if target is None and kwargs.get("inplace") is True:
        target = bound[0]
    if target is None or raw is target:
        return raw
    if isinstance(target, (tuple, list)):
        return rebuild_seq(target, [t if v is t else store_result(t, v) for t, v in zip(target, raw)])
    return store_result(target, raw)


def store_result(target: torch.Tensor, value: Any) -> torch.Tensor:
    """An out-of-place implementation's ``value`` written into the call's ``target`` (a
    wrapper: at its stored positions; a dense tensor: resized and copied, as ``out=``)."""
    dense = densify(value)
    if isinstance(target, SparseTensorWrapper):
        if writes_exactly(target):
            return write_growing(target, dense, torch.Tensor.copy_)
        return write_back(target, dense)
    if target.shape != dense.shape:
        target.resize_(dense.shape)
    return target.copy_(dense)


def accumulate(target: SparseTensorWrapper, new: torch.Tensor) -> SparseTensorWrapper:
    """Autograd's ``grad += new`` into a wrapper whose pattern ``new`` does not share (two
    backward calls whose ``grad_fmt`` re-sparsifies the gradient): the exact sum, in
    ``target``'s layout rebuilt from it where that layout stores every nonzero of the sum
    (CSR, COO: the union of the patterns); otherwise (an n:m gradient cannot hold the
    union) at ``target``'s stored positions, warned as a lossy step. Keeping the pattern
    silently dropped ``new``'s values outside it."""
    dense = densify(target) + densify(new)
    layout_cls = type(target.wrapped_tensor)
    if builds_from_dense(layout_cls):
        try:
            rebuilt = layout_cls.from_dense(dense)
        except (ValueError, TypeError, RuntimeError):
            rebuilt = None
        if rebuilt is not None and torch.count_nonzero(to_dense_tensor(rebuilt)) == torch.count_nonzero(dense):
            target.wrapped_tensor = rebuilt
            return target
    fail(f"Lossy gradient accumulation: the {layout_cls.__name__} gradient already in .grad and the new one have "
         f"different patterns, and {layout_cls.__name__} cannot store their sum's pattern, so the sum was kept at "
         f".grad's stored positions. Call zero_grad() between backward calls, or use a grad_fmt that keeps the "
         f"weight's pattern (or a layout such as CsrTensor that can hold any pattern)",
         ("lossy accumulation", layout_cls))
    return write_back(target, dense)


def sum_growing(a: SparseTensorWrapper, b: SparseTensorWrapper) -> SparseTensorWrapper | None:
    """``a + b`` of two wrappers of one layout class and different patterns (autograd summing
    a weight's gradients from two uses, each re-sparsified by its ``grad_fmt``) in that layout,
    holding the union of their stored positions and the sum's nonzeros; ``None`` where the layout
    cannot hold it (n:m), and the sum is then dense, exactly. It was always dense: ``w.grad``
    of a weight used twice lost the layout its ``grad_fmt`` asked for."""
    from sten_core.model.tensor import _copy_layout

    if type(a.wrapped_tensor) is not type(b.wrapped_tensor) or not supports_values(a.wrapped_tensor):
        return None
    summed = SparseTensorWrapper(_copy_layout(a.wrapped_tensor), False, a.grad_fmt)
    return write_growing(summed, densify(a) + densify(b), torch.add, lossy=False)


def write_growing(target: SparseTensorWrapper, dense: torch.Tensor, func: Any,
                  lossy: bool = True) -> SparseTensorWrapper | None:
    """An in-place result ``dense`` stored into ``target``, a wrapper that is not a parameter
    (optimizer state, a gradient, a temporary), computed with a sparse operand of another
    pattern: the pattern grows to hold the result (the positions ``target`` stores, zeros
    included, and the result's nonzeros) where ``target``'s layout can store that pattern;
    otherwise the result is kept at the stored positions and a ``DispatchWarning`` counts what
    was dropped. Keeping the pattern silently dropped the other operand's values outside it:
    SGD's momentum buffer, a clone of the first gradient, kept that gradient's pattern, so with
    a ``grad_fmt`` that picks a pattern per step the later gradients were lost at the weight's
    other positions. A parameter keeps its pattern (an optimizer step on the weight). With
    ``lossy=False`` nothing is dropped: ``None`` where the layout cannot hold the result."""
    stored = stored_mask(target).to(dense.device)
    wanted = stored | (dense != 0)
    if torch.equal(wanted, stored):  # nothing lands off the pattern
        return write_back(target, dense)
    grown = layout_at(type(target.wrapped_tensor), dense, wanted)
    if grown is not None:
        target.wrapped_tensor = grown
        return target
    if not lossy:
        return None
    return write_back_warned(target, dense, func)


def layout_at(layout_cls: type, dense: torch.Tensor, mask: torch.Tensor) -> Any:
    """``pattern_of_mask`` where the layout stores every position of ``mask`` (zeros included;
    it may store more, with ``dense``'s values there: an ELL or block layout pads, an n:m layout
    fills each group to ``n``), else ``None`` (a mask an n:m layout cannot hold, no stored-values
    protocol, a ``from_dense`` that refuses the mask). Requiring exactly ``mask`` refused padding
    layouts, whose optimizer state then dropped values it could have held."""
    if not builds_from_dense(layout_cls):
        return None
    try:
        layout = pattern_of_mask(layout_cls, dense, mask)
    except (ValueError, TypeError, RuntimeError):
        return None
    if layout is None or bool((mask & ~stored_mask_of(layout)).any()):
        return None
    return layout


def stored_mask_of(layout: Any) -> torch.Tensor:
    """``stored_mask`` of a bare layout."""
    return stored_mask(SparseTensorWrapper(layout))


def is_storage_view(target: SparseTensorWrapper) -> bool:
    """A wrapper over a layout sharing another wrapper's storage (``model.tensor.storage_view``:
    scipy's transpose): a write keeps its pattern, as growing would not reach the other wrapper
    (a temporary's view warns where it drops values)."""
    return target.__dict__.get("_storage_view", False)


def write_back_warned(target: SparseTensorWrapper, dense: torch.Tensor, func: Any) -> SparseTensorWrapper:
    """``write_back`` (``dense`` at ``target``'s stored positions), with ``warn_if_dropped``'s
    ``DispatchWarning`` where ``func`` put values elsewhere."""
    write_back(target, dense)
    warn_if_dropped(func, target, dense)
    return target


def view_of_temporary(target: SparseTensorWrapper) -> bool:
    """A storage view of a wrapper that is not a weight: its writes keep the pattern, warned."""
    return is_storage_view(target) and not is_weight(target)


def writes_exactly(target: SparseTensorWrapper, operands: Any = (), recorded: bool = False) -> bool:
    """Whether an in-place write into ``target`` gives dense torch's result at every position
    (its pattern grows to hold it, ``write_growing``) rather than at its stored positions: a
    wrapper that is neither a weight (``is_weight``) nor a storage view, unless the write is an
    optimizer step's update of its state (``in_optimizer_step``: read at the parameter's stored
    positions only), where only an operand of another pattern makes it grow. A write autograd
    records (``recorded``; LBFGS's closure runs one inside the step) or into a result of a graph
    is no state update. Writing at the stored positions only, a sparse intermediate's residual
    ``out += identity`` silently dropped ``identity`` off the pattern, and ``h.exp_()`` left
    zeros where dense torch has ones."""
    if is_weight(target) or is_storage_view(target):
        return False
    if recorded or target.requires_grad:
        return True
    return not in_optimizer_step() or other_pattern(target, operands)


def other_pattern(target: SparseTensorWrapper, operands: Any) -> bool:
    """Whether a wrapper among ``operands`` stores another pattern than ``target`` (a layout
    with the stored-values protocol; others are rebuilt by their ``SameFormatSparsifier``)."""
    layout = target.wrapped_tensor
    if not supports_values(layout):
        return False
    for value in operands:
        if isinstance(value, SparseTensorWrapper) and value.wrapped_tensor is not layout:
            other = values_layout(value.wrapped_tensor)   # (a FilledTensor's: RMSprop's sqrt().add_(eps) divisor)
            if type(other) is not type(layout) or not layout.same_pattern(other):
                return True
    return False


def another_params_pattern(target: SparseTensorWrapper, operands: Any) -> bool:
    """Whether an in-place write into the parameter ``target`` combines it with another
    *parameter* of another pattern (an EMA copy's ``ema_w.lerp_(w, 0.1)`` after ``w``'s pattern
    changed): the write keeps ``target``'s pattern, so the values it drops are worth a warning.
    An optimizer step combines a parameter with its gradient and state, never with another
    parameter, and drops quietly by design."""
    return any(isinstance(value, SparseTensorWrapper) and is_weight(value) for value in operands) \
        and other_pattern(target, operands)


def partners(op: Any, args: tuple, kwargs: dict, target: SparseTensorWrapper) -> list:
    """The tensors a call combines with ``target``: for a ``torch._foreach_*`` or ``torch._fused_*``
    op, those at ``target``'s index in the other lists (``_foreach_add_(bufs, grads)`` pairs
    ``bufs[i]`` with ``grads[i]``; ``_fused_adam_(params, grads, exp_avgs, ...)`` pairs
    ``exp_avgs[i]`` with ``params[i]``: read as the other weights, two sparse weights' state grew
    to every position); otherwise every other tensor of the call."""
    if getattr(op, "__name__", "").startswith(("_foreach_", "_fused_")):
        lists = [a for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple))]
        for mine in lists:
            index = next((i for i, t in enumerate(mine) if t is target), None)
            if index is not None:
                return [a[index] for a in lists if a is not mine and index < len(a)]
        if lists:
            return []
    found: list = []
    map_tensors(lambda t: found.append(t) if t is not target else None, (args, kwargs))
    return found
