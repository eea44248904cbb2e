"""The layout protocol: how a tensor's values are stored.

A layout class wraps its storage and converts to and from a dense tensor. Only
``from_dense`` and ``to_dense`` are required (the paper's hand-written
``MyCscTensor`` is a valid layout); the rest have defaults or are optional.

Layouts that store their kept values in one tensor may also implement the
*stored-values protocol* (``values``, ``with_values``, ``gather``,
``same_pattern``). The wrapper then runs element-wise updates (optimizer steps,
``grad`` accumulation) on the stored values in O(nnz), keeping the pattern.

Example:
    >>> import torch, sten_core as sten
    >>> x = sten.CsrTensor.from_dense(torch.eye(3))
    >>> x.shape, x.nnz
    (torch.Size([3, 3]), 3)
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import torch


class Layout:
    """Base class of sparsity layouts (subclassing it is optional).

    Subclasses implement ``from_dense`` and ``to_dense``; metadata defaults are
    derived from them but may be overridden for speed.
    """

    @classmethod
    def from_dense(cls, tensor: torch.Tensor) -> "Layout":
        """Build the layout from a dense tensor, keeping its nonzeros."""
        raise NotImplementedError(f"{cls.__name__}.from_dense")

    def to_dense(self) -> torch.Tensor:
        """Return the dense tensor this layout represents."""
        raise NotImplementedError(f"{type(self).__name__}.to_dense")

    @property
    def shape(self) -> torch.Size:
        return self.to_dense().shape

    @property
    def dtype(self) -> torch.dtype:
        return self.to_dense().dtype

    @property
    def device(self) -> torch.device:
        return self.to_dense().device

    @property
    def nnz(self) -> int | None:
        """Number of stored values, or ``None`` where that is meaningless."""
        return None

    # -- stored-values protocol (optional) -------------------------------
    def values(self) -> torch.Tensor | None:
        """The stored values as one tensor, or ``None`` if not supported."""
        return None

    def with_values(self, values: torch.Tensor) -> "Layout":
        """A layout with this one's pattern and the given stored values."""
        raise NotImplementedError(f"{type(self).__name__}.with_values")

    def gather(self, dense: torch.Tensor) -> torch.Tensor:
        """Values of ``dense`` at this layout's stored positions."""
        raise NotImplementedError(f"{type(self).__name__}.gather")

    def same_pattern(self, other: Any) -> bool:
        """Whether ``other`` stores exactly the same positions."""
        return False

    # -- serialization (optional) -----------------------------------------
    # ``state_tensors()`` returns plain tensors and the classmethod
    # ``from_state_tensors(tensors, shape)`` rebuilds the layout from them; with
    # both, a wrapper saves for ``torch.load(..., weights_only=True)``.

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, nnz={self.nnz})"


@runtime_checkable
class DenseConvertible(Protocol):
    """The two required methods of a layout: ``from_dense`` (a classmethod) and ``to_dense``."""

    @classmethod
    def from_dense(cls, tensor: torch.Tensor) -> Any: ...

    def to_dense(self) -> torch.Tensor: ...


@runtime_checkable
class StoredValues(Protocol):
    """The stored-values protocol: kept values in one tensor, replaceable and
    readable at the stored positions (a ``values()`` of ``None`` opts out)."""

    def values(self) -> torch.Tensor | None: ...

    def with_values(self, values: torch.Tensor) -> Any: ...

    def gather(self, dense: torch.Tensor) -> torch.Tensor: ...

    def same_pattern(self, other: Any) -> bool: ...


@runtime_checkable
class StateTensors(Protocol):
    """Saving as plain tensors: ``state_tensors()`` and the classmethod
    ``from_state_tensors(tensors, shape)`` that rebuilds the layout
    (``torch.load(..., weights_only=True)`` then reads it)."""

    def state_tensors(self) -> tuple: ...

    @classmethod
    def from_state_tensors(cls, tensors: tuple, shape: tuple) -> Any: ...


@runtime_checkable
class Movable(Protocol):
    """A layout that moves itself: ``to(device, dtype)`` returns the moved layout."""

    def to(self, device: Any = None, dtype: Any = None) -> Any: ...


_implements: dict[tuple[type, type], bool] = {}


def implements(layout: Any, protocol: type) -> bool:
    """``isinstance(layout, protocol)`` for the protocols above, cached per layout class
    (a runtime protocol check costs microseconds; this one a dict look-up).

    Example:
        >>> import torch, sten_core as sten
        >>> implements(sten.CsrTensor.from_dense(torch.eye(2)), StateTensors)
        True
    """
    key = (type(layout), protocol)
    found = _implements.get(key)
    if found is None:
        found = _implements[key] = isinstance(layout, protocol)
    return found


