"""Helpers for the code every layout plugin writes (re-exported by
``sten_core.plugin_api``, where plugins import them): argument checks that
name the argument, the inputs and flags of an implementation, and the
registration of a product with a sparse weight.

Example:
    >>> import torch
    >>> check_tensor(torch.ones(2, 3), "weight", ndim=2).shape
    torch.Size([2, 3])
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F

from sten_core.model.registry import Registry
from sten_core.model.sparsifiers import KeepAll
from sten_core.model.tensor import SparseTensorWrapper


FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


# -- argument checks ---------------------------------------------------------------

def check_tensor(value: Any, name: str, *, ndim: int | Iterable[int] | None = None,
                 dtypes: Iterable[torch.dtype] | None = None, device_type: str | None = None,
                 where: str = "") -> torch.Tensor:
    """``value`` if it is a tensor of the given rank, dtype and device type;
    else a ``TypeError`` / ``ValueError`` that names ``name`` (prefixed by
    ``where``) and what was expected.

    Example:
        >>> check_tensor(torch.ones(2, 3), "weight", ndim=2, dtypes=FLOAT_DTYPES).shape
        torch.Size([2, 3])
        >>> check_tensor(torch.ones(3), "weight", ndim=2)
        Traceback (most recent call last):
        ...
        ValueError: weight must be 2-D, got shape (3,)
    """
    prefix = f"{where}: " if where else ""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{prefix}{name} must be a torch.Tensor, got {type(value).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if value.dtype not in dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise TypeError(f"{prefix}{name} must have dtype {names}, got {value.dtype}")
    if ndim is not None:
        ranks = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if value.dim() not in ranks:
            want = " or ".join(str(r) for r in ranks)
            raise ValueError(f"{prefix}{name} must be {want}-D, got shape {tuple(value.shape)}")
    if device_type is not None and value.device.type != device_type:
        raise ValueError(f"{prefix}{name} must be on {device_type}, got device {value.device}")
    return value


def check_nm(n: Any, m: Any, max_m: int | None = None) -> tuple[int, int]:
    """An n:m pattern: ints with ``1 <= n < m`` (and ``m <= max_m``), or an
    error naming the argument.

    Example:
        >>> check_nm(3, 2)
        Traceback (most recent call last):
        ...
        ValueError: n must be < m (n:m keeps n of every m), got n=3, m=2
    """
    for name, v in (("n", n), ("m", m)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if max_m is not None and m > max_m:
        raise ValueError(f"m must be <= {max_m}, got m={m}")
    if m < 2:
        raise ValueError(f"m must be >= 2, got m={m}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got n={n}")
    if n >= m:
        raise ValueError(f"n must be < m (n:m keeps n of every m), got n={n}, m={m}")
    return n, m


# -- inside an implementation ------------------------------------------------------

def linear_inputs(inputs: Any) -> tuple[Any, Any, Any]:
    """``(x, weight, bias)`` of an ``F.linear``-like call (``bias`` ``None`` when absent).

    Example:
        >>> linear_inputs(["x", "w"])
        ('x', 'w', None)
    """
    x, weight, bias = (list(inputs) + [None, None])[:3]
    return x, weight, bias


def needs_grad(ctx: Any, i: int) -> bool:
    """Whether backward must return the gradient of input ``i`` (``True`` when
    the context does not say, e.g. a direct call in a test)."""
    needs = getattr(ctx, "needs_input_grad", ()) or ()
    return bool(needs[i]) if i < len(needs) else True


def wrap_layout(layout: Any, grad_fmt: Any = None, requires_grad: bool = False) -> SparseTensorWrapper:
    """A layout object as a tensor (what implementations and sparsifiers return)."""
    return SparseTensorWrapper(layout, requires_grad=requires_grad, grad_fmt=grad_fmt)


def bias_grad(grad_output: torch.Tensor) -> torch.Tensor:
    """The gradient of a bias added on the last dimension: ``grad_output``
    summed over every other dimension (a zero-width output too: -1 has no size there).

    >>> bias_grad(torch.ones(2, 3, 4)).tolist()
    [6.0, 6.0, 6.0, 6.0]
    """
    if grad_output.dim() < 2:
        return grad_output
    return grad_output.sum(tuple(range(grad_output.dim() - 1)))


def register_member_linear_autograd(op: Any, grad_input: Callable, grad_values: Callable,
                                    values_index: int) -> None:
    """The autograd formula of a custom ``op(x, tensors, consts, bias)`` computing
    ``F.linear`` with a weight given by its member tensors (``tensors[values_index]``
    its stored values, ``consts`` its integers): ``grad_input(gy, x, tensors, consts)``
    gives x's gradient, ``grad_values(gy, x, tensors, consts)`` the stored values', the
    bias gets ``bias_grad``. The other members (indices) get none.

    Example (the shape of a plugin's compiled linear):
        >>> register_member_linear_autograd(my_linear, my_grad_input, my_grad_values, 0)  # doctest: +SKIP
    """

    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        x, tensors, consts, bias = inputs
        ctx.save_for_backward(x, *tensors)
        ctx.consts = consts
        ctx.has_bias = bias is not None

    def backward(ctx: Any, gy: torch.Tensor) -> tuple:
        x, *tensors = ctx.saved_tensors
        need_x, need_t, _, need_b = ctx.needs_input_grad
        gx = grad_input(gy, x, tensors, ctx.consts) if need_x else None
        gt = None
        if need_t:
            gt = [None] * len(tensors)
            gt[values_index] = grad_values(gy, x, tensors, ctx.consts)
        gb = bias_grad(gy) if ctx.has_bias and need_b else None
        return gx, gt, None, gb

    op.register_autograd(backward, setup_context=setup_context)


# -- registration ------------------------------------------------------------------

def register_weight_product(registry: Registry, op: Callable, layout: type, forward: Callable,
                            backward: Callable, sparse_grad_backward: Callable | None = None,
                            grad_outs: Iterable[type] = (torch.Tensor,), input_layout: type = torch.Tensor,
                            weight_first: bool = False) -> None:
    """Register ``op(x, weight[, bias])`` with a ``layout`` weight in the
    second place (``op(weight, x)`` with ``weight_first``, e.g. ``W @ x``):
    ``forward`` (one dense output), and ``backward`` for dense gradients of
    all inputs, in the operands' order; ``sparse_grad_backward``, if given, for
    a weight gradient wanted in ``layout`` (``grad_fmt`` of the weight).
    ``F.linear`` is registered with and without a bias; ``grad_outs`` are the
    incoming gradient layouts handled, ``input_layout`` the layout of ``x``.

    Example:
        >>> import sten_core as sten
        >>> class Doubled(sten.DenseTensor):   # a layout of its own
        ...     pass
        >>> def fwd(ctx, inputs, out):
        ...     x, w, b = linear_inputs(inputs)
        ...     return F.linear(x, w.wrapped_tensor.to_dense(), b)
        >>> with sten.registry.owner("doc"):
        ...     register_weight_product(sten.registry, F.linear, Doubled, fwd, lambda *a: None)
        >>> len(sten.registry.owned_by("doc", "impls"))   # forward and backward, with and without bias
        4
        >>> sten.registry.remove_owner("doc")
    """
    T = torch.Tensor
    keep = (KeepAll, T)
    X = input_layout
    if weight_first and op is F.linear:
        raise ValueError("weight_first: F.linear takes its weight second")
    w_at = 0 if weight_first else 1
    patterns = ((X, layout, T), (X, layout)) if op is F.linear else (((layout, X),) if weight_first else ((X, layout),))
    for inp in patterns:
        registry.register_fwd_op_impl(op, inp, [keep], forward)
        for grad_out in grad_outs:
            grads = [keep, keep] + [keep] * (len(inp) - 2)
            registry.register_bwd_op_impl(op, (grad_out,), tuple(grads), inp, backward)
            if sparse_grad_backward is not None:
                grads[w_at] = (KeepAll, layout)
                registry.register_bwd_op_impl(op, (grad_out,), tuple(grads), inp, sparse_grad_backward)


def member_grads(flatten: Callable, grad_input_op: Callable, grad_values_op: Callable) -> tuple[Callable, Callable]:
    """``register_traceable_layout``'s ``grad_input`` / ``grad_values`` (``(gy, x, layout)``)
    from a plugin's member-level operators ``op(gy, x, tensors, consts)``, the layout
    given to them as ``flatten(layout)``'s ``(tensors, consts)``.

    Example (the shape of a plugin's registration):
        >>> grad_input, grad_values = member_grads(members, my_grad_input, my_grad_values)  # doctest: +SKIP
    """

    def grad_input(gy: torch.Tensor, x: torch.Tensor, layout: Any) -> torch.Tensor:
        return grad_input_op(gy, x, *flatten(layout))

    def grad_values(gy: torch.Tensor, x: torch.Tensor, layout: Any) -> torch.Tensor:
        return grad_values_op(gy, x, *flatten(layout))

    return grad_input, grad_values
