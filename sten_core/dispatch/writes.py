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

from sten_core.model.tensor import SparseTensorWrapper, densify, map_tensors, write_back


def run_dense_in_place(op: Any, args: tuple, kwargs: dict) -> Any:
    """``op`` on dense copies of the call's wrappers (one copy per wrapper, so aliasing is
    as in dense: ``torch.add(a, b, out=a)``); each wrapper whose copy the op changed gets
    the result at its stored positions. Changes are found by comparing each copy with a
    snapshot: version counters miss the fused optimizer kernels (``torch._fused_adam_``
    writes its lists without bumping them). Returns ``op``'s result with each copy
    replaced by its wrapper (``add_`` and ``out=`` return their target, as in torch)."""
    copies: dict[int, tuple] = {}

    def dense(tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, SparseTensorWrapper):
            return tensor
        hit = copies.get(id(tensor))
        if hit is None:
            d = densify(tensor)
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


def store_result(target: torch.Tensor, value: Any) -> torch.Tensor:
    """An out-of-place implementation's ``value`` written into the call's ``target`` (a
    wrapper: at its stored positions; a dense tensor: resized and copied, as ``out=``)."""
    dense = densify(value)
    if isinstance(target, SparseTensorWrapper):
        return write_back(target, dense)
    if target.shape != dense.shape:
        target.resize_(dense.shape)
    return target.copy_(dense)
