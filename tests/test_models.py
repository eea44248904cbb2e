"""Sparse models: training keeps sparsity, serialization, AMP, TransformerEncoderLayer."""

import io
import pickle

import pytest
import torch

import sten_core as sten


def mlp(sizes=(20, 32, 16, 4)):
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        if i:
            layers.append(torch.nn.ReLU())
        layers.append(torch.nn.Linear(a, b))
    return torch.nn.Sequential(*layers)


def sparse_mlp(layout=sten.CsrTensor, fraction=0.8, grad_layout=None, seed=0):
    torch.manual_seed(seed)
    model = mlp()
    sb = sten.SparsityBuilder(model)
    for name, p in model.named_parameters():
        if name.endswith("weight"):
            sb.set_weight(name, initial_sparsifier=sten.ScalarFractionSparsifier(fraction), out_format=layout)
            if grad_layout is not None:
                sb.set_weight_grad(name, sten.KeepAll(), grad_layout, sten.KeepAll(), grad_layout)
    return model, sb, sb.get_sparse_model()


def patterns(model):
    return {n: (p.to_dense() != 0).clone() for n, p in model.named_parameters() if isinstance(p, sten.SparseTensorWrapper)}


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
@pytest.mark.parametrize("layout,grad_layout", [(sten.CsrTensor, None), (sten.CooTensor, sten.CooTensor), (sten.CscTensor, sten.CscTensor)])
def test_training_keeps_sparsity(opt_name, layout, grad_layout):
    _, _, model = sparse_mlp(layout, grad_layout=grad_layout)
    params = list(model.parameters())
    if opt_name == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-1, momentum=0.9)
    before = patterns(model)
    nnz = {n: p.wrapped_tensor.nnz for n, p in model.named_parameters() if isinstance(p, sten.SparseTensorWrapper)}
    torch.manual_seed(1)
    x, y = torch.randn(64, 20), torch.randint(0, 4, (64,))
    losses = []
    for _ in range(20):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]  # identity preserved
    for n, p in model.named_parameters():
        if isinstance(p, sten.SparseTensorWrapper):
            assert isinstance(p.wrapped_tensor, layout)
            assert p.wrapped_tensor.nnz == nnz[n]
            assert torch.equal(p.to_dense() != 0, before[n]) or bool(((p.to_dense() != 0) & ~before[n]).sum() == 0)
            if grad_layout is not None:
                assert isinstance(p.grad.wrapped_tensor, grad_layout)


def test_sparse_grad_matches_dense_grad_at_kept_positions():
    dense_model, sb, model = sparse_mlp(sten.CsrTensor, grad_layout=sten.CsrTensor)
    ref = mlp()
    ref.load_state_dict(sten.densify_state_dict(model.state_dict()))
    x = torch.randn(8, 20)
    model(x).sum().backward()
    ref(x).sum().backward()
    for (n, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        if isinstance(p, sten.SparseTensorWrapper):
            mask = p.to_dense() != 0
            torch.testing.assert_close(p.grad.to_dense(), r.grad * mask, rtol=1e-4, atol=1e-6)
        else:
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-6)


def test_state_dict_roundtrip_weights_only(tmp_path):
    _, _, model = sparse_mlp(sten.CsrTensor)
    path = tmp_path / "sparse.pt"
    torch.save(model.state_dict(), path)
    loaded = torch.load(path, weights_only=True)
    _, _, fresh = sparse_mlp(sten.CsrTensor, seed=5)
    x = torch.randn(4, 20)
    assert not torch.allclose(fresh(x), model(x))
    fresh.load_state_dict(loaded)
    torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)
    for (n, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters()):
        assert type(p) is type(q)
        if isinstance(p, sten.SparseTensorWrapper):
            assert type(p.wrapped_tensor) is type(q.wrapped_tensor)
            assert torch.equal(p.to_dense(), q.to_dense())


