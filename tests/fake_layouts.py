"""A minimal layout for dispatch and plugin tests: it stores a dense copy and
has no stored-values protocol, so whatever runs on it is what was registered."""

import torch

import sten_core as sten


class DenseCopyLayout(sten.Layout):
    def __init__(self, data: torch.Tensor):
        self.data = data

    @classmethod
    def from_dense(cls, tensor: torch.Tensor) -> "DenseCopyLayout":
        return cls(tensor.detach().clone())

    def to_dense(self) -> torch.Tensor:
        return self.data

    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype)
    device = property(lambda self: self.data.device)
