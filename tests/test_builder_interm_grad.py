"""``set_interm_grad`` on its own: the intermediate's gradient is sparsified, its value stays dense.

The paper treats error signals like intermediates, "with independent sparse layouts and
sparsifiers from their associated forward pass tensors"; the builder used to drop a
``set_interm_grad`` whose name had no ``set_interm``, silently.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten


class MLP(torch.nn.Module):
    def __init__(self, reference: bool = False):
        super().__init__()
        self.fc1, self.fc2, self.reference = torch.nn.Linear(32, 64), torch.nn.Linear(64, 16), reference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if self.reference:  # the dense reference: keep the half of dL/dh with the largest magnitude
            h.register_hook(lambda g: g * sten.ScalarFractionSparsifier(0.5).mask(g))
        return self.fc2(h)


def grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    F.mse_loss(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("layout", [torch.Tensor, sten.CooTensor, sten.CsrTensor])
def test_interm_grad_without_interm_sparsifies_the_gradient(layout):
    x, y = torch.randn(16, 32), torch.randn(16, 16)
    torch.manual_seed(0)
    want = grads(MLP(reference=True), x, y)
    torch.manual_seed(0)
    plain = grads(MLP(), x, y)
    torch.manual_seed(0)
    sb = sten.SparsityBuilder(MLP())
    sb.set_interm_grad("relu", inline_sparsifier=sten.ScalarFractionSparsifier(0.5), tmp_format=layout,
                       out_format=layout)
    sparse = sb.get_sparse_model()
    out = sparse(x)
    assert type(out) is torch.Tensor
    torch.testing.assert_close(out, MLP.forward(sparse, x))   # the forward is unchanged, dense
    got = grads(sparse, x, y)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7)
    assert not torch.allclose(got["fc1.weight"], plain["fc1.weight"])   # the gradient was sparsified
