"""``nn.Embedding(sparse=True)`` with a sparse weight: its gradient is a torch sparse COO tensor,
and the optimizers that take one (SGD, SparseAdam) update the stored values as for a dense
weight masked to the pattern. SGD crashed in the stored-values update (``expand`` of a torch
sparse operand), SparseAdam when its ``sparse_mask`` result was checked for views of the weight."""

import warnings

import pytest
import torch

import sten_core as sten

OPTIMIZERS = {
    "SGD": lambda params: torch.optim.SGD(params, lr=0.1),
    "SGD(momentum)": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "SparseAdam": lambda params: torch.optim.SparseAdam(params, lr=0.1),
}


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CooTensor, sten.CscTensor])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_sparse_embedding_gradient_updates_a_sparse_weight(layout, optimizer):
    torch.manual_seed(0)
    dense = torch.randn(10, 8) * (torch.rand(10, 8) > 0.5)
    idx = torch.tensor([[0, 2, 4, 5], [4, 3, 2, 9]])
    weights = {}
    for mode in ("dense", "sparse"):
        emb = torch.nn.Embedding(10, 8, sparse=True)
        emb.weight = torch.nn.Parameter(dense.clone()) if mode == "dense" else \
            sten.SparseParameterWrapper(layout.from_dense(dense))
        opt = OPTIMIZERS[optimizer](list(emb.parameters()))
        for _ in range(2):
            opt.zero_grad()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", sten.DispatchWarning)
                emb(idx).pow(2).sum().backward()
                opt.step()
        weights[mode] = emb.weight
    assert type(weights["sparse"].wrapped_tensor) is layout
    torch.testing.assert_close(weights["sparse"].to_dense(), weights["dense"].detach() * (dense != 0))
