"""``ScipyCscTensor``: a 2-D ``scipy.sparse.csc_array`` as a STen layout.

It can replace the paper's hand-written ``MyCscTensor`` (appendix A.3).

Example:
    >>> import torch, sten_core as sten
    >>> from sten_scipy import ScipyCscTensor
    >>> w = sten.SparseTensorWrapper(ScipyCscTensor.from_dense(torch.eye(3)))
    >>> torch.mm(w, torch.ones(3, 1)).flatten().tolist()
    [1.0, 1.0, 1.0]
"""

from __future__ import annotations

import scipy.sparse

from .compressed import ScipyCompressed


class ScipyCscTensor(ScipyCompressed):
    """Compressed sparse columns held in a ``scipy.sparse.csc_array`` (``.data``)."""

    format = "csc"
    array_type = scipy.sparse.csc_array
    _major = 1
