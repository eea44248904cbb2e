"""Custom operators (``sten_core::...``) for the built-in layouts' kernels under ``torch.compile``.

Each operator takes a layout's plain member tensors (never a sparse torch
tensor or a wrapper), so Dynamo and AOTAutograd see it as one opaque graph
node: its fake implementation gives the output's metadata, its CPU/CUDA
implementation is the eager kernel (same arithmetic, same results), and its
autograd formula is registered.

Example:
    >>> import torch
    >>> from sten_core.builtin.torch_layouts import CsrTensor
    >>> w = CsrTensor.from_dense(torch.eye(3))
    >>> crow, col, values = w.state_tensors()
    >>> torch.ops.sten_core.csr_linear(torch.ones(2, 3), crow, col, values, None).tolist()
    [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from .ops import _sparse_times
from .torch_layouts import CsrTensor


def _csr(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, columns: int,
         dtype: torch.dtype) -> torch.Tensor:
    values = values if values.dtype == dtype else values.to(dtype)
    return torch.sparse_csr_tensor(crow, col, values, (crow.shape[0] - 1, columns))


@torch.library.custom_op("sten_core::csr_linear", mutates_args=())
def csr_linear(x: torch.Tensor, crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor,
               bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for a CSR weight ``W`` [N, K] given by its members."""
    x2 = x.reshape(-1, x.shape[-1])
    y = _sparse_times(_csr(crow, col, values, x.shape[-1], x2.dtype), x2.t()).t()
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], crow.shape[0] - 1).contiguous()


@csr_linear.register_fake
def _(x: torch.Tensor, crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor,
      bias: Optional[torch.Tensor]) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], crow.shape[0] - 1)


@torch.library.custom_op("sten_core::csr_t_matmul", mutates_args=())
def csr_t_matmul(g: torch.Tensor, crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor,
                 columns: int) -> torch.Tensor:
    """``g @ W`` for ``g`` [M, N] and a CSR ``W`` [N, columns] (the input gradient of a linear)."""
    w = _csr(crow, col, values, columns, g.dtype)
    return _sparse_times(w.t(), g.t()).t().contiguous()


@csr_t_matmul.register_fake
def _(g: torch.Tensor, crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, columns: int) -> torch.Tensor:
    return g.new_empty(g.shape[0], columns)


@torch.library.custom_op("sten_core::csr_sampled", mutates_args=())
def csr_sampled(g: torch.Tensor, x: torch.Tensor, crow: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """Values of ``g.t() @ x`` at a CSR pattern (the weight gradient of a linear, pattern kept)."""
    ones = torch.ones(col.shape[0], dtype=g.dtype, device=g.device)
    pattern = torch.sparse_csr_tensor(crow, col, ones, (crow.shape[0] - 1, x.shape[1]))
    return torch.sparse.sampled_addmm(pattern, g.t().contiguous(), x.contiguous(), beta=0.0).values().clone()


@csr_sampled.register_fake
def _(g: torch.Tensor, x: torch.Tensor, crow: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    return g.new_empty(col.shape[0])


def _setup_linear(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, crow, col, values, bias = inputs
    ctx.save_for_backward(x, crow, col, values)
    ctx.has_bias = bias is not None


def _linear_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    x, crow, col, values = ctx.saved_tensors
    g2 = grad.reshape(-1, grad.shape[-1])
    x2 = x.reshape(-1, x.shape[-1]).to(g2.dtype)
    needs = ctx.needs_input_grad
    grad_x = torch.ops.sten_core.csr_t_matmul(g2, crow, col, values, x.shape[-1]).reshape(x.shape) \
        if needs[0] else None
    grad_values = torch.ops.sten_core.csr_sampled(g2, x2, crow, col).to(values.dtype) if needs[3] else None
    grad_bias = g2.sum(0) if ctx.has_bias and needs[4] else None
    return grad_x, None, None, grad_values, grad_bias


csr_linear.register_autograd(_linear_backward, setup_context=_setup_linear)


def csr_linear_kernel(x: torch.Tensor, weight: Any, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` with a ``CsrTensor`` weight while ``torch.compile`` traces: one
    ``sten_core::csr_linear`` node on the layout's members."""
    crow, col, values = weight.wrapped_tensor.state_tensors()
    return torch.ops.sten_core.csr_linear(x, crow, col, values, bias)


def register(registry: Any) -> None:
    T = torch.Tensor
    for inp in ((T, CsrTensor, T), (T, CsrTensor)):
        registry.register_compiled_impl(F.linear, inp, csr_linear_kernel)
