"""``torch.compile`` support: the scipy kernels as PyTorch custom operators (``sten_scipy::...``).

While Dynamo traces a model, ``F.linear(x, W, b)`` with a ``ScipyCsrTensor`` or
``ScipyCscTensor`` weight becomes one ``sten_scipy::linear`` node on the
layout's member tensors (``indptr``, ``indices``, ``values``: torch tensors
sharing memory with scipy's arrays) and its constants (rows, cols, compressed
dim). Its CPU implementation rebuilds the scipy array around numpy views of
those tensors and runs the eager kernel (scipy's sparse × dense product); its
fake implementation gives the output's metadata; its autograd formula calls
``sten_scipy::linear_grad_input`` (``gy @ W``, scipy) and
``sten_scipy::linear_grad_values`` (the sampled product at the stored
positions).

Example:
    >>> import torch
    >>> from sten_scipy import ScipyCsrTensor
    >>> from sten_scipy.compiled import members
    >>> tensors, consts = members(ScipyCsrTensor.from_dense(torch.eye(2)))
    >>> torch.ops.sten_scipy.linear(torch.ones(1, 2), tensors, consts, None).tolist()
    [[1.0, 1.0]]
"""

from __future__ import annotations

import math
from typing import Any, List, Optional

import torch
import torch.nn.functional as F

from sten_core import plugin_api

from .compressed import ScipyCompressed
from .kernels import dense_times_sparse, sampled, sparse_times_dense
from .layouts import SCIPY_LAYOUTS

Tensor = torch.Tensor
_BY_MAJOR = {cls._major: cls for cls in SCIPY_LAYOUTS}


def members(layout: ScipyCompressed) -> tuple[list[Tensor], list[int]]:
    """``([indptr, indices, values], [rows, cols, compressed dim])`` of a scipy layout.

    >>> from sten_scipy import ScipyCscTensor
    >>> members(ScipyCscTensor.from_dense(torch.eye(2)))[1]
    [2, 2, 1]
    """
    if not isinstance(layout, ScipyCompressed):
        raise TypeError(f"layout must be a scipy layout, got {type(layout).__name__}")
    rows, cols = layout.shape
    return list(layout.torch_members), [rows, cols, layout._major]


def _rebuild(tensors: List[Tensor], consts: List[int]) -> ScipyCompressed:
    indptr, indices, values = tensors
    cls = _BY_MAJOR[consts[2]]
    return cls.from_parts(values.numpy(), indices.numpy(), indptr.numpy(), (consts[0], consts[1]))


def from_members(tensors: List[Tensor], consts: List[int]) -> ScipyCompressed:
    """The layout of ``members(layout)`` (``register_traceable_layout``'s unflatten): reads no
    tensor values; on traced tensors a traced layout without a scipy array
    (``ScipyCompressed.from_torch_members``).

    >>> from sten_scipy import ScipyCscTensor
    >>> type(from_members(*members(ScipyCscTensor.from_dense(torch.eye(2))))).__name__
    'ScipyCscTensor'
    """
    indptr, indices, values = tensors
    return _BY_MAJOR[consts[2]].from_torch_members(indptr, indices, values, (consts[0], consts[1]))


def _rows2(x: Tensor) -> Tensor:
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # reshape(-1, 0) raises for K == 0


@torch.library.custom_op("sten_scipy::linear", mutates_args=())
def linear(x: Tensor, tensors: List[Tensor], consts: List[int], bias: Optional[Tensor]) -> Tensor:
    """``F.linear(x, W, bias)`` for a scipy ``W`` given by ``members(W)`` (eager's kernel)."""
    layout = _rebuild(tensors, consts)
    y = sparse_times_dense(layout, _rows2(x).t().to(layout.dtype)).t()
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], consts[0]).contiguous()


@linear.register_fake
def _(x: Tensor, tensors: List[Tensor], consts: List[int], bias: Optional[Tensor]) -> Tensor:
    dtype = tensors[2].dtype if bias is None else torch.promote_types(tensors[2].dtype, bias.dtype)
    return x.new_empty((*x.shape[:-1], consts[0]), dtype=dtype)


@torch.library.custom_op("sten_scipy::linear_grad_input", mutates_args=())
def linear_grad_input(gy: Tensor, x: Tensor, tensors: List[Tensor], consts: List[int]) -> Tensor:
    """``gy @ W`` shaped like ``x``."""
    layout = _rebuild(tensors, consts)
    return dense_times_sparse(_rows2(gy).to(layout.dtype), layout).reshape(x.shape).to(x.dtype).contiguous()


@linear_grad_input.register_fake
def _(gy: Tensor, x: Tensor, tensors: List[Tensor], consts: List[int]) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("sten_scipy::linear_grad_values", mutates_args=())
def linear_grad_values(gy: Tensor, x: Tensor, tensors: List[Tensor], consts: List[int]) -> Tensor:
    """The gradient of the stored values: ``gy.T @ x`` at the stored positions."""
    layout = _rebuild(tensors, consts)
    g2 = _rows2(gy).to(layout.dtype)
    return sampled(layout, g2.t(), _rows2(x).to(layout.dtype)).clone()


@linear_grad_values.register_fake
def _(gy: Tensor, x: Tensor, tensors: List[Tensor], consts: List[int]) -> Tensor:
    return torch.empty_like(tensors[2], memory_format=torch.contiguous_format)


plugin_api.register_member_linear_autograd(linear, linear_grad_input, linear_grad_values, values_index=2)


def linear_compiled(x: Tensor, weight: Any, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear`` with a scipy weight while ``torch.compile`` traces: one ``sten_scipy::linear`` node."""
    tensors, consts = members(weight.wrapped_tensor)
    k, dtype = consts[1], tensors[2].dtype
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"F.linear: input's last dim must equal the weight's in_features {k}, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dtype != dtype:
        raise TypeError(f"F.linear: input must have the weight's dtype {dtype}, got {x.dtype}")
    return linear(x, tensors, consts, bias)


def register(registry: Any) -> None:
    """Register the compiled ``F.linear`` for both scipy layouts and make their wrappers
    traceable (called by the plugin): a compiled training step of a scipy weight whose
    ``grad_fmt`` keeps its layout, or is the explicit dense format, is one graph."""
    T = torch.Tensor
    grads = plugin_api.member_grads(members, linear_grad_input, linear_grad_values)
    for layout in SCIPY_LAYOUTS:
        for inp in ((T, layout, T), (T, layout)):
            registry.register_compiled_impl(F.linear, inp, linear_compiled)
        plugin_api.register_traceable_layout(layout, members, from_members, *grads, values_index=2)
