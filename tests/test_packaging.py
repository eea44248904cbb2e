"""Every package (the core, each plugin, the example plugin) is a distribution users can install:
SPDX license metadata with the license file beside it, a build that needs no torch, and a
dependency on the core that the core's own name and version satisfy.

The wheels themselves are built and installed by ``make wheel-test`` (run by CI).
"""

from __future__ import annotations

import pathlib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ImportError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROJECTS = sorted(p.parent for p in [ROOT / "pyproject.toml", *ROOT.glob("plugins/*/pyproject.toml"),
                                     *ROOT.glob("examples/*/pyproject.toml")])
PLUGINS = [p for p in PROJECTS if p != ROOT]
LICENSE = (ROOT / "LICENSE").read_text()


def project(path: pathlib.Path) -> dict:
    return tomllib.loads((path / "pyproject.toml").read_text())


def label(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT)) if path != ROOT else "core"


CORE = project(ROOT)["project"]


def test_every_package_is_found():
    names = {project(p)["project"]["name"] for p in PROJECTS}
    assert {"sten-core", "sten-nm", "sten-scipy", "sten-cuda24", "sten-example-plugin"} <= names


def test_the_license_is_bsd_3_clause():
    assert LICENSE.startswith("BSD 3-Clause License")


@pytest.mark.parametrize("path", PROJECTS, ids=label)
def test_spdx_license_and_its_file(path):
    meta = project(path)["project"]
    assert meta.get("license") == "BSD-3-Clause", "license must be an SPDX expression string"
    assert meta.get("license-files") == ["LICENSE"]
    assert (path / "LICENSE").read_text() == LICENSE, "each package ships the repository's LICENSE"


@pytest.mark.parametrize("path", PROJECTS, ids=label)
def test_builds_without_torch(path):
    build = project(path)["build-system"]
    assert build["build-backend"] == "setuptools.build_meta"
    names = {canonicalize_name(Requirement(r).name) for r in build["requires"]}
    assert names <= {"setuptools", "wheel"}, f"build requirements {sorted(names)}: torch is not needed to build"
    setuptools = next(Requirement(r) for r in build["requires"] if Requirement(r).name == "setuptools")
    assert not setuptools.specifier.contains("76.9"), "SPDX `license` strings need setuptools >= 77"


@pytest.mark.parametrize("path", PLUGINS, ids=label)
def test_plugin_depends_on_the_core_it_is_built_with(path):
    deps = [Requirement(r) for r in project(path)["project"]["dependencies"]]
    core = [r for r in deps if canonicalize_name(r.name) == canonicalize_name(CORE["name"])]
    assert core, f"{label(path)} does not depend on {CORE['name']}"
    assert core[0].specifier.contains(CORE["version"]), \
        f"{label(path)} asks for {core[0]}, the core is {CORE['name']} {CORE['version']}"
    assert "sten" in project(path)["project"]["entry-points"], "a plugin is found through the `sten` entry-point group"
