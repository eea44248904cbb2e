"""The torch-native layouts: ``DenseTensor``, ``CooTensor``, ``CsrTensor``, ``CscTensor``.

Each wraps one ``torch`` tensor (``.data``) and implements the stored-values
protocol, so optimizer updates act on the stored values only.

Example:
    >>> import torch
    >>> c = CooTensor.from_dense(torch.tensor([[0., 2.], [3., 0.]]))
    >>> c.nnz, c.values().tolist()
    (2, [2.0, 3.0])
"""

from __future__ import annotations

from typing import Any

import torch

from sten_core.model.layouts import Layout


def _check_dense(tensor: Any, cls: type, ndim: int | None = None) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{cls.__name__}.from_dense: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    tensor = tensor.detach()
    if tensor.layout is not torch.strided:
        tensor = tensor.to_dense()
    if ndim is not None and tensor.dim() != ndim:
        raise ValueError(f"{cls.__name__}.from_dense: tensor must be {ndim}-D, got shape {tuple(tensor.shape)}")
    return tensor


def _concrete(data: torch.Tensor) -> bool:
    """Whether ``data`` holds real indices to canonicalise (not meta, not fake while compiling)."""
    if data.device.type == "meta" or torch.compiler.is_compiling():
        return False
    from torch._subclasses.fake_tensor import is_fake

    return not is_fake(data)


def _bad_data(cls: type, data: Any) -> None:
    """The ``TypeError`` of ``CsrTensor(3)`` or ``CsrTensor(dense)``: what the constructor takes."""
    got = f"a {data.layout} tensor" if isinstance(data, torch.Tensor) else type(data).__name__
    raise TypeError(f"{cls.__name__}(data): data must be a {cls._torch_layout} torch.Tensor, got {got} "
                    f"({cls.__name__}.from_dense(tensor) builds one from a dense tensor)")


def _own(*members: torch.Tensor) -> tuple:
    """A sparse tensor's member tensors as plain aliases (same storage and version
    counter, not views of the sparse tensor): ``torch.compile`` can take them as
    graph inputs, where views of a sparse base cannot be faked."""
    return tuple(m.detach() for m in members)


class _TorchLayout(Layout):
    """Common parts of the layouts that hold one torch tensor in ``data``."""

    _torch_layout = torch.strided  # the torch layout ``data`` has

    def __init__(self, data: torch.Tensor, check: bool = True):
        if check and ((type(data) is not torch.Tensor and not isinstance(data, torch.Tensor))
                      or data.layout is not self._torch_layout):
            _bad_data(type(self), data)
        self.data = data

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to_dense(self) -> torch.Tensor:
        if not torch.compiler.is_compiling() and self.data.is_inference() and not torch.is_inference_mode_enabled():
            # made under inference_mode, read outside it (a model's output): torch's CSR / CSC
            # to_dense writes into its result in place, which an inference tensor refuses there
            with torch.inference_mode():
                return self.data.to_dense()
        return self.data.to_dense()

    def same_pattern(self, other: Any) -> bool:
        if type(other) is not type(self) or other.shape != self.shape:
            return False
        mine, theirs = self._indices(), other._indices()
        return all(a is b or (a.shape == b.shape and torch.equal(a, b)) for a, b in zip(mine, theirs))

    def _indices(self) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def __getstate__(self) -> dict:
        return {"parts": self.state_tensors(), "shape": tuple(self.shape)}

    def __setstate__(self, state: dict) -> None:
        self.data = self.from_state_tensors(state["parts"], state["shape"]).data

    def state_tensors(self) -> tuple[torch.Tensor, ...]:
        """Plain tensors that, with the shape, rebuild this layout (serialization)."""
        return self._indices() + (self.values(),)


