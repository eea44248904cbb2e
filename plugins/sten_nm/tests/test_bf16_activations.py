"""bf16 activations read by the paper-format kernel (``nm_colgrouped_gather_bf16x``): the
``vdpbf16ps`` path (AVX512_BF16 CPUs) and the widening path (every ISA), each against the dense
reference: exact bf16 operands with float32 accumulation, values and gradients."""

import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import sten_core as sten
from sten_nm import ColumnGroupedNMTensor, _bf16x, _kernel

from conftest import KERNEL_OK, requires_kernel

pytestmark = requires_kernel


def _paths():
    """(isa, dot) pairs this CPU runs: the widening path on every ISA, vdpbf16ps where it can."""
    if not KERNEL_OK:
        return []
    out = [(isa, False) for isa in _kernel.supported_isas()]
    if "avx512" in _kernel.supported_isas() and _bf16x.bf16_dot_supported():
        out.append(("avx512", True))
    return out


@pytest.fixture(params=_paths(), ids=lambda p: f"{p[0]}-{'dot' if p[1] else 'widen'}")
def path(request):
    isa, dot = request.param
    before_isa, before_dot = _kernel.isa(), _bf16x.bf16_dot_enabled()
    _kernel.set_isa(isa)
    _bf16x.set_bf16_dot(dot)
    assert _bf16x.bf16_dot() == dot   # the path under test is the one that runs
    yield request.param
    _kernel.set_isa(before_isa)
    _bf16x.set_bf16_dot(before_dot)


def test_every_path_is_covered_where_the_cpu_has_it():
    """On an AVX512_BF16 CPU the vdpbf16ps path is one of the parametrised paths (not skipped)."""
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if " avx512_bf16" in flags and " avx512bw" in flags:
        assert ("avx512", True) in _paths()


def _ref(x, t, bias=None):
    """float32 product of the exact bf16 operands (what both paths compute)."""
    return F.linear(x.float(), t.to_dense().float(), bias)


@pytest.mark.parametrize("n,m", [(1, 2), (2, 4), (1, 4), (3, 6), (5, 8), (1, 10)])
@pytest.mark.parametrize("B", [1, 5, 31, 33, 64, 97])
def test_matches_dense(path, n, m, B):
    for N, K in ((19, 37), (40, 200)):
        t = ColumnGroupedNMTensor.from_dense(torch.randn(N, K).bfloat16(), n, m)
        x, b = torch.randn(B, K).bfloat16(), torch.randn(N)
        d = t.desc()
        torch.testing.assert_close(_bf16x.colgrouped_gather_bf16x(d, x, b), _ref(x, t, b), rtol=1e-5, atol=1e-4)
        for threads in (1, 3):
            torch.testing.assert_close(_bf16x.colgrouped_gather_bf16x(d, x, nthreads=threads), _ref(x, t),
                                       rtol=1e-5, atol=1e-4)


def test_float32_values_with_bf16_x(path):
    """fp32 stored values: x widened, the float32 kernel (no rounding of the weight)."""
    t = ColumnGroupedNMTensor.from_dense(torch.randn(24, 50), 2, 4)
    x = torch.randn(40, 50).bfloat16()
    y = _bf16x.colgrouped_gather_bf16x(t.desc(), x)
    torch.testing.assert_close(y, F.linear(x.float(), t.to_dense()), rtol=1e-5, atol=1e-4)


def test_strided_and_offset_x(path):
    """x a view (row stride > K, odd element offset): read as given."""
    t = ColumnGroupedNMTensor.from_dense(torch.randn(16, 60).bfloat16(), 1, 4)
    big = torch.randn(150, 71).bfloat16()
    x = big[3:143, 7:67]   # whole batch chunks too (packed widened in registers)
    torch.testing.assert_close(_bf16x.colgrouped_gather_bf16x(t.desc(), x), _ref(x, t), rtol=1e-5, atol=1e-4)


@settings(max_examples=25, deadline=None)
@given(N=st.integers(1, 50), K=st.integers(1, 90), B=st.integers(0, 70),
       nm=st.sampled_from([(1, 2), (2, 4), (1, 4), (3, 8), (2, 5)]), dot=st.booleans())
