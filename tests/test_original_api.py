"""The original STen's user code (``import sten_core as sten``): a builder without
a model, ``get_sparse_model(model)``, ``sparsify_model_inplace``,
``sparsify_model_and_optimizer_inplace`` returning ``(model, optimizer)``,
``SameFormatSparsifier.ref_sp_ten``, ``register_fwd_op_impl(..., out=[])``,
``scalar_mask_sparsify(tensor, frac)`` and ``sten.summary(model)``."""

from __future__ import annotations

import pytest
import torch

import sten_core as sten


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.ReLU(), torch.nn.Linear(30, 5))


def builder_without_model():
    sb = sten.SparsityBuilder()
    sb.set_weight("0.weight", initial_sparsifier=sten.ScalarFractionSparsifier(0.7), out_format=sten.CsrTensor)
    sb.set_weight_grad("0.weight", tmp_format=sten.CsrTensor, out_format=sten.CsrTensor)
    return sb


def test_builder_without_a_model_get_sparse_model():
    model = mlp()
    sb = builder_without_model()
    sparse = sb.get_sparse_model(model)
    assert isinstance(sparse[0].weight.wrapped_tensor, sten.CsrTensor)
    assert not isinstance(model[0].weight, sten.SparseTensorWrapper), "the original is untouched"
    mask = sten.ScalarFractionSparsifier(0.7).mask(model[0].weight)
    assert torch.equal(sparse[0].weight.to_dense(), model[0].weight.detach() * mask)
    x = torch.randn(4, 20)
    ref = mlp()
    ref[0].weight.data = sparse[0].weight.to_dense()
    torch.testing.assert_close(sparse(x), ref(x))
    assert sparse[0].weight.grad_fmt is not None  # set_weight_grad applied


def test_builder_without_a_model_checks_names_when_given_one():
    sb = sten.SparsityBuilder()
    sb.set_weight("nosuch.weight", initial_sparsifier=sten.ScalarFractionSparsifier(0.5), out_format=sten.CsrTensor)
    with pytest.raises(ValueError, match="unknown weight 'nosuch.weight'"):
        sb.get_sparse_model(mlp())
    sb = sten.SparsityBuilder()
    sb.set_interm("1.nosuch", inline_sparsifier=sten.ScalarFractionSparsifier(0.5))
    with pytest.raises(ValueError, match="unknown intermediate '1.nosuch'"):
        sb.get_sparse_model(mlp())
    with pytest.raises(TypeError, match="get_sparse_model\\(\\) needs the model"):
        sb.get_sparse_model()
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        sb.sparsify_model_inplace("not a model")


def test_sparsify_model_inplace():
    model = mlp()
    dense_weight = model[0].weight.detach().clone()
    out = builder_without_model().sparsify_model_inplace(model)
    assert out is model and isinstance(model[0].weight.wrapped_tensor, sten.CsrTensor)
    assert torch.equal(model[0].weight.to_dense(), dense_weight * sten.ScalarFractionSparsifier(0.7).mask(dense_weight))


def test_sparsify_model_and_optimizer_inplace_returns_both():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 20)).sum().backward()
    opt.step()
    returned = builder_without_model().sparsify_model_and_optimizer_inplace(model, opt)
    assert isinstance(returned, tuple) and returned[0] is model and returned[1] is opt
    w = model[0].weight
    assert opt.param_groups[0]["params"][0] is w and isinstance(w, sten.SparseParameterWrapper)
    assert isinstance(opt.state[w]["momentum_buffer"].wrapped_tensor, sten.CsrTensor)
    # the paper's form keeps working
    model2 = mlp()
    sb = sten.SparsityBuilder(model2)
    sb.set_weight("2.weight", initial_sparsifier=sten.ScalarFractionSparsifier(0.5), out_format=sten.CooTensor)
    m, o = sb.sparsify_model_and_optimizer_inplace()
    assert m is model2 and o is None and isinstance(model2[2].weight.wrapped_tensor, sten.CooTensor)


def test_same_format_sparsifier_ref_sp_ten():
    ref = sten.sparsify(sten.ScalarFractionSparsifier(0.5), torch.randn(4, 6), sten.CsrTensor)
    sp = sten.SameFormatSparsifier(ref)
    assert sp.ref_sp_ten is ref and sp.ref is ref
    assert sten.SameFormatSparsifier(ref_sp_ten=ref).ref_sp_ten is ref
    other = sten.sparsify(sten.KeepAll(), torch.ones(4, 6), sten.CsrTensor)
    sp.ref_sp_ten = other
    assert sp.ref is other
    x = torch.randn(4, 6)
    out = sten.sparsify(sten.SameFormatSparsifier(ref_sp_ten=ref), x, sten.CsrTensor)
    assert torch.equal(out.to_dense(), x * (ref.to_dense() != 0))
    with pytest.raises(TypeError, match="one reference tensor"):
        sten.SameFormatSparsifier()