class DenseTensor(_TorchLayout):
    """A dense tensor seen as a layout (every position stored)."""

    @classmethod
    def from_dense(cls, tensor: torch.Tensor) -> "DenseTensor":
        return cls(_check_dense(tensor, cls).clone())

    def to_dense(self) -> torch.Tensor:
        return self.data

    @property
    def nnz(self) -> int:
        return self.data.numel()

    def values(self) -> torch.Tensor:
        return self.data.view(-1) if self.data.is_contiguous() else self.data.reshape(-1)

    def with_values(self, values: torch.Tensor) -> "DenseTensor":
        return DenseTensor(values.view(self.shape))

    def gather(self, dense: torch.Tensor) -> torch.Tensor:
        return dense.expand(self.shape).reshape(-1)

    def _indices(self) -> tuple:
        return ()

    @classmethod
    def from_state_tensors(cls, parts: tuple, shape: tuple) -> "DenseTensor":
        return cls(parts[0].view(shape))


class _Members(_TorchLayout):
    """A sparse torch layout that keeps its member tensors (indices..., values).

    ``with_values`` builds the new torch tensor from the *same* member objects
    rather than from fresh aliases of ``data``: repeated updates (an optimizer
    step each) then create no chain of aliases.
    """

    def __init__(self, data: torch.Tensor, members: tuple | None = None):
        if members is None and isinstance(data, torch.Tensor) and data.layout is self._torch_layout \
                and _concrete(data):
            data = self._canonical(data)
        super().__init__(data, check=members is None)  # (built from members: while tracing, data is dense)
        self._members = members if members is not None else self._extract(data)

    @classmethod
    def _canonical(cls, data: torch.Tensor) -> torch.Tensor:
        """``data`` with each position stored once: every stored value is then one entry, which
        in-place updates and optimizer steps rely on (the default: ``data`` as is)."""
        return data

    @property
    def nnz(self) -> int:
        return self._members[-1].shape[0]

    def values(self) -> torch.Tensor:
        return self._members[-1]

    def _indices(self) -> tuple:
        return self._members[:-1]

    def with_values(self, values: torch.Tensor) -> "_Members":
        members = self._indices() + (values,)
        return type(self)(self._build(members, self.shape), members)

    @classmethod
    def from_state_tensors(cls, parts: tuple, shape: tuple) -> "_Members":
        parts = tuple(parts)
        return cls(cls._build_checked(parts, tuple(shape)), parts)

    def __setstate__(self, state: dict) -> None:
        parts = tuple(state["parts"])
        self.data = self._build_checked(parts, tuple(state["shape"]))
        self._members = parts

    @classmethod
    def _build_checked(cls, parts: tuple, shape: tuple) -> torch.Tensor:
        """Build from saved members, checking torch's invariants (indices in range,
        monotone pointers): a corrupted file must fail here, not read out of bounds."""
        checkable = all(part.device.type != "meta" for part in parts)  # meta parts hold no indices to check
        try:
            return cls._build(parts, shape, check=checkable)
        except RuntimeError as error:
            raise ValueError(f"{cls.__name__}: the saved members do not form a valid {cls.__name__} "
                             f"of shape {tuple(shape)}: {error}") from error

    @staticmethod
    def _extract(data: torch.Tensor) -> tuple:
        raise NotImplementedError

    @staticmethod
    def _build(members: tuple, shape: tuple, check: bool = False) -> torch.Tensor:
        raise NotImplementedError


class CooTensor(_Members):
    """Coordinate format (``torch.sparse_coo``, coalesced), any number of dims."""

    _torch_layout = torch.sparse_coo

    @classmethod
    def from_dense(cls, tensor: torch.Tensor) -> "CooTensor":
        return cls(_check_dense(tensor, cls).to_sparse().coalesce())

    @classmethod
    def _canonical(cls, data: torch.Tensor) -> torch.Tensor:
        """Coalesced: an uncoalesced COO tensor (``torch.sparse_coo_tensor``'s default) may store a
        position twice; its value is their sum, and a step applied to each entry counted twice."""
        return data if data.is_coalesced() else data.coalesce()

    @staticmethod
    def _extract(data: torch.Tensor) -> tuple:
        return _own(data._indices(), data._values())

    @staticmethod
    def _build(members: tuple, shape: tuple, check: bool = False) -> torch.Tensor:
        return torch.sparse_coo_tensor(members[0], members[1], shape, is_coalesced=True, check_invariants=check)

    def gather(self, dense: torch.Tensor) -> torch.Tensor:
        return dense.expand(self.shape)[tuple(self._members[0])]


