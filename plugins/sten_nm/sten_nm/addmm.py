"""``torch.addmm(bias, x, W)`` with an n:m ``W`` ``[in, out]``: GPT-2's ``Conv1D``.

The n:m groups may run along either dim of ``W``; the kernels follow the
layout's ``dim`` (``NMSparsifier(2, 4, dim=0)`` puts the groups along the
contraction dim of ``x @ W``, as ``dim=1`` does for an ``F.linear`` weight).

Example:
    >>> import torch
    >>> from sten_nm import NMTensor
    >>> from sten_nm.addmm import nm_addmm
    >>> w = NMTensor.from_dense(torch.eye(4), n=1, m=2, dim=0)
    >>> nm_addmm(torch.ones(4), torch.ones(1, 4), w).tolist()
    [[2.0, 2.0, 2.0, 2.0]]
"""

from __future__ import annotations

from typing import Any

import torch

from .nm_tensor import NMTensor
from .ops import _autocast_dtype, _backward, _cast, nm_matmul


def nm_addmm(bias: torch.Tensor, x: torch.Tensor, weight: Any, *, beta: Any = 1, alpha: Any = 1) -> torch.Tensor:
    """``beta * bias + alpha * (x @ weight)`` for a 2-D ``x`` and an n:m ``weight``."""
    if x.dim() != 2:
        raise ValueError(f"torch.addmm: mat1 must be 2-D, got shape {tuple(x.shape)}")
    y = nm_matmul(x, weight)
    if alpha != 1:
        y = y * alpha
    if beta == 0:  # torch ignores input then: NaN or inf there must not reach the result
        return y
    # under CPU autocast the bias is cast too, as dense torch does (a float32 bias promoted the result)
    bias = _cast(bias, _autocast_dtype(x, weight, bias))
    return y + (bias if beta == 1 else beta * bias)


def _scalars(ctx: Any) -> tuple[Any, Any]:
    args, kwargs = ctx.call_args
    return kwargs.get("beta", 1), kwargs.get("alpha", 1)


def addmm_fwd(ctx: Any, inputs: list, output_sparsifiers: list) -> torch.Tensor:
    bias, x, w = inputs[:3]
    beta, alpha = _scalars(ctx)
    ctx.save_for_backward(x, w, bias)
    return nm_addmm(bias, x, w, beta=beta, alpha=alpha)


def _addmm_backward(sparse_grad: bool):
    def impl(ctx: Any, grad_outputs: tuple, input_sparsifiers: list) -> tuple:
        x, w, bias = ctx.saved_tensors
        beta, alpha = _scalars(ctx)
        (gy,) = grad_outputs
        needs = tuple(ctx.needs_input_grad) + (True,) * 3

        class _Ctx:  # the product's view of the call: (x, W) with their needs
            needs_input_grad = (needs[1], needs[2])

        gx, gw = _backward(_Ctx, (gy * alpha if alpha != 1 else gy,), sparse_grad, linear=False,
                           saved=(x, w, None))
        gb = None
        if needs[0]:
            gb = gy.flatten(0, -2) * beta if gy.dim() > 1 else gy * beta   # (reshape(-1, N): no size when N = 0)
            while gb.dim() > bias.dim():
                gb = gb.sum(0)
            for d, size in enumerate(bias.shape):
                if size == 1 and gb.shape[d] != 1:
                    gb = gb.sum(d, keepdim=True)
            gb = gb.to(bias.dtype)
        return gb, gx, gw

    return impl


def register(registry: Any) -> None:
    """``torch.addmm(bias, x, NMTensor)``: forward, and backward with a dense or n:m weight gradient."""
    from sten_core.plugin_api import KeepAll

    T = torch.Tensor
    inp = (T, T, NMTensor)
    registry.register_fwd_op_impl(torch.addmm, (*inp, ...), [(KeepAll, T)], addmm_fwd)   # (beta, alpha)
    for wfmt, sparse in ((T, False), (NMTensor, True)):
        registry.register_bwd_op_impl(torch.addmm, (T,), ((KeepAll, T), (KeepAll, T), (KeepAll, wfmt)), inp,
                                      _addmm_backward(sparse))
