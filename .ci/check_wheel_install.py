"""Check a wheel install before its tests run: the core and PLUGIN come from the venv's
site-packages (not the source tree), the plugin's ``sten`` entry points load and report
themselves available (for sten_nm: its C kernel was built into the wheel and loads).

Usage (with the wheel venv's python, from outside the repository):
    python check_wheel_install.py sten_nm
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import json
import pathlib
import subprocess
import sys
import sysconfig


def main(plugin: str) -> None:
    site = pathlib.Path(sysconfig.get_paths()["purelib"]).resolve()
    platsite = pathlib.Path(sysconfig.get_paths()["platlib"]).resolve()
    for name in ("sten_core", plugin):
        where = pathlib.Path(importlib.import_module(name).__file__).resolve()
        if site not in where.parents and platsite not in where.parents:
            sys.exit(f"{name} was imported from {where}, not from the wheel install in {site}")
        print(f"{name} {md.version(name)} from {where.parent}")
    names = {ep.name for ep in md.distribution(plugin).entry_points if ep.group == "sten"}
    if not names:
        sys.exit(f"{plugin} declares no `sten` entry point")
    sten = pathlib.Path(sys.executable).parent / "sten"
    report = json.loads(subprocess.run([str(sten), "plugins"], check=True, capture_output=True, text=True).stdout)
    for entry in report:
        if entry["name"] in names:
            if not entry["available"]:
                sys.exit(f"plugin {entry['name']} is installed but unavailable: {entry['reason']}")
            print(f"plugin {entry['name']}: available, layouts {', '.join(entry['layouts'])}")
    missing = names - {entry["name"] for entry in report}
    if missing:
        sys.exit(f"`sten plugins` does not list {', '.join(sorted(missing))}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
