"""Data-parallel training of sparse models.

``DistributedDataParallel`` reduces gradients through flat buckets of dense
storage, which sparse wrappers do not have. ``sparse_ddp(model)`` therefore
hands DDP the dense parameters only and reduces each sparse parameter's
gradient itself, averaged like DDP does:

* a dense gradient (``grad_fmt`` None, or a dense ``out_format`` without
  sparsifiers) is all-reduced densely;
* a gradient kept in the weight's layout (``(KeepAll(), L, KeepAll(), L)`` with
  ``L`` the weight's layout: the gradient at the weight's stored positions, the
  same pattern on every rank) has its stored values all-reduced (O(nnz));
* any other ``grad_fmt`` (a sparsifier, which chooses each rank's pattern from
  its own values, or another layout) is reduced before it is applied:
  ``sparse_ddp`` sets the parameter's ``grad_fmt`` to ``None`` (dense), all-reduces
  the dense gradient, then applies the format once, identically on every rank
  (random sparsifiers draw from one seed shared by the ranks). The result equals
  one process on the whole batch for a deterministic format.

Sparse parameters are broadcast from rank 0 at the start. Gradients are
reduced at the end of each backward pass, in one order on every rank (a
parameter that a rank did not use takes part with zeros): with a re-sparsifying ``grad_fmt``, call
``optimizer.zero_grad()`` every step (``no_sync`` accumulation formats each
backward's gradient on its own); dense and pattern-keeping ones accumulate fine.

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

import gc
import hashlib
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from sten_core.model.layouts import supports_values
from sten_core.model.masks import stored_mask
from sten_core.model.spec import OutputSpec
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


def _stored(tensor: Any, payload: torch.Tensor) -> None:
    """``payload`` (``_payload(tensor)`` after a collective wrote it) made ``tensor``'s values where
    ``values()`` gave a copy (a ``DenseTensor`` whose data is not contiguous): the broadcast at
    ``sparse_ddp`` and the gradient average went into the copy and were lost."""
    if isinstance(tensor, SparseTensorWrapper):
        layout = tensor.wrapped_tensor
        if layout.values().data_ptr() != payload.data_ptr():
            tensor.wrapped_tensor = layout.with_values(payload)


def reduces_in_place(param: SparseTensorWrapper) -> bool:
    """Whether ``param``'s gradient, as its ``grad_fmt`` gives it, can be averaged as is:
    dense (a dense ``out_format`` without sparsifiers), or kept in the weight's layout at
    its stored positions (the same pattern on every rank). Otherwise the ranks' patterns
    may differ, and the gradient is reduced densely before its format is applied.

    >>> import torch, sten_core as sten
    >>> w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.eye(2)))
    >>> w.grad_fmt = (sten.KeepAll(), sten.CsrTensor, sten.KeepAll(), sten.CsrTensor)
    >>> reduces_in_place(w)
    True
    >>> w.grad_fmt = (sten.ScalarFractionSparsifier(0.5), sten.CsrTensor, sten.KeepAll(), sten.CsrTensor)
    >>> reduces_in_place(w)
    False
    """
    if param.grad_fmt is None:
        return True
    spec = OutputSpec.coerce(param.grad_fmt, "grad_fmt")
    if not spec.keeps_all:
        return False
    if spec.out_format is torch.Tensor:
        return True  # a dense gradient: the dense sum is the sum
    layout = type(param.wrapped_tensor)
    return spec.out_format is layout and spec.tmp_format is layout and supports_values(param.wrapped_tensor)


def _zero_grad_of(param: SparseTensorWrapper) -> Any:
    """What a rank that did not use ``param`` contributes to its average: zeros in the form its
    ``grad_fmt`` gives (dense, or the weight's layout at its stored positions)."""
    spec = None if param.grad_fmt is None else OutputSpec.coerce(param.grad_fmt, "grad_fmt")
    if spec is None or spec.out_format is torch.Tensor:
        return torch.zeros(param.shape, dtype=param.dtype, device=param.device)
    layout = param.wrapped_tensor
    return SparseTensorWrapper(layout.with_values(torch.zeros_like(layout.values())), False, None)


def _reduce_grad(param: SparseTensorWrapper, group: Any = None) -> None:
    """Average ``param``'s gradient over the ranks in place (dense, or its stored values); a
    rank without one takes part with zeros and gets the average."""
    grad = param.grad
    if grad is None:
        grad = param.grad = _zero_grad_of(param)
    if isinstance(grad, SparseTensorWrapper) and not _same_structure(grad, param):
        raise RuntimeError(
            f"sparse_ddp: the gradient of a {type(param.wrapped_tensor).__name__} parameter is a "
            f"{type(grad.wrapped_tensor).__name__} with {grad.wrapped_tensor.nnz} stored values, not the weight's "
            f"pattern ({param.wrapped_tensor.nnz}); its stored values cannot be averaged by position")
    payload = _payload(grad)
    dist.all_reduce(payload, group=group)
    payload.div_(dist.get_world_size(group))
    _stored(grad, payload)


def _same_structure(grad: SparseTensorWrapper, param: SparseTensorWrapper) -> bool:
    """A cheap check that a pattern-keeping gradient has the weight's layout and size."""
    return type(grad.wrapped_tensor) is type(param.wrapped_tensor) and grad.wrapped_tensor.nnz == param.wrapped_tensor.nnz


class _ReduceThenFormat:
    """The reduction of a parameter whose ``grad_fmt`` does not keep one pattern
    across ranks: average the dense gradient, then apply the format (``apply_grad_spec``,
    as eager's backward does), identically on every rank.

    Random sparsifiers draw from ``seed`` (shared by the ranks) plus a call counter."""

    def __init__(self, grad_fmt: Any, group: Any, seed: int):
        self.spec = OutputSpec.coerce(grad_fmt, "grad_fmt")
        self.group, self.seed, self.calls = group, seed, 0

    def __call__(self, param: SparseTensorWrapper) -> None:
        from sten_core.dispatch.sparsifier_dispatch import apply_grad_spec

        grad = param.grad
        if grad is None:   # not used on this rank: zeros in the average
            dense = torch.zeros(param.shape, dtype=param.dtype, device=param.device)
        else:
            dense = grad.to_dense() if isinstance(grad, SparseTensorWrapper) else grad
            dense = dense.contiguous()
        dist.all_reduce(dense, group=self.group)
        dense.div_(dist.get_world_size(self.group))
        self.calls += 1
        devices = [dense.device] if dense.device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.seed + self.calls)
            param.grad = apply_grad_spec(dense, self.spec, param)


