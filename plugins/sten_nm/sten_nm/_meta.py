"""The n:m layouts on PyTorch's meta device (shapes and dtypes, no data).

A layout moves there and back with ``.to("meta")`` / ``Module.to_empty(device="cpu")``
and keeps its class; on meta, ``to_dense()``, ``mask()``, the stored-values protocol and
the products give meta tensors of the right shape and dtype (torch operations, never the C
kernels, which :func:`sten_nm._kernel.ptr` refuses meta tensors). The layouts' ``empty_like``
(what the core's ``torch.empty_like`` of a wrapper, and so ``to_empty``, calls) keeps the
pattern with zero values where it has data, and from the meta device gives a valid default
pattern (the one ``from_dense`` picks for an all-zero tensor), for the caller to fill.

What the meta device cannot give: a layout rebuilt by ``torch.load(map_location="meta")``,
whose pattern parameters (``n``, ``m``, ...) are saved as tensor data (:func:`read_params`).

Example:
    >>> import torch, sten_core as sten
    >>> from sten_nm import NMTensor
    >>> w = sten.SparseTensorWrapper(NMTensor.from_dense(torch.randn(4, 8), 2, 4)).to("meta")
    >>> d = w.to_dense()
    >>> d.device.type, tuple(d.shape)
    ('meta', (4, 8))
    >>> e = torch.empty_like(w, device="cpu")
    >>> type(e.wrapped_tensor).__name__, bool(((e.to_dense() != 0).reshape(4, 2, 4).sum(-1) <= 2).all())
    ('NMTensor', True)
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch


def read_params(params: torch.Tensor, layout: str, names: str) -> list[int]:
    """The integer pattern parameters (``names``, e.g. ``"n, m, dim"``) that ``layout`` saves as
    one tensor; a ``NotImplementedError`` naming the layout when the tensor is on the meta device
    (``torch.load(map_location="meta")`` reads no data, so they are unknown).

    >>> read_params(torch.tensor([2, 4, 1]), "NMTensor", "n, m, dim")
    [2, 4, 1]
    """
    if params.is_meta:
        raise NotImplementedError(
            f"{layout} cannot be rebuilt on the meta device: its pattern parameters ({names}) are saved as "
            f"tensor data, which torch.load(..., map_location='meta') does not read. Load with "
            f"map_location='cpu' and move it with .to('meta'), or build the model on the meta device "
            f"and load the checkpoint with load_state_dict(..., assign=True)")
    return [int(v) for v in params.tolist()]


def empty_layout(layout: Any, device: Any, dtype: Optional[torch.dtype],
                 default: Callable[[torch.Tensor], Any]) -> Any:
    """``torch.empty_like`` of an n:m ``layout`` on ``device`` in ``dtype`` (``None``: its own):
    its pattern with zero values, or, from the meta device to one with data, ``default(zeros)``:
    the layout ``from_dense`` builds of an all-zero tensor (a valid pattern, zero values)."""
    device = layout.device if device is None else torch.device(device)
    dtype = layout.dtype if dtype is None else dtype
    if layout.device.type == "meta" and device.type != "meta":
        return default(torch.zeros(tuple(layout.shape), dtype=dtype, device=device))
    moved = layout.to(device=device, dtype=dtype)
    return moved.with_values(torch.zeros_like(moved.values()))
