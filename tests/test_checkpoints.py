"""Checkpoints of every built-in layout and the example plugin's through the
default ``torch.load`` (``weights_only=True``), with the conformance kit's
``check_checkpoint``; a layout that cannot be loaded that way is named."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

import sten_core as sten
from fake_layouts import DenseCopyLayout
from sten_core.testing import check_checkpoint

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "sten_example_plugin"


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CscTensor, sten.CooTensor, sten.DenseTensor])
def test_builtin_layouts(layout):
    check_checkpoint(layout, dtypes=(torch.float32, torch.float64, torch.bfloat16))


def test_example_plugin_layout(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    from sten_example_plugin import BitmaskTensor, plugin

    assert sten.plugins.register_plugin(plugin, name="example")
    try:
        check_checkpoint(BitmaskTensor, dtypes=(torch.float32, torch.float64))
    finally:
        sten.plugins.unregister_plugin("example")
        for name in [m for m in sys.modules if m.startswith("sten_example_plugin")]:
            del sys.modules[name]


class NoStateLayout(DenseCopyLayout):
    """Registered, but without state_tensors / from_state_tensors."""


def test_layout_without_state_tensors_is_named():
    sten.registry.register_layout(NoStateLayout)
    try:
        with pytest.raises(AssertionError, match="NoStateLayout.*state_tensors.*from_state_tensors"):
            check_checkpoint(NoStateLayout)
    finally:
        sten.registry.layouts.pop("NoStateLayout")
        sten.registry._owners.pop(("layouts", "NoStateLayout"))


def test_a_layout_name_now_registered_by_another_plugin_is_named_on_load(tmp_path):
    """Two plugins named a layout alike and the one that saved the checkpoint is not installed:
    ``torch.load`` failed with "type object ... has no attribute 'from_state_tensors'", naming
    neither the layout name nor the class it resolved to."""
    path = tmp_path / "w.pt"
    torch.save({"weight": sten.SparseTensorWrapper(sten.CooTensor.from_dense(torch.eye(3)))}, path)
    coo = sten.registry.layouts["CooTensor"]
    try:
        sten.registry.layouts["CooTensor"] = NoStateLayout
        with pytest.raises(TypeError, match=r"'CooTensor' tensor, and the layout registered under that name now "
                                            r"\(test_checkpoints.NoStateLayout.*cannot rebuild one"):
            torch.load(path, weights_only=True)
    finally:
        sten.registry.layouts["CooTensor"] = coo
    assert torch.equal(torch.load(path, weights_only=True)["weight"].to_dense(), torch.eye(3))


class ElsewhereLayout(DenseCopyLayout):
    """A layout whose class another package defines (its module is set below)."""

    def state_tensors(self) -> tuple:
        return (self.data,)

    @classmethod
    def from_state_tensors(cls, tensors: tuple, shape: tuple) -> "ElsewhereLayout":
        return cls(tensors[0])


def _saved_under_the_coo_name(tmp_path: Path, cls: type, module: str) -> Path:
    """A checkpoint of a ``cls`` tensor (its class in ``module``) saved while ``cls`` held the name
    ``CooTensor``."""
    path, coo = tmp_path / "w.pt", sten.registry.layouts["CooTensor"]
    cls.__module__, cls.__qualname__ = module, "CooTensor"
    try:
        sten.registry.layouts["CooTensor"] = cls
        torch.save({"weight": sten.SparseTensorWrapper(cls.from_dense(torch.eye(3)))}, path)
    finally:
        sten.registry.layouts["CooTensor"] = coo
    return path


def test_a_checkpoint_of_another_packages_layout_of_the_same_name_is_refused(tmp_path):
    """Two plugins (installed on different machines) both call their layout ``CooTensor``: the
    checkpoint named only the layout, and loaded into the other package's class, which read its
    values wrong without a word."""
    path = _saved_under_the_coo_name(tmp_path, ElsewhereLayout, "other_vendor.layouts")
    with pytest.raises(TypeError, match=r"saved by other_vendor\.layouts\.CooTensor \(package 'other_vendor'\), but "
                                        r"'CooTensor' is now sten_core\.builtin\.torch_layouts\.CooTensor"):
        torch.load(path, weights_only=True)


def test_a_layout_class_moved_within_its_package_still_loads(tmp_path):
    coo = sten.CooTensor
    path = tmp_path / "w.pt"
    torch.save({"weight": sten.SparseTensorWrapper(coo.from_dense(torch.eye(3)))}, path)
    module = coo.__module__
    try:
        coo.__module__ = "sten_core.layouts_moved"
        assert torch.equal(torch.load(path, weights_only=True)["weight"].to_dense(), torch.eye(3))
    finally:
        coo.__module__ = module


def test_checkpoints_without_the_saving_class_still_load():
    """Checkpoints written before the class was recorded name the layout only."""
    from sten_core.training.serialization import rebuild_sparse

    tensors = sten.CooTensor.from_dense(torch.eye(3)).state_tensors()
    for args in ((), (None,)):
        w = rebuild_sparse(False, "CooTensor", (3, 3), tensors, False, *args)
        assert torch.equal(w.to_dense(), torch.eye(3))


def test_a_layout_no_plugin_registers_names_the_class_that_saved_it(tmp_path):
    path = _saved_under_the_coo_name(tmp_path, ElsewhereLayout, "other_vendor.layouts")
    coo = sten.registry.layouts.pop("CooTensor")
    try:
        with pytest.raises(ValueError, match=r"'CooTensor' tensor \(saved by other_vendor\.layouts\.CooTensor\), a "
                                             r"layout no installed plugin registers: install or enable the plugin"):
            torch.load(path, weights_only=True)
    finally:
        sten.registry.layouts["CooTensor"] = coo


@pytest.mark.parametrize("layout, corrupt", [
    (sten.CsrTensor, lambda parts: (parts[0], parts[1] + 100, parts[2])),           # column out of range
    (sten.CscTensor, lambda parts: (parts[0].flip(0), parts[1], parts[2])),         # pointers not monotone
    (sten.CooTensor, lambda parts: (parts[0] - 50, parts[1])),                      # negative index
])
def test_corrupted_members_fail_on_load(layout, corrupt, tmp_path):
    """A damaged checkpoint must raise a clear error when loaded, not read out of bounds later."""
    weight = torch.randn(6, 5) * (torch.rand(6, 5) > 0.5)
    parts = layout.from_dense(weight).state_tensors()
    with pytest.raises(ValueError, match=f"{layout.__name__}: the saved members do not form a valid"):
        layout.from_state_tensors(corrupt(parts), (6, 5))
    path = tmp_path / "w.pt"
    torch.save(sten.SparseTensorWrapper(layout.from_state_tensors(parts, (6, 5))), path)
    assert torch.equal(torch.load(path, weights_only=False).to_dense(), weight), "an intact file still loads"


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CscTensor, sten.CooTensor])
def test_move_to_meta(layout):
    """``model.to("meta")`` keeps the layout and shapes (the load-time invariant check skips meta parts)."""
    model = torch.nn.Linear(5, 6)
    builder = sten.SparsityBuilder()
    builder.set_weight(name="weight", initial_sparsifier=sten.ScalarFractionSparsifier(0.5), out_format=layout)
    meta = builder.get_sparse_model(model).to("meta")
    assert meta.weight.device.type == "meta" and isinstance(meta.weight.wrapped_tensor, layout)
    assert meta.weight.shape == (6, 5) and isinstance(meta.weight, torch.nn.Parameter)


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CscTensor, sten.CooTensor])
def test_a_model_on_the_meta_device_infers_shapes(layout):
    """The forward of a sparse model moved to the meta device raised torch's "Could not run
    'aten::addmm.out' with arguments from the 'SparseCsrMeta' backend" (COO, CSC likewise)."""
    builder = sten.SparsityBuilder()
    builder.set_weight(name="weight", initial_sparsifier=sten.ScalarFractionSparsifier(0.5), out_format=layout)
    meta = builder.get_sparse_model(torch.nn.Linear(5, 6)).to("meta")
    x = torch.randn(3, 5, device="meta")
    for y in (meta(x), torch.mm(meta.weight, x.t()), x @ meta.weight.t(), torch.addmm(meta.bias, x, meta.weight.t())):
        assert y.device.type == "meta" and y.dtype == torch.float32
    assert meta(x).shape == (3, 6) and torch.mm(meta.weight, x.t()).shape == (6, 3)


