"""DDP with 2 gloo ranks on loopback equals one process on the whole batch."""

import gc
import os
import re
import sys
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sten_core as sten
from sten_core.training.distributed import sparse_ddp

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
    _leave()


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


# -- patterns across ranks, the collective device, plain DistributedDataParallel -------------

def mismatch_worker(rank, world, port, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(rank)  # another pattern per rank, with the same nnz
        model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        sb = sten.SparsityBuilder(model)
        sb.set_weight("0.weight", initial_sparsifier=sten.ScalarFractionSparsifier(0.7), out_format=sten.CsrTensor)
        sb.set_weight("2.weight", initial_sparsifier=sten.ScalarFractionSparsifier(0.7), out_format=sten.CsrTensor)
        model = sb.get_sparse_model()
        with torch.no_grad():  # 2.weight: the same pattern on both ranks, other values
            model[2].weight.wrapped_tensor = sten.CsrTensor.from_dense(torch.ones(3, 16) * (rank + 1))
        try:
            sparse_ddp(model)
            message = "no error"
        except ValueError as error:
            message = str(error)
        with open(f"{out_path}.{rank}", "w") as f:
            f.write(message)
    finally:
        dist.destroy_process_group()


def test_sparse_ddp_rejects_different_patterns_with_equal_nnz(tmp_path):
    out = str(tmp_path / "msg")
    mp.start_processes(mismatch_worker, args=(2, free_port(), out), nprocs=2, join=True, start_method="spawn")
    for rank in range(2):
        message = open(f"{out}.{rank}").read()
        assert "different patterns across ranks" in message, message
        assert "0.weight: rank 1 stores 58 positions like rank 0, but other ones" in message
        assert "2.weight" not in message, "equal patterns with other values are fine (values are broadcast)"


def test_collective_device(monkeypatch):
    import sten_core.training.distributed as sd

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert sd.collective_device() == torch.device("cpu")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    if torch.cuda.is_available():
        assert sd.collective_device() == torch.device("cuda", torch.cuda.current_device())
    else:
        with pytest.raises(RuntimeError, match="NCCL, which needs CUDA"):
            sd.collective_device()


def test_pattern_fingerprint_sees_positions_layout_and_shape():
    from sten_core.training.distributed import pattern_fingerprint

    x = torch.randn(6, 8)
    a = sten.sparsify(sten.ScalarFractionSparsifier(0.5), x, sten.CsrTensor)
    b = sten.sparsify(sten.ScalarFractionSparsifier(0.5), -x.flip(1), sten.CsrTensor)
    assert pattern_fingerprint(a) == pattern_fingerprint(sten.sparsify(sten.ScalarFractionSparsifier(0.5), 2 * x, sten.CsrTensor))
    assert pattern_fingerprint(a)[0] == pattern_fingerprint(b)[0] and pattern_fingerprint(a) != pattern_fingerprint(b)
    assert pattern_fingerprint(a) != pattern_fingerprint(sten.sparsify(sten.ScalarFractionSparsifier(0.5), x, sten.CooTensor))


def _leave() -> None:
    """End a worker without the interpreter's teardown: about 1 run in 12 on a loaded 2-core
    machine, a C++ thread of torch/gloo still joinable at exit aborted a worker ("terminate
    called without an active exception") after its results were saved; the saved results are
    what the tests compare. An exception in the worker still fails the test (raised before)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def plain_model(seed=0):
    from sten_nm import NMSparsifier, NMTensor

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    sb = sten.SparsityBuilder(model)
    sb.set_weight("0.weight", initial_sparsifier=sten.ScalarFractionSparsifier(0.7), out_format=sten.CsrTensor)
    sb.set_weight("2.weight", initial_sparsifier=NMSparsifier(2, 4), out_format=NMTensor)
    return sb.get_sparse_model()


def plain_train(model, xs, ys, net=None):
    net = net or model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in zip(xs, ys):
        loss = torch.nn.functional.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = {n: (p.to_dense() if isinstance(p, sten.SparseTensorWrapper) else p.detach()).clone() for n, p in model.named_parameters()}
    out["layouts"] = [type(model[0].weight.wrapped_tensor).__name__, type(model[2].weight.wrapped_tensor).__name__]
    return out


def plain_worker(rank, world, port, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from sten_core.training.distributed import check_same_patterns

        model = plain_model()
        check_same_patterns(model)
        xs, ys = data()
        per = xs.shape[1] // world
        params = plain_train(model, xs[:, rank * per:(rank + 1) * per], ys[:, rank * per:(rank + 1) * per],
                             torch.nn.parallel.DistributedDataParallel(model))
        torch.save(params, f"{out_path}.{rank}")
    finally:
        dist.destroy_process_group()
    _leave()


def test_plain_ddp_keeps_csr_and_nm_ranks_bit_identical(tmp_path):
    out = str(tmp_path / "plain")
    mp.start_processes(plain_worker, args=(2, free_port(), out), nprocs=2, join=True, start_method="spawn")
    ranks = [torch.load(f"{out}.{r}", weights_only=True) for r in range(2)]
    xs, ys = data()
    single = plain_train(plain_model(), xs, ys)
    before = plain_model()
    assert ranks[0].pop("layouts") == ranks[1].pop("layouts") == single.pop("layouts") == ["CsrTensor", "NMTensor"]
    for name in single:
        assert torch.equal(ranks[0][name], ranks[1][name]), f"{name} differs between the ranks"
        torch.testing.assert_close(ranks[0][name], single[name], rtol=1e-5, atol=1e-5)
    for name in ("0.weight", "2.weight"):  # trained, inside the pattern
        initial = before.get_parameter(name).to_dense()
        assert not torch.equal(ranks[0][name], initial)
        assert not bool(((ranks[0][name] != 0) & (initial == 0)).any())


@pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(), reason="needs CUDA and NCCL")
def test_sparse_ddp_on_nccl_single_rank(tmp_path):
    """NCCL rejects CPU tensors: the pattern check and the broadcast run on the GPU."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        model = make_model(None)
        for module in model:  # onto the GPU by hand (moving sparse parameters is another issue's)
            for attr, p in list(module.named_parameters(recurse=False)):
                dense = (p.to_dense() if isinstance(p, sten.SparseTensorWrapper) else p.detach()).cuda()
                setattr(module, attr, sten.SparseParameterWrapper(sten.CsrTensor.from_dense(dense))
                        if isinstance(p, sten.SparseTensorWrapper) else torch.nn.Parameter(dense))
        ddp = sparse_ddp(model)
        ddp(torch.randn(4, 12, device="cuda")).sum().backward()
    finally:
        dist.destroy_process_group()


# -- gradient formats whose pattern differs per rank: reduced densely, then formatted ----------

def grad_format(kind):
    """A weight-gradient format that chooses its own pattern (sparsifier) or layout."""
    if kind == "topk-csr":     # the 10 % largest entries of the (averaged) gradient, in CSR
        return (sten.ScalarFractionSparsifier(0.9), sten.CsrTensor, sten.KeepAll(), sten.CsrTensor)
    if kind == "topk-dense":   # a masked dense gradient
        return (sten.ScalarFractionSparsifier(0.8), torch.Tensor, sten.KeepAll(), torch.Tensor)
    if kind == "coo":          # a CSR weight's gradient at its positions, as COO (another layout)
        return (sten.KeepAll(), sten.CooTensor, sten.KeepAll(), sten.CooTensor)
    if kind == "random-csr":   # not deterministic: the ranks must still agree
        return (sten.RandomFractionSparsifier(0.7), sten.CsrTensor, sten.KeepAll(), sten.CsrTensor)
    raise ValueError(kind)


def format_model(kind):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    sb = sten.SparsityBuilder(model)
    sb.set_weight("0.weight", initial_sparsifier=sten.ScalarFractionSparsifier(0.5), out_format=sten.CsrTensor)
    sb.set_weight_grad("0.weight", *grad_format(kind))
    return sb.get_sparse_model()


def format_worker(rank, world, port, kind, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = format_model(kind)
        xs, ys = data()
        per = xs.shape[1] // world
        ddp = sparse_ddp(model)
        x, y = xs[0, rank * per:(rank + 1) * per], ys[0, rank * per:(rank + 1) * per]
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        grad = model[0].weight.grad
        first = {"grad": grad.to_dense() if isinstance(grad, sten.SparseTensorWrapper) else grad.clone(),
                 "grad_layout": type(getattr(grad, "wrapped_tensor", grad)).__name__}
        model.zero_grad()
        params = train(model, xs[:, rank * per:(rank + 1) * per], ys[:, rank * per:(rank + 1) * per], ddp)
        params.pop("live_tensors")
        torch.save({**params, **first}, f"{out_path}.{rank}")
    finally:
        dist.destroy_process_group()
    _leave()


@pytest.mark.parametrize("kind", ["topk-csr", "topk-dense", "coo", "random-csr"])
def test_sparse_ddp_reduces_re_sparsified_gradients_before_formatting(tmp_path, kind):
    """Each rank's re-sparsified gradient has its own pattern: averaging stored values by
    position mixed positions (rank 0 got rank 1's values at its own positions) and the ranks
    drifted apart. The dense gradient is averaged first, then formatted once."""
    out = str(tmp_path / "fmt")
    mp.start_processes(format_worker, args=(2, free_port(), kind, out), nprocs=2, join=True, start_method="spawn")
    ranks = [torch.load(f"{out}.{r}", weights_only=True) for r in range(2)]
    for name in ranks[0]:
        if name == "grad_layout":
            assert ranks[0][name] == ranks[1][name]
            continue
        assert torch.equal(ranks[0][name], ranks[1][name]), f"{name} differs between the ranks"
    if kind == "random-csr":
        return
    xs, ys = data()
    single = format_model(kind)
    torch.nn.functional.cross_entropy(single(xs[0]), ys[0]).backward()
    grad = single[0].weight.grad
    assert ranks[0].pop("grad_layout") == type(getattr(grad, "wrapped_tensor", grad)).__name__
    want = grad.to_dense() if isinstance(grad, sten.SparseTensorWrapper) else grad
    torch.testing.assert_close(ranks[0].pop("grad"), want, rtol=1e-5, atol=1e-6)
    single.zero_grad()
    reference = train(single, xs, ys)
    reference.pop("live_tensors")
    for name in reference:
        torch.testing.assert_close(ranks[0][name], reference[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["topk-csr", "topk-dense", "coo", "random-csr"])
def test_reduces_in_place_only_for_one_pattern_across_ranks(kind):
    from sten_core.training.distributed import reduces_in_place

    assert not reduces_in_place(format_model(kind)[0].weight)
    assert all(reduces_in_place(make_model(layout)[0].weight) for layout in (None, sten.CsrTensor))


def test_scheduler_add_after_ddp_wrapping_is_a_clear_error(tmp_path):
    """Swapping a dense parameter that DDP already reduces used to surface one iteration later
    as DDP's "Expected to have finished reduction in the prior iteration"."""
    from sten_core.training.schedule import OneShot, SparsityScheduler

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        for scheduled, name in ((model, "0.weight"), (ddp, "module.0.weight")):
            sched = SparsityScheduler(scheduled, torch.optim.SGD(model.parameters(), lr=0.1))
            with pytest.raises(ValueError, match=rf"weight '{re.escape(name)}' is a dense parameter that "
                                                 r"DistributedDataParallel already reduces.*before wrapping the model"):
                sched.add(name, OneShot(0.5))
            assert type(model[0].weight) is torch.nn.Parameter and not sched.entries
        sched.add("module.2.weight", OneShot(0.5), layout=torch.Tensor)   # a masked dense weight stays the parameter
        ddp(torch.randn(4, 12)).sum().backward()
    finally:
        dist.destroy_process_group()


def edge_worker(rank, world, port, out_path):
    """Four cases that went wrong under ``sparse_ddp`` (see the test)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = {}
        torch.manual_seed(rank)   # other values per rank: the start broadcast must make them rank 0's
        w0 = torch.randn(6, 4)
        dense_t = sten.SparseParameterWrapper(sten.DenseTensor(w0.t()))   # data not contiguous
        random_fmt = (sten.RandomFractionSparsifier(0.5), sten.CsrTensor, sten.KeepAll(), sten.CsrTensor)
        a = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.ones(8, 8)), grad_fmt=random_fmt)
        b = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.ones(8, 8)), grad_fmt=random_fmt)
        model = torch.nn.Module()
        model.t, model.a, model.b = dense_t, a, b   # only sparse parameters: DDP itself would refuse it
        wrapped = sparse_ddp(model)
        result["returned"] = type(wrapped).__name__
        result["t"] = dense_t.to_dense().clone()
        (a.sum() + b.sum()).backward()
        result["same mask"] = torch.equal(a.grad.to_dense() != 0, b.grad.to_dense() != 0)
        result["a grad nnz"] = a.grad.wrapped_tensor.nnz
        dist.broadcast(a, src=0)      # outside no_grad, on a parameter that requires grad, as dense allows
        dist.all_reduce(b)
        result["b"] = b.to_dense().clone()
        torch.save(result, f"{out_path}.{rank}")
    finally:
        dist.destroy_process_group()
    _leave()


def test_sparse_ddp_edges(tmp_path):
    """A non-contiguous ``DenseTensor`` weight kept each rank's values (the broadcast went into a
    copy ``values()`` made); a random ``grad_fmt`` gave two same-shape weights one mask every step
    (one seed for all); a model of sparse parameters only failed in DDP ("DistributedDataParallel
    is not needed when a module doesn't have any parameter that requires a gradient"); and
    ``dist.broadcast`` / ``all_reduce`` of a sparse parameter outside ``no_grad`` raised "a leaf
    Variable that requires grad is being used in an in-place operation", where dense works."""
    out = str(tmp_path / "edge")
    mp.start_processes(edge_worker, args=(2, free_port(), out), nprocs=2, join=True, start_method="spawn")
    r0, r1 = (torch.load(f"{out}.{rank}", weights_only=False) for rank in range(2))
    assert r0["returned"] == r1["returned"] == "Module"
    torch.manual_seed(0)
    torch.testing.assert_close(r1["t"], torch.randn(6, 4).t())
    torch.testing.assert_close(r0["t"], r1["t"])
    assert not r0["same mask"] and 0 < r0["a grad nnz"] < 64
    torch.testing.assert_close(r0["b"], 2 * torch.ones(8, 8))


# -- sparse parameters that some ranks do not use -------------------------------------------

class Branches(torch.nn.Module):
    """Two sparse bias-free branches of equal nnz and a dense head; ``route`` picks the branches."""

    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(6, 6, bias=False), torch.nn.Linear(6, 6, bias=False)
        self.head = torch.nn.Linear(6, 2)
        sb = sten.SparsityBuilder(self)
        for name in ("a.weight", "b.weight"):
            sb.set_weight(name, initial_sparsifier=sten.ScalarFractionSparsifier(0.5), out_format=sten.CsrTensor)
            if kind == "csr":   # the gradient at the weight's positions: its stored values are averaged
                sb.set_weight_grad(name, sten.KeepAll(), sten.CsrTensor, sten.KeepAll(), sten.CsrTensor)
            elif kind is not None:
                sb.set_weight_grad(name, *grad_format(kind))
        sb.sparsify_model_inplace()

    def forward(self, x, route):
        for name in route:
            x = torch.tanh(getattr(self, name)(x))
        return self.head(x)


ROUTES = (("ab", "b"), ("ab", ""), ("ba", "a"), ("b", "ab"))   # (rank 0, rank 1) per step


def branch_data():
    gen = torch.Generator().manual_seed(2)
    return torch.randn(len(ROUTES), 2, 4, 6, generator=gen)


def branch_train(model, rank=None, net=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
    for step, x in enumerate(branch_data()):
        opt.zero_grad()
        if rank is None:   # one process: the mean of the ranks' losses
            loss = sum((model(x[r], ROUTES[step][r]) ** 2).mean() for r in range(2)) / 2
        else:
            loss = (net(x[rank], ROUTES[step][rank]) ** 2).mean()
        loss.backward()
        opt.step()
    return {n: (p.to_dense() if isinstance(p, sten.SparseTensorWrapper) else p.detach()).clone()
            for n, p in model.named_parameters()}


def branch_worker(rank, world, port, kind, out_path):
    import datetime

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # a timeout: collectives paired wrongly wait for a partner that never comes
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        model = Branches(kind)
        torch.save(branch_train(model, rank, sparse_ddp(model)), f"{out_path}.{rank}")
    finally:
        dist.destroy_process_group()
    _leave()


@pytest.mark.parametrize("kind", [None, "csr", "topk-csr"])
def test_sparse_parameters_unused_on_some_ranks_are_averaged_with_zeros(tmp_path, kind):
    """Rank 1 skips a branch (or both) at some steps. Each gradient was reduced when it was
    accumulated, so rank 0's reduction of ``a`` met rank 1's of ``b`` (equal nnz: the weights'
    gradients mixed, silently) and the ranks then waited on each other. Now every rank reduces
    every sparse parameter at the end of the backward, zeros where it did not use one."""
    out = str(tmp_path / "branch")
    mp.start_processes(branch_worker, args=(2, free_port(), kind, out), nprocs=2, join=True, start_method="spawn")
    ranks = [torch.load(f"{out}.{r}", weights_only=True) for r in range(2)]
    single = branch_train(Branches(kind))
    for name in single:
        torch.testing.assert_close(ranks[0][name], ranks[1][name], rtol=0, atol=0)
        if kind != "topk-csr":   # a top-k of the average is not the average of top-ks: ranks agree (above)
            torch.testing.assert_close(ranks[0][name], single[name], rtol=1e-5, atol=1e-6)


def interrupted_worker(rank, world, port, out_path):
    """A saliency map on rank 0 only, then a backward that raises on every rank (a skipped batch)."""
    import datetime

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
        sb = sten.SparsityBuilder(model)
        sb.set_weight("0.weight", initial_sparsifier=sten.ScalarFractionSparsifier(0.5), out_format=sten.CsrTensor)
        model = sb.get_sparse_model()
        net = sparse_ddp(model)
        x = torch.full((4, 6), float(rank + 1))
        if rank == 0:   # accumulates into no parameter: no collective to pair with rank 1's
            xi = x.clone().requires_grad_()
            torch.autograd.grad(net(xi).sum(), xi)
        out = net(x)
        out.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("skip this batch")))
        with pytest.raises(RuntimeError, match="skip this batch"):
            out.sum().backward()
        # gradients taken with torch.autograd.grad (nothing accumulates, nothing is reduced)
        torch.autograd.grad(net(x).sum(), [model[2].bias])
        torch.autograd.grad(net(x).sum(), [model[0].weight], create_graph=True)
        model.zero_grad()
        net(x).pow(2).sum().backward()
        grad = model[0].weight.grad
        torch.save(grad.to_dense() if isinstance(grad, sten.SparseTensorWrapper) else grad, f"{out_path}.{rank}")
    finally:
        dist.destroy_process_group()
    _leave()


def test_sparse_ddp_after_a_one_rank_input_gradient_and_a_backward_that_raised(tmp_path):
    """``torch.autograd.grad`` of an input on rank 0 alone queued a reduction whose collective had
    no partner (gloo aborted the process); a backward that raised before its end left the
    reduction marked as queued, so no later gradient was averaged (the ranks drifted apart);
    ``torch.autograd.grad`` with respect to a parameter raised (torch refuses to say whether a
    leaf's node will run during it)."""
    out = str(tmp_path / "interrupted")
    mp.start_processes(interrupted_worker, args=(2, free_port(), out), nprocs=2, join=True, start_method="spawn")
    grads = [torch.load(f"{out}.{r}", weights_only=True) for r in range(2)]
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    torch.manual_seed(0)
    single = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    sb = sten.SparsityBuilder(single)
    sb.set_weight("0.weight", initial_sparsifier=sten.ScalarFractionSparsifier(0.5), out_format=sten.CsrTensor)
    single = sb.get_sparse_model()
    loss = sum(single(torch.full((4, 6), float(r + 1))).pow(2).sum() for r in range(2)) / 2
    loss.backward()
    want = single[0].weight.grad
    want = want.to_dense() if isinstance(want, sten.SparseTensorWrapper) else want
    torch.testing.assert_close(grads[0], want, rtol=1e-5, atol=1e-6)
