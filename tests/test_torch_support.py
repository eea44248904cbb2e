"""Traceable wrappers only on torch versions where compiled training was tested
(``sten_core.model.torch_support``): on an older torch a trainable sparse weight keeps the eager
class, and a compiled training step runs its sparse calls eagerly (graph breaks) with eager's
gradients instead of failing inside the compiler."""

import warnings

import pytest
import torch

import sten_core as sten
from sten_core.model import torch_support
from sten_core.testing import compiled_training_grads


def test_versions_and_the_override():
    supported = torch_support.traceable_wrappers_supported
    assert supported("2.13.0+cpu", {}) and supported("2.14.1", {}) and supported("3.0.0", {})
    assert not supported("2.11.0+cu130", {}) and not supported("2.4.1", {})
    assert supported("2.11.0", {"STEN_TRACEABLE_WRAPPERS": "1"})
    assert not supported("2.13.0", {"STEN_TRACEABLE_WRAPPERS": "0"})
    with pytest.raises(ValueError, match="STEN_TRACEABLE_WRAPPERS must be 0 or 1"):
        supported("2.13.0", {"STEN_TRACEABLE_WRAPPERS": "yes"})


def csr_mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.ReLU(), torch.nn.Linear(10, 4))
    sb = sten.SparsityBuilder(model)
    for name in ("0.weight", "2.weight"):
        sb.set_weight(name, sten.ScalarFractionSparsifier(0.5), out_format=sten.CsrTensor)
    return sb.get_sparse_model()


def test_an_older_torch_keeps_the_eager_class_and_eager_gradients(monkeypatch):
    assert hasattr(type(csr_mlp()[0].weight), "__tensor_flatten__")  # this torch: traceable
    monkeypatch.setattr(torch_support, "TRACEABLE_WRAPPERS", False)
    model = csr_mlp()
    assert not hasattr(type(model[0].weight), "__tensor_flatten__")
    x = torch.randn(3, 12, requires_grad=True)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        run = compiled_training_grads(model, x, fullgraph=False)
    # not one whole graph: the sparse calls ran eagerly (the dispatcher is a compiler-disabled call;
    # explain counts -1 when no frame is left with a graph of its own)
    assert run["graph_breaks"] != 0
    for got, want in zip(run["compiled"], run["eager"]):
        got, want = (g.to_dense() if isinstance(g, sten.SparseTensorWrapper) else g for g in (got, want))
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(run["compiled_out"], run["eager_out"])


def test_an_element_of_a_wrapper_formats_with_a_spec():
    """``f"{w[0, 0]:.3f}"`` raised "unsupported format string passed to WrapperView.__format__"."""
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.tensor([[1.25, 0.0], [0.0, 2.0]])))
    assert f"{w[0, 0]:.3f}" == "1.250"
    assert f"{w.detach()[1, 1]:.1f}" == "2.0"
    assert f"{(w * 2)[0, 0]:.2f}" == "2.50"
