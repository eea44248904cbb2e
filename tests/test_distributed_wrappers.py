"""Sparse wrappers handed to torch.distributed and torch.multiprocessing as they are.

- ``dist.all_reduce(w)`` / ``dist.broadcast(w)`` on a wrapper ran on a dense copy and left the
  wrapper unchanged on every rank (silently): collectives now write back at the stored positions.
- Plain DDP copying its averaged gradient into a ``.grad`` whose pattern differs per rank (a
  ``grad_fmt`` with a sparsifier) drops values there: a DispatchWarning names ``sparse_ddp``.
- FSDP (``fully_shard``, ``FullyShardedDataParallel``) sharded sparse parameters as dense copies
  and trained them dense: it now gets a ``NotImplementedError`` naming FSDP and the layout.
- ``sparse_ddp`` on a model with a frozen sparse weight raised torch's hook error.
- A spawned worker given an n:m or scipy model died unpickling it (the layouts' pickled state
  tensors were temporaries, freed before the worker opened their shared memory).
"""

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sten_core as sten
from sten_core.training.distributed import sparse_ddp

from test_ddp import _leave, free_port

DENSE = torch.tensor([[1.0, 0.0, 2.0, 0.0], [0.0, 3.0, 0.0, 4.0]])


def collective_worker(rank, world, port, out_path):
    from sten_nm import NMTensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        for layout in (sten.CsrTensor, NMTensor):
            make = (lambda t: NMTensor.from_dense(t, n=2, m=4)) if layout is NMTensor else layout.from_dense
            for name, run in (("all_reduce", lambda t: dist.all_reduce(t)), ("broadcast", lambda t: dist.broadcast(t, 0))):
                w = sten.SparseTensorWrapper(make(DENSE * (rank + 1)))
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", sten.DispatchWarning)
                    run(w)
                results[f"{layout.__name__} {name}"] = w.to_dense()
        torch.manual_seed(0)   # plain DDP and a gradient sparsified per rank
        model = torch.nn.Sequential(torch.nn.Linear(6, 4))
        sb = sten.SparsityBuilder(model)
        sb.set_weight("0.weight", sten.ScalarFractionSparsifier(0.5), out_format=sten.CsrTensor)
        sb.set_weight_grad("0.weight", sten.ScalarFractionSparsifier(0.8), sten.CsrTensor, sten.KeepAll(), sten.CsrTensor)
        model = sb.get_sparse_model()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", sten.DispatchWarning)
            ddp(torch.randn(5, 6, generator=torch.Generator().manual_seed(rank))).pow(2).sum().backward()
        results["ddp warnings"] = [str(w.message) for w in caught]
        results["ddp grad"] = model[0].weight.grad.to_dense()
        torch.save(results, f"{out_path}.{rank}")
    finally:
        dist.destroy_process_group()
    _leave()


def test_collectives_on_wrappers_and_plain_ddp_with_per_rank_patterns(tmp_path):
    pytest.importorskip("sten_nm")
    out = str(tmp_path / "collectives")
    mp.start_processes(collective_worker, args=(2, free_port(), out), nprocs=2, join=True, start_method="spawn")
    ranks = [torch.load(f"{out}.{r}", weights_only=True) for r in range(2)]
    for rank in ranks:
        for layout in ("CsrTensor", "NMTensor"):
            torch.testing.assert_close(rank[f"{layout} all_reduce"], DENSE * 3)
            torch.testing.assert_close(rank[f"{layout} broadcast"], DENSE)
    # DDP copies the averaged gradient into each rank's .grad, a wrapper that is not a weight: it
    # takes it exactly (its pattern grows), so the ranks agree (it was kept at each rank's own
    # pattern, and the ranks drifted apart, warned)
    dropped = [m for m in ranks[0]["ddp warnings"] + ranks[1]["ddp warnings"] if "positions it does not store" in m]
    assert not dropped
    torch.testing.assert_close(ranks[0]["ddp grad"], ranks[1]["ddp grad"])


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sparse_mlp(frozen=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    sb = sten.SparsityBuilder(model)
    sb.set_weight("0.weight", sten.ScalarFractionSparsifier(0.7), out_format=sten.CsrTensor)
    model = sb.get_sparse_model()
    model[0].weight.requires_grad_(not frozen)
    return model


@pytest.mark.parametrize("fsdp", ["fully_shard", "FSDP(use_orig_params=False)", "FSDP(use_orig_params=True)"])
def test_fsdp_refuses_sparse_parameters_by_name(one_rank, fsdp):
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    model = sparse_mlp()
    wrap = {"fully_shard": fully_shard,
            "FSDP(use_orig_params=False)": lambda m: FullyShardedDataParallel(m, device_id=torch.device("cpu")),
            "FSDP(use_orig_params=True)": lambda m: FullyShardedDataParallel(
                m, device_id=torch.device("cpu"), use_orig_params=True)}[fsdp]
    with warnings.catch_warnings(), pytest.raises(NotImplementedError, match=r"FSDP .* sparse CsrTensor parameter"):
        warnings.simplefilter("ignore")
        wrap(model)


def test_sparse_ddp_broadcasts_a_frozen_sparse_weight_and_trains_the_rest(one_rank):
    model = sparse_mlp(frozen=True)
    before = model[0].weight.to_dense().clone()
    ddp = sparse_ddp(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ddp(torch.randn(4, 12)).sum().backward()
    opt.step()
    assert model[0].weight.grad is None
    torch.testing.assert_close(model[0].weight.to_dense(), before)


def _send_back(model, queue):
    queue.put([p.to_dense().tolist() if isinstance(p, sten.SparseTensorWrapper) else p.tolist()
               for p in model.parameters()])


def test_a_spawned_worker_receives_nm_and_scipy_models():
    sten_nm = pytest.importorskip("sten_nm")
    sten_scipy = pytest.importorskip("sten_scipy")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Linear(16, 4))
    sb = sten.SparsityBuilder(model)
    sb.set_weight("0.weight", sten_nm.NMSparsifier(2, 4), out_format=sten_nm.NMTensor)
    sb.set_weight("1.weight", sten.ScalarFractionSparsifier(0.5), out_format=sten_scipy.ScipyCsrTensor)
    model = sb.get_sparse_model()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    worker = ctx.Process(target=_send_back, args=(model, queue))
    worker.start()
    got = queue.get(timeout=120)
    worker.join(60)
    assert worker.exitcode == 0
    _send_back(model, queue)
    assert got == queue.get(timeout=10)
