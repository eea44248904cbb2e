"""How an operator's implementation hands back the gradient of one input.

A gradient is wanted either dense (``torch.Tensor``) or in a scipy layout at
the input's stored positions (the sampled gradient): ``sparse_grad`` builds
that from the values at the positions, never from a dense gradient when a
sampled kernel exists.

Example:
    >>> import torch
    >>> from sten_scipy import ScipyCsrTensor
    >>> w = ScipyCsrTensor.from_dense(torch.eye(2))
    >>> sparse_grad(w, ScipyCsrTensor, torch.tensor([5., 6.])).to_dense().tolist()
    [[5.0, 0.0], [0.0, 6.0]]
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from sten_core.plugin_api import KeepAll, SparseTensorWrapper

from .compressed import ScipyCompressed

DENSE_PAIR = (KeepAll, torch.Tensor)


def sparse_grad(layout: ScipyCompressed, want: type, values: torch.Tensor) -> SparseTensorWrapper:
    """A wrapper of layout ``want`` holding ``values`` at ``layout``'s positions."""
    obj = layout.with_values(values.to(layout.dtype).contiguous())
    if not isinstance(obj, want):
        obj = _convert(obj, want)
    return SparseTensorWrapper(obj)


def _convert(obj: ScipyCompressed, want: type) -> Any:
    from .conversions import csc_to_csr, csr_to_csc

    if want._major == 1:
        return csr_to_csc(obj)
    return csc_to_csr(obj)


def grad_of(wrapper: Any, want: type | None, dense: Callable[[], torch.Tensor],
            at_positions: Callable[[ScipyCompressed], torch.Tensor] | None = None) -> Any:
    """The gradient of input ``wrapper``: ``dense()`` when ``want`` is dense,
    else ``at_positions(layout)`` (default: ``layout.gather(dense())``) stored
    in ``want``."""
    if want is None or want is torch.Tensor:
        return dense()
    layout = wrapper.wrapped_tensor
    values = at_positions(layout) if at_positions is not None else layout.gather(dense())
    return sparse_grad(layout, want, values)


def wanted(pair: Any) -> type | None:
    """The layout of a ``(sparsifier class, format)`` grad pattern entry."""
    return None if pair is None else pair[1]
