"""A sparse intermediate (``set_interm``) viewed before the next layer inside ``torch.compile``.

The ``set_interm`` call breaks the graph and runs eagerly; a view of its sparse result (``reshape``,
a slice, ``.T``) is a ``GradView`` (under autograd) or a ``WrapperView`` (without), which the next
graph takes as its input. Dynamo inlined their ``__torch_function__`` and recursed without end
(``RecursionError``), for every view, in grad mode; ``.T`` in ``no_grad`` too. While Dynamo traces,
they now run as plain tensors. An eval-mode dropout returns the sparse intermediate itself, as
dense torch returns its input (it ran densely and handed the next layer a dense view).
"""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sten_core as sten

VIEWS = {
    "reshape": lambda h: h.reshape(h.shape[0], 32),
    "slice": lambda h: h[:, :32],
    "T.T": lambda h: h.T.T,
    "eval dropout": lambda h: F.dropout(h, 0.1, training=False),
}


class Block(nn.Module):
    def __init__(self, view):
        super().__init__()
        self.fc1, self.fc2, self.view = nn.Linear(16, 32), nn.Linear(32, 8), view

    def forward(self, x):
        return self.fc2(VIEWS[self.view](torch.relu(self.fc1(x))))


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("view", list(VIEWS))
def test_a_view_of_a_sparse_intermediate_compiles(view, grad):
    torch.manual_seed(0)
    sb = sten.SparsityBuilder(Block(view))
    sb.set_interm("relu", inline_sparsifier=sten.KeepAll(), tmp_format=torch.Tensor,
                  external_sparsifier=sten.ScalarThresholdSparsifier(0.3), out_format=sten.CsrTensor)
    model = sb.get_sparse_model().eval()
    x = torch.randn(6, 16)
    torch._dynamo.reset()
    with torch.set_grad_enabled(grad), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = model(x)
        compiled = torch.compile(model)(x)
    torch.testing.assert_close(compiled, eager)
    if grad:
        (g_eager,) = torch.autograd.grad(eager.sum(), model.fc1.weight)
        (g_compiled,) = torch.autograd.grad(compiled.sum(), model.fc1.weight)
        torch.testing.assert_close(g_compiled, g_eager)


@pytest.mark.parametrize("dropout", [F.dropout, F.dropout1d, F.alpha_dropout, F.feature_alpha_dropout])
@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CooTensor])
def test_a_dropout_that_drops_nothing_returns_the_wrapper_itself(layout, dropout):
    w = sten.SparseTensorWrapper(layout.from_dense(torch.relu(torch.randn(4, 6))))
    assert dropout(w, 0.5, training=False) is w
    assert F.dropout(w, 0.0) is w and F.dropout(w, p=0.3, training=False, inplace=True) is w
    with pytest.raises(ValueError, match="dropout probability"):
        dropout(w, 1.5, training=False)   # validated as in dense torch


def test_a_dropout_that_drops_still_runs():
    torch.manual_seed(0)
    w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.ones(64, 64)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = F.dropout(w, 0.5, training=True)
    out = out.to_dense() if isinstance(out, sten.SparseTensorWrapper) else out
    assert 0.3 < float((out == 0).float().mean()) < 0.7
    assert set(out.unique().tolist()) <= {0.0, 2.0}
