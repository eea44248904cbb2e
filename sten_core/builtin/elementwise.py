"""Element-wise operations on stored values, for any layout with the
stored-values protocol.

In-place updates (``add_``, ``mul_``, ``lerp_``, ``addcdiv_``, ... as optimizers
use them) of a weight act on the stored values only, in O(nnz): the pattern is
kept. A dense operand is read at the stored positions (``gather``), as it is in an
optimizer's update of its state; a sparse operand must have the same pattern. A
temporary's update is exact (``writes.writes_exactly``): a dense operand sends it to
the dense path, whose result its pattern grows to hold, and a scalar update that turns
zeros into something else (of any wrapper that is not a weight) makes a
``FilledTensor`` (``filled.py``). Zero-preserving out-of-place
operations (``sqrt``, ``mul``, ``clone``, ``zeros_like``, ...) called on a wrapper
without an explicit output format return the same layout. Anything else goes to
the dense path.

Example:
    >>> import torch, sten_core as sten
    >>> w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.eye(2)))
    >>> with torch.no_grad():
    ...     _ = w.add_(torch.ones(2, 2))
    >>> w.to_dense().tolist()
    [[2.0, 0.0], [0.0, 2.0]]
"""

from __future__ import annotations

import cmath
import numbers
from typing import Any, Callable

import torch

from sten_core.builtin.filled import FilledTensor, image_of, with_fill
from sten_core.dispatch.conversions import convert_exactly
from sten_core.dispatch.optimizer_steps import in_optimizer_step
from sten_core.dispatch.writes import (another_params_pattern, is_storage_view, is_weight, view_of_temporary,
                                       warn_if_dropped, write_back_warned, write_growing, writes_exactly)
from sten_core.model.layouts import Layout, supports_values
from sten_core.model.registry import Entry, OpKey
from sten_core.model.tensor import SparseTensorWrapper, densify, densify_tree, write_back

T = torch.Tensor
INPLACE = {
    T.add_, T.sub_, T.mul_, T.div_, T.lerp_, T.addcmul_, T.addcdiv_, T.copy_, T.zero_, T.fill_,
    T.clamp_, T.clamp_min_, T.clamp_max_, T.sqrt_, T.neg_, T.abs_, T.pow_, T.sign_,
    T.__iadd__, T.__isub__, T.__imul__, T.__itruediv__, T.masked_fill_,
}
ZERO_PRESERVING = {
    T.sqrt, torch.sqrt, T.neg, torch.neg, T.__neg__, T.abs, torch.abs, T.__abs__, T.sign, torch.sign,
    T.square, torch.square, T.clone, torch.clone, T.conj, torch.conj, T.mul, torch.mul, T.__mul__,
    T.__rmul__, T.div, torch.div, T.__truediv__, torch.zeros_like, T.type_as, T.contiguous,
}
MULS = {T.mul, torch.mul, T.__mul__, T.__rmul__}
DIVS = {T.div, torch.div, T.__truediv__}
SAME_PATTERN_ONLY = {T.add, torch.add, T.__add__, T.__radd__, T.sub, torch.sub, T.__sub__, T.maximum, torch.maximum}


class _NotOnValues(Exception):
    """The operands do not allow a stored-values computation."""


def _fills_zeros(op: Any, operands: tuple) -> bool:
    """Whether an out-of-place ``mul`` / ``div`` turns the unstored zeros into something else:
    ``0 * inf``, ``0 * nan``, ``0 / 0`` and ``0 / nan`` are NaN (dense torch's values there); a
    sparse divisor has zeros wherever it stores nothing (``a / a`` is NaN there)."""
    div = op in DIVS
    for value in operands:
        if isinstance(value, numbers.Number):  # (numpy scalars too: np.float32(inf) gave 0 off the pattern)
            value = complex(value)
            if (value == 0 or cmath.isnan(value)) if div else not cmath.isfinite(value):
                return True
        elif isinstance(value, SparseTensorWrapper):
            if div and value.wrapped_tensor.nnz != value.numel():   # 0 / 0 at the divisor's unstored zeros
                return True
        elif isinstance(value, torch.Tensor):
            bad = (value == 0) | value.isnan() if div else ~torch.isfinite(value)
            if bool(bad.any()):
                return True
    return False


