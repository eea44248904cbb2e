"""Torch layouts built from a user's tensor store each position once.

``torch.sparse_coo_tensor`` makes an uncoalesced tensor by default, and a CSR/CSC tensor built
without ``check_invariants`` may repeat a column: the value of such a position is the sum of its
entries, but ``copy_``, in-place arithmetic and optimizer steps touched each entry, so
``W.copy_(t)`` stored twice ``t`` there and an SGD step moved it twice. COO is coalesced when
wrapped; a compressed tensor that breaks torch's invariants is a ``ValueError``."""

import pytest
import torch

import sten_core as sten


def uncoalesced_coo() -> torch.Tensor:
    # (0, 1) stored twice: 1 + 2 = 3
    return torch.sparse_coo_tensor(torch.tensor([[0, 0, 1], [1, 1, 0]]), torch.tensor([1.0, 2.0, 5.0]), (2, 2))


def test_an_uncoalesced_coo_tensor_is_coalesced_when_wrapped():
    layout = sten.CooTensor(uncoalesced_coo())
    assert layout.nnz == 2 and layout.data.is_coalesced()
    assert layout.to_dense().tolist() == [[0.0, 3.0], [5.0, 0.0]]


def test_copy_and_an_optimizer_step_act_once_per_position():
    w = sten.SparseParameterWrapper(sten.CooTensor(uncoalesced_coo()))
    with torch.no_grad():
        w.copy_(torch.tensor([[0.0, 10.0], [20.0, 0.0]]))
    assert w.to_dense().tolist() == [[0.0, 10.0], [20.0, 0.0]]
    w = sten.SparseParameterWrapper(sten.CooTensor(uncoalesced_coo()))
    w.grad = torch.ones(2, 2)
    torch.optim.SGD([w], lr=1.0).step()
    assert w.to_dense().tolist() == [[0.0, 2.0], [4.0, 0.0]]   # dense: 3 - 1, 5 - 1


@pytest.mark.parametrize("layout", ["csr", "csc"])
def test_a_compressed_tensor_with_a_repeated_index_is_refused(layout):
    make = torch.sparse_csr_tensor if layout == "csr" else torch.sparse_csc_tensor
    cls = sten.CsrTensor if layout == "csr" else sten.CscTensor
    bad = make(torch.tensor([0, 2, 3]), torch.tensor([1, 1, 0]), torch.tensor([1.0, 2.0, 5.0]), (2, 2))
    with pytest.raises(ValueError, match=rf"{cls.__name__}\(data\): data breaks torch's .*invariants.*"
                                         rf"coalesce\(\)\.to_sparse_{layout}\(\)"):
        cls(bad)


def test_valid_tensors_and_layout_results_are_unchanged():
    dense = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 3.0]])
    for cls in (sten.CooTensor, sten.CsrTensor, sten.CscTensor):
        layout = cls.from_dense(dense)
        assert torch.equal(layout.to_dense(), dense) and layout.nnz == 3
    w = sten.SparseTensorWrapper(sten.CooTensor.from_dense(dense))
    assert torch.equal((w + w).to_dense() if isinstance(w + w, sten.SparseTensorWrapper) else w + w, 2 * dense)
