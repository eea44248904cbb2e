"""A fingerprint of the code a compiled graph depends on, for torch's on-disk caches.

AOTAutograd's cache keys a traceable wrapper input by its metadata
(``_stable_hash_for_caching``); it knows nothing of the layout's or STen's code, so a
cache entry written by another version of a layout's ``__tensor_unflatten__`` or of a
plugin's operators would be reused. The fingerprint of a package (the sizes and
modification times of its source files, read once per process) goes into that key.

Example:
    >>> len(package_fingerprint("sten_core"))
    32
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os

SOURCE_SUFFIXES = (".py", ".c", ".h", ".cu", ".so", ".pyd", ".dll", ".dylib")


@functools.lru_cache(maxsize=None)
def package_fingerprint(package: str) -> str:
    """A hex digest of the top-level ``package`` (a dotted name counts as its first part):
    each source file's relative path, size and modification time (an edit or another
    version changes it). Walked once per process and package."""
    top = package.split(".")[0]
    if top != package:
        return package_fingerprint(top)
    spec = importlib.util.find_spec(top)
    digest = hashlib.blake2b(top.encode(), digest_size=16)
    roots = list(spec.submodule_search_locations or []) if spec else []
    if spec and spec.origin and not roots:
        roots = [os.path.dirname(spec.origin)]
    for root in sorted(roots):
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
            for name in sorted(files):
                if name.endswith(SOURCE_SUFFIXES):
                    path = os.path.join(folder, name)
                    stat = os.stat(path)
                    digest.update(f"{os.path.relpath(path, root)}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return digest.hexdigest()