def test_shapes_hypothesis(N, K, B, nm, dot):
    isa = _kernel.isa()
    dot = dot and isa == "avx512" and _bf16x.bf16_dot_supported()
    before = _bf16x.bf16_dot_enabled()
    _bf16x.set_bf16_dot(dot)
    try:
        t = ColumnGroupedNMTensor.from_dense(torch.randn(N, K).bfloat16(), *nm)
        x = torch.randn(B, K).bfloat16()
        y = _bf16x.colgrouped_gather_bf16x(t.desc(), x)
        assert y.shape == (B, N) and y.dtype == torch.float32
        torch.testing.assert_close(y, _ref(x, t), rtol=1e-5, atol=1e-4)
    finally:
        _bf16x.set_bf16_dot(before)


def test_f_linear_bf16_in_bf16_out(path):
    """bf16 x and bf16 weight through F.linear: bf16 result as dense, within bf16 tolerance of the
    dense bf16 product."""
    t = ColumnGroupedNMTensor.from_dense(torch.randn(48, 64).bfloat16(), 2, 4)
    x, b = torch.randn(3, 5, 64).bfloat16(), torch.randn(48).bfloat16()
    y = F.linear(x, sten.SparseTensorWrapper(t), b)
    ref = F.linear(x, t.to_dense(), b)
    assert y.dtype == ref.dtype == torch.bfloat16 and y.shape == ref.shape
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)
    # the kernel's own result: the float32 product of the exact operands, rounded once to bf16
    exact = _ref(x.reshape(15, 64), t, b.float()).reshape(3, 5, 48)
    torch.testing.assert_close(y.float(), exact, rtol=2 ** -8, atol=1e-3)


@pytest.mark.parametrize("variant", ["stream", "tiled"])
@pytest.mark.parametrize("vdtype", [torch.float32, torch.bfloat16])
def test_bf16_result_is_the_rounded_float32_result(path, variant, vdtype):
    """out_bf16: the kernel rounds each block as it writes it: bit for bit the float32 result
    rounded (round to nearest even), with bias, on the tile-major packed weight too, for N and B
    off the 8 x 8 write-out blocks and a row stride past N; the empty contraction is the bias."""
    from sten_nm._cg_tiles import with_tiles

    for (N, K, B), nm in (((37, 450, 150), (2, 4)), ((203, 300, 70), (1, 10)), ((8, 64, 1), (1, 4))):
        t = ColumnGroupedNMTensor.from_dense(torch.randn(N, K).to(vdtype), *nm)
        x, b = torch.randn(B, K).bfloat16(), torch.randn(N)
        for d in (t.desc(), with_tiles(t.desc(), B, variant)):
            y32 = _bf16x.colgrouped_gather_bf16x(d, x, b, variant=variant)
            y16 = _bf16x.colgrouped_gather_bf16x(d, x, b, variant=variant, out_bf16=True)
            assert y16.dtype == torch.bfloat16 and y16.shape == (B, N)
            assert torch.equal(y16.view(torch.int16), y32.bfloat16().view(torch.int16))
    e = ColumnGroupedNMTensor.from_dense(torch.randn(5, 0).to(vdtype), 1, 4)
    b = torch.randn(5)
    y = _bf16x.colgrouped_gather_bf16x(e.desc(), torch.randn(3, 0).bfloat16(), b, out_bf16=True)
    assert torch.equal(y, b.bfloat16().expand(3, 5))


@pytest.mark.parametrize("variant", ["stream", "tiled"])
def test_bf16_result_rounds_specials_like_the_scalar_rounding(path, variant):
    """out_bf16 on a zero weight: the result is the bias, rounded in the write-out's 8 x 8
    blocks and at its edges exactly as the scalar rounding (f32_to_bf16): ties to even both
    ways, the largest floats to infinity, infinities, NaN as 0x7fc0, subnormals."""
    one = 1.0 + 2.0 ** -8   # halfway between two bf16 values: ties to even (down)
    specials = [one, 1.0 + 3 * 2.0 ** -8, -one, 3.3895314e38, -3.4028235e38, float("inf"), float("-inf"),
                float("nan"), 0.0, 1e-45, -1e-45, 65504.0, 1.01171875, 2.0 ** -133, 7.0, -2.5]
    b = torch.tensor(specials * 3 + specials[:5], dtype=torch.float32)   # 53 rows: blocks and edges
    t = ColumnGroupedNMTensor.from_dense(torch.zeros(b.numel(), 96), 1, 4)
    x = torch.zeros(21, 96).bfloat16()
    y16 = _bf16x.colgrouped_gather_bf16x(t.desc(), x, b, variant=variant, out_bf16=True)
    ref = _kernel.to_bf16(b).expand(21, -1)
    assert torch.equal(y16.view(torch.int16), ref.view(torch.int16))


