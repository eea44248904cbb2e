"""Lossless conversions between the scipy layouts and the core's torch-native
``CsrTensor`` / ``CscTensor`` / ``CooTensor``.

Each conversion keeps the stored pattern (explicit zeros included) and dtype;
values are copied, so the two layouts never alias.

Example:
    >>> import torch, sten_core as sten
    >>> from sten_scipy import ScipyCsrTensor
    >>> x = ScipyCsrTensor.from_dense(torch.eye(2))
    >>> csr_to_torch(x).data.layout
    torch.sparse_csr
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from sten_core.plugin_api import CooTensor, CscTensor, CsrTensor

from ._checks import SUPPORTED, TORCH_TO_NUMPY
from .compressed import ScipyCompressed
from .csc import ScipyCscTensor
from .csr import ScipyCsrTensor


def _torch_parts(x: ScipyCompressed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    indptr, indices = x.index_arrays()
    return indptr.long(), indices.long(), x.values().clone()


def csr_to_torch(x: ScipyCsrTensor) -> CsrTensor:
    """``ScipyCsrTensor`` → the core's ``CsrTensor`` (int64 indices)."""
    crow, col, values = _torch_parts(x)
    return CsrTensor(torch.sparse_csr_tensor(crow, col, values, x.shape, check_invariants=False))


def csc_to_torch(x: ScipyCscTensor) -> CscTensor:
    """``ScipyCscTensor`` → the core's ``CscTensor`` (int64 indices)."""
    ccol, row, values = _torch_parts(x)
    return CscTensor(torch.sparse_csc_tensor(ccol, row, values, x.shape, check_invariants=False))


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().numpy()


def _values(t: torch.Tensor, target: type) -> np.ndarray:
    """The stored values as numpy, or the layout's dtype error (numpy said "Got unsupported
    ScalarType BFloat16")."""
    if t.dtype not in TORCH_TO_NUMPY:
        raise TypeError(f"{target.__name__}: dtype must be {SUPPORTED}, got {t.dtype} (convert the tensor "
                        "with .float() first)")
    return _numpy(t)


def torch_csr_to_scipy(x: CsrTensor) -> ScipyCsrTensor:
    """The core's ``CsrTensor`` → ``ScipyCsrTensor``."""
    data = x.data
    return ScipyCsrTensor.from_parts(_values(data.values(), ScipyCsrTensor).copy(), _numpy(data.col_indices()).copy(),
                                     _numpy(data.crow_indices()).copy(), tuple(data.shape))


def torch_csc_to_scipy(x: CscTensor) -> ScipyCscTensor:
    """The core's ``CscTensor`` → ``ScipyCscTensor``."""
    data = x.data
    return ScipyCscTensor.from_parts(_values(data.values(), ScipyCscTensor).copy(), _numpy(data.row_indices()).copy(),
                                     _numpy(data.ccol_indices()).copy(), tuple(data.shape))


def to_coo(x: ScipyCompressed) -> CooTensor:
    """A scipy layout → the core's (coalesced) ``CooTensor``."""
    rows, cols = x.coords()
    coo = torch.sparse_coo_tensor(torch.stack([rows, cols]), x.values().clone(), x.shape, check_invariants=False)
    return CooTensor(coo.coalesce())


def from_coo(target: type) -> Callable[[CooTensor], ScipyCompressed]:
    """The core's 2-D ``CooTensor`` → ``target`` (a scipy layout)."""

    def convert(x: CooTensor) -> ScipyCompressed:
        if x.data.dim() != 2:
            raise ValueError(f"{target.__name__}: a CooTensor must be 2-D to convert, got shape {tuple(x.shape)}")
        coo = x.data.coalesce()
        (rows, cols), values = coo.indices(), coo.values()
        major, minor = (rows, cols) if target._major == 0 else (cols, rows)
        order = torch.argsort(major * coo.shape[1 - target._major] + minor) if target._major == 1 else None
        if order is not None:
            major, minor, values = major[order], minor[order], values[order]
        counts = torch.bincount(major, minlength=coo.shape[target._major])
        indptr = torch.zeros(counts.numel() + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=indptr[1:])
        return target.from_parts(_values(values, target).copy(), _numpy(minor).copy(), _numpy(indptr), tuple(coo.shape))

    return convert


def csr_to_csc(x: ScipyCsrTensor) -> ScipyCscTensor:
    return ScipyCscTensor(x.data.tocsc())


def csc_to_csr(x: ScipyCscTensor) -> ScipyCsrTensor:
    return ScipyCsrTensor(x.data.tocsr())


def conversions() -> list[tuple[type, type, Callable[[Any], Any]]]:
    """Every ``(src, dst, fn)`` this plugin registers."""
    return [
        (ScipyCsrTensor, CsrTensor, csr_to_torch),
        (CsrTensor, ScipyCsrTensor, torch_csr_to_scipy),
        (ScipyCscTensor, CscTensor, csc_to_torch),
        (CscTensor, ScipyCscTensor, torch_csc_to_scipy),
        (ScipyCsrTensor, CooTensor, to_coo),
        (ScipyCscTensor, CooTensor, to_coo),
        (CooTensor, ScipyCsrTensor, from_coo(ScipyCsrTensor)),
        (CooTensor, ScipyCscTensor, from_coo(ScipyCscTensor)),
        (ScipyCsrTensor, ScipyCscTensor, csr_to_csc),
        (ScipyCscTensor, ScipyCsrTensor, csc_to_csr),
    ]
