"""The documentation site: it builds strictly, documents every hook spec, and its code runs.

Code blocks fenced as ```python on the pages in ``RUNNABLE`` are executed, page by page in one
namespace, exactly as written; ```py blocks are fragments (shown, not run).
"""

from __future__ import annotations

import html
import importlib.util
import inspect
import pathlib
import re
import subprocess
import sys
import warnings

import pytest
import torch

import sten_core as sten
from sten_core.plugins import hookspecs

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
EXAMPLE = ROOT / "examples" / "sten_example_plugin"
PLUGIN_GUIDE = DOCS / "guides" / "write-a-plugin.md"
RUNNABLE = ["getting-started.md", "guides/from-scratch.md", "guides/train.md", "guides/sparsify-existing.md", "training.md",
            "guides/saving-and-loading.md", "pruning.md", "compile.md"]
SNIPPET = re.compile(r'^--8<-- "([^"]+)"$', re.M)


def python_blocks(page: pathlib.Path) -> list[str]:
    """The ```python blocks of a markdown page, in order."""
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M)


def hook_spec_names() -> list[str]:
    """The hook specs declared in ``sten_core/hookspecs.py``."""
    marker = f"{hookspecs.PROJECT}_spec"
    return [name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if hasattr(fn, marker)]


@pytest.fixture
def restore_sten():
    """Undo what documentation code changes in the core's global state."""
    sten.plugins.ensure_loaded()  # snapshot the registry with the installed plugins in it
    impls = dict(sten.registry.impls)
    observers = sten.dispatch.observers.active()
    yield
    sten.registry.impls.clear()
    sten.registry.impls.update(impls)
    sten.dispatch.clear_caches()
    sten.dispatch.reset_warnings()
    assert sten.dispatch.observers.active() == observers, "a page left an observer behind"
    sten.set_dispatch_failure("warn")


def test_mkdocs_build_strict(tmp_path: pathlib.Path) -> None:
    for module in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install -e '.[docs]')")
    site = tmp_path / "site"
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    api = (site / "api" / "index.html").read_text()
    for anchor in ("sten_core.training.builder.SparsityBuilder", "sten_core.model.tensor.SparseTensorWrapper",
                   "sten_core.dispatch.sparsified_op", "sten_core.register_fwd_op_impl",
                   *(f"sten_core.plugins.hookspecs.{name}" for name in hook_spec_names())):
        assert f'id="{anchor}"' in api, f"the API reference does not render {anchor}"
    guide = html.unescape(re.sub(r"<[^>]+>", "", (site / "guides" / "write-a-plugin" / "index.html").read_text()))
    assert "--8<--" not in guide, "a snippet was not included"
    assert "def pack_bits" in guide and "def row_topk_to_bitmask" in guide  # the example's code is shown


def test_every_hook_spec_is_documented() -> None:
    names = hook_spec_names()
    assert set(names) >= {"sten_register", "sten_resolve_op", "sten_convert", "sten_plugin_info"}
    guide = PLUGIN_GUIDE.read_text()
    api = (DOCS / "api.md").read_text()
    for name in names:
        assert f"### `{name}`" in guide, f"hook spec {name} has no section in the plugin guide"
        assert re.search(rf"\b{name}\b", api), f"hook spec {name} is missing from the API reference"


def test_public_api_is_documented() -> None:
    text = "\n".join(p.read_text() for p in DOCS.rglob("*.md"))
    missing = [name for name in sten.__all__ if not re.search(rf"\b{re.escape(name)}\b", text)]
    assert not missing, f"public names not mentioned anywhere in docs/: {missing}"


def test_nav_pages_exist() -> None:
    config = (ROOT / "mkdocs.yml").read_text()
    pages = re.findall(r":\s+([\w/-]+\.md)\s*$", config, re.M)
    assert "guides/write-a-plugin.md" in pages and "api.md" in pages
    missing = [page for page in pages if not (DOCS / page).is_file()]
    assert not missing, f"pages in the mkdocs nav that do not exist: {missing}"


def test_plugin_guide_includes_every_example_file() -> None:
    included = set(SNIPPET.findall(PLUGIN_GUIDE.read_text()))
    files = {str(p.relative_to(ROOT)) for p in EXAMPLE.rglob("*") if p.suffix in (".py", ".toml")
             and "__pycache__" not in p.parts and "build" not in p.parts}
    assert files, "the example plugin has no files"
    assert files == included, f"not shown in the guide: {files - included}; no such file: {included - files}"


@pytest.mark.parametrize("page", RUNNABLE)
def test_page_code_runs(page: str, restore_sten: None) -> None:
    if "sparsify-existing" in page:
        pytest.importorskip("transformers")
    blocks = python_blocks(DOCS / page)
    assert blocks, f"{page} has no ```python blocks"
    namespace: dict = {"__name__": f"docs_{page}"}
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)  # some pages show a fallback on purpose
        for i, block in enumerate(blocks):
            try:
                exec(compile(block, f"{page}[block {i}]", "exec"), namespace)
            except Exception as error:
                raise AssertionError(f"{page}, python block {i} failed: {error!r}\n{block}") from error