@pytest.mark.parametrize("layout", [sten.CooTensor, sten.CscTensor, sten.DenseTensor])
def test_whole_wrapper_pickles(layout):
    w = sten.SparseParameterWrapper(layout.from_dense(torch.randn(3, 4)))
    buf = io.BytesIO()
    torch.save(w, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert isinstance(back, sten.SparseParameterWrapper) and torch.equal(back.to_dense(), w.to_dense())
    assert torch.equal(pickle.loads(pickle.dumps(w)).to_dense(), w.to_dense())


def test_dense_state_dict_into_sparse_and_back():
    dense, sb, model = sparse_mlp(sten.CsrTensor)
    other = mlp()
    sd = other.state_dict()
    sten.load_dense_state_dict(model, sd)  # keeps the masks, reads values at them
    w = model.get_parameter("0.weight")
    mask = w.to_dense() != 0
    torch.testing.assert_close(w.to_dense(), sd["0.weight"] * mask)
    sten.load_dense_state_dict(model, sd, builder=sb)  # sparsified anew from the loaded values
    kept = model.get_parameter("0.weight").to_dense() != 0
    assert torch.equal(kept, sten.ScalarFractionSparsifier(0.8).mask(sd["0.weight"]))
    back = mlp()
    back.load_state_dict(sten.densify_state_dict(model.state_dict()))
    torch.testing.assert_close(back[0].weight, model.get_parameter("0.weight").to_dense())


def test_autocast_bf16():
    _, _, model = sparse_mlp(sten.CsrTensor)
    x = torch.randn(8, 20)
    ref = mlp()
    ref.load_state_dict(sten.densify_state_dict(model.state_dict()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
        out_ref = ref(x)
    assert out.dtype == torch.bfloat16 == out_ref.dtype
    torch.testing.assert_close(out.float(), out_ref.float(), rtol=5e-2, atol=5e-2)
    out.float().sum().backward()


def test_autocast_dense_fallback():
    """An op with no sparse implementation runs densely under autocast."""
    w = sten.SparseTensorWrapper(sten.CooTensor.from_dense(torch.randn(6, 6)))
    x = torch.randn(6, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.warns(sten.DispatchWarning):
            out = torch.addmm(x, w, x)
    assert out.dtype == torch.bfloat16


def test_transformer_encoder_layer_keeps_its_arguments():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(512, 8, dim_feedforward=256, batch_first=True)
    sb = sten.SparsityBuilder(layer)
    for name in ("linear1.weight", "linear2.weight"):
        sb.set_weight(name, initial_sparsifier=sten.ScalarFractionSparsifier(0.5), out_format=sten.CsrTensor)
    sb.set_interm("relu", sten.ScalarThresholdSparsifier(0.1), torch.Tensor, sten.KeepAll(), sten.CooTensor)
    sparse = sb.get_sparse_model()
    x = torch.randn(2, 10, 512)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(10)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        out = sparse(x, src_mask=mask, is_causal=True)
        out2 = sparse(x, src_key_padding_mask=torch.zeros(2, 10, dtype=torch.bool))
    assert out.shape == out2.shape == (2, 10, 512)
    out.sum().backward()
    assert sparse.linear1.weight.grad is not None


def test_transformer_encoder_unknown_intermediate_lists_calls():
    layer = torch.nn.TransformerEncoderLayer(64, 4, dim_feedforward=32)
    sb = sten.SparsityBuilder(layer)
    sb.set_interm("gelu", sten.KeepAll(), torch.Tensor, sten.KeepAll(), sten.CooTensor)
    sparse = sb.get_sparse_model()
    with pytest.raises(ValueError, match="relu"):
        sparse(torch.randn(3, 2, 64))


def test_scalar_add_is_not_stored_values_only():
    w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(2)))
    out = w + 2
    assert torch.equal(sten.model.tensor.densify(out), torch.eye(2) + 2)
    both = torch.add(w, w)
    assert isinstance(both, sten.SparseTensorWrapper) and torch.equal(both.to_dense(), 2 * torch.eye(2))


class _Inner(torch.nn.Module):
    """A custom module: fx traces through it, so its calls are named in its parent's graph."""

    def forward(self, x):
        return torch.relu(x) * 2


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2, self.inner = (torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8),
                                                    _Inner())

    def forward(self, x):
        h = self.inner(self.act(self.fc1(x)))    # fx: fc1, act (call_module), relu, mul (from _Inner)
        return torch.relu(self.fc2(h))           # fx: fc2, relu_1


@pytest.mark.parametrize("node", ["relu", "relu_1", "mul"])
def test_set_interm_prunes_the_fx_node_it_names(node):
    """Names are fx node names of the submodule: calls inside the torch.nn modules it calls
    (call_module nodes) are not counted, calls inside a custom module it traces through are.
    Before, the TorchFunctionMode also counted nn.ReLU's own relu: "0.relu_1" pruned
    the wrong tensor."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block())
    names = [n.name for n in torch.fx.symbolic_trace(model[0]).graph.nodes]
    assert names == ["x", "fc1", "act", "relu", "mul", "fc2", "relu_1", "output"]
    sp = sten.ScalarFractionSparsifier(0.5)
    sb = sten.SparsityBuilder(model)
    sb.set_interm(f"0.{node}", sp, torch.Tensor, sten.KeepAll(), torch.Tensor)
    sparse = sb.get_sparse_model()
    x = torch.randn(4, 8)
    blk = model[0]

    def prune(t, at):
        return t * sp.mask(t) if node == at else t

    h = blk.act(blk.fc1(x))
    h = prune(prune(torch.relu(h), "relu") * 2, "mul")
    expected = prune(torch.relu(blk.fc2(h)), "relu_1")
    torch.testing.assert_close(sparse(x), expected)
