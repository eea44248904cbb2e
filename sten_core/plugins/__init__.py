"""The plugin system: hook specifications (``hookspecs``) and discovery and
loading (``manager``). Plugins are found through entry points in the group
``sten``; the built-in ones (``builtin``, ``pruning``) load the same way, by
module name.

Example:
    >>> import sten_core
    >>> sten_core.plugins.ensure_loaded()
    >>> "builtin" in [row["name"] for row in sten_core.plugins.plugin_report()]
    True
"""

from sten_core.plugins.hookspecs import hookimpl, hookspec
from sten_core.plugins.manager import (BUILTIN_PLUGINS, ENTRY_POINT_GROUP, PluginLoadError, PluginLoadWarning, failed,
                                       UnknownHookError, ensure_loaded, get_plugin_manager, loaded,
                                       plugin_report, register_plugin, reset, unregister_plugin)

__all__ = [
    "BUILTIN_PLUGINS", "ENTRY_POINT_GROUP", "PluginLoadError", "PluginLoadWarning", "UnknownHookError",
    "ensure_loaded", "failed", "get_plugin_manager", "hookimpl", "hookspec", "loaded", "plugin_report", "register_plugin",
    "reset", "unregister_plugin",
]
