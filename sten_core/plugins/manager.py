"""Plugin discovery and loading.

Plugins are found through entry points in the group ``sten`` and loaded lazily,
on the first dispatch or registry look-up. A plugin that fails to import or
register is reported with a ``PluginLoadWarning`` and skipped; the others keep
working. Environment variables:

- ``STEN_PLUGINS=a,b``: load only these entry points (a name that is not
  installed is reported, naming the installed ones);
- ``STEN_DISABLE_PLUGINS=a,b``: never load these;
- ``STEN_STRICT_PLUGINS=1``: a load error raises instead of warning (after the
  other plugins are loaded, so one broken plugin does not take the rest down).

Loading is thread-safe: a thread that asks while another one loads waits until
the registry is complete. A plugin with a hook that is not in the spec (a
misspelling such as ``sten_regster``) fails to load with the name it meant.

Tests register a plugin without installing it:

    >>> import sten_core
    >>> sten_core.plugins.manager.register_plugin(my_module, name="mine")   # doctest: +SKIP
"""

from __future__ import annotations

import difflib
import importlib.metadata
import os
import threading
import warnings
from typing import Any, Callable

import pluggy

from sten_core.plugins import hookspecs
from sten_core.model.registry import registry
from sten_core.model.tensor import services
from sten_core.user_frames import user_stacklevel

ENTRY_POINT_GROUP = "sten"
BUILTIN_PLUGINS = {"builtin": "sten_core.builtin.plugin", "pruning": "sten_core.training.pruning.plugin"}
"""The plugins that are part of sten-core, loaded by module name before the installed ones."""


class PluginLoadWarning(UserWarning):
    """A plugin failed to load and was skipped."""


class PluginLoadError(RuntimeError):
    """A plugin failed to load under ``STEN_STRICT_PLUGINS=1``."""


class PluginHookWarning(UserWarning):
    """A plugin's ``sten_resolve_op`` or ``sten_convert`` hook raised; its answer
    was taken as ``None`` (warned once per plugin and hook)."""


registry.silent_owners.update(BUILTIN_PLUGINS)  # they load first: overriding them is well defined

_pm: pluggy.PluginManager | None = None
_loaded = False  # set only when every plugin has been loaded (or reported)
_loading_thread: int | None = None  # the thread loading now (its own re-entry returns at once)
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
        # historic: each plugin's sten_register runs when it is registered, inside registry.owner(name)
        pm.hook.sten_register.call_historic(kwargs={"registry": registry})
        _pm = pm
    return _pm


def _strict() -> bool:
    return os.environ.get("STEN_STRICT_PLUGINS", "") not in ("", "0")


def _report(name: str, error: BaseException, deferred: list | None = None) -> None:
    """Record a failed plugin; warn, or raise under ``STEN_STRICT_PLUGINS=1``
    (collected into ``deferred`` when given, raised by the caller at the end)."""
    message = f"sten plugin {name!r} failed to load and was skipped: {type(error).__name__}: {error}"
    failed[name] = f"{type(error).__name__}: {error}"
    if _strict():
        if deferred is not None:
            deferred.append((message, error))
            return
        raise PluginLoadError(message) from error
    warnings.warn(message, PluginLoadWarning, stacklevel=user_stacklevel())


class UnknownHookError(ValueError):
    """A plugin implements a hook that the ``sten`` hook specs do not define."""


