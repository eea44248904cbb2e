"""bf16 weights in the paper-format kernel: stored bf16, widened in the kernel, fp32
accumulation; checked against the dense reference on every ISA (no float32 copy made)."""

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_nm import ColumnGroupedNMTensor, _kernel
from sten_nm.column_grouped_ops import column_grouped_linear

from conftest import requires_kernel

pytestmark = requires_kernel


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (3, 6), (2, 8), (1, 10)])
@pytest.mark.parametrize("B", [1, 7, 64, 130])
@pytest.mark.parametrize("blocked", [False, True])
def test_bf16_values_every_isa(isa, n, m, B, blocked, monkeypatch):
    if blocked:   # passes of one slot each: the widening of a slot range
        monkeypatch.setenv("STEN_NM_CG_BLOCK_BYTES", "1")
    for N, K in ((19, 37), (40, 200)):
        t = ColumnGroupedNMTensor.from_dense(torch.randn(N, K).bfloat16(), n, m)
        assert t.values().dtype == torch.bfloat16
        d = t.desc()
        assert d.vtype == _kernel.VTYPES[torch.bfloat16]
        x, b = torch.randn(B, K), torch.randn(N)
        ref = F.linear(x, t.to_dense().float(), b)   # fp32 product of the exact bf16 values
        torch.testing.assert_close(_kernel.colgrouped_gather(d, x, b), ref, rtol=1e-5, atol=1e-4)
        for threads in (1, 3):
            torch.testing.assert_close(_kernel.colgrouped_gather(d, x, nthreads=threads),
                                       F.linear(x, t.to_dense().float()), rtol=1e-5, atol=1e-4)
        assert getattr(t, "_fp32_cache", None) is None   # no float32 copy of the weight


def test_bf16_weight_through_f_linear():
    """fp32 input and bf16 weight: fp32 result as dense; bf16 input: bf16 result."""
    w = torch.randn(48, 64)
    t = ColumnGroupedNMTensor.from_dense(w.bfloat16(), 2, 4)
    x = torch.randn(5, 64)
    y = F.linear(x, sten.SparseTensorWrapper(t))
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, x @ t.to_dense().float().t(), rtol=1e-5, atol=1e-4)
    yb = column_grouped_linear(x.bfloat16(), t)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), (x.bfloat16().float() @ t.to_dense().float().t()),
                               rtol=1e-2, atol=1e-2)


def test_bf16_values_in_place_update_seen():
    t = ColumnGroupedNMTensor.from_dense(torch.randn(16, 32).bfloat16(), 1, 4)
    x = torch.randn(3, 32)
    column_grouped_linear(x, t)
    t.values().mul_(2)
    torch.testing.assert_close(column_grouped_linear(x, t), x @ t.to_dense().float().t(), rtol=1e-5, atol=1e-4)


def test_autocast_rounds_to_a_cached_bf16_copy():
    """fp32 weight under CPU autocast: a bf16 copy (half the bytes of fp32), made once."""
    t = ColumnGroupedNMTensor.from_dense(torch.randn(24, 40), 2, 4)
    assert t.desc(torch.bfloat16).vtype == _kernel.VTYPES[torch.bfloat16]
    assert t.desc(torch.bfloat16)._keep[0] is t.desc(torch.bfloat16)._keep[0]
    assert t.desc().vtype == _kernel.VTYPES[torch.float32]
    with pytest.raises(ValueError, match="vals must be contiguous float32 or bfloat16"):
        _kernel.colgrouped(t.values().half(), t.columns, t.columns[:0], 24, 40, 2, 4)
