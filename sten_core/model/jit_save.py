"""``torch.jit.save`` of a scripted module that holds sparse wrappers: a clear error, not a crash.

``torch.jit.script`` and ``torch.jit.freeze`` take a module with sparse weights and run it
correctly (each call reaches the wrapper's ``__torch_dispatch__``), but TorchScript's serializer
copies every tensor's storage, and a wrapper has none (its values live in its layout object):
saving read a null data pointer and killed the process with a segmentation fault. ``install``
wraps the save methods of ``torch.jit.RecursiveScriptModule`` so that they raise a
``NotImplementedError`` naming the first sparse tensor found (a parameter, a buffer or a frozen
constant) before the serializer runs; modules without sparse wrappers save as before.

Example:
    >>> import io, torch, sten_core as sten
    >>> m = torch.nn.Linear(4, 4)
    >>> m.weight = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.eye(4)))
    >>> torch.jit.save(torch.jit.script(m), io.BytesIO())
    Traceback (most recent call last):
    ...
    NotImplementedError: STen: torch.jit.save of a scripted module holding sparse tensors is not supported ...
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator, Optional

import torch

SAVE_METHODS = ("save", "save_to_buffer", "_save_for_lite_interpreter", "_save_to_buffer_for_lite_interpreter")
"""The methods of ``RecursiveScriptModule`` through which ``torch.jit.save`` and the lite
interpreter's export reach the serializer."""


def _tensors(module: Any) -> Iterator[tuple[str, Any]]:
    """``(name, value)`` of a scripted module's parameters, buffers and (frozen) constants."""
    yield from module.named_parameters()
    yield from module.named_buffers()
    for prefix, sub in module.named_modules():
        try:
            constants = sub.code_with_constants[1].const_mapping
        except (AttributeError, RuntimeError):  # no forward, or not a scripted module
            continue
        for name, value in constants.items():
            yield (f"{prefix}.{name}" if prefix else name), value


def first_sparse(module: Any) -> Optional[tuple[str, Any]]:
    """The first sparse wrapper a scripted ``module`` holds, as ``(name, wrapper)``, or ``None``."""
    from sten_core.model.tensor import SparseTensorWrapper

    for name, value in _tensors(module):
        if isinstance(value, SparseTensorWrapper):
            return name, value
    return None


def _refusing(save: Callable) -> Callable:
    @functools.wraps(save)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        found = first_sparse(self)
        if found is not None:
            name, value = found
            raise NotImplementedError(
                "STen: torch.jit.save of a scripted module holding sparse tensors is not supported "
                f"({name!r} is a {type(value.wrapped_tensor).__name__}): TorchScript writes each tensor's "
                "storage, and a sparse wrapper keeps its values in its layout. Save the eager model's "
                "state_dict with torch.save (sparse checkpoints load back sparse), or script and save the "
                "dense model (sten_core.densify_state_dict)."
            )
        return save(self, *args, **kwargs)

    guarded.__sten_guard__ = True  # type: ignore[attr-defined]
    return guarded


def install() -> None:
    """Wrap ``RecursiveScriptModule``'s save methods (once; those a torch lacks are skipped)."""
    cls = getattr(torch.jit, "RecursiveScriptModule", None)
    for name in SAVE_METHODS:
        save = getattr(cls, name, None) if cls is not None else None
        if callable(save) and not getattr(save, "__sten_guard__", False):
            setattr(cls, name, _refusing(save))
