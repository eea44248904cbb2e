"""PyTorch utilities that find a weight's autograd node or replace its contents, on sparse weights.

- ``get_gradient_edge`` and ``register_multi_grad_hook`` find a leaf's gradient accumulator as
  ``w.view_as(w).grad_fn.next_functions[0][0]``, and Megatron-LM / Apex DDP hook
  ``w.expand_as(w)``'s: for a wrapper that was an unused densify node, so the hooks never fired
  (a gradient reduction built on them silently did not happen) and ``autograd.grad`` refused the
  edge.
- ``load_state_dict`` under ``torch.__future__.set_swap_module_params_on_conversion(True)`` swapped
  a plain dense view into a sparse parameter (the next optimizer step failed); it now loads as
  without the flag (``copy_`` rules) and the parameter keeps its layout and class.
- ``torch.save``'s legacy format cannot hold sparse tensors (its loader rebuilt them from
  uninitialised memory): saving in it, and loading such a file, are clear errors.
"""

import copy
import io
import warnings

import pytest
import torch
from torch.autograd.graph import get_gradient_edge, register_multi_grad_hook

import sten_core as sten
from sten_core.training import serialization

LAYOUTS = [sten.CsrTensor, sten.CooTensor]


def models(layout):
    torch.manual_seed(0)
    dense = torch.nn.Linear(16, 8)
    with torch.no_grad():
        dense.weight.mul_(torch.rand(8, 16) > 0.6)
    sparse = copy.deepcopy(dense)
    sparse.weight = sten.SparseParameterWrapper(layout.from_dense(dense.weight.detach()))
    return dense, sparse


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        yield


@pytest.mark.parametrize("layout", LAYOUTS)
def test_view_as_and_expand_as_lead_to_the_weights_gradient_accumulator(layout):
    x = torch.randn(5, 16)
    for m in models(layout):
        for how in (lambda w: w.view_as(w), lambda w: w.expand_as(w)):
            node = how(m.weight).grad_fn.next_functions[0][0]
            assert type(node).__name__ == "AccumulateGrad" and node.variable is m.weight
        fired = []
        m.weight.expand_as(m.weight).grad_fn.next_functions[0][0].register_hook(lambda *a: fired.append(1))
        m(x).sum().backward()
        assert fired == [1]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradient_edges_and_multi_grad_hooks_match_dense(layout):
    x = torch.randn(5, 16)
    dense, sparse = models(layout)
    want = torch.autograd.grad(dense(x).pow(2).sum(), get_gradient_edge(dense.weight))[0]
    got = torch.autograd.grad(sparse(x).pow(2).sum(), get_gradient_edge(sparse.weight))[0]
    torch.testing.assert_close(got.to_dense() if isinstance(got, sten.SparseTensorWrapper) else got, want)
    calls = []
    register_multi_grad_hook((sparse.weight, sparse.bias), lambda gs: calls.append([g is not None for g in gs]))
    sparse(x).pow(2).sum().backward()
    assert calls == [[True, True]]


def test_the_values_of_a_view_as_are_the_weights():
    _, sparse = models(sten.CsrTensor)
    w = sparse.weight
    assert torch.equal(w.view_as(w), w.to_dense()) and torch.equal(w.expand_as(w), w.to_dense())
    with torch.no_grad():
        assert torch.equal(w.view_as(w), w.to_dense())


@pytest.fixture
def swap_on_load():
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_load_state_dict_with_swapping_keeps_the_layout(layout, swap_on_load):
    _, sparse = models(layout)
    weight, mask = sparse.weight, sparse.weight.to_dense() != 0
    checkpoint = torch.nn.Linear(16, 8).state_dict()
    sparse.load_state_dict(checkpoint)
    assert sparse.weight is weight and isinstance(weight, sten.SparseParameterWrapper)
    assert type(weight.wrapped_tensor) is layout and weight.requires_grad
    torch.testing.assert_close(weight.to_dense(), checkpoint["weight"] * mask)   # as without the flag
    x = torch.randn(5, 16)
    sparse(x).pow(2).sum().backward()
    torch.optim.SGD(sparse.parameters(), lr=0.1).step()
    own = {k: v.detach().clone() if not isinstance(v, sten.SparseTensorWrapper) else v
           for k, v in sparse.state_dict().items()}
    sparse.load_state_dict(own)
    assert type(sparse.weight.wrapped_tensor) is layout


def test_saving_sparse_tensors_in_the_legacy_format_is_an_error():
    w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(3)))
    with pytest.raises(RuntimeError, match=r"legacy format .* does not hold sparse tensors.*would not load back"):
        torch.save({"w": w}, io.BytesIO(), _use_new_zipfile_serialization=False)
    buf = io.BytesIO()
    torch.save({"w": torch.eye(3)}, buf, _use_new_zipfile_serialization=False)   # dense: as before
    buf.seek(0)
    assert torch.equal(torch.load(buf)["w"], torch.eye(3))


def test_loading_a_legacy_file_with_sparse_tensors_is_an_error(monkeypatch):
    w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(3)))
    buf = io.BytesIO()
    with monkeypatch.context() as patch:   # such a file, as an older STen wrote it
        patch.setattr(serialization, "_in_torch", lambda function, depth=40: False)
        torch.save({"w": w}, buf, _use_new_zipfile_serialization=False)
    buf.seek(0)
    with pytest.raises(RuntimeError, match=r"legacy format .* this file's sparse tensors cannot be rebuilt"):
        torch.load(buf, weights_only=False)


def test_a_model_built_under_inference_mode_gets_torchs_message():
    """It was torch's raw "Inference tensors do not track version counter" from STen's dispatcher."""
    with torch.inference_mode():
        builder = sten.SparsityBuilder(torch.nn.Linear(16, 8))
        builder.set_weight("weight", sten.ScalarFractionSparsifier(0.5), out_format=sten.CsrTensor)
        model = builder.get_sparse_model()
    x = torch.randn(5, 16)
    with torch.inference_mode():   # (torch's sparse to_dense writes in place: inference tensors need the mode)
        want = torch.nn.functional.linear(x, model.weight.to_dense(), model.bias)
    with torch.no_grad():
        torch.testing.assert_close(model(x), want)
    with pytest.raises(RuntimeError, match=r"[Ii]nference tensor.*make a clone"):   # as dense torch
        model(x.requires_grad_()).sum().backward()
