"""Several optimizer steps of 2:4 training on CPU, checking what the CUDA code path
would multiply by: the CUTLASS operands of the weight (forward) and of its transposed
pair (input gradient) are pure tensor code, decoded here back to dense matrices."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sten_cuda24 import Sparse24Sparsifier, Sparse24Tensor, encoding


def underfull_weight(rows: int = 64, cols: int = 96) -> torch.Tensor:
    """A weight whose greedy transposable mask leaves groups with fewer than 2 kept values."""
    torch.manual_seed(3)
    w = torch.randn(rows, cols)
    # tiles where one row and one column hold the two largest values of the tile
    w[0:4, 0:4] = torch.tensor([[9., 8., 0.1, 0.1], [7., 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.1]])
    return w


def operand_dense(layout: Sparse24Tensor) -> torch.Tensor:
    """The dense matrix the sparse kernel multiplies by for this layout (decoded operand:
    CUTLASS's reordered metadata where the shape allows, else the plain metadata)."""
    if layout.shape[0] % 32 == 0:
        packed, meta = layout.cutlass_pair()
        return encoding.from_cutlass(packed, meta)[:, : layout.shape[1]]
    return encoding.decompress(layout.packed, layout.meta, layout.shape[1])


@pytest.mark.parametrize("shape", [(64, 96), (37, 50)])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_transposable_training_keeps_one_mask(sten, momentum, shape):
    w0 = underfull_weight()[: shape[0], : shape[1]]
    mask0 = encoding.transposable_mask(w0)
    underfull = encoding.keep_mask(encoding.compress(w0 * mask0)[1], shape[1]) & ~mask0
    assert bool(underfull.any()), "the test weight must have filler positions"
    s = sten.sparsify(Sparse24Sparsifier(transposable=True), w0.half(), Sparse24Tensor)
    fmt = (sten.KeepAll(), Sparse24Tensor, sten.KeepAll(), Sparse24Tensor)
    param = sten.SparseParameterWrapper(s.wrapped_tensor, grad_fmt=fmt)
    opt = torch.optim.SGD([param], lr=0.05, momentum=momentum, weight_decay=0.01)
    x = torch.randn(32, shape[1]).half()
    for step in range(6):
        layout = param.wrapped_tensor
        assert torch.equal(layout.mask(), mask0), f"step {step}: the trainable mask changed"
        dense = layout.to_dense()
        assert not bool(dense[~mask0].any()), f"step {step}: a position outside the mask became nonzero"
        fwd = operand_dense(layout)                       # forward: W
        bwd = operand_dense(layout.transposed()).t()      # input gradient: (W^T)^T
        assert torch.equal(fwd, dense), f"step {step}: forward operand differs from the weight"
        assert torch.equal(bwd, dense), f"step {step}: input-gradient operand differs from the weight"
        opt.zero_grad()
        y = F.linear(x, param)
        y.float().square().mean().backward()
        grad = param.grad.wrapped_tensor
        assert not bool(grad.to_dense()[~mask0].any()), f"step {step}: gradient outside the mask"
        opt.step()


def test_one_of_four_training_keeps_fillers_zero(sten):
    """PerBlockFractionSparsifier(1, 4): each group stores one value and one filler;
    the filler is never trained, so the weight stays 1:4."""
    w = sten.sparsify(sten.PerBlockFractionSparsifier(1, 4), torch.randn(8, 32), Sparse24Tensor)
    fmt = (sten.KeepAll(), Sparse24Tensor, sten.KeepAll(), Sparse24Tensor)
    param = sten.SparseParameterWrapper(w.wrapped_tensor, grad_fmt=fmt)
    mask0 = param.wrapped_tensor.mask()
    assert int(mask0.sum()) == 8 * 8 and param.wrapped_tensor.nnz == 64
    opt = torch.optim.Adam([param], lr=0.1)
    x = torch.randn(16, 32)
    for _ in range(3):
        opt.zero_grad()
        F.linear(x, param).square().sum().backward()
        opt.step()
        dense = param.wrapped_tensor.to_dense()
        assert torch.equal(param.wrapped_tensor.mask(), mask0)
        assert not bool(dense[~mask0].any())
        assert bool(dense[mask0].ne(0).all())


def test_transposed_pair_from_kernel_output_drops_disagreeing_slots():
    """``from_pair``: slots that only one orientation's metadata names are fillers (zeroed)."""
    w0 = underfull_weight()
    pruned = (w0 * encoding.transposable_mask(w0)).half()
    packed, meta = encoding.compress(pruned)
    packed = packed + 1.0                      # a kernel that wrote garbage at fillers
    _, meta_t = encoding.compress(pruned.t())
    s = Sparse24Tensor.from_pair(packed, meta, pruned.shape, meta_t)
    assert torch.equal(s.mask(), pruned != 0)
    assert torch.equal(s.to_dense() != 0, pruned != 0)
    assert torch.equal(operand_dense(s.transposed()).t(), s.to_dense())


@pytest.mark.parametrize("make", ["transposable", "one_of_four"])
def test_core_linear_conformance_with_fillers(sten, make):
    """The core's F.linear conformance check (values and gradients vs dense) on weights with filler slots."""
    from sten_core.testing import check_linear

    sp = Sparse24Sparsifier(transposable=True) if make == "transposable" else sten.PerBlockFractionSparsifier(1, 4)
    check_linear(Sparse24Tensor, sparsifier=sp, shapes=((7, 16, 12), (5, 20, 36)))
