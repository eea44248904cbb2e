"""Data-parallel training of sparse models.

``DistributedDataParallel`` reduces gradients through flat buckets of dense
storage, which sparse wrappers do not have. ``sparse_ddp(model)`` therefore
hands DDP the dense parameters only and reduces each sparse parameter's
gradient itself, in its layout: the stored values are all-reduced (same
pattern on every rank) and averaged like DDP does; a dense gradient of a sparse
parameter is all-reduced densely. Sparse parameters are broadcast from rank 0
at the start. Gradients are reduced when they are accumulated, so call
``optimizer.zero_grad()`` every step (no ``no_sync`` accumulation).

Example (inside an initialised process group):
    >>> ddp = sparse_ddp(sparse_model)          # doctest: +SKIP
    >>> ddp(x).sum().backward(); optimizer.step()  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .layouts import supports_values
from .tensor import SparseTensorWrapper


def _sparse_parameters(model: torch.nn.Module) -> list[tuple[str, SparseTensorWrapper]]:
    return [(n, p) for n, p in model.named_parameters() if isinstance(p, SparseTensorWrapper)]


def _payload(tensor: Any) -> torch.Tensor:
    """The tensor to communicate: stored values for sparse, itself for dense."""
    if isinstance(tensor, SparseTensorWrapper):
        if not supports_values(tensor.wrapped_tensor):
            raise TypeError(f"{type(tensor.wrapped_tensor).__name__} has no stored values to reduce")
        return tensor.wrapped_tensor.values()
    return tensor


def _reduce_grad(param: SparseTensorWrapper) -> None:
    grad = param.grad
    if grad is None:
        return
    payload = _payload(grad)
    dist.all_reduce(payload)
    payload.div_(dist.get_world_size())


def sparse_ddp(model: torch.nn.Module, **ddp_kwargs: Any) -> torch.nn.parallel.DistributedDataParallel:
    """Wrap a sparse model for data-parallel training (gloo or nccl).

    Args:
        model: a model whose sparse parameters are ``SparseParameterWrapper``.
        ddp_kwargs: passed to ``DistributedDataParallel``.
    """
    if not dist.is_initialized():
        raise RuntimeError("sparse_ddp needs an initialised process group (torch.distributed.init_process_group)")
    sparse = _sparse_parameters(model)
    ignore = getattr(torch.nn.parallel.DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model", None)
    if ignore is None:
        raise RuntimeError("this torch has no DistributedDataParallel._set_params_and_buffers_to_ignore_for_model")
    ignore(model, [name for name, _ in sparse])
    for name, param in sparse:
        nnz = torch.tensor([_payload(param).numel()])
        counts = [torch.zeros_like(nnz) for _ in range(dist.get_world_size())]
        dist.all_gather(counts, nnz)
        if len({int(c) for c in counts}) != 1:
            raise ValueError(f"sparse parameter {name} has different patterns across ranks: seed the sparsifiers alike")
        with torch.no_grad():
            dist.broadcast(_payload(param), src=0)
        param.register_post_accumulate_grad_hook(_reduce_grad)
    return torch.nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