class _Compressed(_Members):
    """Shared parts of CSR and CSC (2-D)."""

    _compress_dim = 0  # 0 for CSR (rows compressed), 1 for CSC

    def __init__(self, data: torch.Tensor, members: tuple | None = None):
        super().__init__(data, members)
        self._coords: tuple[torch.Tensor, torch.Tensor] | None = None
        self.size_2d = (int(data.shape[0]), int(data.shape[1]))  # plain ints: read while compiling

    @classmethod
    def _canonical(cls, data: torch.Tensor) -> torch.Tensor:
        """``data`` checked against torch's invariants (built without ``check_invariants``, a
        compressed tensor may repeat or misorder an index: a position stored twice took each
        update twice, and kernels may read out of bounds): a ``ValueError`` if it breaks them."""
        members = cls._extract(data)
        try:
            cls._build(members, tuple(data.shape), check=True)
        except RuntimeError as error:
            raise ValueError(
                f"{cls.__name__}(data): data breaks torch's {data.layout} invariants ({error}); a tensor with "
                "repeated indices can be summed into a valid one with "
                f"data.to_sparse_coo().coalesce().to_sparse_{'csr' if cls._compress_dim == 0 else 'csc'}()") from error
        return data

    def coords(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Row and column index of every stored value (cached)."""
        if self._coords is None:
            compressed, plain = self._indices()
            counts = compressed[1:] - compressed[:-1]
            major = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
            self._coords = (major, plain) if self._compress_dim == 0 else (plain, major)
        return self._coords

    def gather(self, dense: torch.Tensor) -> torch.Tensor:
        rows, cols = self.coords()
        return dense.expand(self.shape)[rows, cols]

    def with_values(self, values: torch.Tensor) -> "_Compressed":
        new = super().with_values(values)
        new._coords = self._coords
        return new

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._coords = None
        self.size_2d = (int(self.data.shape[0]), int(self.data.shape[1]))


class CsrTensor(_Compressed):
    """Compressed sparse rows (``torch.sparse_csr``), 2-D."""

    _torch_layout = torch.sparse_csr

    @classmethod
    def from_dense(cls, tensor: torch.Tensor) -> "CsrTensor":
        return cls(_check_dense(tensor, cls, 2).to_sparse_csr())

    @staticmethod
    def _extract(data: torch.Tensor) -> tuple:
        return _own(data.crow_indices(), data.col_indices(), data.values())

    @staticmethod
    def _build(members: tuple, shape: tuple, check: bool = False) -> torch.Tensor:
        return torch.sparse_csr_tensor(members[0], members[1], members[2], shape, check_invariants=check)


class CscTensor(_Compressed):
    """Compressed sparse columns (``torch.sparse_csc``), 2-D."""

    _torch_layout = torch.sparse_csc

    _compress_dim = 1

    @classmethod
    def from_dense(cls, tensor: torch.Tensor) -> "CscTensor":
        return cls(_check_dense(tensor, cls, 2).to_sparse_csc())

    @staticmethod
    def _extract(data: torch.Tensor) -> tuple:
        return _own(data.ccol_indices(), data.row_indices(), data.values())

    @staticmethod
    def _build(members: tuple, shape: tuple, check: bool = False) -> torch.Tensor:
        return torch.sparse_csc_tensor(members[0], members[1], members[2], shape, check_invariants=check)


TORCH_LAYOUTS = (DenseTensor, CooTensor, CsrTensor, CscTensor)