def test_sparsifying_a_model_built_on_the_meta_device_says_why_it_cannot():
    with torch.device("meta"):
        model = torch.nn.Linear(5, 6)
    builder = sten.SparsityBuilder()
    builder.set_weight(name="weight", initial_sparsifier=sten.ScalarFractionSparsifier(0.5), out_format=sten.CsrTensor)
    with pytest.raises(RuntimeError, match=r"set_weight\('weight'.*the weight is on the meta device, so it has no "
                                           r"values to sparsify"):
        builder.get_sparse_model(model)


@pytest.mark.parametrize("layout", [sten.CsrTensor, sten.CscTensor])
@pytest.mark.parametrize("kept", ["layout", "dense"])
def test_state_dict_of_a_traceable_weight_loads_weights_only(layout, kept, tmp_path):
    """A weight whose gradient keeps its layout or is dense (a traceable wrapper: its
    ``detach()`` keeps the ``grad_fmt``) saves in plain tensors, its format named."""
    grad = layout if kept == "layout" else torch.Tensor
    fmt = (sten.KeepAll(), grad, sten.KeepAll(), grad)

    def model(seed):
        torch.manual_seed(seed)
        linear = torch.nn.Linear(5, 6)
        linear.weight = sten.SparseParameterWrapper(layout.from_dense(linear.weight.detach()), grad_fmt=fmt)
        return linear

    saved = model(0)
    torch.save(saved.state_dict(), tmp_path / "sd.pt")
    state = torch.load(tmp_path / "sd.pt", weights_only=True)
    assert state["weight"].grad_fmt == fmt and hasattr(type(state["weight"]), "__tensor_flatten__")
    loaded = model(1)
    loaded.load_state_dict(state)
    assert torch.equal(loaded.weight.to_dense(), saved.weight.to_dense())
    assert loaded.weight.grad_fmt == fmt and isinstance(loaded.weight.wrapped_tensor, layout)


