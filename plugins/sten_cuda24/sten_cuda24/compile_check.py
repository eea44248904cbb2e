"""Ahead-of-time compile checks that need no GPU.

``python -m sten_cuda24.compile_check [out_dir]`` compiles the Triton kernels
for ``GPUTarget("cuda", 90, 32)`` (``triton.compile`` on an ``ASTSource``) and
prints one JSON line per kernel. It must run without ``TRITON_INTERPRET``.

Example:
    >>> results = compile_triton()     # doctest: +SKIP
    >>> all(r["ok"] for r in results)  # doctest: +SKIP
    True
"""

from __future__ import annotations

import json
import sys
from typing import Any

SPECS: list[tuple[str, str, dict[str, str], dict[str, Any]]] = [
    ("triton_sparsify24", "sparsify24_kernel",
     {"x_ptr": "*bf16", "packed_ptr": "*bf16", "meta_ptr": "*i16", "dense_ptr": "*bf16",
      "R": "i32", "K": "i32", "W": "i32", "stride_x": "i32", "stride_d": "i32",
      "ACT": "constexpr", "WRITE_DENSE": "constexpr", "BLOCK_R": "constexpr", "BLOCK_W": "constexpr"},
     {"ACT": 1, "WRITE_DENSE": True, "BLOCK_R": 32, "BLOCK_W": 8}),
    ("triton_bsr", "bsr_linear_kernel",
     {"x_ptr": "*bf16", "crow_ptr": "*i32", "col_ptr": "*i32", "blk_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16",
      "T": "i32", "N": "i32", "K": "i32", "stride_x": "i32", "stride_o": "i32",
      "HAS_BIAS": "constexpr", "BT": "constexpr", "BN": "constexpr", "BK": "constexpr", "IEEE": "constexpr"},
     {"HAS_BIAS": True, "BT": 64, "BN": 64, "BK": 64, "IEEE": False}),
    ("triton_bsr", "bsr_linear_kernel",   # fp32 at full precision (torch's default, no TF32)
     {"x_ptr": "*fp32", "crow_ptr": "*i32", "col_ptr": "*i32", "blk_ptr": "*fp32", "bias_ptr": "*fp32", "out_ptr": "*fp32",
      "T": "i32", "N": "i32", "K": "i32", "stride_x": "i32", "stride_o": "i32",
      "HAS_BIAS": "constexpr", "BT": "constexpr", "BN": "constexpr", "BK": "constexpr", "IEEE": "constexpr"},
     {"HAS_BIAS": False, "BT": 32, "BN": 64, "BK": 64, "IEEE": True}),
    ("triton_bsr", "bsr_sdd_kernel",
     {"g_ptr": "*fp16", "x_ptr": "*fp16", "brow_ptr": "*i32", "col_ptr": "*i32", "out_ptr": "*fp16",
      "T": "i32", "N": "i32", "K": "i32", "stride_g": "i32", "stride_x": "i32",
      "BT": "constexpr", "BN": "constexpr", "BK": "constexpr", "IEEE": "constexpr"},
     {"BT": 64, "BN": 64, "BK": 64, "IEEE": False}),
    ("triton_sdd24", "sdd24_kernel",
     {"g_ptr": "*bf16", "x_ptr": "*bf16", "meta_ptr": "*i16", "out_ptr": "*bf16",
      "T": "i32", "N": "i32", "K": "i32", "W": "i32", "stride_g": "i32", "stride_x": "i32",
      "BT": "constexpr", "BN": "constexpr", "BK": "constexpr", "IEEE": "constexpr"},
     {"BT": 32, "BN": 64, "BK": 64, "IEEE": False}),
    ("triton_sdd24", "sdd24_kernel",
     {"g_ptr": "*fp32", "x_ptr": "*fp32", "meta_ptr": "*i16", "out_ptr": "*fp32",
      "T": "i32", "N": "i32", "K": "i32", "W": "i32", "stride_g": "i32", "stride_x": "i32",
      "BT": "constexpr", "BN": "constexpr", "BK": "constexpr", "IEEE": "constexpr"},
     {"BT": 32, "BN": 64, "BK": 64, "IEEE": True}),
]


def compile_triton(arch: int = 90, warp_size: int = 32) -> list[dict[str, Any]]:
    """Compile every kernel for ``GPUTarget("cuda", arch, warp_size)``; no driver needed."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, warp_size)
    results = []
    for module, name, signature, constexprs in SPECS:
        fn = getattr(importlib.import_module(f"sten_cuda24.{module}"), name)
        try:
            kernel = triton.compile(ASTSource(fn, signature=signature, constexprs=constexprs), target=target)
            ptx = kernel.asm.get("ptx", "")
            results.append({"kernel": name, "ok": True, "ptx_target": next((l.split()[1] for l in ptx.splitlines() if l.startswith(".target")), None)})
        except Exception as error:  # report, do not hide
            results.append({"kernel": name, "ok": False, "error": f"{type(error).__name__}: {error}"})
    return results


if __name__ == "__main__":
    arch = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    for row in compile_triton(arch):
        print(json.dumps(row))
