"""In-place calls on wrappers without an in-place implementation: what the call wrote
into (its first argument, ``out=``, the tensors of ``_foreach_mul_``'s or
``_fused_adam_``'s lists) is found by comparing the dense copies the op ran on with
snapshots, and written back into those wrappers at their stored positions
(``write_back``). Writing back only the first argument lost writes through ``out=``
and into tensor lists (foreach and fused optimizers left sparse weights unchanged).

Example:
    >>> import torch, sten_core as sten
    >>> a = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(2)))
    >>> with sten.dispatch.quiet_fallbacks():
    ...     _ = torch.mul(torch.full((2, 2), 3.0), 2.0, out=a)
    >>> a.to_dense().tolist()
    [[6.0, 0.0], [0.0, 6.0]]
"""

from __future__ import annotations

from typing import Any

import torch

from sten_core.dispatch.errors import fail
from sten_core.model.layouts import builds_from_dense, to_dense_tensor
from sten_core.model.tensor import SparseTensorWrapper, densify, map_tensors, rebuild_seq, write_back


def run_dense_in_place(op: Any, args: tuple, kwargs: dict) -> Any:
    """``op`` on dense copies of the call's wrappers (one copy per wrapper, so aliasing is
    as in dense: ``torch.add(a, b, out=a)``); each wrapper whose copy the op changed gets
    the result at its stored positions. Changes are found by comparing each copy with a
    snapshot: version counters miss the fused optimizer kernels (``torch._fused_adam_``
    writes its lists without bumping them). Returns ``op``'s result with each copy
    replaced by its wrapper (``add_`` and ``out=`` return their target, as in torch). The copies
    are contiguous: torch's CPU fused optimizer kernels read their lists as contiguous whatever
    the strides (scipy CSC's column-major ``to_dense()`` was updated at transposed positions)."""
    copies: dict[int, tuple] = {}

    def dense(tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, SparseTensorWrapper):
            return tensor
        hit = copies.get(id(tensor))
        if hit is None:
            d = densify(tensor).contiguous()
            hit = copies[id(tensor)] = (tensor, d, d.clone())
        return hit[1]

    dense_args, dense_kwargs = map_tensors(dense, (args, kwargs))
    raw = op(*dense_args, **dense_kwargs)
    back = {}
    for wrapper, d, before in copies.values():
        if not torch.equal(d, before):
            write_back(wrapper, d)
        back[id(d)] = wrapper
    return map_tensors(lambda t: back.get(id(t), t), raw)


def into_target(raw: Any, kwargs: dict, bound: list) -> Any:
    """An implementation's result written into what the call names as its target
    (``out=``, or the first argument with ``inplace=True``) when the implementation
    computed it out of place; other calls' results as they are."""
    if not kwargs:
        return raw
    target = kwargs.get("out")
    if target is None and kwargs.get("inplace") is True:
        target = bound[0]
    if target is None or raw is target:
        return raw
    if isinstance(target, (tuple, list)):
        return rebuild_seq(target, [t if v is t else store_result(t, v) for t, v in zip(target, raw)])
    return store_result(target, raw)


def store_result(target: torch.Tensor, value: Any) -> torch.Tensor:
    """An out-of-place implementation's ``value`` written into the call's ``target`` (a
    wrapper: at its stored positions; a dense tensor: resized and copied, as ``out=``)."""
    dense = densify(value)
    if isinstance(target, SparseTensorWrapper):
        return write_back(target, dense)
    if target.shape != dense.shape:
        target.resize_(dense.shape)
    return target.copy_(dense)


def accumulate(target: SparseTensorWrapper, new: torch.Tensor) -> SparseTensorWrapper:
    """Autograd's ``grad += new`` into a wrapper whose pattern ``new`` does not share (two
    backward calls whose ``grad_fmt`` re-sparsifies the gradient): the exact sum, in
    ``target``'s layout rebuilt from it where that layout stores every nonzero of the sum
    (CSR, COO: the union of the patterns); otherwise (an n:m gradient cannot hold the
    union) at ``target``'s stored positions, warned as a lossy step. Keeping the pattern
    silently dropped ``new``'s values outside it."""
    dense = densify(target) + densify(new)
    layout_cls = type(target.wrapped_tensor)
    if builds_from_dense(layout_cls):
        try:
            rebuilt = layout_cls.from_dense(dense)
        except (ValueError, TypeError, RuntimeError):
            rebuilt = None
        if rebuilt is not None and torch.count_nonzero(to_dense_tensor(rebuilt)) == torch.count_nonzero(dense):
            target.wrapped_tensor = rebuilt
            return target
    fail(f"Lossy gradient accumulation: the {layout_cls.__name__} gradient already in .grad and the new one have "
         f"different patterns, and {layout_cls.__name__} cannot store their sum's pattern, so the sum was kept at "
         f".grad's stored positions. Call zero_grad() between backward calls, or use a grad_fmt that keeps the "
         f"weight's pattern (or a layout such as CsrTensor that can hold any pattern)",
         ("lossy accumulation", layout_cls))
    return write_back(target, dense)
