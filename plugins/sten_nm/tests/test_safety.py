"""Memory safety and edge cases: misaligned values, bad offsets, empty contractions and
shapes, every instruction set this CPU has. Each compares with the dense reference."""

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_nm import GroupedNMTensor, NMTensor, _kernel, grouped_linear, nm_linear

from conftest import KERNEL_OK, PATTERNS, requires_kernel

pytestmark = requires_kernel


def _run_isolated(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter: a crash (SIGSEGV) fails the test, not the run."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_values_view_at_odd_offset_every_isa():
    """Values at a 4-byte (not vector) aligned address, e.g. ``flat[1:].view_as(v)``: the
    grouped kernels load them unaligned (this crashed with SIGSEGV)."""
    proc = _run_isolated("""
        import torch, torch.nn.functional as F
        from sten_nm import GroupedNMTensor, NMTensor, _kernel
        torch.manual_seed(0)
        for isa in _kernel.supported_isas():
            _kernel.set_isa(isa)
            for n, m in ((2, 4), (1, 10)):
                g = GroupedNMTensor.from_dense(torch.randn(70, 64), n, m)
                v = g.values()
                flat = torch.empty(v.numel() + 1)
                flat[1:] = v.flatten()
                g2 = g.with_values(flat[1:].view_as(v))
                assert g2.values().data_ptr() % 16 != 0
                d = g.to_dense()
                for B in (3, 50):
                    x, gy = torch.randn(B, 64), torch.randn(B, 70)
                    torch.testing.assert_close(_kernel.grouped_gather(g2.desc(), x), F.linear(x, d), rtol=1e-4, atol=1e-4)
                    torch.testing.assert_close(_kernel.grouped_tgather(g2.desc(), gy), gy @ d, rtol=1e-4, atol=1e-4)
                    out = torch.empty(v.numel() + 1)[1:].view_as(v)   # output at an odd offset too
                    ref = _kernel.grouped_sddmm(g.desc(), gy, x)
                    W = g2.desc()
                    rc = _kernel._load().nm_grouped_sddmm_f32(
                        _kernel.ctypes.byref(W), B, gy.data_ptr(), gy.stride(0), x.data_ptr(), x.stride(0),
                        out.data_ptr(), 2)
                    assert rc == 0
                    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
                t = NMTensor.from_dense(torch.randn(70, 64), n, m)
                tv = t.values()
                f2 = torch.empty(tv.numel() + 1)
                f2[1:] = tv.flatten()
                t2 = t.with_values(f2[1:].view_as(tv))
                x = torch.randn(9, 64)
                torch.testing.assert_close(F.linear(x, t2.to_dense()), F.linear(x, t.to_dense()))
                from sten_nm import nm_linear
                torch.testing.assert_close(nm_linear(x, t2), F.linear(x, t.to_dense()), rtol=1e-4, atol=1e-4)
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def _pack(offsets: list[list[int]], m: int) -> torch.Tensor:
    """Pack per-row offset lists as the layouts store them (``bits`` each, low bits first)."""
    bits, per = _kernel.index_bits(m), _kernel.index_per_word(m)
    rows = []
    for offs in offsets:
        words = [0] * (-(-len(offs) // per))
        for e, o in enumerate(offs):
            words[e // per] |= o << (bits * (e % per))
        rows.append([w - (1 << 32) if w >= 1 << 31 else w for w in words])
    return torch.tensor(rows, dtype=torch.int32)


@pytest.mark.parametrize("offsets,n,m,word", [
    ([[15, 3], [0, 9]], 1, 10, "offset 15 of row 0, group 0 is not < m=10"),
    ([[2, 9], [0, 12]], 1, 10, "offset 12 of row 1, group 1 is not < m=10"),
    ([[1, 1, 0, 3], [0, 1, 2, 3]], 2, 4, "row 0, group 0 must increase strictly"),
    ([[0, 1, 3, 2], [0, 1, 2, 3]], 2, 4, "row 0, group 1 must increase strictly"),
])
def test_constructors_reject_bad_offsets(offsets, n, m, word):
    idx = _pack(offsets, m)
    R, C = len(offsets), len(offsets[0]) // n * m
    with pytest.raises(ValueError, match="indices: .*" + word):
        NMTensor(torch.randn(R, len(offsets[0])), idx, (R, C), n, m)
    with pytest.raises(ValueError, match="indices: .*" + word):   # dim=0: the same stored matrix
        NMTensor(torch.randn(R, len(offsets[0])), idx, (C, R), n, m, dim=0)
    # grouped: one pattern per row group (groups 0 and 1 = the two rows of ``offsets``)
    with pytest.raises(ValueError, match="indices: .*" + word):
        GroupedNMTensor(torch.randn(R, len(offsets[0]), 16), idx, torch.arange(32, dtype=torch.int32),
                        (32, C), n, m)


def test_constructor_accepts_valid_offsets_and_matches_dense(isa):
    """Hand-packed valid offsets: the kernel result equals ``to_dense()``'s product."""
    idx = _pack([[0, 3, 1, 2, 0, 1], [1, 2, 0, 3, 2, 3]], 4)
    vals = torch.randn(2, 6)
    t = NMTensor(vals, idx, (2, 12), 2, 4)
    d = t.to_dense()
    assert int((d != 0).sum()) == 12
    x = torch.randn(5, 12)
    torch.testing.assert_close(nm_linear(x, t), F.linear(x, d), rtol=1e-5, atol=1e-5)


def test_constructors_reject_bad_types():
    t = NMTensor.from_dense(torch.randn(4, 8), 2, 4)
    with pytest.raises(TypeError, match="values must be a floating-point"):
        NMTensor(t.values().long(), t.indices, t.shape, 2, 4)
    with pytest.raises(ValueError, match="indices must be int32"):
        NMTensor(t.values(), t.indices.long(), t.shape, 2, 4)
    g = GroupedNMTensor.from_dense(torch.randn(4, 8), 2, 4)
    with pytest.raises(TypeError, match="vals must be a floating-point"):
        GroupedNMTensor(g.values().int(), g.indices, g.perm, g.shape, 2, 4)
    with pytest.raises(ValueError, match="indices must be int32"):
        GroupedNMTensor(g.values(), g.indices.long(), g.perm, g.shape, 2, 4)
    with pytest.raises(ValueError, match="perm must be int32"):
        GroupedNMTensor(g.values(), g.indices, g.perm.long(), g.shape, 2, 4)


def test_tgather_empty_contraction_writes_bias_or_zeros(isa):
    """``X = Y A`` with no rows in A: every output is the bias (or 0), never stale memory."""
    t = NMTensor.from_dense(torch.randn(0, 40), 2, 4)
    bias = torch.randn(40)
    for B in (1, 50, 300):
        _ = torch.randn(B, 600) @ torch.randn(600, 300)   # leave used memory on the heap
        assert torch.equal(_kernel.tgather(t.mat(), torch.randn(B, 0)), torch.zeros(B, 40))
        assert torch.equal(_kernel.tgather(t.mat(), torch.randn(B, 0), bias), bias.expand(B, 40))
        assert torch.equal(_kernel.scatter(t.mat(), torch.randn(B, 0), bias), bias.expand(B, 40))


EMPTY_SHAPES = [(0, 16), (8, 0), (0, 0), (0, 5)]


@pytest.mark.parametrize("shape", EMPTY_SHAPES)
@pytest.mark.parametrize("layout", [NMTensor, GroupedNMTensor])
def test_empty_weight_conversion(layout, shape):
    w = torch.randn(*shape)
    t = layout.from_dense(w, 2, 4)
    assert t.shape == w.shape and t.nnz == 0
    assert torch.equal(t.to_dense(), w) and torch.equal(t.mask(), torch.zeros(shape, dtype=torch.bool))
    assert t.with_values(t.values()).same_pattern(t)
    assert torch.equal(t.gather(w), t.values())


@pytest.mark.parametrize("shape", EMPTY_SHAPES + [(5, 12)])
@pytest.mark.parametrize("layout", [NMTensor, GroupedNMTensor])
@pytest.mark.parametrize("sparse_grad", [True, False])
@pytest.mark.parametrize("batch", [(3,), (0,), (2, 3)])
def test_empty_weight_linear_fwd_bwd(layout, shape, sparse_grad, batch):
    """F.linear with an empty weight (or empty batch) equals dense, forward and backward."""
    N, K = shape
    t = layout.from_dense(torch.randn(N, K), 1, 4)
    fmt = (sten.KeepAll(), layout, sten.KeepAll(), layout) if sparse_grad else None
    W = sten.SparseParameterWrapper(t, grad_fmt=fmt)
    x = torch.randn(*batch, K, requires_grad=True)
    b = torch.randn(N, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = F.linear(x, W, b)
        gy = torch.randn_like(y)
        y.backward(gy)
    xr, wr, br = x.detach().requires_grad_(), t.to_dense().requires_grad_(), b.detach().requires_grad_()
    yr = F.linear(xr, wr, br)
    yr.backward(gy)
    torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad, br.grad, rtol=1e-5, atol=1e-5)
    gw = W.grad.wrapped_tensor.to_dense() if sparse_grad else W.grad
    torch.testing.assert_close(gw, wr.grad * (t.mask() if sparse_grad else 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim", [0, 1])
def test_empty_weight_mm(dim):
    for K, N in ((0, 6), (6, 0), (8, 6)):
        t = NMTensor.from_dense(torch.randn(K, N), 1, 2, dim=dim)
        for B in (0, 3):
            x = torch.randn(B, K)
            torch.testing.assert_close(torch.mm(x, sten.SparseTensorWrapper(t)), x @ t.to_dense())


# -- instruction sets -------------------------------------------------------------------
def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@pytest.mark.skipif(not _cpu_flags(), reason="no /proc/cpuinfo to read the CPU's flags from")
def test_every_isa_the_cpu_has_is_supported_and_default():
    """On a CPU with AVX-512 the AVX-512 kernels are selected by default (and so run in
    every ``isa``-parametrised test); AVX2 likewise."""
    flags, isas = _cpu_flags(), _kernel.supported_isas()
    if "avx512f" in flags:
        assert "avx512" in isas
    if {"avx2", "fma"} <= flags:
        assert "avx2" in isas
    proc = _run_isolated("from sten_nm import _kernel; print(_kernel.isa())", env={"STEN_NM_ISA": ""})
    assert proc.returncode == 0 and proc.stdout.strip() == isas[-1], proc.stderr


@pytest.mark.parametrize("name", _kernel.supported_isas() if KERNEL_OK else [])
def test_isa_forced_by_environment(name):
    code = """
        import torch, torch.nn.functional as F
        from sten_nm import NMTensor, GroupedNMTensor, _kernel, nm_linear, grouped_linear
        print(_kernel.isa())
        w, x = torch.randn(40, 72), torch.randn(33, 72)
        for t, f in ((NMTensor.from_dense(w, 2, 4), nm_linear), (GroupedNMTensor.from_dense(w, 1, 4), grouped_linear)):
            torch.testing.assert_close(f(x, t), F.linear(x, t.to_dense()), rtol=1e-4, atol=1e-4)
    """
    proc = _run_isolated(code, env={"STEN_NM_ISA": name})
    assert proc.returncode == 0 and proc.stdout.strip() == name, proc.stderr


def test_unknown_isa_in_environment_warns():
    # torch first: its own import-time warnings (e.g. no numpy installed) are not under test
    proc = _run_isolated("import torch, warnings; warnings.simplefilter('error')\n"
                         "from sten_nm import _kernel\n_kernel.isa()", env={"STEN_NM_ISA": "avx9000"})
    assert proc.returncode != 0 and "STEN_NM_ISA='avx9000' is not an instruction set" in proc.stderr


def test_set_isa_rejects_unknown():
    with pytest.raises(ValueError, match="isa 'sse9' is not supported"):
        _kernel.set_isa("sse9")


@pytest.mark.parametrize("n,m", PATTERNS)
def test_all_kernels_match_dense(isa, n, m):
    """Every kernel of the forced instruction set against the dense reference."""
    K = 5 * m + 3
    t = NMTensor.from_dense(torch.randn(23, K), n, m)
    d = t.to_dense()
    for B in (1, 9, 70):
        x, gy, b = torch.randn(B, K), torch.randn(B, 23), torch.randn(23)
        torch.testing.assert_close(_kernel.gather(t.mat(), x, b), F.linear(x, d, b), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(_kernel.scatter(t.mat(), gy), gy @ d, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(_kernel.tgather(t.mat(), gy), gy @ d, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(_kernel.sddmm(t.mat(), gy, x), t.gather(gy.t() @ x), rtol=1e-4, atol=1e-4)
    g = GroupedNMTensor.from_dense(torch.randn(23, K), n, m)
    dg = g.to_dense()
    for B in (1, 9, 70):
        x, gy = torch.randn(B, K), torch.randn(B, 23)
        torch.testing.assert_close(grouped_linear(x, g), F.linear(x, dg), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(_kernel.grouped_tgather(g.desc(), gy), gy @ dg, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(_kernel.grouped_sddmm(g.desc(), gy, x), g.gather(gy.t() @ x), rtol=1e-4, atol=1e-4)
