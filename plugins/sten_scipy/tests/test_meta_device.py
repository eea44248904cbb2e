"""The scipy layouts and the meta device: their pattern and values live in scipy (numpy, CPU)
arrays, which meta tensors cannot hold, so ``torch.load(map_location="meta")`` and
``Module.to("meta")`` raise an error naming the layout and the meta device (not numpy's "can't
convert meta device type tensor to numpy"); the CPU paths are unchanged."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

import sten_core as sten
from sten_scipy import ScipyCscTensor, ScipyCsrTensor

LAYOUTS = [ScipyCsrTensor, ScipyCscTensor]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _saved(layout_cls: type) -> io.BytesIO:
    """A checkpoint ``{"w": wrapper}`` of a ``layout_cls`` weight, rewound."""
    buf = io.BytesIO()
    torch.save({"w": sten.SparseTensorWrapper(layout_cls.from_dense(torch.randn(6, 5)))}, buf)
    buf.seek(0)
    return buf


@pytest.mark.parametrize("layout_cls", LAYOUTS)
def test_load_onto_meta_names_layout(layout_cls):
    with pytest.raises(NotImplementedError, match=f"{layout_cls.__name__} cannot be on the meta device"):
        torch.load(_saved(layout_cls), map_location="meta")


@pytest.mark.parametrize("layout_cls", LAYOUTS)
def test_module_to_meta_names_layout(layout_cls):
    layer = torch.nn.Linear(5, 6)
    layer.weight = sten.SparseParameterWrapper(layout_cls.from_dense(layer.weight.detach()))
    with pytest.raises(NotImplementedError, match=f"{layout_cls.__name__} cannot be on the meta device"):
        layer.to("meta")
    assert layer.weight.device.type == "cpu" and type(layer.weight.wrapped_tensor) is layout_cls


@pytest.mark.parametrize("layout_cls", LAYOUTS)
def test_cpu_load_unchanged(layout_cls):
    w = torch.load(_saved(layout_cls), map_location="cpu")["w"]
    assert type(w.wrapped_tensor) is layout_cls and w.to_dense().shape == (6, 5)
