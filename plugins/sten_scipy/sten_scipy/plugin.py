"""The ``scipy`` STen plugin (entry point ``[project.entry-points.sten] scipy = "sten_scipy.plugin"``).

Registers the ``ScipyCsrTensor`` / ``ScipyCscTensor`` layouts, their
conversions to and from the core's torch-native CSR/CSC/COO, sparsifier
implementations for every built-in sparsifier, and the operator
implementations (``F.linear``, ``mm``/``matmul``, ``add``, ``mul``, ``t``,
``sum``). Calls without an explicit output format get the natural result
(sparse + sparse → sparse union, sparse * dense → sparse, ``t`` → the other
scipy layout) through ``sten_resolve_op``.

Example:
    >>> from sten_scipy import plugin
    >>> plugin.sten_plugin_info()["name"]
    'scipy'
"""

from __future__ import annotations

from typing import Any

import torch

from sten_core import plugin_api
from sten_core.plugin_api import OpKey

from . import __version__
from .table import TABLE

try:
    import scipy
    import scipy.sparse  # noqa: F401

    _MISSING: str | None = None
except ImportError as error:  # pragma: no cover - scipy is a dependency
    _MISSING = f"scipy is not importable: {error}"



@plugin_api.hookimpl
def sten_register(registry: Any) -> None:
    if _MISSING is not None:
        return
    from . import compiled, conversions, elementwise, linear, sparsifiers, structure
    from .layouts import SCIPY_LAYOUTS

    for layout in SCIPY_LAYOUTS:
        registry.register_layout(layout)
    for src, dst, fn in conversions.conversions():
        registry.register_conversion(src, dst, fn)
    sparsifiers.register(registry)
    grad_outs = (torch.Tensor,) + SCIPY_LAYOUTS
    TABLE.clear()
    linear.register(registry, grad_outs)
    elementwise.register(registry, grad_outs, TABLE)
    structure.register(registry, grad_outs, TABLE)
    compiled.register(registry)  # torch.compile: sten_scipy::linear custom operators


@plugin_api.hookimpl
def sten_resolve_op(key: OpKey) -> Any:
    """Implicit calls on scipy operands get the natural output (see ``table``);
    dense-output variants of naturally sparse operators are served here."""
    return TABLE.resolve(key, plugin_api.registry)


@plugin_api.hookimpl
def sten_bench_layouts(register: Any) -> None:
    """``sten bench`` line: scipy CSR filled by magnitude."""
    register(plugin_api.BenchLayout("scipy_csr", "scipy CSR", "ScipyCsrTensor", plugin_api.ScalarFractionSparsifier,
                                    devices=("cpu",)))


@plugin_api.hookimpl
def sten_plugin_info() -> dict:
    version = getattr(scipy, "__version__", "?") if _MISSING is None else None
    return {
        "name": "scipy",
        "version": __version__,
        "available": _MISSING is None,
        "reason": _MISSING,
        "scipy_version": version,
    }