def _operand(value: Any, layout: Any, dense_ok: bool, updates: bool = False) -> Any:
    """``value`` at ``layout``'s stored positions. In an update of stored values (in place or
    ``out=`` a wrapper: those positions only are computed) a ``FilledTensor`` is read there as
    a dense operand is: its inner values where it has ``layout``'s pattern (Adam's
    ``param.addcdiv_(exp_avg, denom)``, RMSprop's ``buf.addcdiv_(grad, avg)``: O(nnz)), else its
    dense tensor gathered (unless ``dense_ok`` is false: then it, as a dense operand, is refused)."""
    if isinstance(value, SparseTensorWrapper):
        other = value.wrapped_tensor
        if isinstance(other, FilledTensor):
            if not updates:
                raise _NotOnValues
            if not (supports_values(other.inner) and layout.same_pattern(other.inner)):
                if not dense_ok:
                    raise _NotOnValues
                return layout.gather(other.to_dense().to(layout.device))
            other = other.inner
        if other is layout or (supports_values(other) and layout.same_pattern(other)):
            return other.values()
        raise _NotOnValues
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        if not dense_ok:
            raise _NotOnValues
        if value.layout is not torch.strided:  # a torch sparse operand (Embedding(sparse=True)'s gradient)
            value = value.to_dense()
        if value.shape != layout.shape:  # broadcasting: only an operand that expands to the layout's shape
            try:
                expands = torch.broadcast_shapes(value.shape, layout.shape) == layout.shape
            except RuntimeError:   # (a dense out= of another shape, which dense torch resizes)
                expands = False
            if not expands:
                raise _NotOnValues
            value = value.expand(layout.shape)
        return layout.gather(value.to(layout.device))
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        return type(value)(_operand(v, layout, dense_ok, updates) for v in value)
    return value


def _off_pattern(value: Any) -> Any:
    """What an operand of a stored-values update holds where the target stores nothing: a
    wrapper of the target's pattern 0 there, a ``FilledTensor`` its fill; anything else as it is
    (``image_of`` takes no tensor of more than one value)."""
    if isinstance(value, SparseTensorWrapper):
        layout = value.wrapped_tensor
        return layout.fill if isinstance(layout, FilledTensor) else 0.0
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        return type(value)(_off_pattern(v) for v in value)
    return value


INPLACE_SCALINGS = {T.mul_, T.div_, T.__imul__, T.__itruediv__}


def _fill_of(op: Any, args: tuple, kwargs: dict, values: torch.Tensor, exact: bool) -> float | None:
    """What a temporary's or optimizer state's in-place update makes of its unstored zeros (each
    operand there one value: a scalar, the zero or fill of a wrapper of this pattern); ``None``
    for zero. Where that is not known (a 0-d operand off the CPU, which ``image_of`` does not
    read: a device sync per call), a scaling keeps zeros (``clip_grad_norm_``'s ``g.mul_(coef)``
    stays O(nnz)); any other exact update goes to the dense path."""
    fill = image_of(op, 0.0, _off_pattern(args[1:]), _off_pattern(kwargs), values)
    if fill is None and exact and op not in INPLACE_SCALINGS \
            and any(isinstance(a, torch.Tensor) and a.dim() == 0 for a in (*args[1:], *kwargs.values())):
        raise _NotOnValues
    return fill


