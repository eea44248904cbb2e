"""``W @ x`` with a sparse ``W`` while compiled: the layout's own compiled ``F.linear``.

A layout registers a compiled implementation of ``F.linear(x, W)`` (``x @ W.T``,
its kernel as a custom operator). A product with the sparse matrix as the
*first* operand is the transpose of such a linear: ``W @ x`` is
``F.linear(x.mT, W).mT`` (``x`` a matrix or a batch of matrices) and ``W @ v``
is ``F.linear(v, W)`` (``v`` a vector). While Dynamo traces, ``torch.matmul(W,
x)``, ``torch.mm(W, x)``, ``W.matmul(x)``, ``W.mm(x)`` and ``W @ x`` without a
compiled implementation of their own run this way, so the graph holds the
layout's kernel (not its ``to_dense()``, which for layouts whose dense form
goes through ctypes or data-dependent shapes is not traceable).

Example:
    >>> import torch, torch.nn.functional as F, sten_core as sten
    >>> from sten_core.model.registry import registry
    >>> w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(3)))
    >>> x = torch.arange(6.).reshape(3, 2)
    >>> torch.equal(weight_first_matmul(w, x), x)
    True
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from sten_core.model.registry import registry

Tensor = torch.Tensor

WEIGHT_FIRST_MATMULS = frozenset({torch.matmul, Tensor.matmul, Tensor.__matmul__})
WEIGHT_FIRST_MMS = frozenset({torch.mm, Tensor.mm})


def weight_first_impl(op: Any, layouts: tuple) -> Optional[Callable]:
    """The implementation of ``op(W, x)`` through ``W``'s compiled ``F.linear``, for layouts
    ``(Layout, torch.Tensor)`` whose ``F.linear`` has one; else ``None``.

    >>> import torch, sten_core as sten
    >>> weight_first_impl(torch.mm, (sten.CsrTensor, torch.Tensor)).__name__
    'weight_first_mm'
    """
    if len(layouts) != 2 or layouts[1] is not torch.Tensor or layouts[0] in (None, torch.Tensor):
        return None
    if op not in WEIGHT_FIRST_MATMULS and op not in WEIGHT_FIRST_MMS:
        return None
    if registry.compiled.get((F.linear, (torch.Tensor, layouts[0]))) is None:
        return None
    return weight_first_mm if op in WEIGHT_FIRST_MMS else weight_first_matmul


def _linear_of(weight: Any) -> Callable:
    return registry.compiled[(F.linear, (torch.Tensor, type(weight.wrapped_tensor)))]


def _check(name: str, other: Any, dims: tuple) -> None:
    """The second operand's kind (the layout's compiled F.linear checks the sizes)."""
    if not isinstance(other, torch.Tensor) or other.dim() not in dims:
        got = tuple(other.shape) if isinstance(other, torch.Tensor) else type(other).__name__
        raise ValueError(f"{name}: the second operand must be a tensor of {' or '.join(map(str, dims))} "
                         f"dimensions, got {got}")


def weight_first_matmul(weight: Any, other: Tensor, linear: Optional[Callable] = None) -> Tensor:
    """``torch.matmul(weight, other)`` for a 2-D sparse ``weight``: ``F.linear(other, weight)``
    for a vector, ``F.linear(other.mT, weight).mT`` (contiguous, as eager's) for a matrix or a
    batch of matrices; ``linear`` the compiled ``F.linear`` (by default the layout's)."""
    _check("matmul", other, tuple(range(1, 9)))
    linear = linear or _linear_of(weight)
    if other.dim() == 1:
        return linear(other, weight)
    return linear(other.transpose(-1, -2), weight).transpose(-1, -2).contiguous()


def weight_first_mm(weight: Any, other: Tensor, linear: Optional[Callable] = None) -> Tensor:
    """``torch.mm(weight, other)`` for a 2-D sparse ``weight`` and a matrix ``other``."""
    _check("mm", other, (2,))
    return (linear or _linear_of(weight))(other.t(), weight).t().contiguous()


def is_weight_first_product(op: Any, args: tuple) -> bool:
    """Whether ``op(*args)`` is ``W @ x`` / ``torch.mm(W, x)`` / ``torch.matmul(W, x)`` (two operands).

    >>> is_weight_first_product(torch.mm, (torch.ones(2, 2), torch.ones(2, 2)))
    True
    """
    return (op in WEIGHT_FIRST_MATMULS or op in WEIGHT_FIRST_MMS) and len(args) == 2


def weight_first_training(weight: Any, other: Tensor, op: Any) -> Tensor:
    """``op(weight, other)`` while compiling a training step of a trainable traceable ``weight``:
    the ``sten_core::wrapper_linear`` node on ``other``'s transpose (the weight's gradient computed
    in the graph, in its ``grad_fmt``, as for ``F.linear``)."""
    from sten_core.dispatch.traceable import linear_training

    product = weight_first_mm if op in WEIGHT_FIRST_MMS else weight_first_matmul
    return product(weight, other, linear_training)
