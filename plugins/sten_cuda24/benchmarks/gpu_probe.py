"""Which of torch's 2:4 primitives run on this GPU (each in its own process).

A failing CUDA kernel (illegal instruction, internal error) poisons the process,
so every probe runs in a fresh interpreter with ``CUDA_LAUNCH_BLOCKING=1`` and
reports ``ok``, ``WRONG`` (ran, values differ from dense) or the error's first line.

    python3 plugins/sten_cuda24/benchmarks/gpu_probe.py [NAME-SUBSTRING ...] > probe.txt
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SETUP = """
import torch
torch.manual_seed(0)
def pruned(n, k, dtype):
    w = torch.randn(n, k, device="cuda", dtype=dtype)
    g = w.reshape(n, k // 4, 4)
    keep = g.abs().topk(2, dim=-1).indices
    mask = torch.zeros_like(g, dtype=torch.bool).scatter_(-1, keep, True)
    return (g * mask).reshape(n, k)
def check(got, ref, what):
    err = (got.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-6)
    print(("ok" if err < 2e-2 else "WRONG") + f" rel.err {err:.1e}", what)
"""

PROBES = {
    "torch sparse semi-structured (default backend) fp16 mm": """
from torch.sparse import to_sparse_semi_structured
a = pruned(128, 128, torch.float16); x = torch.randn(128, 64, device="cuda", dtype=torch.float16)
check(to_sparse_semi_structured(a) @ x, a @ x, "")
""",
    "torch sparse semi-structured, CUTLASS forced, fp16 mm": """
from torch.sparse import to_sparse_semi_structured, SparseSemiStructuredTensor
SparseSemiStructuredTensor._FORCE_CUTLASS = True
a = pruned(128, 128, torch.float16); x = torch.randn(128, 64, device="cuda", dtype=torch.float16)
check(to_sparse_semi_structured(a) @ x, a @ x, "")
""",
    "_cslt_compress shape": """
a = pruned(128, 256, torch.float16); c = torch._cslt_compress(a)
print("ok", tuple(c.shape), c.dtype, c.is_contiguous())
""",
    "_cslt_sparse_mm fp16 plain": """
a = pruned(128, 256, torch.float16); x = torch.randn(256, 64, device="cuda", dtype=torch.float16)
check(torch._cslt_sparse_mm(torch._cslt_compress(a), x), a @ x, "")
""",
    "_cslt_sparse_mm fp16 x.t() view, transpose_result": """
a = pruned(128, 256, torch.float16); x = torch.randn(64, 256, device="cuda", dtype=torch.float16)
check(torch._cslt_sparse_mm(torch._cslt_compress(a), x.t(), transpose_result=True), x @ a.t(), "")
""",
    "_cslt_sparse_mm fp16 alg_id=0 bias": """
a = pruned(128, 256, torch.float16); x = torch.randn(256, 64, device="cuda", dtype=torch.float16)
b = torch.randn(128, device="cuda", dtype=torch.float16)
check(torch._cslt_sparse_mm(torch._cslt_compress(a), x, bias=b, alg_id=0), a @ x + b[:, None], "")
""",
    "_cslt_sparse_mm bf16 4096": """
a = pruned(4096, 4096, torch.bfloat16); x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
check(torch._cslt_sparse_mm(torch._cslt_compress(a), x), a @ x, "")
""",
    "_cslt_sparse_mm_search fp16": """
a = pruned(128, 256, torch.float16); x = torch.randn(256, 64, device="cuda", dtype=torch.float16)
print("ok alg", torch._cslt_sparse_mm_search(torch._cslt_compress(a), x))
""",
    "_cslt_sparse_mm_search fp16 transpose_result, then mm": """
a = pruned(256, 256, torch.float16); x = torch.randn(64, 256, device="cuda", dtype=torch.float16)
c = torch._cslt_compress(a)
alg = torch._cslt_sparse_mm_search(c, x.t(), transpose_result=True)
check(torch._cslt_sparse_mm(c, x.t(), transpose_result=True, alg_id=alg), x @ a.t(), f"alg {alg}")
""",
    "_cslt_sparse_mm_search bf16 transpose_result, then mm": """
a = pruned(256, 256, torch.bfloat16); x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
c = torch._cslt_compress(a)
alg = torch._cslt_sparse_mm_search(c, x.t(), transpose_result=True)
check(torch._cslt_sparse_mm(c, x.t(), transpose_result=True, alg_id=alg), x @ a.t(), f"alg {alg}")
""",
    "sten_cuda24 backends.linear fp16 (no search)": """
from sten_cuda24 import backends, sparsify_24
w = sparsify_24(torch.randn(256, 256, device="cuda", dtype=torch.float16)); x = torch.randn(64, 256, device="cuda", dtype=torch.float16)
check(backends.linear(x, w, backend="cusparselt"), x @ w.to_dense().t(), backends.last_path["path"])
""",
    "cusparselt module mm (torch._C._cusparselt)": """
m = getattr(torch._C, "_cusparselt", None)
print("ok" if m is not None else "absent", [n for n in dir(m) if not n.startswith("__")] if m else "")
""",
    "_sparse_semi_structured_tile + _mm (CUTLASS)": """
a = pruned(128, 128, torch.float16); x = torch.randn(128, 64, device="cuda", dtype=torch.float16)
packed, meta, *_ = torch._sparse_semi_structured_tile(a, algorithm="", use_cutlass=True)
check(torch._sparse_semi_structured_mm(packed, meta, x), a @ x, "")
""",
    "_sparse_semi_structured_linear (CUTLASS)": """
from torch.sparse import to_sparse_semi_structured, SparseSemiStructuredTensor
SparseSemiStructuredTensor._FORCE_CUTLASS = True
a = pruned(128, 128, torch.float16); x = torch.randn(64, 128, device="cuda", dtype=torch.float16)
s = to_sparse_semi_structured(a)
check(torch._sparse_semi_structured_linear(x, s.packed, s.meta), x @ a.t(), "")
""",
    "bsr_dense_mm (torch.sparse._triton_ops)": """
from torch.sparse._triton_ops import bsr_dense_mm
a = torch.randn(256, 256, device="cuda", dtype=torch.float16) * (torch.rand(4, 4, device="cuda") < 0.3).repeat_interleave(64, 0).repeat_interleave(64, 1)
x = torch.randn(256, 128, device="cuda", dtype=torch.float16)
check(bsr_dense_mm(a.to_sparse_bsr((64, 64)), x), a @ x, "")
""",
}


def run(name: str, body: str) -> str:
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    code = SETUP + textwrap.dedent(body)
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired:
        return "TIMEOUT"
    if p.returncode == 0:
        return p.stdout.strip().splitlines()[-1] if p.stdout.strip() else "ok (no output)"
    err = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    first = next((ln for ln in reversed(err) if "Error" in ln), err[-1] if err else f"rc={p.returncode}")
    return f"FAIL {first.strip()[:300]}"


def main() -> None:
    wanted = sys.argv[1:]   # substrings of probe names (default: all)
    for name, body in PROBES.items():
        if wanted and not any(w in name for w in wanted):
            continue
        print(f"{name:55s} {run(name, body)}", flush=True)


if __name__ == "__main__":
    main()
