"""DDP with 2 gloo ranks on loopback equals one process on the whole batch."""

import gc
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sten_core as sten
from sten_core.distributed import sparse_ddp

STEPS = 5


def make_model(grad_layout):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    sb = sten.SparsityBuilder(model)
    for name in ("0.weight", "2.weight"):
        sb.set_weight(name, initial_sparsifier=sten.ScalarFractionSparsifier(0.7), out_format=sten.CsrTensor)
        if grad_layout is not None:
            sb.set_weight_grad(name, sten.KeepAll(), grad_layout, sten.KeepAll(), grad_layout)
    return sb.get_sparse_model()


def data():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, 8, 12, generator=gen), torch.randint(0, 3, (STEPS, 8), generator=gen)


def live_tensors():
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def train(model, xs, ys, ddp=None):
    net = ddp or model
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    counts = []
    for x, y in zip(xs, ys):
        loss = torch.nn.functional.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        del loss
        counts.append(live_tensors())
    params = {n: (p.to_dense() if isinstance(p, sten.SparseTensorWrapper) else p.detach()).clone() for n, p in model.named_parameters()}
    params["live_tensors"] = torch.tensor(counts)
    return params


def worker(rank, world, port, grad_layout, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = make_model(grad_layout)
        xs, ys = data()
        per = xs.shape[1] // world
        params = train(model, xs[:, rank * per:(rank + 1) * per], ys[:, rank * per:(rank + 1) * per], sparse_ddp(model))
        torch.save(params, f"{out_path}.{rank}")
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("grad_layout", [None, sten.CsrTensor])
def test_ddp_two_ranks_match_single_process(tmp_path, grad_layout):
    out = str(tmp_path / "params")
    mp.start_processes(worker, args=(2, free_port(), grad_layout, out), nprocs=2, join=True, start_method="spawn")
    ranks = [torch.load(f"{out}.{r}", weights_only=True) for r in range(2)]
    xs, ys = data()
    single = train(make_model(grad_layout), xs, ys)
    for r in range(2):  # nothing accumulates from step to step
        counts = ranks[r].pop("live_tensors")
        assert len(set(counts[1:].tolist())) == 1, counts
    single.pop("live_tensors")
    for name in single:
        torch.testing.assert_close(ranks[0][name], ranks[1][name], rtol=0, atol=0)
        torch.testing.assert_close(ranks[0][name], single[name], rtol=1e-5, atol=1e-5)
