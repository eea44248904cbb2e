"""The built-in plugin: torch-native layouts, their conversions and operators,
the built-in sparsifiers' implementations and the generic element-wise path.

It is registered through the same hooks as external plugins.
"""

from __future__ import annotations

from typing import Any


from sten_core.model.sparsifiers import ScalarFractionSparsifier
from sten_core.plugins.bench_layouts import BenchLayout
from sten_core.plugins.hookspecs import hookimpl
from sten_core.version import __version__
from sten_core.builtin import compiled_ops, elementwise, memory, moves, ops, sparsifier_impls, weight_first
from sten_core.builtin.torch_layouts import TORCH_LAYOUTS, CooTensor, CscTensor, CsrTensor, DenseTensor


def _conversions() -> list[tuple[type, type, Any]]:
    return [
        (CooTensor, CsrTensor, lambda x: CsrTensor(x.data.to_sparse_csr())),
        (CooTensor, CscTensor, lambda x: CscTensor(x.data.to_sparse_csc())),
        (CsrTensor, CooTensor, lambda x: CooTensor(x.data.to_sparse().coalesce())),
        (CsrTensor, CscTensor, lambda x: CscTensor(x.data.to_sparse_csc())),
        (CscTensor, CooTensor, lambda x: CooTensor(x.data.to_sparse().coalesce())),
        (CscTensor, CsrTensor, lambda x: CsrTensor(x.data.to_sparse_csr())),
        (DenseTensor, CooTensor, lambda x: CooTensor.from_dense(x.data)),
        (CooTensor, DenseTensor, lambda x: DenseTensor(x.to_dense())),
    ]


@hookimpl
def sten_register(registry: Any) -> None:
    for layout in TORCH_LAYOUTS:
        registry.register_layout(layout)
    for src, dst, fn in _conversions():
        registry.register_conversion(src, dst, fn)
    sparsifier_impls.register(registry, TORCH_LAYOUTS)
    ops.register(registry)
    compiled_ops.register(registry)


@hookimpl(trylast=True)
def sten_resolve_op(key: Any) -> Any:
    return (moves.resolve(key) or memory.resolve(key) or elementwise.resolve(key) or sparsifier_impls.resolve(key)
            or weight_first.resolve(key))


@hookimpl
def sten_bench_layouts(register: Any) -> None:
    """``sten bench`` lines: torch's COO and CSR, filled by magnitude."""
    register(BenchLayout("torch_coo", "torch COO", "CooTensor", ScalarFractionSparsifier, aliases=("coo",)))
    register(BenchLayout("torch_csr", "torch CSR", "CsrTensor", ScalarFractionSparsifier, aliases=("csr",)))


@hookimpl
def sten_plugin_info() -> dict:
    return {"name": "builtin", "version": __version__, "available": True, "reason": None}
