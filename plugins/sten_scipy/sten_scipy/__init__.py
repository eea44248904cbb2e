"""sten_scipy: ``scipy.sparse`` CSR/CSC layouts for STen.

Example:
    >>> import torch, sten_core as sten
    >>> from sten_scipy import ScipyCsrTensor
    >>> w = sten.sparsify(sten.ScalarFractionSparsifier(0.5), torch.randn(4, 4), ScipyCsrTensor)
    >>> w.wrapped_tensor.nnz
    8
"""

__version__ = "0.1.0"

from .csc import ScipyCscTensor  # noqa: E402
from .csr import ScipyCsrTensor  # noqa: E402

__all__ = ["ScipyCsrTensor", "ScipyCscTensor", "__version__"]