def supports_values(layout: Any) -> bool:
    """Whether ``layout`` implements the stored-values protocol (and does not opt out)."""
    return implements(layout, StoredValues) and layout.values() is not None


def values_layout(layout: Any) -> Any:
    """The layout whose stored positions hold ``layout``'s own values: ``layout`` itself, or,
    for one that keeps them in an ``inner`` layout and one fill value elsewhere (a class with
    ``fills_unstored = True``: ``sten_core.builtin.filled.FilledTensor``), that inner layout."""
    return layout.inner if getattr(type(layout), "fills_unstored", False) else layout


def pattern_of_mask(layout_cls: type, dense: torch.Tensor, mask: torch.Tensor, **from_dense_kwargs: Any) -> Any:
    """A ``layout_cls`` object whose pattern is ``from_dense`` of ``mask`` itself (zeros of
    ``dense`` at ``mask`` stay stored) with ``dense``'s values gathered there, or ``None``
    where the layout has no stored-values protocol. The layout may store more than ``mask``
    (an n:m layout fills each group to ``n``); those positions get ``dense``'s values too.

    Example:
        >>> import torch, sten_core as sten
        >>> pattern_of_mask(sten.CooTensor, torch.zeros(2, 2), torch.eye(2, dtype=torch.bool)).nnz
        2
    """
    pattern = layout_cls.from_dense(mask.to(dense.dtype), **from_dense_kwargs)
    if not supports_values(pattern):
        return None
    return pattern.with_values(pattern.gather(dense).to(pattern.values().dtype))


def is_layout_object(value: Any) -> bool:
    """Whether ``value`` is a layout instance: an object with a ``to_dense()`` method,
    neither a class nor a ``torch.Tensor``.

    Example:
        >>> import torch, sten_core as sten
        >>> is_layout_object(sten.CsrTensor.from_dense(torch.eye(2))), is_layout_object(sten.CsrTensor)
        (True, False)
    """
    return not isinstance(value, (type, torch.Tensor)) and callable(getattr(value, "to_dense", None))


def type_name(value: Any) -> str:
    """How an error message names what it got: ``int``, ``numpy.bool``, ``the class CsrTensor``.

    Example:
        >>> import sten_core as sten
        >>> type_name(3), type_name(sten.CsrTensor)
        ('int', 'the class CsrTensor')
    """
    if isinstance(value, type):
        return f"the class {value.__name__}"
    cls = type(value)
    return cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__.split('.')[0]}.{cls.__name__}"


def layout_metadata(layout: Any) -> tuple[torch.Size, torch.dtype, torch.device]:
    """Logical (shape, dtype, device) of any layout object.

    Layouts that do not report their metadata (like the paper's ``MyCscTensor``)
    are densified once to learn it.
    """
    try:
        shape, dtype, device = layout.shape, layout.dtype, layout.device
        if isinstance(dtype, torch.dtype) and device is not None:
            return torch.Size(shape), dtype, torch.device(device)
    except (AttributeError, NotImplementedError):
        pass
    dense = layout.to_dense()
    if not isinstance(dense, torch.Tensor):
        dense = torch.as_tensor(dense)
    return dense.shape, dense.dtype, dense.device


def to_dense_tensor(layout: Any) -> torch.Tensor:
    """``layout.to_dense()`` as a contiguous strided ``torch.Tensor`` (numpy results converted).

    A wrapper reports contiguous strides, and ops that read strides (``view``, ``as_strided``)
    run on this tensor: a ``to_dense()`` returning a strided view (a slice of padded storage, a
    transpose) is copied, else those ops read the padding or the wrong order. A contiguous one
    is returned as it is. Under a ``torch.func`` transform, a layout that holds none of the
    transform's tensors (a frozen weight) is densified outside it, as torch's own sparse
    tensors must be ("Sparse CSR tensors do not have strides").

    Example:
        >>> import torch, sten_core as sten
        >>> to_dense_tensor(sten.DenseTensor(torch.ones(2, 3).t())).is_contiguous()
        True
    """
    if torch._C._are_functorch_transforms_active() and not holds_transform_tensors(layout):
        with torch._C._DisableFuncTorch():
            return _dense_of(layout)
    return _dense_of(layout)