def _check_hooks(pm: pluggy.PluginManager, plugin: Any, name: str) -> None:
    """Raise ``UnknownHookError`` for a hook implementation without a spec
    (pluggy's ``check_pending``, for this plugin only)."""
    known = sorted(n for n in dir(hookspecs) if n.startswith("sten_") and callable(getattr(hookspecs, n)))
    for caller in pm.get_hookcallers(plugin) or []:
        if caller.spec is not None:
            continue
        for impl in caller.get_hookimpls():
            if impl.plugin is plugin and not impl.optionalhook:
                close = difflib.get_close_matches(caller.name, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise UnknownHookError(
                    f"plugin {name!r} implements {caller.name!r}, which is not a sten hook{hint} "
                    f"(the hooks are: {', '.join(known)})"
                )


def _register_into(pm: pluggy.PluginManager, plugin: Any, name: str, deferred: list | None = None) -> bool:
    """Register ``plugin`` (its historic ``sten_register`` runs then, owned by
    ``name``); undo everything on error."""
    try:
        with registry.owner(name):
            pm.register(plugin, name=name)
            _check_hooks(pm, plugin, name)
            pm.check_pending()
    except Exception as error:  # a hook signature mismatch, a duplicate name, an unknown hook, sten_register
        registry.remove_owner(name)
        if pm.is_registered(plugin):
            pm.unregister(plugin)
        _report(name, error, deferred)
        return False
    registry.changed()  # its hooks (sten_resolve_op, conversions) may change cached plans
    failed.pop(name, None)
    return True


_hook_errors_warned: set[tuple[str, str]] = set()


def has_hook(hook_name: str) -> bool:
    """Whether a loaded plugin implements the hook ``hook_name`` (dispatch plans a conversion
    through ``sten_convert`` only where one does).

    >>> has_hook("sten_register")
    True
    """
    return bool(getattr(get_plugin_manager().hook, hook_name).get_hookimpls())


def first_result(hook_name: str, *, _valid: Callable[[Any], str | None] | None = None, **kwargs: Any) -> Any:
    """The first non-``None`` answer of the firstresult hook ``hook_name``,
    asking each plugin in pluggy's order (``tryfirst`` ones first, then the
    last registered first, ``trylast`` ones at the end) on its own: a plugin
    whose hook raises, or answers what ``_valid`` refuses (it returns what was
    expected instead), is warned about once (``PluginHookWarning``, naming the
    plugin, the hook and the error) and counts as answering ``None``, so one
    broken plugin never breaks calls on another's layouts. Dispatch asks once
    per key (plans are cached).

    >>> import torch
    >>> first_result("sten_convert", tensor=torch.zeros(2), target=torch.Tensor) is None   # no plugin converts it
    True
    """
    caller = getattr(get_plugin_manager().hook, hook_name)
    impls = caller.get_hookimpls()
    if any(impl.wrapper or impl.hookwrapper for impl in impls):
        return _call_with_wrappers(caller, hook_name, impls, kwargs)
    for impl in reversed(impls):  # pluggy's call order
        args = [kwargs[arg] for arg in impl.argnames]
        extra = {arg: kwargs[arg] for arg in impl.kwargnames if arg in kwargs}
        try:
            result = impl.function(*args, **extra)
        except Exception as error:
            _warn_hook_error(impl.plugin_name, hook_name, error)
            continue
        expected = None if result is None or _valid is None else _valid(result)
        if expected is not None:
            _warn_hook_error(impl.plugin_name, hook_name, TypeError(f"it returned {result!r}, not {expected}"),
                             "answered")
            continue
        if result is not None:
            return result
    return None


def _call_with_wrappers(caller: Any, hook_name: str, impls: list, kwargs: dict) -> Any:
    """A hook with wrapper implementations runs through pluggy (wrappers need its
    machinery); an error then is warned naming every plugin of the hook."""
    try:
        return caller(**kwargs)
    except Exception as error:
        names = ", ".join(sorted({impl.plugin_name for impl in impls}))
        _warn_hook_error(f"one of {names}", hook_name, error)
        return None


def _warn_hook_error(plugin_name: str, hook_name: str, error: Exception, what: str = "raised") -> None:
    if (plugin_name, hook_name) in _hook_errors_warned:
        return
    _hook_errors_warned.add((plugin_name, hook_name))
    warnings.warn(
        f"sten plugin {plugin_name!r}: its {hook_name} hook {what} {type(error).__name__}: {error}; "
        f"its answer is taken as None (this plugin's bug; it is reported once)",
        PluginHookWarning, stacklevel=user_stacklevel())


def register_plugin(plugin: Any, name: str | None = None) -> bool:
    """Register a plugin object or module directly (no entry point needed).

    Returns whether it loaded; a failure is reported as for installed plugins. A plugin already
    registered under ``name`` this way (or the same plugin again) is replaced; an installed one
    that ``ensure_loaded`` loaded is not: a ``ValueError`` asks for another name.
    """
    ensure_loaded()
    with _lock:
        name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
        pm = get_plugin_manager()
        if pm.has_plugin(name):
            current = pm.get_plugin(name)
            if current is not plugin and name in _loaded_at_start:
                raise ValueError(
                    f"name: a plugin named {name!r} is installed and loaded "
                    f"({getattr(current, '__name__', type(current).__name__)}); registering another under that name "
                    f"would remove it and everything it registered. Register this one under another name "
                    f"(register_plugin(plugin, name=...)), or unregister_plugin({name!r}) first to replace it")
            unregister_plugin(name)   # the same plugin again (a notebook cell re-run), or one registered here
        return _register_into(pm, plugin, name)


_loaded_at_start: set[str] = set()
"""The built-in and installed plugins ``ensure_loaded`` loaded: ``register_plugin`` does not
replace one of them silently (a test plugin named "nm" removed ``NMTensor``)."""


def unregister_plugin(name: str) -> None:
    """Remove plugin ``name`` and everything it registered."""
    pm = get_plugin_manager()
    plugin = pm.get_plugin(name)
    if plugin is not None:
        pm.unregister(plugin)
    registry.remove_owner(name)
    _forget_hook_errors(name)


def _forget_hook_errors(name: str) -> None:
    """A plugin registered again under ``name`` gets its hook errors reported again."""
    _hook_errors_warned.difference_update({pair for pair in _hook_errors_warned if pair[0] == name})


def loaded() -> bool:
    """Whether every plugin has been loaded (or reported)."""
    return _loaded


def ensure_loaded() -> None:
    """Load the built-in plugin and the installed ones, once.

    Other threads calling meanwhile wait until loading has finished; under
    ``STEN_STRICT_PLUGINS=1`` every plugin is tried and then one
    ``PluginLoadError`` names all that failed.
    """
    global _loaded, _loading_thread
    if _loaded:
        return
    with _lock:
        if _loaded or _loading_thread == threading.get_ident():
            return  # loaded meanwhile, or this thread's own plugin asks while it loads
        _loading_thread = threading.get_ident()
        deferred: list = []
        try:
            _load_all(deferred)
        finally:
            _loading_thread = None
            _loaded = True
        if deferred:
            messages = "; ".join(message for message, _ in deferred)
            raise PluginLoadError(messages) from deferred[0][1]


def _load_all(deferred: list) -> None:
    pm = get_plugin_manager()
    for name, module in BUILTIN_PLUGINS.items():
        if _register_into(pm, importlib.import_module(module), name, deferred):
            _loaded_at_start.add(name)
    only = _names_from_env("STEN_PLUGINS")
    disabled = _names_from_env("STEN_DISABLE_PLUGINS") or set()
    # by name: the order decides which of two plugins' registrations of one key wins (the last), so it must
    # not depend on the order the file system lists the installed distributions in
    entry_points = sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)
    if only:
        installed = {ep.name for ep in entry_points} | set(BUILTIN_PLUGINS)
        unknown = sorted(only - installed)
        if unknown:
            error = LookupError(
                f"STEN_PLUGINS names {', '.join(map(repr, unknown))}, which {'is' if len(unknown) == 1 else 'are'} "
                f"not installed; installed plugins: {', '.join(sorted(installed))}"
            )
            for name in unknown:
                _report(name, error, deferred)
    for ep in entry_points:
        if (only is not None and ep.name not in only) or ep.name in disabled or pm.has_plugin(ep.name):
            continue
        try:
            module = ep.load()
        except Exception as error:
            _report(ep.name, error, deferred)
            continue
        if _register_into(pm, module, ep.name, deferred):
            _loaded_at_start.add(ep.name)


