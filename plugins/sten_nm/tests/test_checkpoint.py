"""Checkpoints: a model with NMTensor and GroupedNMTensor weights saves with
``torch.save(model.state_dict())`` and loads with the default ``torch.load``
(``weights_only=True``) into a fresh sparse model and into a dense one."""

import copy

import pytest
import torch

import sten_core as sten
from sten_core.testing import check_checkpoint
from sten_nm import ColumnGroupedNMTensor, GroupedNMSparsifier, GroupedNMTensor, NMSparsifier, NMTensor


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16))


def sparse_mlp(seed):
    torch.manual_seed(seed)
    sb = sten.SparsityBuilder(mlp())
    sb.set_weight("0.weight", NMSparsifier(1, 4), out_format=NMTensor)
    sb.set_weight("2.weight", GroupedNMSparsifier(2, 8), out_format=GroupedNMTensor)
    return sb.get_sparse_model()


def test_model_state_dict_default_torch_load(tmp_path):
    model = sparse_mlp(0)
    torch.save(model.state_dict(), tmp_path / "nm.pt")
    loaded = torch.load(tmp_path / "nm.pt")  # weights_only=True is the default
    assert isinstance(loaded["0.weight"].wrapped_tensor, NMTensor)
    assert isinstance(loaded["2.weight"].wrapped_tensor, GroupedNMTensor)
    x = torch.randn(5, 32)
    fresh = sparse_mlp(1)
    assert not torch.equal(fresh(x), model(x))
    fresh.load_state_dict(loaded)
    assert torch.equal(fresh(x), model(x))
    for name in ("0.weight", "2.weight"):
        got, want = fresh.get_parameter(name).wrapped_tensor, model.get_parameter(name).wrapped_tensor
        assert type(got) is type(want) and got.same_pattern(want) and (got.n, got.m) == (want.n, want.m)
    dense = mlp()
    dense.load_state_dict(sten.densify_state_dict(loaded))
    for name, p in model.named_parameters():
        want = p.to_dense() if isinstance(p, sten.SparseTensorWrapper) else p.detach()
        assert torch.equal(dense.get_parameter(name).detach(), want), name
    torch.testing.assert_close(dense(x), model(x), rtol=1e-5, atol=1e-5)  # dense GEMM vs the n:m kernel


def test_nm_params_survive_the_checkpoint():
    t = NMTensor.from_dense(torch.randn(6, 20), n=3, m=10, dim=0)
    back = NMTensor.from_state_tensors(t.state_tensors(), t.shape)
    assert (back.n, back.m, back.dim) == (3, 10, 0) and back.same_pattern(t) and torch.equal(back.to_dense(), t.to_dense())


def test_conformance_checkpoint():
    check_checkpoint(NMTensor, sparsifier=NMSparsifier(2, 4), dtypes=(torch.float32, torch.bfloat16))
    check_checkpoint(NMTensor, sparsifier=sten.PerBlockFractionSparsifier(1, 8),
                     make=lambda d: NMTensor.from_dense(d, n=1, m=8))
    check_checkpoint(GroupedNMTensor, sparsifier=GroupedNMSparsifier(2, 4))


@pytest.mark.parametrize("layout", [NMTensor, GroupedNMTensor, ColumnGroupedNMTensor])
def test_module_moves_keep_the_pattern(layout):
    """``.double()`` / ``.bfloat16()`` / ``.to("meta")`` move the layout itself (its pattern
    kept, no index re-read: ``"meta"`` used to fail reading n:m from a meta tensor)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(48, 32)
    model.weight = sten.SparseParameterWrapper(layout.from_dense(model.weight.detach()))
    x = torch.randn(4, 48)
    y = model(x)
    for move, dtype in ((lambda m: m.double(), torch.float64), (lambda m: m.bfloat16(), torch.bfloat16)):
        moved = move(copy.deepcopy(model))
        assert isinstance(moved.weight.wrapped_tensor, layout) and moved.weight.dtype == dtype
        assert torch.equal(moved.weight.to_dense() != 0, model.weight.to_dense() != 0)
        torch.testing.assert_close(moved(x.to(dtype)).float(), y, rtol=2e-2, atol=5e-2)
    meta = copy.deepcopy(model).to("meta")
    assert isinstance(meta.weight.wrapped_tensor, layout) and meta.weight.device.type == "meta"
    assert meta.weight.shape == model.weight.shape and isinstance(meta.weight, torch.nn.Parameter)
