"""The package structure: each layer imports only itself and the layers below
it, and no module imports another that (directly or not) imports it back,
counting imports inside functions too (docs/architecture.md).

Layers, bottom up: the programming model (``model``), the plugin system
(``plugins``), ``dispatch``, the built-in plugins (``builtin``), ``training``,
the public kits (``testing``, ``plugin_api``), ``tools``; ``sten_core`` itself
re-exports the public API and is imported by none of them.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "sten_core"
LAYERS = ["version", "progress", "user_frames", "machine", "model", "plugins", "dispatch", "builtin", "training", "testing", "plugin_api", "tools"]
RANK = {name: i for i, name in enumerate(LAYERS)}
RANK["plugin_api"] = RANK["testing"]  # the two public kits sit side by side
RANK["progress"] = RANK["user_frames"] = RANK["machine"] = RANK["version"]  # base utilities, importing nothing of sten_core


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(path: pathlib.Path, modules: dict) -> set[str]:
    """The sten_core modules ``path`` imports anywhere in it (module or function
    level; not under ``if TYPE_CHECKING:``, which never runs)."""
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            names = [sub if sub in modules else node.module for sub in subs]  # a submodule, or a name in the module
        else:
            continue
        for name in names:
            if name in modules and name.startswith("sten_core"):
                found.add(name)
    return found


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_relative_imports_are_not_used():
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}: relative import (use sten_core.<package>.<module>)"


def test_every_module_belongs_to_a_layer():
    for module in _modules():
        layer = _layer(module)
        assert layer is None or layer in RANK, f"{module} is in no layer of {LAYERS}"


def test_layers_import_only_downwards():
    modules = _modules()
    bad = []
    for module, path in modules.items():
        layer = _layer(module)
        if layer is None:
            continue
        for imported in _imports(path, modules):
            target = _layer(imported)
            if target is None:
                bad.append(f"{module} imports the top-level sten_core package")
            elif RANK[target] > RANK[layer]:
                bad.append(f"{module} ({layer}) imports {imported} ({target})")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycles():
    modules = _modules()
    graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
    # a package's __init__ that re-exports its own modules is not a cycle with them
    for m in graph:
        graph[m] = {d for d in graph[m] if not (d.startswith(m + ".") and modules[m].name == "__init__.py")
                    and not m.startswith(d + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


PLUGIN_PACKAGES = ("sten_nm", "sten_scipy", "sten_cuda24", "sten_example_plugin")


def _imported_names(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_the_core_names_no_plugin():
    for path in ROOT.rglob("*.py"):
        for name in _imported_names(path):
            assert name.split(".")[0] not in PLUGIN_PACKAGES, f"{path} imports the plugin module {name}"


def _plugin_sources() -> list[pathlib.Path]:
    repo = ROOT.parent
    found = []
    for package in PLUGIN_PACKAGES:
        for folder in repo.glob(f"*/*/{package}") or ():
            found += [p for p in folder.rglob("*.py")]
    return found


def test_plugins_import_only_the_plugin_api():
    sources = _plugin_sources()
    assert len({p.parent.name for p in sources}) >= 4, "the four plugin packages are found"
    bad = [f"{path}: {name}" for path in sources for name in _imported_names(path)
           if name.startswith("sten_core") and name not in ("sten_core.plugin_api",)
           and not name.startswith("sten_core.plugin_api.")]
    assert not bad, "plugins must import sten_core.plugin_api only:\n" + "\n".join(sorted(bad))
