"""Tied weights (transformers GPT-2: ``lm_head.weight`` is ``transformer.wte.weight``):
``set_weight`` accepts either name, sparsifying one side keeps the two tied, and
setting both names is an error that names the tie. The model is built from a
tiny ``GPT2Config`` with random weights (nothing is downloaded)."""

from __future__ import annotations

import warnings

import pytest
import torch

import sten_core as sten

import transformers  # a test dependency (pyproject's [test] extra)


def tiny_gpt2(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config).eval()
    assert model.lm_head.weight is model.transformer.wte.weight, "GPT-2 ties its output and input embeddings"
    return model


def logits(model, ids):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)  # the embedding look-up may run densely
        return model(input_ids=ids).logits


@pytest.mark.parametrize("name", ["lm_head.weight", "transformer.wte.weight"])
def test_sparsifying_one_side_keeps_the_tie(name):
    model = tiny_gpt2()
    sb = sten.SparsityBuilder(model)
    sb.set_weight(name, initial_sparsifier=sten.ScalarFractionSparsifier(0.75), out_format=sten.CsrTensor)
    sparse = sb.get_sparse_model()
    w = sparse.lm_head.weight
    assert isinstance(w, sten.SparseParameterWrapper) and isinstance(w.wrapped_tensor, sten.CsrTensor)
    assert sparse.transformer.wte.weight is w, "the two names still hold one parameter"
    assert sum(p is w for p in sparse.parameters()) == 1
    dense_w = model.lm_head.weight.detach()
    assert torch.equal(w.to_dense(), dense_w * sten.ScalarFractionSparsifier(0.75).mask(dense_w))

    # the dense reference: the masked weight on both sides
    ref = tiny_gpt2()
    with torch.no_grad():
        ref.transformer.wte.weight.copy_(w.to_dense())
    ids = torch.randint(0, 64, (2, 10))
    torch.testing.assert_close(logits(sparse, ids), logits(ref, ids), rtol=1e-4, atol=1e-5)

    # a training step keeps the tie and the pattern
    kept = w.to_dense() != 0
    nnz = w.wrapped_tensor.nnz
    sparse.train()
    opt = torch.optim.AdamW(sparse.parameters(), lr=1e-3)
    loss = sparse(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    assert sparse.lm_head.weight is sparse.transformer.wte.weight
    after = sparse.lm_head.weight
    assert isinstance(after.wrapped_tensor, sten.CsrTensor) and after.wrapped_tensor.nnz == nnz
    assert not bool(((after.to_dense() != 0) & ~kept).any()), "nothing outside the pattern"
    assert not torch.equal(after.to_dense(), dense_w * kept), "the step moved the kept values"


def test_setting_both_names_of_a_tie_is_an_error_naming_it():
    model = tiny_gpt2()
    sb = sten.SparsityBuilder(model)
    sb.set_weight("lm_head.weight", sten.ScalarFractionSparsifier(0.5), out_format=sten.CsrTensor)
    sb.set_weight("transformer.wte.weight", sten.ScalarFractionSparsifier(0.5), out_format=sten.CsrTensor)
    with pytest.raises(ValueError, match="'lm_head.weight' is tied to 'transformer.wte.weight'"):
        sb.get_sparse_model()


def test_unknown_weight_still_lists_the_parameters():
    sb = sten.SparsityBuilder(tiny_gpt2())
    with pytest.raises(ValueError, match="unknown weight 'lm_head.wieght'.*transformer.wte.weight"):
        sb.set_weight("lm_head.wieght", sten.ScalarFractionSparsifier(0.5), out_format=sten.CsrTensor)


def test_scheduler_on_a_tied_weight_keeps_the_tie():
    from sten_core.training.schedule import OneShot, SparsityScheduler

    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = SparsityScheduler(model, opt)
    sched.add("lm_head.weight", OneShot(0.5), layout=sten.CsrTensor)
    w = model.lm_head.weight
    assert isinstance(w, sten.SparseParameterWrapper) and model.transformer.wte.weight is w
    assert any(p is w for p in opt.param_groups[0]["params"])
    with pytest.raises(ValueError, match="'transformer.wte.weight' is tied to 'lm_head.weight'"):
        sched.add("transformer.wte.weight", OneShot(0.5), layout=sten.CsrTensor)