@pytest.mark.parametrize("layout,grad_layout", [(sten.CsrTensor, sten.CooTensor), (sten.CooTensor, sten.CsrTensor),
                                                (sten.DenseTensor, sten.CsrTensor), ("nm", "scipy")])
def test_a_grad_fmt_in_another_layout_saves_and_loads_weights_only(layout, grad_layout, tmp_path):
    """A weight whose gradient format names another registered layout saves in plain tensors
    (the format named ``layout:<name>``) and the default ``torch.load`` reads it: it failed with
    "_rebuild is not an allowed global" (the wrapper pickled whole)."""
    if layout == "nm":
        from sten_nm import NMTensor
        from sten_scipy import ScipyCsrTensor

        layout, grad_layout = NMTensor, ScipyCsrTensor
    fmt = (sten.KeepAll(), grad_layout, sten.KeepAll(), grad_layout)
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 8)
    dense = linear.weight.detach()
    made = layout.from_dense(dense, n=2, m=4) if layout.__name__ == "NMTensor" else layout.from_dense(dense * (dense > 0))
    linear.weight = sten.SparseParameterWrapper(made, grad_fmt=fmt)
    torch.save(linear.state_dict(), tmp_path / "sd.pt")
    state = torch.load(tmp_path / "sd.pt", weights_only=True)
    assert state["weight"].grad_fmt == fmt
    assert torch.equal(state["weight"].to_dense(), linear.weight.to_dense())


def test_a_sparsifying_gradient_format_is_left_out_of_state_dicts():
    """A weight whose ``grad_fmt`` holds a sparsifier: its state dict and its optimizer's load
    with the default ``torch.load``; the optimizer state failed on the sparsifier object (Adam's
    ``exp_avg``, a ``zeros_like`` of the weight, inherited the format). A parameter pickled itself
    keeps the format."""
    import io

    import torch.nn.functional as F

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8))
    sb = sten.SparsityBuilder(model)
    sb.set_weight("0.weight", sten.ScalarFractionSparsifier(0.7), out_format=sten.CsrTensor)
    sb.set_weight_grad("0.weight", sten.ScalarFractionSparsifier(0.5), sten.CsrTensor, sten.KeepAll(), sten.CsrTensor)
    model = sb.get_sparse_model()
    opt = torch.optim.Adam(model.parameters())
    for _ in range(2):
        opt.zero_grad()
        F.mse_loss(model(torch.randn(4, 16)), torch.randn(4, 8)).backward()
        opt.step()
    for state in (model.state_dict(), opt.state_dict()):
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        back = torch.load(buf)
        flat = back if "state" not in back else back["state"][0]
        for key, value in flat.items():
            if isinstance(value, sten.SparseTensorWrapper):
                want = state[key] if "state" not in state else state["state"][0][key]
                assert torch.equal(value.to_dense(), want.to_dense()), key
    resumed = torch.optim.Adam(model.parameters())
    resumed.load_state_dict(back)
    buf = io.BytesIO()
    torch.save(model[0].weight, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=False).grad_fmt is not None


class Whole(NoStateLayout):
    """Pickled whole (module level: pickle finds it by name)."""


def test_saving_a_layout_without_state_tensors_says_the_file_needs_weights_only_false(tmp_path):
    """It saved without a word, and ``torch.load``'s default then failed with "Unsupported global:
    sten_core.model.tensor._rebuild", naming neither the layout nor the fix."""
    sten.registry.register_layout(Whole)
    try:
        weight = sten.SparseTensorWrapper(Whole.from_dense(torch.eye(3)))
        with pytest.warns(UserWarning, match=r"layout Whole has no state_tensors\(\) / from_state_tensors\(\).*"
                                             r"weights_only=False"):
            torch.save({"w": weight}, tmp_path / "w.pt")
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # once per layout class
            torch.save({"w": weight}, tmp_path / "w.pt")
        assert torch.equal(torch.load(tmp_path / "w.pt", weights_only=False)["w"].to_dense(), torch.eye(3))
    finally:
        sten.registry.layouts.pop("Whole")
        sten.registry._owners.pop(("layouts", "Whole"))
