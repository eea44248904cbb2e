"""An implementation's result checked against the operator's: the shapes and dtypes torch's own
op gives for the same arguments, found by running it on meta tensors (no data), once per
implementation and argument signature.

A plugin's ``F.linear`` returning ``[3, 5]`` where torch gives ``[3, 4]``, or an ``add`` of two
float32 tensors returning float16, reached the user as the operator's result and went wrong far
from its cause (broadcasting even hid the shape).

Checked: the first ``CHECKED_CALLS`` calls of each implementation registered by user code or by a
plugin outside this repository (the packages in ``TESTED_PACKAGES`` check theirs against dense in
their own suites), outside torch function modes, torch.func transforms and compilation (torch's meta
kernels import Dynamo on first use, which fails inside a mode). The first check in a process costs
that import (~1 s); a checked call, a few microseconds.

Example:
    >>> import torch
    >>> expected_result(torch.add, ((torch.ones(2, 3), torch.ones(3)), {}))
    ((torch.Size([2, 3]), torch.float32),)
"""

from __future__ import annotations

from typing import Any

import torch

from sten_core.model.registry import USER, registry
from sten_core.model.signatures import op_name
from sten_core.model.tensor import WRAPPER_TYPES, map_tensors
from sten_core.plugins import manager as plugins

TESTED_PACKAGES = frozenset({"sten_core", "sten_nm", "sten_scipy", "sten_cuda24"})
"""The packages of this repository: their implementations are not checked at run time."""

CHECKED_CALLS = 256
"""Calls checked per implementation and operator; later calls run unchecked (no per-call cost)."""

_expected: dict[Any, dict[tuple, Any]] = {}
"""operator -> {argument signature: ((shape, dtype), ...) of its result, or None (unknown)}"""
_calls: dict[tuple, int] = {}
"""(id of the implementation, operator) -> calls checked so far"""


def is_torch_op(op: Any) -> bool:
    """Whether ``op`` is torch's own (``torch.add``, ``Tensor.add``, ``F.linear``, an aten overload),
    which may run on meta tensors without side effects; a user's function is never run twice.

    >>> is_torch_op(torch.nn.functional.linear), is_torch_op(lambda x: x)
    (True, False)
    """
    if isinstance(op, torch._ops.OpOverload) or getattr(op, "__objclass__", None) is torch._C.TensorBase:
        return True
    module = getattr(op, "__module__", None) or ""
    return module == "torch" or module.startswith("torch.")


def signature(tree: Any) -> Any:
    """What decides an operator's result shapes and dtypes: each tensor's shape and dtype (a wrapper's
    read from its layout, not through ``__torch_function__``), the other arguments' values (their type
    where they are not plain values).

    >>> signature(((torch.ones(2), 1, [torch.ones(3, dtype=torch.int64)]), {"dim": 0}))
    ((((2,), torch.float32), 1, (((3,), torch.int64),)), (('dim', 0),))
    """
    if type(tree) in WRAPPER_TYPES:
        layout = tree.wrapped_tensor
        shape, dtype = getattr(layout, "shape", None), getattr(layout, "dtype", None)
        if shape is None or dtype is None:  # (the paper's layouts need neither)
            with torch._C.DisableTorchFunctionSubclass():
                shape, dtype = tree.shape, tree.dtype
        return (tuple(shape), dtype)
    if isinstance(tree, torch.Tensor):
        return (tuple(tree.shape), tree.dtype)
    if isinstance(tree, (list, tuple)):
        return tuple(signature(v) for v in tree)
    if isinstance(tree, dict):
        return tuple((k, signature(v)) for k, v in tree.items())
    if tree is None or isinstance(tree, (bool, int, float, complex, str, torch.dtype, torch.device,
                                          torch.memory_format, torch.layout)) or tree is Ellipsis:
        return tree
    if isinstance(tree, slice):
        return ("slice", signature(tree.start), signature(tree.stop), signature(tree.step))
    return type(tree)


def _meta(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


def expected_result(op: Any, call_args: tuple) -> tuple | None:
    """``((shape, dtype), ...)`` of what ``op(*args, **kwargs)`` returns, run on meta tensors; ``None``
    where torch cannot tell without data (``nonzero``), or the call fails on meta."""
    args, kwargs = call_args
    try:
        out = op(*map_tensors(_meta, args), **map_tensors(_meta, kwargs))
    except Exception:
        return None
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if not all(isinstance(o, torch.Tensor) for o in outs):
        return None
    return tuple((o.shape, o.dtype) for o in outs)


def checks(key: Any) -> bool:
    """Whether the results of the implementation registered for ``key`` are checked: it is user code's
    or a plugin's outside ``TESTED_PACKAGES``.

    >>> plugins.ensure_loaded()
    >>> checks(next(key for key in registry.impls if registry.owner_of("impls", key) == "builtin"))
    False
    """
    owner = registry.owner_of("impls", key)
    if owner is None or owner == USER:
        return True
    plugin = plugins.get_plugin_manager().get_plugin(owner)
    module = getattr(plugin, "__name__", None) or type(plugin).__module__
    return module.split(".")[0] not in TESTED_PACKAGES


def check_result(fn: Any, key: Any, op: Any, call_args: tuple, raw: Any) -> None:
    """Raise a ``ValueError`` naming implementation ``fn`` (registered for the ``OpKey`` ``key``) where its
    result ``raw`` has other shapes or dtypes than ``op`` gives for ``call_args`` (under autocast only
    shapes are compared: an implementation may follow it where meta tensors do not)."""
    counted = (id(fn), op)
    calls = _calls.get(counted, 0)
    if calls >= CHECKED_CALLS or torch.compiler.is_compiling() or torch._C._is_torch_function_mode_enabled() \
            or torch._C._len_torch_dispatch_stack() or torch._C._functorch.peek_interpreter_stack() is not None:
        return
    _calls[counted] = calls + 1
    known = _expected.setdefault(op, {})
    try:
        shapes = signature(call_args)
        expected = known[shapes] if shapes in known else known.setdefault(shapes, expected_result(op, call_args))
    except TypeError:  # an argument that is not hashable: not checked
        return
    if expected is None:
        return
    outs = raw if isinstance(raw, (tuple, list)) else (raw,)
    got = tuple((getattr(o, "shape", None), getattr(o, "dtype", None)) for o in outs)
    autocast = torch._C._is_any_autocast_enabled()
    if len(got) == len(expected) and all(
            g[0] == e[0] and (autocast or g[1] == e[1]) for g, e in zip(got, expected)):
        return
    raise ValueError(
        f"the implementation {op_name(fn)} of {key.describe()} returned {_describe(got)} where {op_name(op)} gives "
        f"{_describe(expected)} for these arguments: an implementation returns what the operator returns "
        "(its shape and dtype)")


def _describe(results: tuple) -> str:
    parts = [f"shape {tuple(shape) if shape is not None else None} {str(dtype).replace('torch.', '')}"
             for shape, dtype in results]
    return parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"
