"""Argument checks of ``SparsityBuilder`` and output specs, and all-or-nothing building.

A number where a sparsifier belongs, or a class that is not a layout where a format
belongs, used to be accepted and then left the tensor unsparsified; a weight that failed
to build left the model half-converted and its optimizer stale, with an error that did
not say which weight failed.
"""

import pytest
import torch

import sten_core as sten


class PlainSparsifier:
    """A user-defined sparsifier as in the paper's appendix: a plain class, no base class."""

    def __init__(self, fraction):
        self.fraction = fraction


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))


@pytest.mark.parametrize("bad", [0.9, 0, "magnitude", torch.tensor(0.5), (sten.KeepAll(),)])
def test_sparsified_op_rejects_a_non_sparsifier(bad):
    with pytest.raises(TypeError, match=r"external_sparsifier must be a sparsifier instance"):
        sten.sparsified_op(torch.add, ((sten.KeepAll(), torch.Tensor, bad, sten.CsrTensor),))
    # a plain user class instance is a sparsifier (registered with register_sparsifier_implementation)
    sten.sparsified_op(torch.add, ((sten.KeepAll(), torch.Tensor, PlainSparsifier(0.5), sten.CsrTensor),))


@pytest.mark.parametrize("method", ["set_weight", "set_weight_grad", "set_interm", "set_interm_grad"])
def test_builder_rejects_a_number_as_sparsifier(method):
    model = _mlp()
    sb = sten.SparsityBuilder(model)
    name = "1.relu" if "interm" in method else "0.weight"
    with pytest.raises(TypeError, match=rf"{method}: inline_sparsifier must be a sparsifier instance.*0\.5"):
        getattr(sb, method)(name, inline_sparsifier=0.5, out_format=sten.CsrTensor)


@pytest.mark.parametrize("bad", [0, 0.0, False, 0.5, "x"])
def test_set_weight_rejects_a_number_as_initial_sparsifier(bad):
    """``initial_sparsifier=0`` silently meant ``KeepAll()`` (an ``x or KeepAll()``)."""
    sb = sten.SparsityBuilder(_mlp())
    with pytest.raises(TypeError, match="set_weight: initial_sparsifier must be a sparsifier instance"):
        sb.set_weight("0.weight", initial_sparsifier=bad, out_format=sten.CsrTensor)


@pytest.mark.parametrize("bad", [int, torch.nn.Linear, sten.ScalarFractionSparsifier, sten.Layout])
@pytest.mark.parametrize("argument", ["out_format", "tmp_format"])
def test_builder_rejects_a_class_that_is_not_a_layout(bad, argument):
    sb = sten.SparsityBuilder(_mlp())
    if bad is sten.Layout:
        bad = type("NotALayout", (), {})   # a plain class with neither from_dense nor to_dense
    kwargs = {"out_format": sten.CsrTensor, argument: bad}
    with pytest.raises(TypeError, match=rf"set_weight: {argument} must be a layout class.*{bad.__name__}"):
        sb.set_weight("0.weight", sten.ScalarFractionSparsifier(0.5), **kwargs)
    with pytest.raises(TypeError, match=rf"out_fmt\[0\]: {argument} must be a layout class"):
        spec = [sten.KeepAll(), torch.Tensor, sten.KeepAll(), sten.CsrTensor]
        spec[1 if argument == "tmp_format" else 3] = bad
        sten.sparsified_op(torch.add, (tuple(spec),))


def test_unregistered_layout_class_with_from_dense_is_accepted():
    """The paper's ``MyCscTensor`` is a plain, unregistered class: still a layout."""

    class MyLayout:
        def __init__(self, dense):
            self.dense = dense

        @staticmethod
        def from_dense(tensor):
            return MyLayout(tensor.clone())

        def to_dense(self):
            return self.dense

    sb = sten.SparsityBuilder(_mlp())
    sb.set_weight("0.weight", sten.KeepAll(), out_format=MyLayout)
    with pytest.raises(TypeError, match="initial_sparsifier"):
        sb.set_weight("2.weight", 0.5, out_format=MyLayout)


def test_build_error_names_the_weight_and_layout():
    sb = sten.SparsityBuilder(_mlp())
    sb.set_weight("0.weight", sten.ScalarFractionSparsifier(0.5), out_format=sten.CsrTensor)
    sb.set_weight("0.bias", sten.ScalarFractionSparsifier(0.5), out_format=sten.CsrTensor)   # 1-D: no CSR
    with pytest.raises(Exception) as info:
        sb.get_sparse_model()
    assert "'0.bias'" in str(info.value) and "CsrTensor" in str(info.value)


def test_failed_inplace_sparsification_changes_nothing():
    """The first weight used to be swapped in while the optimizer kept the old one."""
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    before = {name: p for name, p in model.named_parameters()}
    groups = [list(g["params"]) for g in optimizer.param_groups]
    state = {id(p): dict(s) for p, s in optimizer.state.items()}
    sb = sten.SparsityBuilder(model)
    sb.set_weight("0.weight", sten.ScalarFractionSparsifier(0.5), out_format=sten.CsrTensor)
    sb.set_interm("1.relu", sten.ScalarThresholdSparsifier(0.1), out_format=torch.Tensor)
    sb.set_weight("2.bias", sten.ScalarFractionSparsifier(0.5), out_format=sten.CsrTensor)   # fails: 1-D
    with pytest.raises(Exception, match=r"'2\.bias'.*CsrTensor"):
        sb.sparsify_model_and_optimizer_inplace(model, optimizer)
    assert all(p is before[name] for name, p in model.named_parameters())
    assert not any(isinstance(p, sten.SparseTensorWrapper) for p in model.parameters())
    assert [list(g["params"]) for g in optimizer.param_groups] == groups
    assert {id(p) for p in optimizer.state} == set(state)
    assert not model[1]._forward_pre_hooks and not model[1]._forward_hooks   # no intermediate hooks either


class _Relu3d(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.proj(x))


@pytest.mark.parametrize("where", ["the model", "a submodule"])
def test_an_intermediate_a_layout_refuses_is_named_in_the_error(where):
    """A 2-D-only layout given a 3-D intermediate failed at the first forward with the layout's own
    message only ("CsrTensor.from_dense: tensor must be 2-D"), naming no intermediate."""
    model = _Relu3d() if where == "the model" else torch.nn.Sequential(_Relu3d())
    name = "relu" if where == "the model" else "0.relu"
    sb = sten.SparsityBuilder(model)
    sb.set_interm(name, inline_sparsifier=sten.ScalarThresholdSparsifier(0.3), tmp_format=torch.Tensor,
                  external_sparsifier=sten.KeepAll(), out_format=sten.CsrTensor)
    sparse = sb.get_sparse_model()
    with pytest.raises(ValueError, match=rf"set_interm\('{name}', \.\.\.\): CsrTensor.from_dense: tensor must be 2-D"):
        sparse(torch.randn(2, 5, 8))
    assert isinstance(sparse(torch.randn(5, 8)), sten.SparseTensorWrapper)  # a 2-D one is sparsified