def test_register_fwd_op_impl_with_empty_out_is_the_default_dense_output():
    calls = []

    @sten.register_fwd_op_impl(operator=torch.allclose, inp=[torch.Tensor, sten.CscTensor], out=[])
    def allclose_impl(ctx, inputs, output_sparsifiers):  # as in the original STen's tests
        calls.append(1)
        a, b = inputs
        return torch.allclose(a, b.wrapped_tensor.to_dense())

    try:
        previous = sten.dispatch.get_dispatch_failure()
        sten.set_dispatch_failure("raise")
        x = torch.randn(3, 4)
        w = sten.SparseTensorWrapper(sten.CscTensor.from_dense(x))
        assert torch.allclose(x, w) is True and calls == [1]
        assert not torch.allclose(x + 1, w)
    finally:
        sten.set_dispatch_failure(previous)
        for key in [k for k, v in sten.registry.impls.items() if v.fn is allclose_impl]:
            del sten.registry.impls[key]
            sten.registry._owners.pop(("impls", key), None)
        sten.registry.changed()


def test_scalar_mask_sparsify_keeps_the_largest_fraction():
    x = torch.tensor([[0.5, -4.0, 2.0, 3.0, -1.0, 0.25, 6.0, -0.1, 0.0, 7.0]])
    assert torch.equal(sten.scalar_mask_sparsify(x, 0.7), torch.tensor([[0.0, -4.0, 0, 0, 0, 0, 6.0, 0, 0, 7.0]]))  # keeps 3 of 10
    assert torch.equal(sten.scalar_mask_sparsify(x, 0.75), torch.tensor([[0.0, 0, 0, 0, 0, 0, 6.0, 0, 0, 7.0]]))
    assert torch.equal(sten.scalar_mask_sparsify(x, frac=0.2),
                       torch.tensor([[0.5, -4.0, 2.0, 3.0, -1.0, 0.25, 6.0, 0, 0, 7.0]]))
    assert torch.equal(sten.scalar_mask_sparsify(x, 0.0), x)
    assert torch.equal(sten.scalar_mask_sparsify(x, 1.0), torch.zeros_like(x))
    big = torch.randn(100, 50)
    assert int((sten.scalar_mask_sparsify(big, 0.9) != 0).sum()) == 500
    with pytest.raises(ValueError, match="frac must be in \\[0, 1\\]"):
        sten.scalar_mask_sparsify(x, 1.5)


def test_summary_prints_layout_shape_nnz_and_bytes(capsys):
    model = mlp()
    sb = sten.SparsityBuilder(model)
    sb.set_weight("0.weight", initial_sparsifier=sten.ScalarFractionSparsifier(0.9), out_format=sten.CsrTensor)
    sb.set_weight("2.weight", initial_sparsifier=sten.ScalarFractionSparsifier(0.5), out_format=sten.CooTensor)
    sparse = sb.get_sparse_model()
    rows = sten.summary(sparse)
    text = capsys.readouterr().out
    by_name = {r["name"]: r for r in rows}
    assert set(by_name) == {"0.weight", "2.weight"}
    w0, w2 = by_name["0.weight"], by_name["2.weight"]
    assert w0["layout"] == "CsrTensor" and w0["shape"] == [30, 20] and w0["nnz"] == 60
    assert w0["dense_bytes"] == 600 * 4
    assert w0["stored_bytes"] == 31 * 8 + 60 * 8 + 60 * 4  # int64 row pointers, int64 columns, fp32 values
    assert w2["layout"] == "CooTensor" and w2["nnz"] == 75 and w2["stored_bytes"] == 2 * 75 * 8 + 75 * 4
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["parameter", "layout", "shape"]
    assert lines[1].split()[:2] == ["0.weight", "CsrTensor"] and "[30, 20]" in lines[1] and " 60 " in lines[1]
    assert str(w0["stored_bytes"]) in lines[1] and "2400" in lines[1]
    total_stored = w0["stored_bytes"] + w2["stored_bytes"]
    assert lines[3].split()[:4] == ["sparse", "parameters", str(total_stored), str(2400 + 600)]
    assert lines[4].startswith("whole model (+2 dense)")
    assert sten.summary(sparse, print_fn=None) == rows
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        sten.summary(rows)


def test_naming_a_submodule_as_an_intermediate_says_how_its_calls_are_named():
    """``set_interm("1", ...)`` on a Sequential names a submodule, not a call: the error said "the fx
    nodes of the model are: " with an empty list (a Sequential calls submodules only)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    with pytest.raises(ValueError, match=r"'1' is a submodule: its intermediates are named '1.<fx node>', here '1.relu'"):
        sten.SparsityBuilder(model).set_interm("1", inline_sparsifier=sten.KeepAll(), out_format=sten.CooTensor)