def holds_transform_tensors(layout: Any) -> bool:
    """Whether ``layout`` may hold a tensor of an active ``torch.func`` transform (an attribute
    that is one, or attributes it cannot list): work on it outside the transform would detach it.

    Example:
        >>> import torch, sten_core as sten
        >>> holds_transform_tensors(sten.DenseTensor.from_dense(torch.ones(2)))
        False
    """
    if not hasattr(layout, "__dict__"):
        return True
    return _holds_transformed(vars(layout).values(), torch._C._functorch.is_functorch_wrapped_tensor, 4)


def _holds_transformed(values: Any, wrapped: Callable[[torch.Tensor], bool], depth: int) -> bool:
    """Whether a transform's tensor is among ``values``: in lists, tuples, dicts and nested
    objects (a ``FilledTensor``'s ``inner`` layout) too; ``True`` past ``depth`` levels."""
    for value in values:
        if isinstance(value, torch.Tensor):
            if wrapped(value):
                return True
        elif isinstance(value, (str, bytes, int, float, bool, type, torch.dtype, torch.device, torch.Size)) \
                or value is None:
            continue
        elif depth == 0:
            return True
        elif isinstance(value, (list, tuple, set, frozenset)):
            if _holds_transformed(value, wrapped, depth - 1):
                return True
        elif isinstance(value, dict):
            if _holds_transformed(value.values(), wrapped, depth - 1):
                return True
        elif hasattr(value, "__dict__") and not callable(value):
            if _holds_transformed(vars(value).values(), wrapped, depth - 1):
                return True
    return False


def _dense_of(layout: Any) -> torch.Tensor:
    try:
        dense = layout.to_dense()
    except NotImplementedError:
        shape, dtype, device = layout_metadata(layout)
        if device.type != "meta":
            raise
        return torch.empty(shape, dtype=dtype, device=device)  # torch's sparse COO has no meta to_dense
    if not isinstance(dense, torch.Tensor):
        import numpy as np

        dense = torch.from_numpy(np.asarray(dense))
    return _contiguous(dense)


def _contiguous(dense: torch.Tensor) -> torch.Tensor:
    """``dense``, copied only where it is a strided tensor that is not contiguous."""
    if dense.layout is torch.strided and not dense.is_contiguous():
        return dense.contiguous()
    return dense


def unshared_dense(layout: Any) -> torch.Tensor:
    """``layout``'s dense tensor, copied where it is the layout's own storage (``DenseTensor``'s
    ``to_dense()`` is): what autograd saves from it then never changes with the layout, so
    writes through ``w.data`` (which autograd ignores, as for a dense tensor: ``gradcheck``
    perturbs its inputs that way) break no backward, as with the other layouts, whose
    ``to_dense()`` is a copy.

    Example:
        >>> import torch, sten_core as sten
        >>> layout = sten.DenseTensor.from_dense(torch.ones(2))
        >>> unshared_dense(layout).data_ptr() == layout.to_dense().data_ptr()
        False
    """
    dense = to_dense_tensor(layout)
    return dense.clone() if _shares_storage(dense, layout) else dense


def _shares_storage(dense: torch.Tensor, layout: Any) -> bool:
    """Whether ``dense`` lies in the memory of one of ``layout``'s tensors (its attributes,
    tuples of them, its stored values)."""
    try:
        ptr = dense.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # fake or storage-less tensors (torch.compile)
        return False
    found = attribute_tensors(layout)
    if implements(layout, StoredValues):
        found.append(layout.values())
    for t in found:
        if isinstance(t, torch.Tensor) and t.layout is torch.strided and t.device == dense.device:
            try:
                if t.untyped_storage().data_ptr() == ptr:
                    return True
            except (RuntimeError, NotImplementedError):
                continue
    return False


def attribute_tensors(layout: Any) -> list:
    """The tensors among ``layout``'s attributes, those in tuples and lists included.

    Example:
        >>> import torch, sten_core as sten
        >>> len(attribute_tensors(sten.DenseTensor.from_dense(torch.ones(2))))
        1
    """
    found = []
    for value in getattr(layout, "__dict__", {}).values():
        for t in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(t, torch.Tensor):
                found.append(t)
    return found


def builds_from_dense(cls: Any) -> bool:
    """Whether a layout class implements ``from_dense`` (not just ``Layout``'s).

    Example:
        >>> import sten_core as sten
        >>> builds_from_dense(sten.CsrTensor), builds_from_dense(sten.Layout)
        (True, False)
    """
    fn = getattr(cls, "from_dense", None)
    if not callable(fn):
        return False
    return getattr(fn, "__func__", fn) is not Layout.__dict__["from_dense"].__func__
