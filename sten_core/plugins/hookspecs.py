"""Hook specifications of the ``sten`` plugin system (pluggy).

A plugin is a module or object with functions marked ``@sten_core.hookimpl``
and named after the specs below; it implements any subset. Discovery is by
entry points in the group ``sten``:

    [project.entry-points.sten]
    nm = "sten_nm.plugin"

Example plugin module:
    >>> from sten_core.plugin_api import hookimpl
    >>> @hookimpl
    ... def sten_register(registry):
    ...     registry.register_layout(MyLayout)          # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pluggy

if TYPE_CHECKING:
    from sten_core.model.registry import OpKey, Registry
    from sten_core.plugins.bench_layouts import BenchLayout

PROJECT = "sten"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec(historic=True)
def sten_register(registry: "Registry") -> None:
    """Register everything the plugin brings: layouts, sparsifier and operator
    implementations, conversions, compiled implementations
    (``registry.register_layout``, ``register_fwd_op_impl``,
    ``register_bwd_op_impl``, ``register_sparsifier_implementation``,
    ``register_conversion``, ``register_compiled_impl``).

    Historic: called once for each plugin, when it is registered, with
    everything it registers owned by it (a plugin that raises here is removed
    whole and reported; a registration it had replaced comes back). The return
    value is ignored. For one key the last registration wins while it exists;
    replacing another installed plugin's registration warns (``OverrideWarning``).
    """


@hookspec(firstresult=True)
def sten_resolve_op(key: "OpKey") -> Callable | None:
    """Return an implementation for a dispatch ``key`` that has no exact
    registration, or ``None`` to pass.

    First result wins (``tryfirst`` ones first, then the last registered plugin
    first, ``trylast`` ones at the end). A hook that raises is reported once
    (``PluginHookWarning``, naming the plugin) and counts as ``None``. The
    implementation has the signature registered implementations of
    ``key.direction`` have (``impl(ctx, inputs, output_sparsifiers)`` forward,
    ``impl(ctx, grad_outputs, input_sparsifiers)`` backward,
    ``impl(sparsifier, tensor[, grad_fmt])`` for sparsifiers), or is a
    ``sten_core.plugin_api.Entry``. Generic implementations live here (e.g.
    element-wise updates on stored values for any layout). Called once per key:
    the answer is cached until the registry changes.
    """


@hookspec(firstresult=True)
def sten_convert(tensor: Any, target: type) -> Any | None:
    """Convert the layout object ``tensor`` to the layout class ``target``
    losslessly and return the new layout object, or return ``None`` if this
    plugin cannot. Asked only when no chain of registered conversions exists, by
    ``sten.convert`` and by the dispatcher (for an implementation of another layout);
    first result wins, in ``sten_resolve_op``'s order; a hook that raises is
    reported once (``PluginHookWarning``) and counts as ``None``."""


@hookspec
def sten_plugin_info() -> dict | None:
    """Describe the plugin: ``{"name", "version", "available", "reason"}``.

    ``available`` is False (with a ``reason``) when its hardware or library is
    missing; its layouts then drop out of ``sten bench`` and ``sten plugins``
    says why. A raising hook or a non-dict reads as unavailable.
    """


@hookspec
def sten_bench_layouts(register: Callable[["BenchLayout"], None]) -> None:
    """Contribute lines to ``sten bench``: call ``register(BenchLayout(...))``
    once per layout (see ``sten_core.plugin_api.BenchLayout``). Called each
    time the benchmark lists its layouts; the return value is ignored. Layouts
    of an unavailable plugin are listed as unavailable, with its reason."""
