"""The layouts ``sten bench`` knows, how a sparsity becomes each of them, and
which are available here.

A bench layout is a name (``"torch_csr"``), the registered layout class it
stores weights in (looked up in ``sten_core.registry.layouts``, so a plugin
that is not installed simply drops out), the sparsifier that produces it for a
sparsity ``s`` and the devices it runs on. Any other registered layout can be
asked for by its class name (``--layouts CscTensor``): it is filled by
magnitude (``ScalarFractionSparsifier``).

Example:
    >>> from sten_core.bench.layouts import nm_for_sparsity
    >>> [nm_for_sparsity(s) for s in (0.5, 0.75, 0.9, 0.95)]
    [(2, 4), (1, 4), (1, 10), (1, 20)]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

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


@dataclass(frozen=True)
class BenchLayout:
    """One line of the benchmark's figure.

    ``layout_name`` is the registry name of the storage class (``None`` for the
    dense reference); ``sparsifier(s)`` builds the initial sparsifier;
    ``sparsities`` limits the sparsities it runs at (``None``: all).
    """

    name: str
    label: str
    layout_name: str | None
    sparsifier: Callable[[float], Any]
    devices: tuple[str, ...] = ("cpu", "cuda")
    sparsities: tuple[float, ...] | None = None
    aliases: tuple[str, ...] = field(default=())

    def layout_class(self) -> type:
        """The storage class (``torch.Tensor`` for dense)."""
        if self.layout_name is None:
            return torch.Tensor
        from ..plugins import ensure_loaded
        from ..registry import registry

        ensure_loaded()
        return registry.layout(self.layout_name)

    def runs_at(self, sparsity: float) -> bool:
        return self.sparsities is None or any(abs(sparsity - s) < 1e-9 for s in self.sparsities)

    def pattern(self, sparsity: float) -> str:
        """A short note on what the sparsity means for this layout (``"1:10"``)."""
        if self.name in ("nm", "grouped_nm"):
            n, m = nm_for_sparsity(sparsity)
            return f"{n}:{m}"
        if self.name == "2:4":
            return "2:4"
        if self.name == "block":
            return "64x64"
        return ""


def _magnitude(s: float) -> Any:
    from ..sparsifiers import ScalarFractionSparsifier

    return ScalarFractionSparsifier(s)


def _nm(s: float) -> Any:
    from ..sparsifiers import PerBlockFractionSparsifier

    return PerBlockFractionSparsifier(*nm_for_sparsity(s))


def _grouped_nm(s: float) -> Any:
    from sten_nm import GroupedNMSparsifier  # only called where the plugin is available

    return GroupedNMSparsifier(*nm_for_sparsity(s))


def _two_four(s: float) -> Any:
    from ..sparsifiers import PerBlockFractionSparsifier

    return PerBlockFractionSparsifier(2, 4)


def _block(s: float) -> Any:
    from ..sparsifiers import BlockwiseFractionSparsifier

    return BlockwiseFractionSparsifier(s, (64, 64))


KNOWN: tuple[BenchLayout, ...] = (
    BenchLayout("dense", "dense (torch)", None, lambda s: None),
    BenchLayout("torch_coo", "torch COO", "CooTensor", _magnitude, aliases=("coo",)),
    BenchLayout("torch_csr", "torch CSR", "CsrTensor", _magnitude, aliases=("csr",)),
    BenchLayout("scipy_csr", "scipy CSR", "ScipyCsrTensor", _magnitude, devices=("cpu",)),
    BenchLayout("nm", "n:m (sten_nm)", "NMTensor", _nm, devices=("cpu",), aliases=("n:m",)),
    BenchLayout("grouped_nm", "grouped n:m (sten_nm)", "GroupedNMTensor", _grouped_nm, devices=("cpu",),
                aliases=("grouped",)),
    BenchLayout("2:4", "2:4 (sten_cuda24)", "Sparse24Tensor", _two_four, devices=("cuda",),
                sparsities=(0.5,), aliases=("24", "sparse24")),
    BenchLayout("block", "block 64x64 (sten_cuda24)", "BlockSparseTensor", _block, devices=("cuda",)),
)


def _owner_info() -> dict[str, tuple[str, bool, str | None]]:
    """Layout class name → (plugin, available, reason), from ``plugin_report()``."""
    from ..plugins import plugin_report

    info = {}
    for row in plugin_report():
        for layout in row["layouts"]:
            info[layout] = (row["name"], row["available"], row["reason"])
    return info


def _generic(layout_name: str) -> BenchLayout:
    return BenchLayout(layout_name, layout_name, layout_name, _magnitude)


def availability(layout: BenchLayout, device: str) -> tuple[bool, str | None]:
    """Whether ``layout`` can run on ``device`` here, and why not."""
    if device not in layout.devices:
        return False, f"runs on {' or '.join(layout.devices)} only, not {device}"
    if layout.layout_name is None:
        return True, None
    owners = _owner_info()
    if layout.layout_name not in owners:
        return False, f"layout {layout.layout_name} is not registered (is its plugin installed?)"
    plugin, ok, reason = owners[layout.layout_name]
    if not ok:
        return False, f"plugin {plugin!r} is unavailable: {reason or 'no reason given'}"
    return True, None


def by_name(name: str) -> BenchLayout | None:
    """The bench layout called ``name`` (or one of its aliases, or a registered class name)."""
    for layout in KNOWN:
        if name == layout.name or name in layout.aliases or name == layout.layout_name:
            return layout
    from ..plugins import ensure_loaded
    from ..registry import registry

    ensure_loaded()
    if name in registry.layouts:
        return _generic(name)
    return None


def default_layouts(device: str) -> list[BenchLayout]:
    """The known layouts that run on ``device`` here (the others drop out)."""
    return [layout for layout in KNOWN if availability(layout, device)[0]]


def choose(names: list[str] | None, device: str) -> list[BenchLayout]:
    """Resolve ``--layouts``: every name must be known and available on ``device``.

    >>> [l.name for l in choose(["dense", "csr"], "cpu")]
    ['dense', 'torch_csr']
    """
    if not names:
        return default_layouts(device)
    chosen = []
    for name in names:
        layout = by_name(name)
        if layout is None:
            valid = ", ".join(l.name for l in KNOWN)
            raise ValueError(f"--layouts: unknown layout {name!r}; valid choices: {valid}")
        ok, reason = availability(layout, device)
        if not ok:
            here = ", ".join(l.name for l in default_layouts(device)) or "none"
            raise ValueError(f"--layouts: layout {name!r} is not available on {device}: {reason}; available here: {here}")
        if layout not in chosen:
            chosen.append(layout)
    return chosen
