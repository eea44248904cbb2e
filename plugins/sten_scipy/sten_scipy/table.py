"""Where an operator implementation is registered.

Most go straight into the core's registry. Operators whose natural result is
sparse (sparse + sparse, sparse * dense, transpose) keep their *dense-output*
variant out of the registry, because the core prefers a registered dense-output
implementation for calls that give no output format; those variants, and the
natural default of such calls, are served by this plugin's ``sten_resolve_op``.

Example:
    >>> import torch
    >>> table = OpTable()
    >>> table.default(torch.mul, (object,), ((object, object),))
    >>> table.defaults[(torch.mul, (object,))]
    ((<class 'object'>, <class 'object'>),)
"""

from __future__ import annotations

from typing import Any, Callable

from sten_core.plugin_api import Entry, OpKey, entry_for, normalize_inp, normalize_out_pairs


class OpTable:
    """The hook-served implementations and the default outputs of implicit calls."""

    def __init__(self) -> None:
        self.defaults: dict[tuple, tuple] = {}
        self.hooked: dict[tuple, Entry] = {}

    def clear(self) -> None:
        self.defaults.clear()
        self.hooked.clear()

    def default(self, op: Any, inp: tuple, out: tuple) -> None:
        """Calls of ``op`` on ``inp`` without an output format produce ``out``."""
        self.defaults[(op, normalize_inp(inp, op))] = normalize_out_pairs(out)

    def hook(self, op: Any, inp: tuple, out: Any, fn: Callable) -> None:
        """Serve ``fn`` for an explicit ``out`` through ``sten_resolve_op``."""
        self.hooked[(op, normalize_inp(inp, op), normalize_out_pairs(out))] = entry_for(fn, inp)

    def resolve(self, key: OpKey, registry: Any) -> Entry | None:
        if key.direction != "fwd":
            return None
        out = key.out
        if out is None:
            out = self.defaults.get((key.op, key.inp))
            if out is None:
                return None
        found = self.hooked.get((key.op, key.inp, out))
        return found if found is not None else registry.impls.get(key._replace(out=out))


TABLE = OpTable()