def reset() -> None:
    """Forget all plugins (tests use it to reload with other environment variables)."""
    global _pm, _loaded
    with _lock:
        if _pm is not None:
            for name, _ in list(_pm.list_name_plugin()):
                registry.remove_owner(name)
        _pm, _loaded = None, False
        failed.clear()
        _loaded_at_start.clear()
        _hook_errors_warned.clear()


def _distribution_version(plugin: Any) -> str | None:
    module = getattr(plugin, "__name__", "") or ""
    top = module.split(".")[0]
    try:
        for dist_name in importlib.metadata.packages_distributions().get(top, []):
            return importlib.metadata.version(dist_name)
    except Exception:
        return None
    return None


def _plugin_info(pm: pluggy.PluginManager, plugin: Any, name: str) -> dict:
    """The plugin's ``sten_plugin_info()``; an error or a non-dict reads as unavailable."""
    for impl in pm.hook.sten_plugin_info.get_hookimpls():
        if impl.plugin is not plugin:
            continue
        try:
            info = impl.function()
        except Exception as error:
            return {"available": False, "reason": f"sten_plugin_info() raised {type(error).__name__}: {error}"}
        if info is None:
            return {}
        if not isinstance(info, dict):
            return {"available": False, "reason": f"sten_plugin_info() returned {type(info).__name__}, not a dict"}
        return info
    return {}


