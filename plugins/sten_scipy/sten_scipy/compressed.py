"""The shared base of ``ScipyCsrTensor`` and ``ScipyCscTensor``.

A layout holds one 2-D ``scipy.sparse`` array in canonical form (sorted
indices, no duplicates) in ``.data``. It implements the stored-values protocol:
``values()`` is a torch tensor that shares memory with ``.data.data``, so
optimizer steps update the scipy array in place, in O(nnz).

Example:
    >>> import torch
    >>> from sten_scipy import ScipyCsrTensor
    >>> x = ScipyCsrTensor.from_dense(torch.tensor([[0., 2.], [3., 0.]]))
    >>> x.nnz, x.values().tolist(), type(x.data).__name__
    (2, [2.0, 3.0], 'csr_array')
"""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.sparse
import torch

from sten_core.plugin_api import Layout

from ._checks import check_dense, torch_dtype


def compress(dense: torch.Tensor, keep: torch.Tensor | None, major: int) -> tuple:
    """``(data, indices, indptr)`` of the nonzeros of ``dense`` (where ``keep``),
    compressed along dim ``major`` (0: CSR, 1: CSC), without a masked dense copy.

    >>> data, indices, indptr = compress(torch.tensor([[0., 1.], [2., 3.]]), None, 0)
    >>> data.tolist(), indices.tolist(), indptr.tolist()
    ([1.0, 2.0, 3.0], [1, 0, 1], [0, 1, 3])
    """
    src = dense if major == 0 else dense.t()
    mask = src != 0
    if keep is not None:
        mask &= keep if major == 0 else keep.t()
    coords = torch.nonzero(mask)
    values = src[mask]
    counts = torch.bincount(coords[:, 0], minlength=src.shape[0])
    index_dtype = torch.int32 if max(src.shape[1], coords.shape[0]) < 2**31 - 1 else torch.int64
    indptr = torch.zeros(src.shape[0] + 1, dtype=index_dtype)
    torch.cumsum(counts, 0, out=indptr[1:])
    return values.numpy(), coords[:, 1].to(index_dtype).numpy(), indptr.numpy()


