"""Appendix A.1 (sparsify a BERT layer) and A.2 (sparse MLP from scratch)."""

import pytest
import torch

import sten_core as sten

transformers = pytest.importorskip("transformers")


def bert_layer():
    torch.manual_seed(0)
    config = transformers.BertConfig()
    config._attn_implementation = "eager"
    return transformers.models.bert.modeling_bert.BertLayer(config).eval()


def first(output):
    return output[0] if isinstance(output, tuple) else output


def a1_builder(model, fraction, interm_fraction):
    sb = sten.SparsityBuilder(model)
    weights = []
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.linear.Linear):
            weight = module_name + ".weight"
            weights.append(weight)
            sb.set_weight(
                name=weight,
                initial_sparsifier=sten.ScalarFractionSparsifier(fraction),
                inline_sparsifier=sten.KeepAll(),
                tmp_format=torch.Tensor,
                external_sparsifier=sten.KeepAll(),
                out_format=sten.CsrTensor,
            )
    sb.set_interm(
        name="intermediate.gelu",
        inline_sparsifier=sten.RandomFractionSparsifier(interm_fraction),
        tmp_format=sten.CooTensor,
        external_sparsifier=sten.KeepAll(),
        out_format=sten.CooTensor,
    )
    return sb, weights


def test_a1_bert_layer_runs_sparse():
    model = bert_layer()
    sb, weights = a1_builder(model, 0.9, 0.9)
    assert weights == ['attention.self.query.weight', 'attention.self.key.weight',
                       'attention.self.value.weight', 'attention.output.dense.weight',
                       'intermediate.dense.weight', 'output.dense.weight']
    sparse_model = sb.get_sparse_model()
    x = torch.rand(8, 128, 768)
    output = first(sparse_model(x))  # transformers 5 returns the tensor, 4 a tuple
    assert output.shape == (8, 128, 768)
    for name in weights:
        w = sparse_model.get_parameter(name)
        assert isinstance(w.wrapped_tensor, sten.CsrTensor)
        assert w.wrapped_tensor.nnz == round(w.numel() * 0.1)
        assert isinstance(model.get_parameter(name), torch.nn.Parameter)  # original untouched
        assert not isinstance(model.get_parameter(name), sten.SparseTensorWrapper)


def test_a1_fraction_zero_matches_dense():
    model = bert_layer()
    sb, _ = a1_builder(model, 0.0, 0.0)
    sparse_model = sb.get_sparse_model()
    x = torch.rand(2, 16, 768, requires_grad=True)
    xd = x.detach().clone().requires_grad_(True)
    out = first(sparse_model(x))
    ref = first(model(xd))
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    g = torch.randn_like(ref)
    out.backward(g)
    ref.backward(g)
    torch.testing.assert_close(x.grad, xd.grad, atol=1e-4, rtol=1e-4)


def test_unknown_names_list_valid_ones():
    model = bert_layer()
    sb = sten.SparsityBuilder(model)
    with pytest.raises(ValueError, match="intermediate.dense.weight"):
        sb.set_weight("nope.weight", sten.KeepAll(), out_format=sten.CsrTensor)
    with pytest.raises(ValueError, match="gelu"):
        sb.set_interm("intermediate.relu", sten.KeepAll(), torch.Tensor, sten.KeepAll(), sten.CooTensor)


class MLP(torch.nn.Module):
    def __init__(self, channel_sizes):
        super().__init__()
        self.layers = torch.nn.Sequential()
        in_out_pairs = list(zip(channel_sizes[:-1], channel_sizes[1:]))
        for idx, (in_channels, out_channels) in enumerate(in_out_pairs):
            if idx != 0:
                self.layers.append(torch.nn.ReLU())
            self.layers.append(torch.nn.Linear(in_channels, out_channels))

    def forward(self, input):
        return self.layers(input)


class SparseLinear(torch.nn.Module):
    def __init__(self, input_features, output_features, weight_sparsity):
        super().__init__()
        self.weight_sparsity = weight_sparsity
        dense_weight = sten.random_mask_sparsify(torch.randn(output_features, input_features), frac=weight_sparsity)
        self.weight = sten.SparseParameterWrapper(sten.CscTensor.from_dense(dense_weight))
        self.weight.grad_fmt = (sten.KeepAll(), torch.Tensor, sten.RandomFractionSparsifier(self.weight_sparsity), sten.CscTensor)
        self.bias = torch.nn.Parameter(torch.rand(output_features))
        self.bias.grad_fmt = (sten.KeepAll(), torch.Tensor, sten.KeepAll(), torch.Tensor)

    def forward(self, input):
        sparse_op = sten.sparsified_op(
            orig_op=torch.nn.functional.linear,
            out_fmt=tuple([(sten.KeepAll(), torch.Tensor, sten.KeepAll(), torch.Tensor)]),
            grad_out_fmt=tuple([(sten.KeepAll(), torch.Tensor, sten.KeepAll(), torch.Tensor)]),
        )
        return sparse_op(input, self.weight, self.bias)


class SparseMLP(torch.nn.Module):
    def __init__(self, channel_sizes, weight_sparsity):
        super().__init__()
        self.layers = torch.nn.Sequential()
        in_out_pairs = list(zip(channel_sizes[:-1], channel_sizes[1:]))
        for idx, (in_channels, out_channels) in enumerate(in_out_pairs):
            if idx != 0:
                self.layers.append(torch.nn.ReLU())
            self.layers.append(SparseLinear(in_channels, out_channels, weight_sparsity))

    def forward(self, input):
        return self.layers(input)


def test_a2_sparse_mlp_forward_backward():
    torch.manual_seed(0)
    model = SparseMLP([50, 40, 30, 20, 30, 10], 0.8)
    output = model(torch.randn(15, 50))
    assert output.shape == (15, 10)
    output.sum().backward()
    w = model.layers[0].weight
    assert isinstance(w.grad, sten.SparseTensorWrapper) and isinstance(w.grad.wrapped_tensor, sten.CscTensor)
    assert isinstance(model.layers[0].bias.grad, torch.Tensor)


def test_a2_zero_sparsity_matches_dense():
    torch.manual_seed(0)
    sizes = [50, 40, 30, 20, 30, 10]
    sparse = SparseMLP(sizes, 0.0)
    for layer in sparse.layers:
        if isinstance(layer, SparseLinear):
            layer.weight.grad_fmt = None  # dense gradient to compare exactly
    dense = MLP(sizes)
    with torch.no_grad():
        for s, d in zip(sparse.layers, dense.layers):
            if isinstance(s, SparseLinear):
                d.weight.copy_(s.weight.to_dense())
                d.bias.copy_(s.bias)
    x = torch.randn(15, 50)
    out, ref = sparse(x), dense(x)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    out.sum().backward()
    ref.sum().backward()
    for s, d in zip(sparse.layers, dense.layers):
        if isinstance(s, SparseLinear):
            torch.testing.assert_close(s.weight.grad, d.weight.grad, rtol=1e-3, atol=1e-4)
            torch.testing.assert_close(s.bias.grad, d.bias.grad, rtol=1e-3, atol=1e-4)
