"""Plugin registration, discovery, sparsifiers and conversions through sten_core."""

import importlib.metadata as md

import pytest
import torch

import sten_core as sten
from sten_nm import NMSparsifier, NMTensor, _kernel, plugin

from conftest import requires_kernel


def test_plugin_info():
    info = plugin.sten_plugin_info()
    ok, reason = _kernel.available()
    assert info["name"] == "nm" and info["available"] is ok and info["reason"] == reason


def test_entry_point():
    eps = [ep for ep in md.entry_points(group="sten") if ep.name == "nm"]
    assert eps and eps[0].value == "sten_nm.plugin"


@pytest.mark.parametrize("sp", [NMSparsifier(2, 4), sten.PerBlockFractionSparsifier(2, 4)])
def test_sparsifiers(sp):
    w = torch.randn(8, 20)
    out = sten.sparsify(sp, w, NMTensor)
    assert isinstance(out.wrapped_tensor, NMTensor)
    assert torch.equal(out.wrapped_tensor.to_dense(), torch.where(sten.PerBlockFractionSparsifier(2, 4).mask(w), w, torch.zeros(())))


def test_per_block_unrepresentable():
    with pytest.raises(ValueError, match="1 <= n < m <= 32"):
        sten.sparsify(sten.PerBlockFractionSparsifier(4, 4), torch.randn(4, 8), NMTensor)


@pytest.mark.parametrize("dst", ["DenseTensor", "CooTensor", "CsrTensor", "CscTensor"])
def test_conversions(dst):
    cls = getattr(sten, dst)
    t = NMTensor.from_dense(torch.randn(6, 10), 1, 4)
    out = sten.convert(sten.SparseTensorWrapper(t), cls).wrapped_tensor
    assert isinstance(out, cls)
    assert torch.equal(out.to_dense(), t.to_dense())


@requires_kernel
def test_conformance_kit():
    testing = pytest.importorskip("sten_core.testing")
    sp = NMSparsifier(2, 4)  # from_dense defaults to 2:4
    testing.check_layout(NMTensor, sparsifier=sp, dtypes=(torch.float32, torch.bfloat16))  # fp64: see docs/nm.md (sten_cuda24 conversion)
    testing.check_linear(NMTensor, sparsifier=sp)
    testing.check_linear(NMTensor, sparsifier=sp, dtype=torch.bfloat16)
