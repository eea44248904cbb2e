"""Data-parallel training of sparse models.

``DistributedDataParallel`` reduces gradients through flat buckets of dense
storage, which sparse wrappers do not have. ``sparse_ddp(model)`` therefore
hands DDP the dense parameters only and reduces each sparse parameter's
gradient itself, in its layout: the stored values are all-reduced (same
pattern on every rank) and averaged like DDP does; a dense gradient of a sparse
parameter is all-reduced densely. Sparse parameters are broadcast from rank 0
at the start. Gradients are reduced when they are accumulated, so call
``optimizer.zero_grad()`` every step (no ``no_sync`` accumulation).

Every rank must hold the same patterns (build the sparse model with the same
seed and sparsifiers everywhere): ``sparse_ddp`` compares a fingerprint of each
sparse parameter's layout, shape and stored positions across ranks and raises
``ValueError`` naming the parameter and the ranks that differ, on every rank.
Collective tensors live on the process group's device (CUDA for NCCL).

Plain ``DistributedDataParallel`` also trains a sparse model whose ranks hold
the same patterns (ranks stay bit-identical); it broadcasts only values at
construction, so ranks that start from other patterns keep them:
``check_same_patterns(model)`` checks that first.

Example (inside an initialised process group):
    >>> ddp = sparse_ddp(sparse_model)          # doctest: +SKIP
    >>> ddp(x).sum().backward(); optimizer.step()  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from sten_core.model.layouts import supports_values
from sten_core.model.tensor import SparseTensorWrapper


def _sparse_parameters(model: torch.nn.Module) -> list[tuple[str, SparseTensorWrapper]]:
    return [(n, p) for n, p in model.named_parameters() if isinstance(p, SparseTensorWrapper)]


def _payload(tensor: Any) -> torch.Tensor:
    """The tensor to communicate: stored values for sparse, itself for dense."""
    if isinstance(tensor, SparseTensorWrapper):
        if not supports_values(tensor.wrapped_tensor):
            raise TypeError(f"{type(tensor.wrapped_tensor).__name__} has no stored values to reduce")
        return tensor.wrapped_tensor.values()
    return tensor


def _reduce_grad(param: SparseTensorWrapper, group: Any = None) -> None:
    grad = param.grad
    if grad is None:
        return
    payload = _payload(grad)
    dist.all_reduce(payload, group=group)
    payload.div_(dist.get_world_size(group))


def _reducer(group: Any) -> Any:
    return lambda param: _reduce_grad(param, group)


def _group_rank0(group: Any) -> int:
    """The global rank of ``group``'s rank 0 (``broadcast`` takes global ranks)."""
    return 0 if group is None else dist.get_global_rank(group, 0)


def collective_device(group: Any = None) -> torch.device:
    """Where tensors for collectives of ``group`` must live: the current CUDA
    device for NCCL, the CPU otherwise (gloo, mpi)."""
    backend = str(dist.get_backend(group)).lower()
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("the process group uses NCCL, which needs CUDA, but torch.cuda is not available")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def pattern_fingerprint(tensor: SparseTensorWrapper) -> tuple[int, int]:
    """``(nnz, hash)`` of a sparse tensor's layout class, shape and stored positions.

    >>> import torch, sten_core as sten
    >>> a = sten.sparsify(sten.KeepAll(), torch.eye(3), sten.CsrTensor)
    >>> b = sten.sparsify(sten.KeepAll(), torch.eye(3).flip(0), sten.CsrTensor)
    >>> pattern_fingerprint(a)[0] == pattern_fingerprint(b)[0], pattern_fingerprint(a) == pattern_fingerprint(b)
    (True, False)
    """
    from sten_core.training.schedule import stored_mask

    mask = stored_mask(tensor).detach().to("cpu", torch.bool).contiguous()
    layout = type(tensor.wrapped_tensor)
    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"{layout.__module__}.{layout.__qualname__}{tuple(tensor.shape)}".encode())
    digest.update(np.packbits(mask.numpy().reshape(-1)).tobytes())
    return int(mask.sum()), int.from_bytes(digest.digest(), "little", signed=True)


def check_same_patterns(model: torch.nn.Module, group: Any = None) -> None:
    """Raise ``ValueError`` (on every rank) unless each sparse parameter of ``model``
    has the same layout, shape and stored positions on all ranks of ``group``."""
    if not dist.is_initialized():
        raise RuntimeError("check_same_patterns needs an initialised process group (torch.distributed.init_process_group)")
    sparse = _sparse_parameters(model)
    mine = torch.tensor([[len(sparse), 0]] + [list(pattern_fingerprint(p)) for _, p in sparse], dtype=torch.int64,
                        device=collective_device(group))
    world = dist.get_world_size(group)
    counts = [torch.zeros(1, dtype=torch.int64, device=mine.device) for _ in range(world)]
    dist.all_gather(counts, mine[:1, 0].contiguous(), group=group)
    if len({int(c) for c in counts}) != 1:
        raise ValueError(f"the ranks hold different numbers of sparse parameters: {[int(c) for c in counts]}")
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    problems = []
    for i, (name, _) in enumerate(sparse, start=1):
        nnz0, hash0 = gathered[0][i].tolist()
        for rank in range(1, world):
            nnz, h = gathered[rank][i].tolist()
            if nnz != nnz0:
                problems.append(f"{name}: rank {rank} stores {nnz} positions, rank 0 {nnz0}")
            elif h != hash0:
                problems.append(f"{name}: rank {rank} stores {nnz} positions like rank 0, but other ones "
                                "(or another layout)")
    if problems:
        raise ValueError(
            "sparse parameters have different patterns across ranks; averaging their stored values would mix "
            "values of different positions. Build the sparse model identically on every rank (the same seed and "
            "sparsifiers) before wrapping it: " + "; ".join(problems)
        )


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
    group = ddp_kwargs.get("process_group")
    check_same_patterns(model, group)
    for name, param in sparse:
        with torch.no_grad():
            dist.broadcast(_payload(param), src=_group_rank0(group), group=group)
        param.register_post_accumulate_grad_hook(_reduce_grad if group is None else _reducer(group))
    return torch.nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
