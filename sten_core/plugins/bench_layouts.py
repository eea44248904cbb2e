"""What a plugin contributes to ``sten bench``: ``BenchLayout`` records, given
to the ``register`` callback of its ``sten_bench_layouts`` hook.

Example:
    >>> from sten_core.plugins.bench_layouts import BenchLayout, nm_for_sparsity
    >>> [nm_for_sparsity(s) for s in (0.5, 0.75, 0.9, 0.95)]
    [(2, 4), (1, 4), (1, 10), (1, 20)]
    >>> BenchLayout("csr", "torch CSR", "CsrTensor", lambda s: None).runs_at(0.9)
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

NM_GROUPS = (4, 5, 8, 10, 16, 20)


def nm_for_sparsity(sparsity: float) -> tuple[int, int]:
    """The n:m pattern whose density ``n/m`` is closest to ``1 - sparsity``
    (ties to the smaller ``m``)."""
    density = 1.0 - sparsity
    best = None
    for m in NM_GROUPS:
        n = min(m - 1, max(1, round(density * m)))
        error = abs(n / m - density)
        if best is None or error < best[0] - 1e-12:
            best = (error, n, m)
    return best[1], best[2]


def nm_label(sparsity: float) -> str:
    """``"n:m"`` of ``nm_for_sparsity`` (a ``BenchLayout.pattern``)."""
    n, m = nm_for_sparsity(sparsity)
    return f"{n}:{m}"


@dataclass(frozen=True)
class BenchLayout:
    """One line of the benchmark's figure.

    Args:
        name: the ``--layouts`` name (``"torch_csr"``).
        label: the figure's legend.
        layout_name: the registry name of the storage class (``None``: the dense reference).
        sparsifier: ``sparsifier(s)`` builds the initial sparsifier for sparsity ``s``.
        devices: where it runs.
        sparsities: the sparsities it runs at (``None``: all).
        aliases: other ``--layouts`` names.
        pattern: ``pattern(s)``, a short note on what ``s`` means for it (``"1:10"``).
    """

    name: str
    label: str
    layout_name: str | None
    sparsifier: Callable[[float], Any]
    devices: tuple[str, ...] = ("cpu", "cuda")
    sparsities: tuple[float, ...] | None = None
    aliases: tuple[str, ...] = field(default=())
    pattern: Callable[[float], str] | None = None

    def runs_at(self, sparsity: float) -> bool:
        return self.sparsities is None or any(abs(sparsity - s) < 1e-9 for s in self.sparsities)

    def pattern_at(self, sparsity: float) -> str:
        """``pattern(sparsity)``, or ``""``."""
        return self.pattern(sparsity) if self.pattern is not None else ""
