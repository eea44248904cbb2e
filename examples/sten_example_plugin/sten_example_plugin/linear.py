"""``F.linear`` with a ``BitmaskTensor`` weight: forward and backward.

Every kept weight ``w[r, c]`` adds ``x[:, c] * w[r, c]`` to output column
``r``; the work is O(batch * nnz). The weight gradient is produced either
dense or at the kept positions only (a ``BitmaskTensor`` with the weight's
mask), depending on the gradient format the weight asks for.

Example:
    >>> import torch, torch.nn.functional as F, sten_core as sten
    >>> from sten_example_plugin import BitmaskTensor
    >>> w = sten.SparseTensorWrapper(BitmaskTensor.from_dense(torch.eye(3)))
    >>> F.linear(torch.ones(2, 3), w).tolist()
    [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
"""

from __future__ import annotations

from typing import Any

import torch

from sten_core import plugin_api as sten


def linear_fwd(ctx: Any, inputs: list, output_sparsifiers: list) -> torch.Tensor:
    """``inputs`` is ``[input, weight, bias]`` (bias may be ``None``)."""
    x, w, bias = (list(inputs) + [None])[:3]
    layout = w.wrapped_tensor
    rows, cols = layout.coords()
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.zeros(x2.shape[0], layout.shape[0], dtype=x2.dtype, device=x2.device)
    y.index_add_(1, rows, x2[:, cols] * layout.values())
    if bias is not None:
        y = y + bias
    ctx.save_for_backward(x, w)
    return y.reshape(*x.shape[:-1], layout.shape[0])


def linear_bwd(sparse_weight_grad: bool):
    """The backward implementation; the weight gradient dense or at the kept positions."""

    def impl(ctx: Any, grad_outputs: tuple, input_sparsifiers: list) -> tuple:
        x, w = ctx.saved_tensors
        (g,) = grad_outputs
        layout = w.wrapped_tensor
        rows, cols = layout.coords()
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.zeros_like(x2).index_add_(1, cols, g2[:, rows] * layout.values())
            grad_x = grad_x.reshape(x.shape)
        if ctx.needs_input_grad[1]:
            if sparse_weight_grad:  # only the kept positions: O(batch * nnz)
                grad_w = sten.SparseTensorWrapper(layout.with_values((g2[:, rows] * x2[:, cols]).sum(0)))
            else:
                grad_w = g2.t() @ x2
        if len(ctx.inputs) > 2 and ctx.inputs[2] is not None and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b

    return impl
