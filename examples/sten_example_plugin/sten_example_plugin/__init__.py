"""sten-example-plugin: the worked example of a third-party STen layout plugin.

Importing the package does not register anything: sten_core finds the plugin
through its entry point (group ``sten``) and calls ``plugin.sten_register``.

Example:
    >>> import torch, sten_core as sten
    >>> from sten_example_plugin import BitmaskTensor, RowTopKSparsifier
    >>> w = sten.sparsify(RowTopKSparsifier(2), torch.randn(4, 8), BitmaskTensor)
    >>> w.wrapped_tensor.nnz
    8
"""

from .bitmask import BitmaskTensor
from .sparsifier import RowTopKSparsifier

__version__ = "0.1.0"
__all__ = ["BitmaskTensor", "RowTopKSparsifier", "__version__"]