def _filled(op: Any, target: SparseTensorWrapper, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """For ``fill_`` / ``masked_fill_``, which set values at positions they choose, the dense
    tensor they mean to leave (so the values put where ``target`` stores nothing are counted and
    warned about, as ``w[mask] = v`` is); ``None`` for other operators."""
    if op is not T.fill_ and op is not T.masked_fill_:
        return None
    with torch.no_grad():
        return getattr(densify(target), op.__name__)(*args[1:], **kwargs)


def _on_values(op: Any, inplace: bool, dense_ok: bool, sparse_only: bool = False) -> Callable:
    """An implementation on stored values; ``sparse_only``: every positional
    operand must be a wrapper of the same pattern (``a + 2`` is not zero-preserving)."""

    def impl(ctx: Any, inputs: list, output_sparsifiers: list) -> Any:
        args, kwargs = ctx.call_args
        self = args[0]
        layout = self.wrapped_tensor
        if op is T.copy_ and isinstance(args[1], SparseTensorWrapper):
            return _copy_from_sparse(self, args[1])
        if op is T.type_as:   # (its operand gives a dtype, not values: w.type_as(hidden_states))
            if args[1].device != layout.device:
                return _dense(op, args, kwargs, inplace)   # (a move too: the dense result, on that device)
            args = (self, torch.empty((), dtype=args[1].dtype, device=layout.device))
        try:
            if not supports_values(layout) or (inplace and view_of_temporary(self)):   # (the dense path warns)
                raise _NotOnValues
            if sparse_only and not all(isinstance(a, SparseTensorWrapper) for a in args[1:]):
                raise _NotOnValues
            if not inplace and (op in MULS or op in DIVS) and _fills_zeros(op, (*args[1:], *kwargs.values())):
                raise _NotOnValues
            values = layout.values()
            # an update of stored values: in place, or into a wrapper's values (Adamax's
            # ``torch.maximum(exp_inf, grad.abs().add_(eps), out=exp_inf)``)
            updates = inplace or isinstance(kwargs.get("out"), SparseTensorWrapper)
            # a temporary's update is exact: a dense operand reaches every position (the dense path)
            exact = inplace and writes_exactly(self, (*args[1:], *kwargs.values()))
            rest = tuple(_operand(a, layout, dense_ok and not exact, updates) for a in args[1:])
            kw = {k: _operand(v, layout, dense_ok and not exact, updates) for k, v in kwargs.items()}
            fill = None if not inplace or is_weight(self) else _fill_of(op, args, kwargs, values, exact)
            intended = _filled(op, self, args, kwargs)
            result = op(values, *rest, **kw)
        except _NotOnValues:
            return _dense(op, args, kwargs, inplace)
        if inplace:
            self.wrapped_tensor = with_fill(layout.with_values(values), fill)
            if intended is not None:   # w.fill_(v), w.masked_fill_(m, v): what landed off the pattern
                warn_if_dropped(op, self, intended)
            return self
        if not isinstance(result, torch.Tensor) or result.shape != values.shape:
            return _dense(op, args, kwargs, inplace)
        try:
            out = layout.with_values(result.detach())
        except TypeError:
            if result.dtype == values.dtype or kwargs.get("dtype") is not None:
                raise   # (an asked-for dtype the layout cannot store: zeros_like(w, dtype=...) says so)
            return _dense(op, args, kwargs, inplace)   # a promoted dtype the layout cannot hold (2:4 float64)
        if kwargs.get("requires_grad"):  # zeros_like(w, requires_grad=True): a leaf that requires grad
            return SparseTensorWrapper(out, True, self.grad_fmt)
        # (zeros_like(w) without grad is a new tensor, no gradient to format: Adam's exp_avg, which with
        # a format holding a sparsifier did not load with torch.load(weights_only=True))
        grad_fmt = None if op is torch.zeros_like else self.grad_fmt
        return SparseTensorWrapper(out, False, grad_fmt)

    return impl


def _copy_from_sparse(self: SparseTensorWrapper, src: SparseTensorWrapper) -> SparseTensorWrapper:
    """``param.copy_(sparse)`` takes the source's values *and* pattern (as loading does): in
    ``param``'s layout class, exactly (``convert_exactly``), else a ``ValueError`` naming
    both layouts (``load_state_dict`` adds the key), then in ``param``'s dtype. A wrapper that
    is not a parameter (optimizer state: Rprop's ``prev.copy_(grad)``) grows its pattern to
    hold the source where its layout can (``write_growing``), else the ``ValueError`` says so."""
    from sten_core.model.tensor import _copy_layout

    layout = self.wrapped_tensor
    if is_storage_view(self):   # (its arrays are another wrapper's: no source's pattern taken, so warned)
        return write_back_warned(self, densify(src).to(self.dtype), T.copy_)
    if src.wrapped_tensor is not layout:
        if type(src.wrapped_tensor) is type(layout):
            converted = src.wrapped_tensor
        else:
            source = type(src.wrapped_tensor).__name__
            if not is_weight(self) and supports_values(layout):
                # optimizer state inside a step keeps its pattern where it cannot take the source's, with
                # a warning, as its other updates do (Rprop's prev.copy_(grad) of an n:m weight's CSR grad)
                if write_growing(self, densify(src).to(self.dtype), T.copy_, lossy=in_optimizer_step()) is not None:
                    return self
                what = (f"copy_ of a {source} value into a {type(layout).__name__} that is not a parameter "
                        "(optimizer state, a gradient, a buffer)")
                advice = (f"{type(layout).__name__} cannot take the source's pattern: keep this tensor dense, or "
                          "give the weight a grad_fmt whose layout is the weight's own (or one such as CsrTensor "
                          "that holds any pattern)")
            else:
                what = f"copy_ of a {source} value (load_state_dict of a checkpoint in another layout)"
                advice = LOAD_ADVICE.replace("{source}", source)
            converted = convert_exactly(src, self, what, advice)
        new = _copy_layout(converted)
        if supports_values(new) and new.values().dtype != self.dtype:
            new = new.with_values(new.values().to(self.dtype))
        self.wrapped_tensor = new
    return self


LOAD_ADVICE = ("Load it into a model whose tensor has the checkpoint's layout ({source}), or densify the "
               "checkpoint (state = sten.densify_state_dict(state)) and load the values at the model's stored "
               "positions (sten.load_dense_state_dict(model, state)) or sparsify them anew "
               "(sten.load_dense_state_dict(model, state, builder=sb)).")
"""What to do instead of loading a value that the model's layout cannot hold (``{source}``:
the checkpoint's layout)."""


def _dense(op: Any, args: tuple, kwargs: dict, inplace: bool) -> Any:
    dense_args, dense_kwargs = densify_tree((args, kwargs))
    result = op(*dense_args, **dense_kwargs)
    if inplace:
        target = args[0]
        operands = (*args[1:], *kwargs.values())
        if writes_exactly(target, operands):   # a temporary, or buf.add_(grad): SGD's momentum
            return write_growing(target, dense_args[0], op)
        write_back(target, dense_args[0])
        if view_of_temporary(target) or (is_weight(target) and another_params_pattern(target, operands)):
            warn_if_dropped(op, target, dense_args[0])        # ema_w.lerp_(w): w's pattern changed
        return target
    return result


def _on_filled(op: Any, inplace: bool) -> Callable:
    """An implementation for a ``FilledTensor`` first argument: a scalar update applies to its
    values and its fill; anything else runs on its dense tensor, and an in-place result
    goes back into its inner layout, grown to hold it (``write_growing``)."""

    def impl(ctx: Any, inputs: list, output_sparsifiers: list) -> Any:
        args, kwargs = ctx.call_args
        self, filled = args[0], args[0].wrapped_tensor
        if not inplace:
            return _dense(op, args, kwargs, False)
        values = filled.inner.values()
        fill = image_of(op, filled.fill, args[1:], kwargs, values)
        if fill is not None:
            op(values, *args[1:], **kwargs)
            self.wrapped_tensor = with_fill(filled.inner.with_values(values), fill)
            return self
        dense_args, dense_kwargs = densify_tree((args, kwargs))
        op(*dense_args, **dense_kwargs)
        self.wrapped_tensor = filled.inner
        if is_weight(self):
            return write_back(self, dense_args[0])
        return write_growing(self, dense_args[0], op)

    return impl


def resolve(key: OpKey) -> Entry | None:
    """The ``sten_resolve_op`` part: element-wise ops whose first argument is sparse."""
    if key.direction != "fwd" or not key.inp or key.inp[0] in (None, torch.Tensor):
        return None
    if key.inp[0] is FilledTensor and (key.op in INPLACE or (key.out is None and (
            key.op in ZERO_PRESERVING or key.op in SAME_PATTERN_ONLY))):
        return Entry(_on_filled(key.op, key.op in INPLACE), len(key.inp), all_args=True)
    if not _has_values(key.inp[0]):
        return None  # nothing to compute on: the dispatcher's fallback reports it
    op = key.op
    if op in INPLACE:
        return Entry(_on_values(op, True, True), len(key.inp), all_args=True)  # (alpha, value, ...)
    if key.out is not None:
        return None
    if op in ZERO_PRESERVING:
        return Entry(_on_values(op, False, op not in (T.div, torch.div, T.__truediv__)), len(key.inp), all_args=True)
    if op in SAME_PATTERN_ONLY:
        return Entry(_on_values(op, False, False, sparse_only=True), len(key.inp), all_args=True)
    return None


def _has_values(layout_cls: type) -> bool:
    """Whether a layout class implements the stored-values protocol."""
    values = getattr(layout_cls, "values", None)
    return callable(values) and values is not Layout.values and callable(getattr(layout_cls, "with_values", None)) \
        and getattr(layout_cls, "with_values") is not Layout.with_values
