"""The numeric kernels behind the operators: scipy sparse × dense products
and sampled dense products (a dense product's values at a sparse pattern).

All take and return torch tensors; the scipy calls see numpy views of them,
so no copies are made beyond the ones scipy itself needs.

Example:
    >>> import torch
    >>> from sten_scipy import ScipyCsrTensor
    >>> w = ScipyCsrTensor.from_dense(torch.eye(2))
    >>> sparse_times_dense(w, torch.ones(2, 3)).tolist()
    [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
"""

from __future__ import annotations

from typing import Any

import torch

from sten_core.plugin_api import SparseTensorWrapper

from .compressed import ScipyCompressed


def sparse_times_dense(a: ScipyCompressed, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for sparse ``a`` [M, K] and dense ``b`` [K, N] or [K]."""
    return torch.from_numpy(a.data @ b.numpy())


def dense_times_sparse(x: torch.Tensor, a: ScipyCompressed) -> torch.Tensor:
    """``x @ a`` for dense ``x`` [N, M] and sparse ``a`` [M, K], as ``(aᵀ xᵀ)ᵀ`` (the transpose of a
    scipy array is O(1)), made contiguous as dense products are (``y.view(...)`` works on it)."""
    return torch.from_numpy(a.data.T @ x.t().numpy()).t().contiguous()


def sampled(layout: ScipyCompressed, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Values of ``a @ b`` (``a`` [M, N], ``b`` [N, K]) at the stored positions
    of ``layout`` [M, K], in its storage order, without forming ``a @ b``."""
    if layout._major == 1:  # CSC of [M, K] is the CSR of its transpose [K, M]
        return _sampled_csr(layout, b.t(), a.t(), (layout.shape[1], layout.shape[0]))
    return _sampled_csr(layout, a, b, tuple(layout.shape))


def _sampled_csr(layout: ScipyCompressed, a: torch.Tensor, b: torch.Tensor, shape: tuple) -> torch.Tensor:
    indptr, indices = layout.index_arrays()
    pattern = torch.sparse_csr_tensor(indptr, indices, torch.zeros(indices.numel(), dtype=a.dtype), shape,
                                      check_invariants=False)
    return torch.sparse.sampled_addmm(pattern, a.contiguous(), b.contiguous(), beta=0.0).values()


def scatter_dense(layout: ScipyCompressed, values: torch.Tensor) -> torch.Tensor:
    """A dense tensor with ``values`` at ``layout``'s positions, zeros elsewhere."""
    rows, cols = layout.coords()
    out = torch.zeros(tuple(layout.shape), dtype=values.dtype)
    out[rows, cols] = values
    return out


def dense_of(value: Any) -> Any:
    """A wrapper's dense tensor; tensors and scalars unchanged."""
    return value.to_dense() if isinstance(value, SparseTensorWrapper) else value


def reduce_to(grad: torch.Tensor, shape: tuple) -> torch.Tensor:
    """Sum a broadcast gradient back to ``shape``."""
    shape = tuple(shape)
    if tuple(grad.shape) == shape:
        return grad
    lead = grad.dim() - len(shape)
    grad = grad.sum(dim=tuple(range(lead))) if lead > 0 else grad
    dims = tuple(i for i, s in enumerate(shape) if s == 1 and grad.shape[i] != 1)
    return grad.sum(dim=dims, keepdim=True) if dims else grad
