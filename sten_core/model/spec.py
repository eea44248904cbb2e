"""The output spec: the 4-tuple that says how one operator output is sparsified.

``(inline_sparsifier, tmp_format, external_sparsifier, out_format)``: the inline
sparsifier may be fused into the operator's kernel and yields ``tmp_format``;
the external one turns that into ``out_format``.

Example:
    >>> import torch, sten_core as sten
    >>> OutputSpec.coerce((sten.KeepAll(), torch.Tensor, sten.KeepAll(), sten.CsrTensor)).out_format
    <class 'sten_core.builtin.torch_layouts.CsrTensor'>
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from sten_core.model.sparsifiers import KeepAll


class OutputSpec(NamedTuple):
    inline_sparsifier: Any
    tmp_format: type
    external_sparsifier: Any
    out_format: type

    @classmethod
    def coerce(cls, value: Any, name: str = "out_fmt") -> "OutputSpec":
        """Accept an ``OutputSpec`` or a 4-tuple; check its parts."""
        if isinstance(value, OutputSpec):
            return value
        if not isinstance(value, (tuple, list)) or len(value) != 4:
            raise ValueError(
                f"{name} must be a 4-tuple (inline_sparsifier, tmp_format, external_sparsifier, "
                f"out_format), got {value!r}"
            )
        inline, tmp, external, out = value
        for part, label in ((inline, "inline_sparsifier"), (external, "external_sparsifier")):
            if isinstance(part, type) or part is None:
                raise TypeError(f"{name}: {label} must be a sparsifier instance, got {part!r}")
        for part, label in ((tmp, "tmp_format"), (out, "out_format")):
            if not isinstance(part, type):
                raise TypeError(f"{name}: {label} must be a layout class, got {part!r}")
        return cls(inline, tmp, external, out)


DENSE = OutputSpec(KeepAll(), torch.Tensor, KeepAll(), torch.Tensor)


def coerce_specs(value: Any, name: str) -> tuple[OutputSpec, ...] | None:
    """A tuple of ``OutputSpec`` from one 4-tuple or a sequence of them."""
    if value is None:
        return None
    if isinstance(value, OutputSpec) or (
        isinstance(value, (tuple, list)) and len(value) == 4 and not isinstance(value[0], (tuple, list))
    ):
        return (OutputSpec.coerce(value, name),)
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"{name} must be a 4-tuple or a sequence of 4-tuples, got {value!r}")
    return tuple(OutputSpec.coerce(v, f"{name}[{i}]") for i, v in enumerate(value))
