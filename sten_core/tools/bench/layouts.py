"""The layouts ``sten bench`` runs: the dense reference, and every line the
plugins contribute through their ``sten_bench_layouts`` hook (the built-in
plugin's torch layouts among them; the core names no plugin). A plugin that is
not installed simply drops out; one that is unavailable is listed with its
reason. Any other registered layout can be asked for by its class name
(``--layouts CscTensor``): it is filled by magnitude (``ScalarFractionSparsifier``).

Example:
    >>> [layout.name for layout in known()][:3]
    ['dense', 'torch_coo', 'torch_csr']
"""

from __future__ import annotations

import warnings

import torch

from sten_core.model.registry import registry
from sten_core.model.sparsifiers import ScalarFractionSparsifier
from sten_core.plugins import ensure_loaded, get_plugin_manager, plugin_report
from sten_core.plugins.bench_layouts import BenchLayout, nm_for_sparsity

__all__ = ["BenchLayout", "DENSE", "availability", "by_name", "choose", "default_layouts", "known",
           "layout_class", "nm_for_sparsity"]

DENSE = BenchLayout("dense", "dense (torch)", None, lambda s: None)


def known() -> tuple[BenchLayout, ...]:
    """The dense reference, then each plugin's contributions in plugin order
    (a plugin whose hook raises is skipped with a warning)."""
    ensure_loaded()
    found: list[BenchLayout] = [DENSE]
    for impl in get_plugin_manager().hook.sten_bench_layouts.get_hookimpls():  # in registration order
        mine: list[BenchLayout] = []
        try:
            impl.function(register=mine.append)
        except Exception as error:
            warnings.warn(f"plugin {impl.plugin_name!r}: sten_bench_layouts raised {type(error).__name__}: {error}; "
                          "its layouts are left out", RuntimeWarning, stacklevel=2)
            continue
        found.extend(layout for layout in mine if isinstance(layout, BenchLayout))
    return tuple(found)


def layout_class(layout: BenchLayout) -> type:
    """The storage class of a bench layout (``torch.Tensor`` for dense)."""
    if layout.layout_name is None:
        return torch.Tensor
    ensure_loaded()
    return registry.layout(layout.layout_name)


def _magnitude(s: float) -> ScalarFractionSparsifier:
    return ScalarFractionSparsifier(s)


def _owner_info() -> dict[str, tuple[str, bool, str | None]]:
    """Layout class name → (plugin, available, reason), from ``plugin_report()``."""
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
    for layout in known():
        if name == layout.name or name in layout.aliases or name == layout.layout_name:
            return layout
    if name in registry.layouts:
        return _generic(name)
    return None


def default_layouts(device: str) -> list[BenchLayout]:
    """The known layouts that run on ``device`` here (the others drop out)."""
    return [layout for layout in known() if availability(layout, device)[0]]


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
            valid = ", ".join(l.name for l in known())
            raise ValueError(f"--layouts: unknown layout {name!r}; valid choices: {valid}")
        ok, reason = availability(layout, device)
        if not ok:
            here = ", ".join(l.name for l in default_layouts(device)) or "none"
            raise ValueError(f"--layouts: layout {name!r} is not available on {device}: {reason}; available here: {here}")
        if layout not in chosen:
            chosen.append(layout)
    return chosen
