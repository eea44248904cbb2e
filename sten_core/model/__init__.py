"""The programming model: layouts and their protocols (``layouts``), the
wrapper tensors (``tensor``), sparsifiers, output specs (``spec``) and the
registry of implementations. Everything else in STen builds on these modules;
they import nothing above them.

Example:
    >>> import torch
    >>> from sten_core.model.tensor import SparseTensorWrapper
    >>> from sten_core.builtin.torch_layouts import CsrTensor
    >>> SparseTensorWrapper(CsrTensor.from_dense(torch.eye(2))).shape
    torch.Size([2, 2])
"""
