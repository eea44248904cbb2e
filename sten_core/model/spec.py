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

from sten_core.model.layouts import Layout
from sten_core.model.sparsifiers import NOT_SPARSIFIERS, KeepAll


#: what is never a sparsifier instance: ``NOT_SPARSIFIERS``, and containers (a spec given one level too deep)
_NOT_INSTANCES = NOT_SPARSIFIERS + (tuple, list, dict, set)


def check_sparsifier(value: Any, name: str) -> Any:
    """``value`` if it can be a sparsifier, else a ``TypeError`` naming ``name``.

    A sparsifier is any object whose class has implementations
    (``register_sparsifier_implementation``): the built-in ones derive from
    ``Sparsifier``, user-defined ones may be plain classes (the paper's
    ``MyRandomFractionSparsifier``). Rejected: ``None``, a class instead of an
    instance, numbers, strings, tensors and containers.

    Example:
        >>> check_sparsifier(0.9, "inline_sparsifier")
        Traceback (most recent call last):
        ...
        TypeError: inline_sparsifier must be a sparsifier instance (e.g. sten.ScalarFractionSparsifier(0.9)), got 0.9 (float)
    """
    if value is None or isinstance(value, type) or isinstance(value, _NOT_INSTANCES):
        what = "a class; pass an instance" if isinstance(value, type) else type(value).__name__
        raise TypeError(f"{name} must be a sparsifier instance (e.g. sten.ScalarFractionSparsifier(0.9)), "
                        f"got {value!r} ({what})")
    return value


def is_layout_class(value: Any) -> bool:
    """Whether ``value`` is a layout class: ``torch.Tensor`` (dense, or a subclass),
    a ``Layout`` subclass, or any class with ``to_dense`` (registered layouts must
    have it; an unregistered one such as the paper's ``MyCscTensor`` too).

    Example:
        >>> import sten_core as sten
        >>> is_layout_class(sten.CsrTensor), is_layout_class(int), is_layout_class(sten.KeepAll)
        (True, False, False)
    """
    if not isinstance(value, type):
        return False
    if issubclass(value, (torch.Tensor, Layout)):
        return True
    return callable(getattr(value, "to_dense", None)) and not issubclass(value, torch.nn.Module)


def check_layout(value: Any, name: str) -> type:
    """``value`` if it is a layout class (``is_layout_class``), else a ``TypeError`` naming ``name``."""
    if not is_layout_class(value):
        got = f"the class {value.__name__}, which is not a layout" if isinstance(value, type) else repr(value)
        raise TypeError(f"{name} must be a layout class (torch.Tensor, sten.CsrTensor, a registered layout or "
                        f"any class with from_dense/to_dense), got {got}")
    return value


class OutputSpec(NamedTuple):
    inline_sparsifier: Any
    tmp_format: type
    external_sparsifier: Any
    out_format: type

    @property
    def keeps_all(self) -> bool:
        """Whether neither sparsifier drops anything (both ``KeepAll``): the spec only changes
        the format.

        >>> DENSE.keeps_all
        True
        """
        return isinstance(self.inline_sparsifier, KeepAll) and isinstance(self.external_sparsifier, KeepAll)

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
        check_sparsifier(inline, f"{name}: inline_sparsifier")
        check_layout(tmp, f"{name}: tmp_format")
        check_sparsifier(external, f"{name}: external_sparsifier")
        check_layout(out, f"{name}: out_format")
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