@pytest.mark.parametrize("sparse_grad", [False, True])
def test_autocast_values_and_gradients(path, sparse_grad):
    """fp32 weight under bf16 autocast: x and the weight rounded to bf16 (the dot path's
    operands), the forward in bf16 within bf16 tolerance of dense autocast; gradients too."""
    w = torch.randn(40, 72)
    t = ColumnGroupedNMTensor.from_dense(w, 2, 4)
    fmt = (sten.KeepAll(), ColumnGroupedNMTensor, sten.KeepAll(), ColumnGroupedNMTensor) if sparse_grad else None
    W = sten.SparseParameterWrapper(t, grad_fmt=fmt)
    x = torch.randn(70, 72, requires_grad=True)
    xr, wr = x.detach().requires_grad_(), t.to_dense().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = F.linear(x, W)
        yr = F.linear(xr, wr)
    assert y.dtype == yr.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), yr.float(), rtol=2e-2, atol=2e-2 * float(yr.detach().abs().max()))
    gy = torch.randn_like(yr)
    y.backward(gy)
    yr.backward(gy)
    torch.testing.assert_close(x.grad.float(), xr.grad.float(), rtol=2e-2, atol=2e-2 * float(xr.grad.abs().max()))
    gw = W.grad.wrapped_tensor.to_dense() if sparse_grad else W.grad
    ref = wr.grad * t.mask() if sparse_grad else wr.grad
    torch.testing.assert_close(gw.float(), ref.float(), rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


def test_bad_input_names_the_argument():
    t = ColumnGroupedNMTensor.from_dense(torch.randn(8, 16).bfloat16(), 2, 4)
    with pytest.raises(ValueError, match="X must be a 2-D bfloat16"):
        _bf16x.colgrouped_gather_bf16x(t.desc(), torch.randn(3, 16))
    with pytest.raises(ValueError, match="X must have 16 columns"):
        _bf16x.colgrouped_gather_bf16x(t.desc(), torch.randn(3, 15).bfloat16())


def test_out_of_range_columns_are_refused():
    """A descriptor whose columns point past the panel is refused (no out-of-bounds read)."""
    t = ColumnGroupedNMTensor.from_dense(torch.randn(8, 16).bfloat16(), 2, 4)
    d = t.desc()
    bad = t.columns.clone()
    bad.view(-1)[0] = 10_000
    d2 = _kernel.colgrouped(t.values().contiguous(), bad, d._keep[2], 8, 16, 2, 4)
    with pytest.raises(RuntimeError, match="nm_colgrouped_gather_bf16x"):
        _bf16x.colgrouped_gather_bf16x(d2, torch.randn(3, 16).bfloat16())


@pytest.mark.parametrize("vdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["stream", "tiled"])
def test_widened_x_in_each_loop_order_on_tiles(isa, vdtype, variant, monkeypatch):
    """The widening path (fp32 values, the dot path off, or the tiled order) runs the float32
    driver's loop orders, on the tile-major packed weight too (bf16 values kept bf16 there):
    equal to the product of the widened operands, whole batch chunks and a partial one."""
    from sten_nm._cg_tiles import with_tiles

    before = _bf16x.bf16_dot_enabled()
    # dot off; and with the dot path on where the CPU has it, the tiled order still widens
    for dot in (False, True) if _bf16x.bf16_dot_supported() else (False,):
        _bf16x.set_bf16_dot(dot)
        try:
            for n, m in ((2, 4), (1, 10)):
                t = ColumnGroupedNMTensor.from_dense(torch.randn(37, 450).to(vdtype), n, m)
                x, b = torch.randn(150, 450).bfloat16(), torch.randn(37)
                for d in (t.desc(), with_tiles(t.desc(), 150, variant)):
                    y = _bf16x.colgrouped_gather_bf16x(d, x, b, variant=variant)
                    torch.testing.assert_close(y, _ref(x, t, b), rtol=1e-5, atol=1e-4)
        finally:
            _bf16x.set_bf16_dot(before)
    with pytest.raises(ValueError, match="variant"):
        _bf16x.colgrouped_gather_bf16x(t.desc(), x, variant="fast")


@pytest.mark.parametrize("variant", ["stream", "tiled"])
def test_out_of_range_columns_are_refused_when_widened(variant):
    """The widening path refuses stored columns past the panel in either loop order (it reads
    them unless a tiled pass reads the tile-major copy, whose columns were checked packing)."""
    t = ColumnGroupedNMTensor.from_dense(torch.randn(8, 16), 2, 4)
    bad = t.columns.clone()
    bad.view(-1)[0] = 10_000
    d2 = _kernel.colgrouped(t.values().contiguous(), bad, t.desc()._keep[2], 8, 16, 2, 4)
    with pytest.raises(RuntimeError, match="nm_colgrouped_gather_bf16x"):
        _bf16x.colgrouped_gather_bf16x(d2, torch.randn(3, 16).bfloat16(), variant=variant)


def test_dot_switch():
    if not _bf16x.bf16_dot_supported():
        with pytest.raises(ValueError, match="AVX512_BF16"):
            _bf16x.set_bf16_dot(True)
        assert not _bf16x.bf16_dot()
        return
    before = _bf16x.bf16_dot_enabled()
    try:
        _bf16x.set_bf16_dot(False)
        assert not _bf16x.bf16_dot()
        _bf16x.set_bf16_dot(True)
        assert _bf16x.bf16_dot() == (_kernel.isa() == "avx512")
    finally:
        _bf16x.set_bf16_dot(before)


def test_env_turns_the_dot_path_off(tmp_path):
    """STEN_NM_BF16_DOT=0 at load: the widening path (a fresh process reads the variable)."""
    import subprocess
    import sys
    code = "from sten_nm import _bf16x; print(_bf16x.bf16_dot_enabled())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "STEN_NM_BF16_DOT": "0"},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


# -- input gradients with bf16 stored values: no float32 copy of the weight ---------------
from sten_nm import GroupedNMTensor, NMTensor  # noqa: E402


@pytest.mark.parametrize("layout,dim", [(NMTensor, 1), (NMTensor, 0), (GroupedNMTensor, 1)])
@pytest.mark.parametrize("sparse_grad", [False, True])
@pytest.mark.parametrize("n,m", [(2, 4), (1, 10), (3, 8)])
def test_bf16_values_backward_without_fp32_copy(isa, layout, dim, sparse_grad, n, m):
    """bf16 stored values, fp32 x: gradients of x (and of the values, at the kept positions)
    equal the dense fp32 product of the same bf16 values; no float32 copy is cached."""
    N, K, B = 37, 53, 29
    w = torch.randn(N, K).bfloat16()
    t = NMTensor.from_dense(w, n, m, dim=dim) if layout is NMTensor else layout.from_dense(w, n, m)
    fmt = (sten.KeepAll(), layout, sten.KeepAll(), layout) if sparse_grad else None
    W = sten.SparseParameterWrapper(t, grad_fmt=fmt)
    x = torch.randn(B, K, requires_grad=True)
    wr = t.to_dense().float().requires_grad_()
    xr = x.detach().requires_grad_()
    y = F.linear(x, W)
    yr = F.linear(xr, wr)
    gy = torch.randn_like(yr)
    y.backward(gy)
    yr.backward(gy)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-4)
    gw = W.grad.wrapped_tensor.to_dense().float() if sparse_grad else W.grad.float()
    ref = (wr.grad * t.mask()) if sparse_grad else wr.grad
    torch.testing.assert_close(gw, ref.to(gw.dtype) if not sparse_grad else ref.bfloat16().float(),
                               rtol=1e-2, atol=1e-2 * float(ref.abs().max()))
    assert getattr(t, "_fp32_cache", None) is None   # no float32 copy of the weight


@pytest.mark.parametrize("B", [1, 17])
def test_bf16_input_gradient_kernels_direct(isa, B):
    """The two C entry points against torch, including an empty batch and bad descriptors."""
    t = NMTensor.from_dense(torch.randn(24, 40).bfloat16(), 2, 4)
    R, C = t._rc()
    d = _kernel.mat(t.values().contiguous(), t.indices, R, C, 2, 4)
    gy = torch.randn(B, 24)
    torch.testing.assert_close(_bf16x.tgather_bf16w(d, gy), gy @ t.to_dense().float(), rtol=1e-5, atol=1e-4)
    assert _bf16x.tgather_bf16w(d, gy[:0]).shape == (0, 40)
    g = GroupedNMTensor.from_dense(torch.randn(24, 40).bfloat16(), 1, 4)
    from sten_nm.ops import _grouped_bf16_desc
    torch.testing.assert_close(_bf16x.grouped_tgather_bf16w(_grouped_bf16_desc(g), gy), gy @ g.to_dense().float(),
                               rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="contiguous bfloat16"):
        _bf16x.tgather_bf16w(t.fp32().mat(), gy)
    with pytest.raises(ValueError, match="contiguous bfloat16"):
        _bf16x.grouped_tgather_bf16w(g.desc(), gy)