def plugin_report(skipped: bool = False) -> list[dict]:
    """One dict per plugin: name, version, available, reason, layouts, hooks; for the loaded
    plugins and those that failed to load, and with ``skipped`` (``sten plugins``) also for the
    installed ones that ``STEN_PLUGINS`` / ``STEN_DISABLE_PLUGINS`` kept from loading
    (unavailable, saying so). ``name`` is the name the plugin is registered and selected by
    (its entry point's); a different name in its ``sten_plugin_info()`` is kept as ``reported_name``."""
    ensure_loaded()
    pm = get_plugin_manager()
    rows = [_loaded_row(pm, plugin, name) for name, plugin in pm.list_name_plugin()]
    rows += [_row(name, _entry_point_version(name), False, f"failed to load: {error}") for name, error in failed.items()]
    return rows + _skipped_rows(pm) if skipped else rows


def _row(name: str, version: str | None, available: bool, reason: str | None,
         layouts: list | None = None, hooks: list | None = None) -> dict:
    return {"name": name, "version": version, "available": available, "reason": reason,
            "layouts": layouts or [], "hooks": hooks or []}


def _loaded_row(pm: pluggy.PluginManager, plugin: Any, name: str) -> dict:
    """A loaded plugin's row: what its ``sten_plugin_info()`` says (``available`` must be a bool)."""
    info = _plugin_info(pm, plugin, name)
    available, reason = info.get("available", True), info.get("reason")
    if not isinstance(available, bool):
        available, reason = False, f"sten_plugin_info() returned available={available!r}, not a bool"
    elif not available and not reason:
        reason = "the plugin reports itself unavailable and gives no reason"
    row = _row(name, info.get("version") or _distribution_version(plugin), available, reason,
               sorted(registry.owned_by(name, "layouts")), sorted(h.name for h in pm.get_hookcallers(plugin) or []))
    if info.get("name") not in (None, name):
        row["reported_name"] = info["name"]
    return row


def _skipped_rows(pm: pluggy.PluginManager) -> list[dict]:
    """The installed plugins that were not loaded on purpose (``STEN_PLUGINS``, ``STEN_DISABLE_PLUGINS``)."""
    only = _names_from_env("STEN_PLUGINS")
    disabled = _names_from_env("STEN_DISABLE_PLUGINS") or set()
    rows, seen = [], set()
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in seen or pm.has_plugin(ep.name) or ep.name in failed:
            continue
        seen.add(ep.name)
        if ep.name in disabled:
            reason = "not loaded: STEN_DISABLE_PLUGINS names it"
        elif only is not None and ep.name not in only:
            reason = (f"not loaded: STEN_PLUGINS names only {', '.join(sorted(only))}" if only
                      else "not loaded: STEN_PLUGINS is empty (the built-in plugins only)")
        else:
            reason = "not loaded"
        rows.append(_row(ep.name, _dist_version(ep), False, reason))
    return rows


def _dist_version(ep: Any) -> str | None:
    dist = getattr(ep, "dist", None)
    return getattr(dist, "version", None)


def _entry_point_version(name: str) -> str | None:
    """The version of the distribution that installs entry point ``name`` (``None``: none does)."""
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return _dist_version(ep)
    return None


services.install(load_plugins=ensure_loaded)  # wrappers of traceable layouts need the plugins' registrations
