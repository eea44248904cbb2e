"""Without the C extension (no compiler at install, a failed load) the plugin reports
``available: false`` with the reason, the layouts still build and convert (pure torch),
the products take STen's dense fallback with a DispatchWarning, and the test suite skips
the kernel tests with that reason. Simulated with ``STEN_NM_LIBRARY`` naming no file."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sten_nm import _kernel, _portable

from conftest import PATTERNS, requires_kernel

MISSING = {"STEN_NM_LIBRARY": "/nonexistent/libstennm.so"}
HERE = os.path.dirname(os.path.abspath(__file__))


def _run(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env}, cwd=os.path.dirname(HERE))


@pytest.fixture
def no_kernel(monkeypatch):
    """The kernel library fails to load (in this process), restored afterwards."""
    monkeypatch.setenv("STEN_NM_LIBRARY", MISSING["STEN_NM_LIBRARY"])
    _kernel.reset()
    yield
    monkeypatch.undo()
    _kernel.reset()


def test_failed_load_is_reported(no_kernel):
    from sten_nm import plugin

    ok, reason = _kernel.available()
    assert not ok and "sten_nm C extension not available" in reason and "/nonexistent/libstennm.so" in reason
    info = plugin.sten_plugin_info()
    assert info["available"] is False and info["reason"] == reason
    with pytest.raises(RuntimeError, match="not available"):
        _kernel.isa()


def test_layouts_work_without_kernel(no_kernel):
    from sten_nm import GroupedNMTensor, NMTensor

    w = torch.randn(20, 30)
    t = NMTensor.from_dense(w, 2, 4)
    d = t.to_dense()
    assert int((d.reshape(-1) != 0).sum()) == 20 * (7 * 2 + 2)
    assert torch.equal(NMTensor.from_dense(d, 2, 4).to_dense(), d)
    g = GroupedNMTensor.from_dense(w, 1, 4)
    assert torch.equal(g.to_nm().to_dense(), g.to_dense())


def test_products_still_run_without_the_kernel():
    code = """
        import warnings, torch, torch.nn.functional as F
        import sten_core as sten
        from sten_nm import GroupedNMTensor, NMTensor
        for L in (NMTensor, GroupedNMTensor):
            t = L.from_dense(torch.randn(12, 40), 2, 4)
            W = sten.SparseParameterWrapper(t)   # dense weight gradient
            x = torch.randn(5, 40, requires_grad=True)
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                y = F.linear(x, W)
                y.square().sum().backward()
            # no C kernel: the products run through a lossless conversion to a built-in layout
            # (the dispatch chain's "convert" step) or, failing that, the dense fallback
            xr, wr = x.detach().requires_grad_(), t.to_dense().requires_grad_()
            F.linear(xr, wr).square().sum().backward()
            torch.testing.assert_close(y, F.linear(xr, wr), rtol=1e-4, atol=1e-3)
            torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-3)
            torch.testing.assert_close(W.grad, wr.grad, rtol=1e-4, atol=1e-3)
        print("ok")
    """
    proc = _run(["-c", textwrap.dedent(code)], MISSING)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.mark.skipif(os.environ.get("STEN_NM_LIBRARY") == MISSING["STEN_NM_LIBRARY"],
                    reason="already the run without the kernel")
def test_suite_skips_kernel_tests_with_the_reason():
    """The whole plugin suite, extension missing: collection works, kernel tests skip with
    the loader's reason, the rest pass."""
    proc = _run(["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-x", "tests",
                 "--deselect", "tests/test_no_kernel.py::test_suite_skips_kernel_tests_with_the_reason"], MISSING)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "needs the C kernels: sten_nm C extension not available" in out
    assert " passed" in out and " skipped" in out


@requires_kernel
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 20), cols=st.integers(0, 50), nm=st.sampled_from(PATTERNS),
       masked=st.booleans(), ties=st.booleans())
def test_portable_compress_equals_the_kernel(rows, cols, nm, masked, ties):
    n, m = nm
    w = torch.randn(rows, cols)
    if ties:
        w = w.round()
        if w.numel():
            w.view(-1)[0] = float("nan")
    mask = None
    if masked:
        from sten_nm import NMTensor

        mask = NMTensor.from_dense(torch.randn(rows, cols), n, m).mask() & (torch.rand(rows, cols) < 0.7)
    v1, i1 = _kernel.compress(w, n, m, mask=mask)
    v2, i2 = _portable.compress(w, n, m, mask=mask)
    assert torch.equal(i1, i2)
    torch.testing.assert_close(v1, v2, equal_nan=True, rtol=0, atol=0)


@requires_kernel
def test_second_openmp_runtime_switches_to_own_threads():
    """A torch wheel with a renamed libgomp: the kernels must not start a second pool."""
    import torch.nn.functional as F

    from sten_nm import GroupedNMTensor, NMTensor, grouped_linear, nm_linear

    lib = _kernel._load()
    before = lib.nm_threading()
    try:
        note = _kernel._pick_threading(lib, runtimes=["/opt/torch/lib/libgomp-a34b3233.so.1"])
        if lib.nm_openmp_library() is None:
            assert "without OpenMP" in note
        else:
            assert "second OpenMP runtime" in note and "libgomp-a34b3233" in note
        assert lib.nm_threading() == b"pthreads"
        w, x = torch.randn(64, 96), torch.randn(200, 96)
        t, g = NMTensor.from_dense(w, 2, 4), GroupedNMTensor.from_dense(w, 1, 4)
        torch.testing.assert_close(nm_linear(x, t), F.linear(x, t.to_dense()), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(grouped_linear(x, g), F.linear(x, g.to_dense()), rtol=1e-4, atol=1e-4)
        own = lib.nm_openmp_library()
        if own:   # only our own runtime loaded: back on the shared pool
            assert _kernel._pick_threading(lib, runtimes=[os.path.realpath(own.decode())]) is None
            assert lib.nm_threading() == b"openmp"
    finally:
        lib.nm_set_threading(before)


@requires_kernel
def test_threading_mode_reported():
    mode, note = _kernel.threading_mode()
    assert mode in ("openmp", "pthreads")
    assert (note is None) == (mode == "openmp")
