"""The examples in the core's docstrings run and print what they say."""

import doctest
import importlib
import pkgutil

import pytest

import sten_core

MODULES = sorted(
    name for _, name, _ in pkgutil.walk_packages(sten_core.__path__, "sten_core.")
    if not name.startswith(("sten_core.tools.bench", "sten_core.tools.cli", "sten_core.tools.demo"))
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