def _reducer(param: SparseTensorWrapper, group: Any, seed: int) -> Any:
    """The function reducing ``param``'s gradient (see ``reduces_in_place``); a
    ``_ReduceThenFormat`` also makes the parameter's own gradient dense."""
    if reduces_in_place(param):
        return lambda p: _reduce_grad(p, group)
    hook = _ReduceThenFormat(param.grad_fmt, group, seed)
    param.grad_fmt = None
    return hook


class _EndOfBackwardReduction:
    """Reduces the sparse parameters' gradients once a backward pass has finished, all of them
    in one fixed order on every rank, whether this rank used each or not.

    Reducing each gradient when it was accumulated paired the ranks' collectives in the order
    each rank accumulated them: a sparse parameter that one rank did not use (a branch taken
    by some ranks only) shifted the pairing, so two weights' gradients of equal size were mixed
    silently (gloo aborted where the sizes differed). Now a parameter's accumulation, or the
    model's output reached by the backward, queues this reduction at the end of the backward
    (``queue_callback``): one all-reduce of which parameters each rank used, then each
    parameter some rank used is averaged, a rank that did not use it taking part with zeros
    (as DDP's ``find_unused_parameters``); one no rank used keeps its gradient as it was."""

    def __init__(self, params: list, group: Any, model: torch.nn.Module):
        self.params = [param for param, _ in params]
        self.reducers = [reduce for _, reduce in params]
        self.group = group
        self.trained = [p for p in model.parameters() if p.requires_grad]
        self.used: set[int] = set()
        self.queued = False

    def accumulated(self, param: SparseTensorWrapper) -> None:
        """A parameter's post-accumulate-grad hook."""
        self.used.add(id(param))
        self.queue()

    def queue(self, *_: Any) -> None:
        """Queue the reduction at the end of the running backward (once per backward)."""
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.reduce)

    def output_reached(self, grad: Any) -> None:
        """The hook on the model's outputs: a backward that accumulates into a parameter of the
        model (a training step, on a rank that may have used no sparse parameter) takes part;
        ``torch.autograd.grad`` of an input (a saliency map on one rank) does not."""
        will_run = torch._C._will_engine_execute_node
        try:
            accumulates = any(will_run(torch.autograd.graph.get_gradient_edge(p).node)
                              for p in self.trained if p.requires_grad)   # (frozen since: no edge)
        except RuntimeError:   # torch.autograd.grad with respect to a parameter: nothing accumulates
            return
        if accumulates:
            self.queue()

    def watch(self, module: Any, inputs: Any, output: Any) -> None:
        """A forward hook: the backward through the model's output may queue the reduction
        (``output_reached``), so a rank that used none of the sparse parameters takes part too."""
        from sten_core.model.tensor import map_tensors

        if self.queued and torch._C._current_graph_task_id() == -1:
            # a forward outside any backward while a reduction is queued: the backward that queued
            # it raised before its end, so it never ran (and would never be queued again)
            self.queued = False
            self.used.clear()
        if torch.is_grad_enabled():
            map_tensors(lambda t: t.register_hook(self.output_reached) if t.requires_grad else None, output)

    def reduce(self) -> None:
        used = torch.tensor([id(p) in self.used for p in self.params], dtype=torch.int64,
                            device=collective_device(self.group))
        self.used.clear()
        self.queued = False
        dist.all_reduce(used, group=self.group)
        for param, reduce, count in zip(self.params, self.reducers, used.tolist()):
            if count:
                reduce(param)


