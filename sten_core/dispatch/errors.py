"""Dispatch errors and the failure mode: what happens when no sparse
implementation applies (a dense fallback with one ``DispatchWarning`` per key,
or a ``DispatchError``).

The mode is process-wide (``set_dispatch_failure``) and can be overridden for
a block and its thread or task (``failure_mode``, like ``torch.set_grad_enabled``).

Example:
    >>> import sten_core as sten
    >>> with sten.dispatch.failure_mode("raise"):
    ...     sten.dispatch.get_dispatch_failure()
    'raise'
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from typing import Any, Iterable, Iterator

import torch

from sten_core.model.registry import OpKey, registry
from sten_core.model.signatures import op_name
from sten_core.user_frames import user_stacklevel
from sten_core.model.sparsifiers import KeepAll


class DispatchError(RuntimeError):
    """No implementation was found and dense fallbacks are disabled."""


class DispatchWarning(UserWarning):
    """A dense fallback ran because no sparse implementation is registered."""


class Unsupported(Exception):
    """Raised by an implementation, before it computes anything, for inputs it does not handle
    (a rank, a dtype, a device its kernel lacks): the call then takes the dense path, with a
    ``DispatchWarning`` (or, in ``"raise"`` mode, a ``DispatchError``) naming the reason; an
    in-place call (``w.mul_(s)``) is then the dense op written into its target at the stored
    positions, as one without an implementation. A backward implementation may raise it too:
    the gradients are then the dense op's.

    Example (in an implementation):
        >>> def my_linear(ctx, inputs, output_sparsifiers):
        ...     if inputs[1].dim() != 2:
        ...         raise Unsupported(f"a {inputs[1].dim()}-D weight (the kernel takes matrices)")
    """


def traced(op: Any) -> NotImplementedError:
    """What an operator on a sparse wrapper raises under ``torch.jit.trace`` or ``make_fx`` on real
    tensors (``torch.func.linearize``): the tracer records torch operators only, so a layout's kernels
    (C, scipy, ctypes) would be baked into the trace as constants or as the uninitialised buffers they
    fill, and the traced module would silently return wrong values."""
    return NotImplementedError(
        f"STen: {op_name(op)} on a sparse wrapper under torch.jit.trace or make_fx (torch.func.linearize) is "
        "not supported: the tracer records torch operators only, not the layouts' kernels, so the trace would "
        "be wrong for other inputs. Use torch.export.export or torch.compile (both supported), torch.func.jvp "
        "instead of linearize, or trace the dense model (sten_core.densify_state_dict / w.to_dense()).")


def declined(key: OpKey, impl: Any, error: Unsupported) -> None:
    """Warn once per key (or raise) that ``impl`` declined a call and the dense path ran."""
    name = f"{getattr(impl, '__module__', '')}.{getattr(impl, '__qualname__', impl)}".lstrip(".")
    report_missing(key, f"{name} declined ({error})")


class UnsupportedTrainingOp(TypeError):
    """An operator other than ``F.linear`` on a trainable traceable weight whose ``grad_fmt`` keeps its
    layout or re-sparsifies it, or an in-place operator on a weight that is a graph input: raised
    while Dynamo traces (a dense ``grad_fmt`` trains compiled through any other operator, on the
    weight's dense view)."""


_MODES = ("warn", "raise")
_default_mode = "warn"
_mode: contextvars.ContextVar[str | None] = contextvars.ContextVar("sten_dispatch_failure", default=None)
_warned: set = set()  # keys already warned about (once per key)


def _check_mode(mode: str) -> str:
    if mode not in _MODES:
        raise ValueError(f"mode must be 'warn' or 'raise', got {mode!r}")
    return mode


def set_dispatch_failure(mode: str) -> None:
    """Process-wide: ``"warn"`` runs the dense fallback with one warning per
    key; ``"raise"`` raises ``DispatchError`` instead."""
    global _default_mode
    _default_mode = _check_mode(mode)


def get_dispatch_failure() -> str:
    """The failure mode in force here (a ``failure_mode`` block's, else the process-wide one)."""
    mode = _mode.get()
    return _default_mode if mode is None else mode


@contextlib.contextmanager
def failure_mode(mode: str) -> Iterator[None]:
    """The failure mode inside the block, for this thread or task only.

    Example:
        >>> import torch, sten_core as sten
        >>> with sten.dispatch.failure_mode("raise"):
        ...     pass
    """
    token = _mode.set(_check_mode(mode))
    try:
        yield
    finally:
        _mode.reset(token)


def reset_warnings() -> None:
    """Forget which fallbacks were warned about: each warns again once."""
    _warned.clear()


def fix_text(key: OpKey) -> str:
    def one(i: Any) -> str:
        if isinstance(i, tuple):  # the layouts of a list argument's items
            return "[" + ", ".join(one(x) for x in i) + "]"
        return "None" if i is None else ("torch.Tensor" if i is torch.Tensor else i.__name__)

    def pat(items: Iterable) -> str:
        parts = [one(i) for i in items]
        return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"

    def pairs(items: Iterable) -> str:
        return "[" + ", ".join("None" if p is None else f"({p[0].__name__}, {pat([p[1]])[1:-1].rstrip(',')})" for p in items) + "]"

    if key.direction == "fwd":
        out = key.out if key.out is not None else ((KeepAll, torch.Tensor),)
        return f"@sten.register_fwd_op_impl(operator={op_name(key.op)}, inp={pat(key.inp)}, out={pairs(out)})"
    if key.direction == "bwd":
        return (
            f"@sten.register_bwd_op_impl(operator={op_name(key.op)}, grad_out={pat(key.grad_out)}, "
            f"grad_inp={pairs(key.out)}, inp={pat(key.inp)})"
        )
    return (
        f"@sten.register_sparsifier_implementation(sparsifier={key.op.__name__}, "
        f"inp={pat(key.inp)[1:-2]}, out={pat([key.out])[1:-2]})"
    )


def report_missing(key: OpKey, detail: str | None = None) -> None:
    """Warn once per key, or raise, about a dense fallback (``detail``: why, when known)."""
    if key.direction == "sparsifier":
        what = "Sparsifier implementation is not registered"
        then = "Fallback to dense keep all implementation."
    else:
        what = f"Sparse operator implementation is not registered ({key.direction})"
        then = "Fallback to dense implementation."
    message = f"{what}. {key.describe()}. {then} To add one: {fix_text(key)}"
    if detail:
        what = "No implementation applies to these inputs"
        message = f"{what}: {detail}. {key.describe()}. {then} To add one: {fix_text(key)}"
    if key.direction == "fwd" and any(isinstance(i, tuple) for i in key.inp):
        message = (f"{what}: wrappers inside a list argument. {key.describe()}. {then} "
                   "Implementations are registered for tensor arguments only: pass the tensors "
                   "densely or call a sparse operator that takes them one by one.")
    fail(message, key, then)


def lossy_fallback(key: OpKey, kept: int, chosen: int) -> None:
    """A sparsifier's output was pruned again by its layout's ``from_dense``:
    a fallback (warned once per key, raised in raise mode)."""
    out = key.out.__name__
    producers = [k.op.__name__ for k in registry.impls if k.direction == "sparsifier" and k.out is key.out]
    hint = f" Sparsifiers registered to produce it: {', '.join(sorted(set(producers)))}." if producers else ""
    message = (f"Lossy sparsifier output: {key.describe()}: {out}.from_dense kept {kept} of the {chosen} values "
               f"that {key.op.__name__} chose (the layout cannot store its pattern), so the result was pruned "
               f"again.{hint} Use a sparsifier that produces {out} directly, or register one: {fix_text(key)}")
    fail(message, ("lossy", key))


@contextlib.contextmanager
def quiet_fallbacks() -> Iterator[None]:
    """Silence ``DispatchWarning`` inside the block without using up the
    once-per-key warnings: fallbacks first met inside still warn after it.

    Example:
        >>> import sten_core as sten
        >>> with sten.dispatch.quiet_fallbacks():
        ...     pass
    """
    given = set(_warned)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DispatchWarning)
        try:
            yield
        finally:
            _warned.intersection_update(given)


def fail(message: str, key: Any, then: str = "") -> None:
    """Raise ``message`` as a ``DispatchError`` in raise mode; else warn once per ``key``."""
    if get_dispatch_failure() == "raise":
        raise DispatchError(message.replace(then + " ", "") if then else message)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, DispatchWarning, stacklevel=user_stacklevel())
