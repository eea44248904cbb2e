"""Plugin discovery and loading.

Plugins are found through entry points in the group ``sten`` and loaded lazily,
on the first dispatch or registry look-up. A plugin that fails to import or
register is reported with a ``PluginLoadWarning`` and skipped; the others keep
working. Environment variables:

- ``STEN_PLUGINS=a,b``: load only these entry points;
- ``STEN_DISABLE_PLUGINS=a,b``: never load these;
- ``STEN_STRICT_PLUGINS=1``: a load error raises instead of warning.

Tests register a plugin without installing it:

    >>> import sten_core
    >>> sten_core.plugins.register_plugin(my_module, name="mine")   # doctest: +SKIP
"""

from __future__ import annotations

import importlib.metadata
import os
import threading
import warnings
from typing import Any

import pluggy

from . import hookspecs
from .registry import registry

ENTRY_POINT_GROUP = "sten"


class PluginLoadWarning(UserWarning):
    """A plugin failed to load and was skipped."""


class PluginLoadError(RuntimeError):
    """A plugin failed to load under ``STEN_STRICT_PLUGINS=1``."""


_pm: pluggy.PluginManager | None = None
_loaded = False
_lock = threading.RLock()
failed: dict[str, str] = {}


def _names_from_env(var: str) -> set[str] | None:
    value = os.environ.get(var)
    if value is None:
        return None
    return {name.strip() for name in value.split(",") if name.strip()}


def get_plugin_manager() -> pluggy.PluginManager:
    """The pluggy manager with the hook specs (plugins are not loaded here)."""
    global _pm
    if _pm is None:
        pm = pluggy.PluginManager(hookspecs.PROJECT)
        pm.add_hookspecs(hookspecs)
        _pm = pm
    return _pm


def _report(name: str, error: BaseException) -> None:
    message = f"sten plugin {name!r} failed to load and was skipped: {type(error).__name__}: {error}"
    failed[name] = f"{type(error).__name__}: {error}"
    if os.environ.get("STEN_STRICT_PLUGINS", "") not in ("", "0"):
        raise PluginLoadError(message) from error
    warnings.warn(message, PluginLoadWarning, stacklevel=3)


def _register_into(pm: pluggy.PluginManager, plugin: Any, name: str) -> bool:
    """Register ``plugin`` and run its ``sten_register``; undo everything on error."""
    try:
        pm.register(plugin, name=name)
    except Exception as error:  # a hook signature mismatch, a duplicate name
        _report(name, error)
        return False
    try:
        with registry.owner(name):
            for impl in pm.hook.sten_register.get_hookimpls():
                if impl.plugin is plugin:
                    impl.function(registry=registry)
    except Exception as error:
        registry.remove_owner(name)
        pm.unregister(plugin)
        _report(name, error)
        return False
    registry._changed()  # its hooks (sten_resolve_op, conversions) may change cached plans
    failed.pop(name, None)
    return True


def register_plugin(plugin: Any, name: str | None = None) -> bool:
    """Register a plugin object or module directly (no entry point needed).

    Returns whether it loaded; a failure is reported as for installed plugins.
    """
    ensure_loaded()
    with _lock:
        name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
        pm = get_plugin_manager()
        if pm.has_plugin(name):
            unregister_plugin(name)
        return _register_into(pm, plugin, name)


def unregister_plugin(name: str) -> None:
    """Remove plugin ``name`` and everything it registered."""
    pm = get_plugin_manager()
    plugin = pm.get_plugin(name)
    if plugin is not None:
        pm.unregister(plugin)
    registry.remove_owner(name)


def ensure_loaded() -> None:
    """Load the built-in plugin and the installed ones, once."""
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        _loaded = True
        pm = get_plugin_manager()
        from .builtin import plugin as builtin_plugin

        _register_into(pm, builtin_plugin, "builtin")
        only = _names_from_env("STEN_PLUGINS")
        disabled = _names_from_env("STEN_DISABLE_PLUGINS") or set()
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if (only is not None and ep.name not in only) or ep.name in disabled or pm.has_plugin(ep.name):
                continue
            try:
                module = ep.load()
            except Exception as error:
                _report(ep.name, error)
                continue
            _register_into(pm, module, ep.name)


def reset() -> None:
    """Forget all plugins (tests use it to reload with other environment variables)."""
    global _pm, _loaded
    with _lock:
        if _pm is not None:
            for name, _ in list(_pm.list_name_plugin()):
                registry.remove_owner(name)
        _pm, _loaded = None, False
        failed.clear()


def _distribution_version(plugin: Any) -> str | None:
    module = getattr(plugin, "__name__", "") or ""
    top = module.split(".")[0]
    try:
        for dist_name in importlib.metadata.packages_distributions().get(top, []):
            return importlib.metadata.version(dist_name)
    except Exception:
        return None
    return None


def plugin_report() -> list[dict]:
    """One dict per plugin: name, version, available, reason, layouts, hooks."""
    ensure_loaded()
    pm = get_plugin_manager()
    rows = []
    for name, plugin in pm.list_name_plugin():
        info = {}
        for impl in pm.hook.sten_plugin_info.get_hookimpls():
            if impl.plugin is plugin:
                info = impl.function() or {}
        rows.append(
            {
                "name": info.get("name", name),
                "version": info.get("version") or _distribution_version(plugin),
                "available": bool(info.get("available", True)),
                "reason": info.get("reason"),
                "layouts": sorted(registry.owned_by(name, "layouts")),
                "hooks": sorted(h.name for h in pm.get_hookcallers(plugin) or []),
            }
        )
    for name, error in failed.items():
        rows.append({"name": name, "version": None, "available": False, "reason": f"failed to load: {error}", "layouts": [], "hooks": []})
    return rows