class ScipyCompressed(Layout):
    """Common parts of the scipy CSR and CSC layouts (2-D, CPU, float32/float64).

    Args:
        data: a 2-D ``scipy.sparse`` array or matrix; it is converted to this
            layout's format (no copy when it already is) and made canonical.
    """

    format: str = "csr"
    array_type: type = scipy.sparse.csr_array
    _major: int = 0  # the compressed dim: 0 for CSR, 1 for CSC

    def __init__(self, data: Any):
        name = type(self).__name__
        if not scipy.sparse.issparse(data):
            raise TypeError(f"{name}: data must be a scipy.sparse array, got {type(data).__name__}; "
                            f"use {name}.from_dense(tensor) for a torch tensor")
        if data.ndim != 2:
            raise ValueError(f"{name}: data must be 2-D, got shape {data.shape}")
        torch_dtype(data.dtype, name)
        if not isinstance(data, self.array_type):
            data = self.array_type(data)
        if not data.has_canonical_format:
            data.sum_duplicates()
        self.data = data
        self._coords: tuple[torch.Tensor, torch.Tensor] | None = None
        # torch views of scipy's arrays (same memory): what torch.compile takes as graph inputs
        self.torch_members = (torch.from_numpy(data.indptr), torch.from_numpy(data.indices),
                              torch.from_numpy(data.data))

    # -- construction -----------------------------------------------------------
    @classmethod
    def from_dense(cls, tensor: torch.Tensor) -> "ScipyCompressed":
        """The nonzeros of a 2-D float32/float64 CPU tensor.

        >>> from sten_scipy import ScipyCscTensor
        >>> ScipyCscTensor.from_dense(torch.eye(3, dtype=torch.float64)).nnz
        3
        """
        dense = check_dense(tensor, f"{cls.__name__}.from_dense")
        return cls.from_parts(*compress(dense, None, cls._major), tuple(dense.shape))

    @classmethod
    def from_parts(cls, data: np.ndarray, indices: np.ndarray, indptr: np.ndarray, shape: tuple) -> "ScipyCompressed":
        """From canonical compressed arrays (no copy, no re-sorting)."""
        array = cls.array_type((data, indices, indptr), shape=tuple(shape), copy=False)
        array.has_canonical_format = True
        return cls(array)

    def to_dense(self) -> torch.Tensor:
        return torch.from_numpy(self.data.toarray())

    # -- metadata ---------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.data.shape)

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.data.dtype, type(self).__name__)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def nnz(self) -> int:
        return int(self.data.nnz)

    # -- stored-values protocol -------------------------------------------------
    def values(self) -> torch.Tensor:
        """The stored values, sharing memory with ``self.data.data``."""
        return torch.from_numpy(self.data.data)

    def with_values(self, values: torch.Tensor) -> "ScipyCompressed":
        """This pattern with other stored values (shares ``values``' memory)."""
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
        if values.shape != (self.nnz,):
            raise ValueError(f"values must have shape ({self.nnz},) (one per stored value), got {tuple(values.shape)}")
        array = values.detach().cpu().contiguous().numpy()
        torch_dtype(array.dtype, f"{type(self).__name__}.with_values")
        new = self.from_parts(array, self.data.indices, self.data.indptr, self.data.shape)
        new._coords = self._coords
        return new

    def coords(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Row and column index of every stored value, in storage order (cached)."""
        if self._coords is None:
            indptr = torch.from_numpy(self.data.indptr).long()
            major = torch.repeat_interleave(torch.arange(indptr.numel() - 1), indptr[1:] - indptr[:-1])
            minor = torch.from_numpy(self.data.indices).long()
            self._coords = (major, minor) if self._major == 0 else (minor, major)
        return self._coords

    def gather(self, dense: torch.Tensor) -> torch.Tensor:
        """Values of ``dense`` (broadcast to this shape) at the stored positions."""
        rows, cols = self.coords()
        return dense.expand(self.shape)[rows, cols]

    def same_pattern(self, other: Any) -> bool:
        if type(other) is not type(self) or other.shape != self.shape:
            return False
        a, b = self.data, other.data
        return all(x is y or np.array_equal(x, y) for x, y in ((a.indptr, b.indptr), (a.indices, b.indices)))

    # -- helpers ----------------------------------------------------------------
    def transpose(self) -> "ScipyCompressed":
        """The transpose, in the other scipy layout, sharing all arrays (O(1))."""
        from .layouts import TRANSPOSED

        return TRANSPOSED[type(self)](self.data.T)

    def index_arrays(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(indptr, indices)`` as torch tensors sharing memory with scipy's."""
        return torch.from_numpy(self.data.indptr), torch.from_numpy(self.data.indices)

    # -- saving: torch.save / torch.load(weights_only=True) ---------------------
    def state_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(indptr, indices, values)``: plain tensors that ``from_state_tensors`` rebuilds it from."""
        indptr, indices = self.index_arrays()
        return (indptr, indices, self.values())

    @classmethod
    def from_state_tensors(cls, tensors: tuple, shape: tuple) -> "ScipyCompressed":
        indptr, indices, values = tensors
        return cls(cls._saved_array(indptr, indices, values, shape))

    @classmethod
    def _saved_array(cls, indptr: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, shape: tuple) -> Any:
        """The scipy array of saved parts, fully checked (pointers monotone, indices
        in range): a damaged checkpoint fails here instead of crashing a kernel later."""
        try:
            array = cls.array_type((values.numpy(), indices.numpy(), indptr.numpy()), shape=tuple(shape))
            array.check_format(full_check=True)
        except ValueError as error:
            raise ValueError(f"{cls.__name__}: the saved parts do not form a valid {cls.format.upper()} "
                             f"array of shape {tuple(shape)}: {error}") from error
        return array

    # -- pickling (torch tensors only, so torch.save keeps the state compact) ----
    def __getstate__(self) -> dict:
        indptr, indices = self.index_arrays()
        return {"indptr": indptr, "indices": indices, "values": self.values(), "shape": tuple(self.data.shape)}

    def __setstate__(self, state: dict) -> None:
        self.__init__(self._saved_array(state["indptr"], state["indices"], state["values"], state["shape"]))
