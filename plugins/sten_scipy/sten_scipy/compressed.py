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

from ._checks import SUPPORTED, TORCH_TO_NUMPY, check_dense, torch_dtype


def _plain(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a real CPU tensor numpy can view (not one ``torch.compile`` traces)."""
    from torch._subclasses.fake_tensor import is_fake

    return (type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.device.type == "cpu"
            and not is_fake(tensor) and not torch._is_functional_tensor(tensor))


def _check_cpu(parts: tuple, layout: str) -> None:
    """The saved parts of a scipy layout are CPU tensors: its arrays live in numpy (CPU) memory,
    so ``torch.load(..., map_location="meta")`` and ``Module.to("meta")`` (or another device) raise
    a ``NotImplementedError`` naming the layout and the device, not numpy's conversion error.

    >>> _check_cpu((torch.zeros(1, device="meta"),), "ScipyCsrTensor")
    Traceback (most recent call last):
    NotImplementedError: ScipyCsrTensor cannot be on the meta device: ...
    """
    device = next((t.device for t in parts if t.device.type != "cpu"), None)
    if device is not None:
        raise NotImplementedError(
            f"{layout} cannot be on the {device.type} device: its pattern and values live in a scipy array "
            f"(numpy, CPU memory), which {device.type} tensors cannot hold. Load it with map_location='cpu' "
            f"and keep it on the CPU (for shapes only, convert it first, e.g. to sten_core's CsrTensor)")


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
    ignores_autocast: bool = True  # scipy computes in the weight's dtype (float32/64): eager's F.linear under
    # CPU autocast returns float32, and a compiled one must too (sten_core.dispatch.compiled.autocast_result)

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
        self._array = data
        self._traced_shape: tuple | None = None
        self._coords: tuple[torch.Tensor, torch.Tensor] | None = None
        # torch views of scipy's arrays (same memory): what torch.compile takes as graph inputs
        self.torch_members = (torch.from_numpy(data.indptr), torch.from_numpy(data.indices),
                              torch.from_numpy(data.data))

    @property
    def data(self) -> Any:
        """The scipy array (absent on a traced layout, see ``from_torch_members``)."""
        if self._array is None:
            raise RuntimeError(
                f"{type(self).__name__}: this layout was rebuilt from the tensors torch.compile traces "
                f"(fake or functional tensors); it holds no scipy array, so scipy code cannot run on it "
                f"in a compiled graph. The compiled F.linear and its gradients run scipy inside the "
                f"sten_scipy::linear* custom operators; call other scipy operations outside torch.compile")
        return self._array

    @data.setter
    def data(self, array: Any) -> None:
        self.__init__(array)

    @property
    def traced(self) -> bool:
        """Whether this layout holds traced member tensors and no scipy array (``from_torch_members``)."""
        return self._array is None

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

    @classmethod
    def from_torch_members(cls, indptr: torch.Tensor, indices: torch.Tensor, values: torch.Tensor,
                           shape: tuple) -> "ScipyCompressed":
        """The layout around its ``torch_members`` ``(indptr, indices, values)``, reading no values.

        Plain CPU tensors (a compiled graph's outputs, say the weight's gradient) give a
        scipy array on numpy views of them (shared memory, trusted canonical, as
        ``from_parts``). Tensors that ``torch.compile`` traces (fake, functional or meta)
        give a *traced* layout: the members and the shape, no scipy array (``traced``);
        its shape, dtype, device, ``values()``, ``coords()`` and ``to_dense()`` are torch
        operations on the members, anything else that reads ``data`` says why it cannot run.

        >>> from sten_scipy import ScipyCsrTensor
        >>> m = ScipyCsrTensor.from_dense(torch.eye(2))
        >>> ScipyCsrTensor.from_torch_members(*m.torch_members, (2, 2)).to_dense().tolist()
        [[1.0, 0.0], [0.0, 1.0]]
        >>> ScipyCsrTensor.from_torch_members(*(t.to("meta") for t in m.torch_members), (2, 2)).traced
        True
        """
        if _plain(indptr) and _plain(indices) and _plain(values):
            return cls.from_parts(values.detach().numpy(), indices.detach().numpy(), indptr.detach().numpy(),
                                  tuple(shape))
        self = cls.__new__(cls)
        self._array = None
        self._traced_shape = (int(shape[0]), int(shape[1]))
        self._coords = None
        self.torch_members = (indptr, indices, values)
        return self

    def to_dense(self) -> torch.Tensor:
        if self.traced:  # torch ops of static output size on the members (no scipy)
            rows, cols = self.coords()
            values = self.torch_members[2]
            return values.new_zeros(self.shape).index_put((rows, cols), values)
        return torch.from_numpy(self.data.toarray(order="C"))  # (CSC gave column-major: views failed)

    # -- metadata ---------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._traced_shape if self._array is None else self._array.shape)

    @property
    def dtype(self) -> torch.dtype:
        if self._array is None:
            return self.torch_members[2].dtype
        return torch_dtype(self._array.dtype, type(self).__name__)

    @property
    def device(self) -> torch.device:
        return self.torch_members[2].device if self._array is None else torch.device("cpu")

    @property
    def nnz(self) -> int:
        return self.torch_members[1].shape[0] if self._array is None else int(self._array.nnz)

    # -- stored-values protocol -------------------------------------------------
    def values(self) -> torch.Tensor:
        """The stored values, sharing memory with ``self.data.data``."""
        if self._array is None:
            return self.torch_members[2]
        return torch.from_numpy(self.data.data)

    def with_values(self, values: torch.Tensor) -> "ScipyCompressed":
        """This pattern with other stored values (shares ``values``' memory)."""
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
        if values.shape != (self.nnz,):
            raise ValueError(f"values must have shape ({self.nnz},) (one per stored value), got {tuple(values.shape)}")
        if values.dtype not in TORCH_TO_NUMPY:  # (numpy's own "unsupported ScalarType BFloat16" otherwise)
            raise TypeError(f"{type(self).__name__}: dtype must be {SUPPORTED}, got {values.dtype}")
        array = values.detach().cpu().contiguous().numpy()
        new = self.from_parts(array, self.data.indices, self.data.indptr, self.data.shape)
        new._coords = self._coords
        return new

    def coords(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Row and column index of every stored value, in storage order (cached)."""
        if self._coords is None and self._array is None:  # traced: static output sizes only
            indptr, indices, _ = self.torch_members
            position = torch.ones_like(indices, dtype=torch.int64).cumsum(0) - 1  # 0 .. nnz-1
            major = torch.searchsorted(indptr.to(torch.int64), position, right=True) - 1
            minor = indices.long()
            return (major, minor) if self._major == 0 else (minor, major)
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
        _check_cpu((indptr, indices, values), cls.__name__)
        if values.dtype not in TORCH_TO_NUMPY:   # (a move to bf16: numpy has no such dtype)
            raise TypeError(f"{cls.__name__}: dtype must be {SUPPORTED}, got {values.dtype}")
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
