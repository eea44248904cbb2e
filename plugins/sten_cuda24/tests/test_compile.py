"""Ahead-of-time compiles that need no GPU: the CUDA source with nvcc for sm_80 and
sm_90 (the source uses no sm_90a feature), the Triton kernels for
GPUTarget("cuda", 90, 32). Both run as subprocesses, started together."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sten_cuda24 import _compat, cuda_lib


@pytest.fixture(scope="module")
def compiles(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compile")
    procs = {}
    nvcc = _compat.nvcc_path()
    if nvcc:
        cmd = cuda_lib.compile_command(nvcc, str(tmp / "sparsify24.o"), shared=False, archs=("80", "90"))
        procs["nvcc"] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        import triton  # noqa: F401
    except Exception:
        pass
    else:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
        procs["triton"] = subprocess.Popen([sys.executable, "-m", "sten_cuda24.compile_check", "90"], env=env,
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        out[name] = (proc.returncode, stdout, stderr)
    return out, tmp


def test_cuda_source_compiles_for_sm80_sm90(compiles):
    out, tmp = compiles
    if "nvcc" not in out:
        pytest.skip("nvcc not found (set STEN_NVCC or CUDA_HOME, or put nvcc on PATH)")
    rc, _, stderr = out["nvcc"]
    assert rc == 0, stderr[-3000:]
    obj = tmp / "sparsify24.o"
    assert obj.exists()
    cuobjdump = os.path.join(os.path.dirname(_compat.nvcc_path()), "cuobjdump")
    if os.path.exists(cuobjdump):
        listing = subprocess.run([cuobjdump, "--list-elf", str(obj)], capture_output=True, text=True)
        if listing.returncode == 0:
            assert "sm_80" in listing.stdout and "sm_90" in listing.stdout


def test_triton_kernels_compile_for_sm90(compiles):
    out, _ = compiles
    if "triton" not in out:
        pytest.skip("triton is not installed")
    rc, stdout, stderr = out["triton"]
    if rc != 0 and ("driver" in stderr.lower() or "libcuda" in stderr.lower()):
        pytest.skip(f"triton.compile needs a GPU driver here: {stderr.strip().splitlines()[-1]}")
    assert rc == 0, stderr[-3000:]
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert {r["kernel"] for r in rows} == {"sparsify24_kernel", "bsr_linear_kernel", "bsr_sdd_kernel", "sdd24_kernel"}
    bad = [r for r in rows if not r["ok"]]
    assert not bad, bad
