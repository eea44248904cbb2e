"""``ScipyCsrTensor``: a 2-D ``scipy.sparse.csr_array`` as a STen layout.

Example:
    >>> import torch, torch.nn.functional as F, sten_core as sten
    >>> from sten_scipy import ScipyCsrTensor
    >>> w = sten.SparseTensorWrapper(ScipyCsrTensor.from_dense(torch.eye(3)))
    >>> F.linear(torch.ones(2, 3), w).tolist()
    [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
"""

from __future__ import annotations

import scipy.sparse

from .compressed import ScipyCompressed


class ScipyCsrTensor(ScipyCompressed):
    """Compressed sparse rows held in a ``scipy.sparse.csr_array`` (``.data``)."""

    format = "csr"
    array_type = scipy.sparse.csr_array
    _major = 0
