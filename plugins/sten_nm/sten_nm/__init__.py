"""sten_nm: n:m sparse weights for STen with a plain-C AVX2/AVX-512 CPU kernel.

Example:
    >>> import torch, torch.nn.functional as F
    >>> import sten_core as sten
    >>> from sten_nm import NMSparsifier, NMTensor
    >>> w = sten.SparseTensorWrapper(NMTensor.from_dense(torch.randn(8, 16), n=2, m=4))
    >>> F.linear(torch.randn(3, 16), w).shape
    torch.Size([3, 8])
"""

__version__ = "0.1.0"

from .nm_tensor import NMTensor  # noqa: E402
from .grouped_tensor import GroupedNMTensor  # noqa: E402
from .column_grouped import ColumnGroupedNMTensor  # noqa: E402
from .sparsifier import ColumnGroupedNMSparsifier, GroupedNMSparsifier, NMSparsifier  # noqa: E402
from .ops import grouped_linear, nm_linear, nm_matmul  # noqa: E402
from .column_grouped_ops import column_grouped_linear  # noqa: E402

__all__ = ["NMTensor", "GroupedNMTensor", "ColumnGroupedNMTensor", "NMSparsifier", "GroupedNMSparsifier",
           "ColumnGroupedNMSparsifier", "nm_linear", "nm_matmul", "grouped_linear", "column_grouped_linear",
           "__version__"]
