"""A transformers GPT-2 (from a config, random weights) with n:m ``Conv1D`` weights
trains without a dense fallback, saves, reloads with the default ``torch.load``
and resumes exactly (issue: a sparse model is an ordinary PyTorch model)."""

import io

import pytest
import torch

import sten_core as sten
from sten_core import dispatch
from sten_nm import NMSparsifier, NMTensor

transformers = pytest.importorskip("transformers")
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def sparse_gpt2(seed: int):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # deterministic steps
    model = transformers.GPT2LMHeadModel(config)
    sb = sten.SparsityBuilder(model)
    for name, _ in model.named_parameters():
        if name.endswith(CONV1D):  # Conv1D stores W [in, out]: n:m along dim 0, the contraction dim
            sb.set_weight(name, initial_sparsifier=NMSparsifier(2, 4, dim=0), out_format=NMTensor)
    return sb.get_sparse_model()


def steps(model, optimizer, batches):
    losses = []
    for ids in batches:
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.fixture
def raise_mode():
    before = dispatch.get_dispatch_failure()
    sten.set_dispatch_failure("raise")
    yield
    sten.set_dispatch_failure(before)


def test_gpt2_nm_conv1d_trains_saves_and_resumes(raise_mode):
    torch.manual_seed(0)
    batches = [torch.randint(0, 64, (2, 16)) for _ in range(6)]
    model = sparse_gpt2(seed=1)
    sparse_names = [n for n, p in model.named_parameters() if isinstance(p, sten.SparseTensorWrapper)]
    assert len(sparse_names) == 8
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = steps(model, optimizer, batches[:3])
    assert first[-1] < first[0]
    for name in sparse_names:
        w = model.get_parameter(name)
        assert type(w.wrapped_tensor) is NMTensor and w.wrapped_tensor.dim == 0
        dense = w.to_dense().detach()
        assert int((dense.reshape(-1, 4, dense.shape[1]) != 0).sum(1).max()) <= 2  # still 2:4 along dim 0

    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer)  # the default: weights_only=True
    resumed = sparse_gpt2(seed=2)  # other values and patterns until loaded
    resumed.load_state_dict(checkpoint["model"])
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    resumed_optimizer.load_state_dict(checkpoint["optimizer"])
    for name in sparse_names:
        torch.testing.assert_close(resumed.get_parameter(name).to_dense().detach(),
                                   model.get_parameter(name).to_dense().detach(), rtol=0, atol=0)

    rest = steps(model, optimizer, batches[3:])
    rest_resumed = steps(resumed, resumed_optimizer, batches[3:])
    assert rest_resumed == pytest.approx(rest, rel=1e-5)


def test_gpt2_conv1d_dense_reference():
    """The n:m model computes what a dense GPT-2 with the same (pruned) weights computes."""
    model = sparse_gpt2(seed=3)
    dense = transformers.GPT2LMHeadModel(model.config)
    dense.load_state_dict(sten.densify_state_dict(model.state_dict()))
    ids = torch.randint(0, 64, (2, 12))
    torch.testing.assert_close(model(ids).logits, dense(ids).logits, rtol=1e-4, atol=1e-4)
