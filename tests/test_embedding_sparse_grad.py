"""``nn.Embedding(sparse=True)`` with a sparse weight: its gradient is a torch sparse COO tensor,
and the optimizers that take one (SGD, SparseAdam) update the stored values as for a dense
weight masked to the pattern. SGD crashed in the stored-values update (``expand`` of a torch
sparse operand), SparseAdam when its ``sparse_mask`` result was checked for views of the weight."""

import warnings

import pytest
import torch

import sten_core as sten
from sten_core.model.tensor import densify

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


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CooTensor, "NMTensor"])
@pytest.mark.parametrize("grad_format", ["the weight's layout", "sparsified into CSR"])
def test_a_sparse_embedding_gradient_is_put_in_the_weights_grad_fmt(layout, grad_format):
    """torch's sparse COO gradient of ``Embedding(sparse=True)`` reached the gradient format as it was:
    the layout's gather raised ``expand is unsupported for Sparse tensors`` (n:m: "unsupported memory
    format"), a sparsifying format ``fill_ ... SparseCPU``."""
    dense = torch.randn(10, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    if layout == "NMTensor":
        sten_nm = pytest.importorskip("sten_nm")
        layout = sten_nm.NMTensor
        stored = sten.sparsify(sten_nm.NMSparsifier(2, 4), dense, layout).wrapped_tensor
    else:
        stored = layout.from_dense(dense * (dense.abs() > 0.5))
    if grad_format == "the weight's layout":
        fmt = (sten.KeepAll(), layout, sten.KeepAll(), layout)
    else:
        fmt = (sten.ScalarFractionSparsifier(0.5), torch.Tensor, sten.KeepAll(), sten.CsrTensor)
    emb = torch.nn.Embedding(10, 8, sparse=True, dtype=torch.float64)
    emb.weight = sten.SparseParameterWrapper(stored, grad_fmt=fmt)
    idx = torch.tensor([[0, 2, 4, 9], [4, 4, 1, 0]])
    weights = torch.linspace(-1, 1, 32, dtype=torch.float64).reshape(2, 4, 4).repeat_interleave(2, -1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        (emb(idx) * weights).sum().backward()
    reference = torch.zeros(10, 8, dtype=torch.float64).index_add_(0, idx.flatten(), weights.reshape(-1, 8))
    stored = emb.weight.to_dense() != 0
    if grad_format == "the weight's layout":
        assert type(emb.weight.grad.wrapped_tensor) is layout
        torch.testing.assert_close(emb.weight.grad.to_dense(), reference * stored)
    else:
        expected = sten.sparsify(sten.ScalarFractionSparsifier(0.5), reference, torch.Tensor)
        assert type(emb.weight.grad.wrapped_tensor) is sten.CsrTensor
        torch.testing.assert_close(emb.weight.grad.to_dense(), densify(expected))