def _shared_seed(group: Any) -> int:
    """Rank 0's ``torch.initial_seed()``, broadcast to every rank (no random number is drawn)."""
    seed = torch.tensor([torch.initial_seed() % 2**62], dtype=torch.int64, device=collective_device(group))
    dist.broadcast(seed, src=_group_rank0(group), group=group)
    return int(seed.item())


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


def ddp_wrappers(model: torch.nn.Module) -> list[torch.nn.parallel.DistributedDataParallel] | None:
    """The ``DistributedDataParallel`` modules that hold ``model``: ``model`` itself or its
    submodules, else those built on it (looked for among the live objects, O(heap): call it
    once); ``None`` without an initialised process group.

    >>> ddp_wrappers(torch.nn.Linear(2, 2)) is None   # no process group
    True
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    ddp = torch.nn.parallel.DistributedDataParallel
    wrappers = [m for m in model.modules() if isinstance(m, ddp)]
    return wrappers or [o for o in gc.get_objects() if issubclass(type(o), ddp) and o.module is model]


def reduces(wrapper: torch.nn.parallel.DistributedDataParallel, param: torch.Tensor) -> bool:
    """Whether DDP ``wrapper`` reduces ``param`` (DDP keeps the parameter objects it was
    built with: a parameter swapped in afterwards is one it never reduces)."""
    return any(p is param for p in getattr(wrapper, "_module_parameters", None) or wrapper.parameters())


def sparse_ddp(model: torch.nn.Module, **ddp_kwargs: Any) -> torch.nn.Module:
    """Wrap a sparse model for data-parallel training (gloo or nccl).

    Args:
        model: a model whose sparse parameters are ``SparseParameterWrapper``.
        ddp_kwargs: passed to ``DistributedDataParallel``.

    A sparse parameter whose ``grad_fmt`` re-sparsifies (``reduces_in_place`` is
    False) gets ``grad_fmt = None``: its gradient is averaged densely, then formatted.
    A sparse parameter that does not require grad when wrapped is broadcast and never
    reduced (as DDP does with its dense ones): unfreeze before wrapping. A model whose only
    trainable parameters are sparse is returned itself (its hooks reduce every gradient; DDP
    refuses a model with nothing for it to reduce).

    The sparse gradients are reduced at the end of each backward pass, in one order on every
    rank: a sparse parameter that some ranks do not use (a branch) is averaged with zeros from
    those ranks, as DDP's ``find_unused_parameters`` does with dense ones. Every rank must run
    each training backward through the model's output or one of its sparse parameters (a rank
    whose loss reaches neither does not take part, and the others wait for it); a backward that
    accumulates into no parameter (``torch.autograd.grad`` of an input) reduces nothing.
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
    seed = _shared_seed(group)
    trained = []
    for index, (name, param) in enumerate(sparse):
        with torch.no_grad():
            payload = _payload(param)
            dist.broadcast(payload, src=_group_rank0(group), group=group)
            _stored(param, payload)
        if param.requires_grad:  # a frozen one is broadcast only, as DDP treats its own
            # (a seed per parameter: random grad_fmt masks of two same-shape weights were identical)
            trained.append((param, _reducer(param, group, seed + 1_000_003 * index)))
    if trained:
        reduction = _EndOfBackwardReduction(trained, group, model)
        for param, _ in trained:
            param.register_post_accumulate_grad_hook(reduction.accumulated)
        model.register_forward_hook(reduction.watch)
    sparse_ids = {id(p) for _, p in sparse}
    if not any(p.requires_grad and id(p) not in sparse_ids for p in model.parameters()):
        return model   # nothing left for DDP, which refuses a model without a parameter to reduce
    return torch.nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
