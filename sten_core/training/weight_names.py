"""The error for a weight name that is not one of the model's parameters, saying what
the name is instead (a buffer, a submodule, another attribute) and what to do.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> print(unknown_weight(model, "0"))
    unknown weight '0': it names a submodule (Linear), not a parameter; its parameters are '0.weight', '0.bias'
"""

from __future__ import annotations

import torch


def unknown_weight(model: torch.nn.Module, name: object) -> ValueError:
    """A ``ValueError`` for ``name``, which is not a parameter of ``model``."""
    prefix = f"unknown weight {name!r}"
    if not isinstance(name, str):
        return ValueError(f"{prefix}: a weight is named by a string such as 'fc.weight'")
    path, _, attr = name.rpartition(".")
    owner = _submodule(model, path)
    if name and _submodule(model, name) is not None:
        inside = [f"'{name}.{p}'" for p, _ in _submodule(model, name).named_parameters()]
        listed = f"its parameters are {', '.join(inside)}" if inside else "it has no parameters"
        return ValueError(f"{prefix}: it names a submodule ({type(_submodule(model, name)).__name__}), not a "
                          f"parameter; {listed}")
    if owner is not None and attr in owner._buffers:
        return ValueError(f"{prefix}: it names a buffer, not a parameter (the builder and schedules sparsify "
                          "parameters); make it an nn.Parameter, or store it with sten.sparsify")
    if owner is not None and hasattr(owner, attr):
        return ValueError(f"{prefix}: it names an attribute of type {type(getattr(owner, attr)).__name__}, not a "
                          f"parameter; the model's parameters are: {', '.join(dict(model.named_parameters()))}")
    return ValueError(f"{prefix}; the model's parameters are: {', '.join(dict(model.named_parameters()))}")


def _submodule(model: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None
