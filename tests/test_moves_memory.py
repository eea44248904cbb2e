"""A sparse model's memory, as for a dense one: meta-device initialisation and
``to_empty``, ``share_memory`` with a forked worker, a state dict whose gradient
format loads with the default ``torch.load``, and Hugging Face / safetensors saving."""

from __future__ import annotations

import io
import multiprocessing
import warnings

import pytest
import torch

import sten_core as sten

CORE_LAYOUTS = [sten.CsrTensor, sten.CooTensor, sten.CscTensor, sten.DenseTensor]


def sparse_mlp(layout: type, seed: int, sparsifier: object = None) -> torch.nn.Module:
    """A 16 -> 8 -> 4 MLP whose first weight is in ``layout``."""
    torch.manual_seed(seed)
    sb = sten.SparsityBuilder(torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)))
    sb.set_weight("0.weight", initial_sparsifier=sparsifier or sten.ScalarFractionSparsifier(0.6), out_format=layout)
    return sb.get_sparse_model()


def saved(state: dict) -> dict:
    """``state`` through ``torch.save`` and the default ``torch.load`` (weights_only=True)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf)


def nm_layout() -> type:
    return pytest.importorskip("sten_nm").NMTensor


# -- meta-device initialisation, to_empty, empty_like ---------------------------------------------

@pytest.mark.parametrize("layout", CORE_LAYOUTS)
def test_meta_to_empty_then_load_gives_the_checkpoints_layout_and_values(layout):
    """It became a plain dense Parameter, and stayed dense after loading the sparse checkpoint."""
    source = sparse_mlp(layout, 0)
    model = sparse_mlp(layout, 1).to("meta").to_empty(device="cpu")
    weight = model[0].weight
    assert isinstance(weight, torch.nn.Parameter) and isinstance(weight.wrapped_tensor, layout)
    assert weight.device.type == "cpu" and weight.requires_grad
    model.load_state_dict(saved(source.state_dict()))
    assert model[0].weight is weight and isinstance(weight.wrapped_tensor, layout)
    assert weight.wrapped_tensor.same_pattern(source[0].weight.wrapped_tensor)
    x = torch.randn(3, 16)
    assert torch.equal(model(x), source(x))
    assert torch.equal(weight.to_dense(), source[0].weight.to_dense())


def test_meta_to_empty_of_an_nm_weight_keeps_its_n_and_m():
    nm = nm_layout()
    source = sparse_mlp(nm, 0, sten.PerBlockFractionSparsifier(1, 4))
    assert (source[0].weight.wrapped_tensor.n, source[0].weight.wrapped_tensor.m) == (1, 4)
    model = sparse_mlp(nm, 1, sten.PerBlockFractionSparsifier(1, 4)).to("meta").to_empty(device="cpu")
    layout = model[0].weight.wrapped_tensor
    assert isinstance(layout, nm) and (layout.n, layout.m) == (1, 4)
    model.load_state_dict(saved(source.state_dict()))
    x = torch.randn(3, 16)
    assert torch.equal(model(x), source(x))


class WithBuffer(torch.nn.Module):
    def __init__(self, layout: type):
        super().__init__()
        torch.manual_seed(0)
        dense = torch.randn(8, 8)
        self.register_buffer("A", sten.SparseTensorWrapper(layout.from_dense(dense * (dense > 0.3))))


@pytest.mark.parametrize("layout", CORE_LAYOUTS)
def test_to_empty_keeps_a_sparse_buffer_and_its_pattern(layout):
    """A sparse buffer became a dense tensor; on a device with data the pattern is kept (it was
    drawn anew from uninitialised memory, which a dense load then silently used)."""
    module = WithBuffer(layout)
    before = module.A.wrapped_tensor
    module.to_empty(device="cpu")
    assert isinstance(module.A, sten.SparseTensorWrapper) and isinstance(module.A.wrapped_tensor, layout)
    assert module.A.wrapped_tensor.same_pattern(before) and module.A.wrapped_tensor is not before


@pytest.mark.parametrize("layout", CORE_LAYOUTS)
def test_empty_like_is_a_wrapper_of_the_same_layout(layout):
    w = sten.SparseTensorWrapper(layout.from_dense(torch.tensor([[0., 2.], [3., 0.]])))
    e = torch.empty_like(w, dtype=torch.float64)
    assert isinstance(e.wrapped_tensor, layout) and e.wrapped_tensor.same_pattern(w.wrapped_tensor)
    assert (e.shape, e.dtype, e.device) == (w.shape, torch.float64, w.device)
    meta = torch.empty_like(w, device="meta")
    assert isinstance(meta.wrapped_tensor, layout) and meta.device.type == "meta"
    back = torch.empty_like(meta, device="cpu")  # no pattern on meta: an empty (all-zero) one
    assert isinstance(back.wrapped_tensor, layout) and back.shape == w.shape
    assert torch.equal(back.to_dense(), torch.zeros(2, 2))


# -- share_memory ---------------------------------------------------------------------------------

def _add_one(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)


def _fork() -> multiprocessing.context.BaseContext:
    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("the fork start method is not available on this platform")
    return torch.multiprocessing.get_context("fork")


@pytest.mark.parametrize("which", ["csr", "nm"])
def test_share_memory_lets_a_forked_worker_update_the_sparse_weight(which):
    """The layout's tensors stayed private: the worker's update of the sparse weight was lost."""
    layout = sten.CsrTensor if which == "csr" else nm_layout()
    sparsifier = None if which == "csr" else sten.PerBlockFractionSparsifier(2, 4)
    model = sparse_mlp(layout, 0, sparsifier)
    weight = model[0].weight
    before, bias = weight.to_dense().clone(), model[0].bias.detach().clone()
    pattern = before != 0
    assert model.share_memory() is model and weight.is_shared() and model[0].weight is weight
    worker = _fork().Process(target=_add_one, args=(model,))
    worker.start()
    worker.join(60)
    assert worker.exitcode == 0
    assert isinstance(weight.wrapped_tensor, layout)
    assert torch.equal(weight.to_dense(), before + pattern)
    assert torch.equal(model[0].bias, bias + 1)  # (a dense parameter, shared by torch itself)


def test_share_memory_of_a_parameter_that_requires_grad():
    """``w.share_memory_()`` raised "a leaf Variable that requires grad is being used in an in-place operation"."""
    w = sparse_mlp(sten.CsrTensor, 0)[0].weight
    assert w.requires_grad and not w.is_shared()
    assert w.share_memory_() is w and w.is_shared()
    assert w.grad_fn is None and w.is_leaf


def test_share_memory_refuses_memory_torch_does_not_own():
    scipy_csr = pytest.importorskip("sten_scipy").ScipyCsrTensor
    w = sten.SparseTensorWrapper(scipy_csr.from_dense(torch.eye(3)))
    with pytest.raises(TypeError, match="ScipyCsrTensor.*shared memory"):
        w.share_memory_()
    assert torch.equal(w.to_dense(), torch.eye(3))


# -- a gradient format in a state dict ------------------------------------------------------------

@pytest.mark.parametrize("tmp,out", [(torch.Tensor, sten.CsrTensor), (sten.CsrTensor, torch.Tensor),
                                     (torch.Tensor, sten.CooTensor)])
def test_state_dict_with_a_two_layout_grad_format_loads_weights_only(tmp, out):
    """``set_weight_grad(name, out_format=CsrTensor)`` (tmp_format left dense) made ``state_dict()``
    need unsafe globals (``_rebuild``, then the wrapper class) under the default ``torch.load``."""
    torch.manual_seed(0)
    sb = sten.SparsityBuilder(torch.nn.Sequential(torch.nn.Linear(16, 8)))
    sb.set_weight("0.weight", initial_sparsifier=sten.ScalarFractionSparsifier(0.7), out_format=sten.CsrTensor)
    sb.set_weight_grad("0.weight", tmp_format=tmp, out_format=out)
    model = sb.get_sparse_model()
    state = saved(model.state_dict())
    assert tuple(state["0.weight"].grad_fmt) == tuple(model[0].weight.grad_fmt)
    fresh = sparse_mlp(sten.CsrTensor, 1)[:1]
    fresh.load_state_dict(state)
    assert torch.equal(fresh[0].weight.to_dense(), model[0].weight.to_dense())
    assert fresh[0].weight.wrapped_tensor.same_pattern(model[0].weight.wrapped_tensor)


# -- safetensors and Hugging Face save_pretrained -------------------------------------------------

def test_storage_of_a_wrapper_says_how_to_save_dense():
    w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(3)))
    with pytest.raises(RuntimeError, match="densify_state_dict"):
        w.storage()


def test_safetensors_save_file_names_the_fix():
    """safetensors failed with an opaque "invalid shape, data type, or offset for tensor"."""
    st = pytest.importorskip("safetensors.torch")
    state = sparse_mlp(sten.CooTensor, 0).state_dict()
    with pytest.raises(RuntimeError, match="densify_state_dict"):
        st.save(state)
    back = st.load(st.save(sten.densify_state_dict(state)))
    assert torch.equal(back["0.weight"], state["0.weight"].to_dense())


def test_hugging_face_save_pretrained_recipe(tmp_path):
    """``save_pretrained`` names the fix; the densified state dict saves, loads and re-sparsifies exactly."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=50, max_position_embeddings=16)
    name = "encoder.layer.0.attention.self.query.weight"

    def sparsify(model: torch.nn.Module) -> torch.nn.Module:
        sb = sten.SparsityBuilder(model)
        sb.set_weight(name, initial_sparsifier=sten.ScalarFractionSparsifier(0.7), out_format=sten.CsrTensor)
        return sb.get_sparse_model().eval()

    torch.manual_seed(0)
    model = sparsify(transformers.BertModel(cfg))
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="densify_state_dict"):
        warnings.simplefilter("ignore")
        model.save_pretrained(tmp_path / "as-is")
    model.save_pretrained(tmp_path / "dense", state_dict=sten.densify_state_dict(model.state_dict()))
    back = sparsify(transformers.BertModel.from_pretrained(tmp_path / "dense"))
    weight = back.get_parameter(name)
    assert isinstance(weight.wrapped_tensor, sten.CsrTensor)
    assert torch.equal(weight.to_dense(), model.get_parameter(name).to_dense())
    ids = torch.randint(0, 50, (2, 8))
    assert torch.equal(back(ids).last_hidden_state, model(ids).last_hidden_state)


@pytest.mark.parametrize("sparsifier", [sten.ScalarFractionSparsifier(0.9), sten.RandomFractionSparsifier(0.9),
                                        sten.ScalarThresholdSparsifier(0.1)],
                         ids=["ScalarFraction", "RandomFraction", "ScalarThreshold"])
def test_a_model_with_a_sparsified_intermediate_runs_on_the_meta_device(sparsifier):
    """Shape inference on meta: the sparsifiers raised (``.item()`` on meta, no meta ``_to_sparse``)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    sb = sten.SparsityBuilder(model)
    sb.set_weight("0.weight", sten.ScalarFractionSparsifier(0.5), out_format=sten.CsrTensor)
    sb.set_interm("1.relu", inline_sparsifier=sparsifier, tmp_format=torch.Tensor,
                  external_sparsifier=sten.KeepAll(), out_format=sten.CooTensor)
    sparse = sb.get_sparse_model()
    assert sparse(torch.randn(4, 16)).shape == (4, 8)
    out = sparse.to("meta")(torch.randn(4, 16, device="meta"))
    assert out.shape == (4, 8) and out.device.type == "meta"
