"""Hook specifications of the ``sten`` plugin system (pluggy).

A plugin is a module or object with functions marked ``@sten_core.hookimpl``
and named after the specs below. Discovery is by entry points in the group
``sten``:

    [project.entry-points.sten]
    nm = "sten_nm.plugin"

Example plugin module:
    >>> import sten_core
    >>> @sten_core.hookimpl
    ... def sten_register(registry):
    ...     registry.register_layout(MyLayout)          # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Callable

import pluggy

PROJECT = "sten"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def sten_register(registry: Any) -> None:
    """Register everything the plugin brings: layouts, sparsifier and operator
    implementations, conversions (``registry.register_layout``,
    ``registry.register_fwd_op_impl``, ``registry.register_bwd_op_impl``,
    ``registry.register_sparsifier_implementation``, ``registry.register_conversion``).
    Called once when the plugin is loaded."""


@hookspec(firstresult=True)
def sten_resolve_op(key: Any) -> Callable | None:
    """Return an implementation for a dispatch ``key`` (a ``sten_core.registry.OpKey``)
    that has no exact registration, or ``None``. Generic implementations live here
    (e.g. element-wise updates on stored values for any layout)."""


@hookspec(firstresult=True)
def sten_convert(tensor: Any, target: type) -> Any | None:
    """Convert the layout object ``tensor`` to the layout class ``target``
    losslessly, or return ``None`` if this plugin cannot."""


@hookspec
def sten_plugin_info() -> dict | None:
    """Describe the plugin: ``{"name", "version", "available", "reason"}``.
    ``available`` is False (with a reason) when its hardware or library is missing."""
