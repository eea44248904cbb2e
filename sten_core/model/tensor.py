"""Sparse tensor and parameter wrappers.

A ``SparseTensorWrapper`` is a ``torch.Tensor`` subclass with no storage of its
own: it reports the true logical shape, dtype, device and ``requires_grad`` of
the layout object it wraps (``.wrapped_tensor``), and routes every torch
operation on it to the STen dispatcher (``__torch_function__``). Nothing in
torch is patched.

Example:
    >>> import torch, sten_core as sten
    >>> w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(3)))
    >>> w.shape, w.dtype
    (torch.Size([3, 3]), torch.float32)
    >>> torch.mm(w, torch.ones(3, 2)).sum().item()
    6.0
"""

from __future__ import annotations

import copy
import inspect
import sys
from typing import Any, Callable

import torch

from sten_core.model import torch_support
from sten_core.model.layouts import is_layout_object, layout_metadata, supports_values, to_dense_tensor, type_name
from sten_core.model.replacing import REPLACE_ADVICE, replacement_layout
from sten_core.model.signatures import op_name
from sten_core.user_frames import FSDP_MODULES, called_from

aten = torch.ops.aten


class SparseTensorWrapper(torch.Tensor):
    """A tensor whose values live in a sparse layout object.

    Args:
        wrapped_tensor: the layout object (e.g. ``CsrTensor``).
        requires_grad: whether autograd tracks it.
        grad_fmt: the output spec ``(inline_sparsifier, tmp_format,
            external_sparsifier, out_format)`` of its gradient; ``None`` is dense.
    """

    _cell: list  # [layout]: shared by a wrapper and its aliases (``detach()``)

    @staticmethod
    def __new__(cls, wrapped_tensor: Any, requires_grad: bool = False, grad_fmt: Any = None):
        if isinstance(wrapped_tensor, torch.Tensor):
            raise TypeError(
                "wrapped_tensor must be a layout object (e.g. sten.CsrTensor.from_dense(t)), "
                f"got {type(wrapped_tensor).__name__}"
            )
        try:
            shape, dtype, device = layout_metadata(wrapped_tensor)
        except (AttributeError, TypeError):
            _check_layout_args(wrapped_tensor, requires_grad)
            raise
        if type(requires_grad) is not bool:
            _check_layout_args(wrapped_tensor, requires_grad)
        if (grad_fmt is not None or requires_grad) and not TRACEABLE_LAYOUTS:
            services.load_plugins()  # their traceable layouts
        trainable = requires_grad  # a parameter or a plain wrapper made to train (not a non-leaf result)
        cls = wrapper_class(cls, wrapped_tensor, grad_fmt, trainable)  # traceable: a graph input when compiled
        self = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=device, requires_grad=requires_grad
        )
        self._cell = [wrapped_tensor]
        self.__dict__["_grad_fmt"] = grad_fmt
        if requires_grad and issubclass(cls, _Traceable) and services.watch_gradient is not None:
            services.watch_gradient(self)  # a re-sparsified grad_fmt: the compiled gradient's conversion
        if (requires_grad or issubclass(cls, SparseParameterWrapper)) and services.watch_optimizer_state is not None:
            services.watch_optimizer_state()  # a weight: its optimizer state follows its pattern
        return self

    @property
    def grad_fmt(self) -> Any:
        """The output spec of the wrapper's gradient; ``None`` is dense. Setting it may change
        the wrapper's class (``sync_class``: whether ``torch.compile`` takes it as a graph input)."""
        return self.__dict__.get("_grad_fmt")

    @grad_fmt.setter
    def grad_fmt(self, grad_fmt: Any) -> None:
        self.__dict__["_grad_fmt"] = grad_fmt
        sync_class(self)

    @property
    def _is_param(self) -> bool:
        """Whether ``nn.Module`` takes the wrapper as a parameter (``isinstance(w, nn.Parameter)``)."""
        return self.__dict__.get("_is_param", False)

    @_is_param.setter
    def _is_param(self, value: bool) -> None:  # nn.Parameter(wrapper) sets it on the detached wrapper
        self.__dict__["_is_param"] = value
        sync_class(self)

    @property
    def wrapped_tensor(self) -> Any:
        """The layout object holding the values."""
        return self._cell[0]

    @wrapped_tensor.setter
    def wrapped_tensor(self, layout: Any) -> None:
        """Replace the layout object: an in-place change, seen by every alias
        (``detach()``) and by autograd (the version counter is bumped)."""
        self._cell[0] = layout
        _bump_version(self)
        sync_class(self)  # a layout of another class may not be traceable

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    @staticmethod
    def wrapped_from_dense(wrapped_tensor: Any, dense: torch.Tensor, grad_fmt: Any = None) -> "SparseTensorWrapper":
        """Wrap ``wrapped_tensor``, made from ``dense``; takes its ``requires_grad``."""
        if not isinstance(dense, torch.Tensor):
            raise TypeError(f"dense must be a torch.Tensor, got {type(dense).__name__}")
        return SparseTensorWrapper(wrapped_tensor, requires_grad=dense.requires_grad, grad_fmt=grad_fmt)

    def to_dense(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        """The dense tensor this wrapper represents; differentiable (as
        ``torch.Tensor.to_dense`` is) when the wrapper requires grad and grad
        mode is on, its gradient then coming back in the wrapper's ``grad_fmt``."""
        if torch.is_grad_enabled() and self.requires_grad:
            return services.dense_with_grad(self)
        return to_dense_tensor(self.wrapped_tensor)

    # Python methods, so Dynamo traces ``W.matmul(x)``, ``W.mm(x)``, ``W.t()`` on a frozen (eager-class) wrapper,
    # which it holds as a plain object whose C methods it cannot call; eager, the same torch function
    # (``Tensor.matmul``) reaches ``__torch_function__`` as before.
    def matmul(self, other: Any) -> torch.Tensor:  # type: ignore[override]
        return torch.Tensor.matmul(self, other)

    def mm(self, mat2: Any) -> torch.Tensor:  # type: ignore[override]
        return torch.Tensor.mm(self, mat2)

    def t(self) -> torch.Tensor:  # type: ignore[override]
        return torch.Tensor.t(self)

    def transpose(self, dim0: int, dim1: int) -> torch.Tensor:  # type: ignore[override]
        return torch.Tensor.transpose(self, dim0, dim1)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        extra = ", requires_grad=True" if self.requires_grad else ""
        if self.grad_fn is not None:
            extra = f", grad_fn=<{type(self.grad_fn).__name__}>"
        layout = f"{type(self.wrapped_tensor).__name__}(shape={tuple(self.shape)}, dtype={self.dtype})"
        if not _has_fake_members(self.wrapped_tensor):  # a layout's repr may read values (nnz): on fake
            try:  # members (torch.compile logs them) that makes unbacked symbols Inductor then rejects
                layout = repr(self.wrapped_tensor)
            except Exception:  # e.g. data-dependent: repr never raises
                pass
        return f"{type(self).__name__}({layout}{extra})"

    def __reduce_ex__(self, protocol: int) -> Any:
        return services.reduce_wrapper(self)

    def __deepcopy__(self, memo: dict) -> "SparseTensorWrapper":
        new = type(self)(copy.deepcopy(self.wrapped_tensor, memo), self.requires_grad, self.grad_fmt)
        if self._is_param:   # nn.Parameter(wrapper): a parameter, as torch's deepcopy keeps one
            new._is_param = True
        memo[id(self)] = new
        return new

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        handler = _HANDLERS.get(func)
        if handler is not None:
            if handler is _PASS:
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **(kwargs or {}))
            out = handler(*args, **(kwargs or {}))
            if out is not _DISPATCH:
                return out
        # (inline, not a helper's call: through one, Dynamo traced a compiled SGD step otherwise,
        # and its momentum buffer came out dense)
        if _is_compiling():  # Dynamo is tracing: the compiled implementation, if any
            out = services.compiled_call(func, args, kwargs or {})
            if out is not services.MISSING:
                return out
            return _eager_dispatch()(func, args, kwargs or {})
        return services.dispatch_call(func, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        """Aten-level operations reach here from autograd's own machinery
        (detach, gradient accumulation, clone); anything else runs densely."""
        kwargs = kwargs or {}
        traced = TRACED_OPS.get(func)  # sten_core.dispatch.traceable's operators on wrappers
        if traced is not None:
            return traced(*args, **kwargs)
        packet = func.overloadpacket
        first = args[0] if args else None
        if packet in (aten.detach, aten.alias, aten.view_as) and isinstance(first, SparseTensorWrapper):
            return _alias(first)
        if packet is aten.set_ and isinstance(first, SparseTensorWrapper) and len(args) == 2 \
                and isinstance(args[1], torch.Tensor):
            return _set_(first, args[1])
        if packet is aten.clone and isinstance(first, SparseTensorWrapper):
            return type(first)(_copy_layout(first.wrapped_tensor), False, first.grad_fmt)
        if packet in (aten.add, aten.add_) and len(args) >= 2 and not kwargs.get("alpha", 1) != 1:
            result = _add_same_pattern(args[0], args[1], inplace=packet is aten.add_)
            if result is not None:
                return result
            if packet is aten.add_ and isinstance(first, SparseTensorWrapper):   # autograd's grad += new
                return services.accumulate(first, args[1])
            if packet is aten.add and isinstance(first, SparseTensorWrapper) and isinstance(args[1], SparseTensorWrapper) \
                    and not _has_fake_members(first.wrapped_tensor):
                summed = services.sum_growing(first, args[1])   # autograd summing a weight's two gradients
                if summed is not None:
                    return summed
        refuse_sharding((args, kwargs), func)
        if func._schema.is_mutable:  # (wrappers in lists too: c10d's allreduce_(Tensor[] tensors))
            return services.run_dense_in_place(func, args, kwargs)
        return func(*densify_tree(args), **densify_tree(kwargs))


def _check_layout_args(wrapped_tensor: Any, requires_grad: Any) -> None:
    """The ``TypeError`` of a wrapper made from something that is not a layout object
    (``SparseTensorWrapper(3)``, or the class ``CsrTensor``) or a ``requires_grad`` that
    is not a bool; nothing for right arguments (run only when making one failed)."""
    if not is_layout_object(wrapped_tensor):
        example = f"{wrapped_tensor.__name__}.from_dense(t)" if isinstance(wrapped_tensor, type) else \
            "sten.CsrTensor.from_dense(t)"
        raise TypeError(f"wrapped_tensor must be a layout object (an instance with to_dense(), e.g. {example}), "
                        f"got {type_name(wrapped_tensor)}")
    if not isinstance(requires_grad, bool):
        raise TypeError(f"requires_grad must be a bool, got {type_name(requires_grad)}")


class SparseParameterWrapper(SparseTensorWrapper):
    """A ``SparseTensorWrapper`` that ``nn.Module`` registers as a parameter.

    Example:
        >>> import torch, sten_core as sten
        >>> m = torch.nn.Linear(4, 3)
        >>> m.weight = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(m.weight.detach()))
        >>> isinstance(m.weight, torch.nn.Parameter), len(list(m.parameters()))
        (True, 2)
    """

    @staticmethod
    def __new__(cls, wrapped_tensor: Any, requires_grad: bool = True, grad_fmt: Any = None):
        if isinstance(wrapped_tensor, SparseTensorWrapper):
            grad_fmt = grad_fmt if grad_fmt is not None else wrapped_tensor.grad_fmt
            wrapped_tensor = wrapped_tensor.wrapped_tensor
        self = SparseTensorWrapper.__new__(cls, wrapped_tensor, requires_grad, grad_fmt)
        self._is_param = True
        return self


TRACEABLE_LAYOUTS: dict = {}
"""Layout class -> ``(flatten, unflatten, takes(grad_fmt, requires_grad))``: layouts whose wrappers
(with a ``grad_fmt`` and ``requires_grad`` that ``takes`` accepts) are traceable tensor subclasses (filled by
``sten_core.dispatch.traceable.register_traceable_layout``)."""
TRACED_OPS: dict = {}
"""Operator overload -> implementation, for ``sten_core.traceable``'s operators on wrappers."""


class _Traceable:
    """The tensor-subclass protocol Dynamo and AOTAutograd use to take a wrapper as a
    graph input: the layout's member tensors are inner tensors, the rest constants."""

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        layout = self.wrapped_tensor
        entry = TRACEABLE_LAYOUTS.get(type(layout))
        if entry is None:
            raise TypeError(f"{type(layout).__name__} is not a traceable layout (register_traceable_layout)")
        tensors, consts = entry[0](layout)
        # (the caller named in torch/_functorch/_aot_autograd/subclass_parametrization.py: UnwrapTensorSubclass)
        if self.requires_grad and sys._getframe(1).f_code.co_name == "_create_subclass_meta":
            _refuse_trainable_unwrap(layout, tensors)
        if len(tensors) > _MAX_MEMBERS:
            raise ValueError(f"{type(layout).__name__}: at most {_MAX_MEMBERS} member tensors, got {len(tensors)}")
        return [f"_sten_m{i}" for i in range(len(tensors))], (type(self), type(layout), tuple(consts), self.grad_fmt)

    def _stable_hash_for_caching(self) -> str:
        """torch's AOTAutograd cache key of this input: its flatten metadata, its members'
        tensor metadata and the fingerprint of STen's and the layout's code, so no cache
        entry of another version of the code is reused."""
        import hashlib

        from sten_core.model.code_fingerprint import package_fingerprint

        names, (cls, layout_cls, consts, grad_fmt) = self.__tensor_flatten__()
        flatten, unflatten = TRACEABLE_LAYOUTS[layout_cls][:2]
        members = [_tensor_metadata(getattr(self, name)) for name in names]
        packages = sorted({m.split(".")[0] for m in ("sten_core", layout_cls.__module__, flatten.__module__,
                                                      unflatten.__module__)})
        text = repr((cls.__qualname__, f"{layout_cls.__module__}.{layout_cls.__qualname__}", consts, grad_fmt,
                     self.requires_grad, members, [package_fingerprint(p) for p in packages]))
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()

    @staticmethod
    def __tensor_unflatten__(inner: dict, ctx: Any, outer_size: Any, outer_stride: Any) -> "SparseTensorWrapper":
        cls, layout_cls, consts, grad_fmt = ctx
        tensors = [inner[f"_sten_m{i}"] for i in range(len(inner))]
        out = cls(TRACEABLE_LAYOUTS[layout_cls][1](tensors, list(consts)), False, grad_fmt)
        if type(out) is not cls:  # a default-format wrapper rebuilt frozen is still the traced input's class
            out.__class__ = cls
        return out


def _refuse_trainable_unwrap(layout: Any, members: list) -> None:
    """torch's ``unwrap_tensor_subclass_parameters`` (``ExportedProgram.run_decompositions``,
    AOTInductor) makes each member of a subclass parameter that requires grad a ``Parameter``
    that requires grad, which integer members (indices, offsets) cannot be: torch's own error
    ("Only Tensors of floating point and complex dtype can require gradients") named no cause."""
    if any(not (t.is_floating_point() or t.is_complex()) for t in members):
        raise RuntimeError(
            f"STen: torch unwraps a sparse parameter that requires grad ({type(layout).__name__}) into member "
            "parameters that require grad (ExportedProgram.run_decompositions, AOTInductor), and its integer "
            "members (indices) cannot require grad. Freeze the model before exporting it for inference: "
            "model.requires_grad_(False), then torch.export.export(model, ...)")


def _tensor_metadata(tensor: torch.Tensor) -> tuple:
    return (tuple(tensor.shape), tuple(tensor.stride()), str(tensor.dtype), str(tensor.device),
            tensor.requires_grad, tensor.storage_offset())


def _member(i: int) -> property:
    return property(lambda self: TRACEABLE_LAYOUTS[type(self.wrapped_tensor)][0](self.wrapped_tensor)[0][i])


_MAX_MEMBERS = 8
for _i in range(_MAX_MEMBERS):
    setattr(_Traceable, f"_sten_m{_i}", _member(_i))


class TraceableSparseTensorWrapper(_Traceable, SparseTensorWrapper):
    """A ``SparseTensorWrapper`` of a traceable layout (made by ``SparseTensorWrapper(layout)``)."""


class TraceableSparseParameterWrapper(_Traceable, SparseParameterWrapper):
    """A ``SparseParameterWrapper`` of a traceable layout (made by ``SparseParameterWrapper(layout)``)."""


_TRACEABLE_TWIN = {SparseTensorWrapper: TraceableSparseTensorWrapper,
                   SparseParameterWrapper: TraceableSparseParameterWrapper}
_EAGER_TWIN = {twin: eager for eager, twin in _TRACEABLE_TWIN.items()}


def wrapper_class(cls: type, layout: Any, grad_fmt: Any, trainable: bool) -> type:
    """The class a wrapper of ``layout`` has: the traceable twin of ``cls`` when the layout is
    registered traceable and takes this ``grad_fmt`` (see ``sten_core.dispatch.traceable.takes``;
    the default ``None`` only for a ``trainable`` wrapper: a parameter that requires grad), else
    the eager class (always, on a torch older than ``torch_support.TRACEABLE_MIN_TORCH``). Other
    subclasses keep theirs.

    Example:
        >>> import torch, sten_core as sten
        >>> wrapper_class(SparseTensorWrapper, sten.DenseTensor.from_dense(torch.ones(1)), None, True).__name__
        'SparseTensorWrapper'
    """
    base = _EAGER_TWIN.get(cls, cls)
    entry = TRACEABLE_LAYOUTS.get(type(layout))
    if entry is not None and torch_support.TRACEABLE_WRAPPERS and entry[2](grad_fmt, trainable):
        return _TRACEABLE_TWIN.get(base, base)
    return base


def sync_class(wrapper: "SparseTensorWrapper") -> None:
    """Give ``wrapper`` the class its layout, ``grad_fmt`` and ``requires_grad`` now call for
    (``wrapper_class``): called when its layout object or ``requires_grad`` changes, so a weight
    frozen afterwards is no graph input (the eager class, as if made frozen), one unfrozen
    afterwards trains compiled, and a layout swapped for a non-traceable class is not flattened.
    Not while Dynamo traces (the class is what its guards check)."""
    t = type(wrapper)
    if t not in WRAPPER_TYPES or _is_compiling() or "_cell" not in wrapper.__dict__:
        return
    trainable = wrapper.requires_grad and (wrapper._is_param or wrapper.is_leaf)
    want = wrapper_class(t, wrapper.wrapped_tensor, wrapper.grad_fmt, trainable)
    if want is not t:
        wrapper.__class__ = want
    if issubclass(want, _Traceable) and wrapper.requires_grad and services.watch_gradient is not None:
        services.watch_gradient(wrapper)


def _has_fake_members(layout: Any) -> bool:
    """Whether a traceable layout's member tensors are fake (torch.compile is tracing it)."""
    entry = TRACEABLE_LAYOUTS.get(type(layout))
    if entry is None:
        return False
    try:
        from torch._subclasses.fake_tensor import is_fake

        return any(is_fake(t) for t in entry[0](layout)[0])
    except Exception:
        return True


def write_back(target: SparseTensorWrapper, dense: torch.Tensor) -> SparseTensorWrapper:
    """Store the result of a dense in-place computation into ``target``: at its
    stored positions when the layout allows (pattern kept), else re-built by the
    layout's ``SameFormatSparsifier`` implementation (through dispatch, so a
    user layout's registered one is used)."""
    layout = target.wrapped_tensor
    if supports_values(layout):
        values = layout.values()
        values.copy_(layout.gather(dense).to(values.dtype))
        target.wrapped_tensor = layout.with_values(values)
    else:
        target.wrapped_tensor = services.same_format_layout(target, dense)
    return target


def _bump_version(tensor: torch.Tensor) -> None:
    """Tell autograd that ``tensor`` changed in place (saved copies of it are stale)."""
    try:
        torch._C._increment_version((tensor,))
    except (RuntimeError, TypeError):  # inference tensors have no version counter
        pass


def _alias(wrapper: SparseTensorWrapper) -> SparseTensorWrapper:
    """A wrapper without autograd history sharing ``wrapper``'s layout cell:
    an in-place change through either is seen by both (``w.detach().copy_(t)``)."""
    new = SparseTensorWrapper.__new__(SparseTensorWrapper, wrapper.wrapped_tensor, False, wrapper.grad_fmt)
    new._cell = wrapper._cell
    _alias_of(new, wrapper)   # p.data.sub_(lr * g) writes the weight
    if type(wrapper) in WRAPPER_TYPES and type(new) is not type(wrapper):
        # the alias keeps the class (not the parameter flag): a traceable wrapper's alias stays traceable
        # (a default-format one is traceable while it trains: torch.compile and export detach graph
        # inputs), and nn.Parameter(w) wants detach() to return w's own class, parameters included
        # (parametrize and weight_norm make a parameter of a parameter)
        new.__class__ = type(wrapper)
    return new


def is_weight(wrapper: SparseTensorWrapper) -> bool:
    """A parameter, a leaf that requires grad, or an alias of one (``p.data``, ``p.detach()``,
    the detached twin an implementation receives, scipy's ``p.t()``): an in-place write (an
    optimizer's step, a manual ``p.data.sub_(lr * p.grad)``) keeps its pattern, which is what
    makes it sparse (``dispatch.writes.writes_exactly``).

    Example:
        >>> import torch, sten_core as sten
        >>> w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.eye(2)))
        >>> is_weight(w), is_weight(w.detach()), is_weight(w * 2)
        (True, True, False)
    """
    return wrapper._is_param or (wrapper.requires_grad and wrapper.is_leaf) \
        or wrapper.__dict__.get("_weight_alias", False)


def _alias_of(alias: SparseTensorWrapper, source: SparseTensorWrapper) -> None:
    """Mark ``alias``, a wrapper over ``source``'s storage, a weight where ``source`` is one."""
    if is_weight(source):
        alias.__dict__["_weight_alias"] = True


def storage_view(base: SparseTensorWrapper, layout: Any, grad_fmt: Any = None) -> SparseTensorWrapper:
    """A wrapper over ``layout``, a layout sharing ``base``'s storage (scipy's transpose: the CSC
    layout of a CSR layout's arrays). In-place writes through it land in those arrays, so they
    keep its pattern (``dispatch.writes``): a weight's view as the weight does, a temporary's with
    a ``DispatchWarning`` counting the values dropped, and under autograd they raise. Growing the
    pattern wrote a new layout that ``base`` never saw (``W.t().add_(x)`` left ``W`` unchanged).

    Example:
        >>> import torch, sten_core as sten
        >>> w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.eye(2)))
        >>> sorted(k for k in storage_view(w, w.wrapped_tensor).__dict__ if k.endswith(("_alias", "_view")))
        ['_storage_view', '_weight_alias']
    """
    view = SparseTensorWrapper(layout, False, grad_fmt)
    view.__dict__["_storage_view"] = True
    _alias_of(view, base)
    return view


class WrapperServices:
    """What the wrapper needs from the layers built on this module, installed
    by them when imported (``sten_core.dispatch``: ``dispatch_call``,
    ``dense_with_grad``, ``same_format_layout``, ``convert``, ``accumulate``,
    ``run_dense_in_place``, ``sum_growing``, ``watch_optimizer_state``;
    ``sten_core.dispatch.compiled``: ``compiled_call``, ``MISSING``;
    ``sten_core.training.serialization``: ``reduce_wrapper``;
    ``sten_core.plugins``: ``load_plugins``), so the
    programming model imports nothing above it.

    Example:
        >>> import sten_core
        >>> sten_core.model.tensor.services.dispatch_call.__name__
        'dispatch_call'
    """

    dispatch_call: Any = None
    dense_with_grad: Any = None
    same_format_layout: Any = None
    convert: Any = None
    compiled_call: Any = None
    MISSING: Any = None
    reduce_wrapper: Any = None
    load_plugins: Any = None
    watch_gradient: Any = None
    traced_sum: Any = None
    accumulate: Any = None
    sum_growing: Any = None
    eager_only_message: Any = None
    run_dense_in_place: Any = None
    watch_optimizer_state: Any = None

    def install(self, **services: Any) -> None:
        for name, service in services.items():
            if not hasattr(WrapperServices, name):
                raise TypeError(f"unknown wrapper service {name!r}")
            setattr(self, name, service)


services = WrapperServices()
_is_compiling = torch.compiler.is_compiling


_EAGER_DISPATCH: list = []


def _eager_dispatch() -> Any:
    """``dispatch_call`` as Dynamo runs it while tracing a call without a compiled implementation:
    one graph break, the eager dispatcher run as is, never traced into (its caches, conversions
    through numpy / scipy and ctypes kernels are not traceable: Dynamo crashed inside them).
    Made on first use (``torch.compiler.disable`` imports Dynamo)."""
    if not _EAGER_DISPATCH:
        _EAGER_DISPATCH.append(torch.compiler.disable(_eager_or_graph_break))
    return _EAGER_DISPATCH[0]


def _eager_or_graph_break(func: Any, args: tuple, kwargs: dict) -> Any:
    """``dispatch_call(func, args, kwargs)``; on fake tensors (Dynamo running a graph node's
    ``__torch_function__`` to learn its output, where a disabled call cannot break the graph)
    the exception Dynamo turns into a graph break, so the call runs eagerly on the real tensors."""
    if _any_fake((args, kwargs)):
        from torch._subclasses.fake_tensor import UnsupportedFakeTensorException

        raise UnsupportedFakeTensorException(services.eager_only_message(func, args))
    return services.dispatch_call(func, args, kwargs)


def _any_fake(tree: Any) -> bool:
    """Whether a tensor in ``tree`` (a wrapper's members included) is fake."""
    from torch._subclasses.fake_tensor import is_fake

    found = []
    map_tensors(lambda t: found.append(_has_fake_members(t.wrapped_tensor) if isinstance(t, SparseTensorWrapper)
                                       else is_fake(t)), tree)
    return any(found)


def _rebuild(cls: type, wrapped: Any, requires_grad: bool, grad_fmt: Any, is_param: bool = False) -> SparseTensorWrapper:
    out = cls(wrapped, requires_grad, grad_fmt)
    if is_param:   # nn.Parameter(wrapper) pickled
        out._is_param = True
    return out


def _copy_layout(layout: Any) -> Any:
    if supports_values(layout):
        return layout.with_values(layout.values().clone())
    return copy.deepcopy(layout)


def _add_same_pattern(a: Any, b: Any, inplace: bool) -> Any:
    """``a + b`` on stored values when both are wrappers with one pattern."""
    if not (isinstance(a, SparseTensorWrapper) and isinstance(b, SparseTensorWrapper)):
        return None
    la, lb = a.wrapped_tensor, b.wrapped_tensor
    if type(la) is not type(lb) or not supports_values(la):
        return None
    if _has_fake_members(la):  # compiling: a weight's gradients at its pattern (a weight used twice)
        summed = None if inplace else services.traced_sum(la, lb)
        return None if summed is None else SparseTensorWrapper(summed, False, a.grad_fmt)
    if not la.same_pattern(lb):
        return None
    if inplace:
        la.values().add_(lb.values())
        a.wrapped_tensor = la.with_values(la.values())
        return a
    return SparseTensorWrapper(la.with_values(la.values() + lb.values()), False, a.grad_fmt)


WRAPPER_TYPES = frozenset({SparseTensorWrapper, SparseParameterWrapper, TraceableSparseTensorWrapper,
                           TraceableSparseParameterWrapper})
"""The wrapper classes themselves: ``type(x) in WRAPPER_TYPES`` is much cheaper than
``isinstance(x, torch.Tensor)`` (torch's metaclass check), so hot paths test it first."""
DENSE_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
PLAIN_TYPES = frozenset({int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.Size})
"""Argument types that are never tensors."""


def detached(value: Any) -> Any:
    """``value`` as implementations see it: without autograd history.

    A wrapper's detached twin (same layout object and ``grad_fmt``) is made
    once and kept on the wrapper while both stay the same, so recording an
    autograd node does not build a new wrapper per input per call (callers
    must not hand the twin out: see ``dispatch.call.own_outputs``). The twin
    shares the wrapper's layout cell, so an in-place implementation that writes
    its input (``inputs[0].wrapped_tensor = ...``) writes the wrapper. Plain tensors
    are ``detach()``-ed; anything else is returned as is. Call it with
    subclass torch functions disabled (``requires_grad`` is read).

    Example:
        >>> import torch, sten_core as sten
        >>> w = sten.SparseTensorWrapper(sten.DenseTensor.from_dense(torch.ones(2)), requires_grad=True)
        >>> with torch._C.DisableTorchFunctionSubclass():
        ...     d = detached(w)
        ...     (d.requires_grad, d.wrapped_tensor is w.wrapped_tensor, detached(w) is d)
        (False, True, True)
    """
    t = type(value)
    if t in PLAIN_TYPES:
        return value
    if t in WRAPPER_TYPES or (t not in DENSE_TYPES and isinstance(value, SparseTensorWrapper)):
        if not value.requires_grad:
            return value
        layout, grad_fmt = value.wrapped_tensor, value.grad_fmt
        if _is_compiling():  # Dynamo tracing the eager dispatcher: a tensor's __dict__ is no attribute it
            return SparseTensorWrapper(layout, False, grad_fmt)  # can read (InternalTorchDynamoError)
        cached = value.__dict__.get("_sten_detached")  # (layout, grad_fmt, twin)
        if cached is None or cached[0] is not layout or cached[1] is not grad_fmt:
            twin = SparseTensorWrapper(layout, False, grad_fmt)
            twin._cell = value._cell
            _alias_of(twin, value)   # (its writes are the weight's)
            cached = value.__dict__["_sten_detached"] = (layout, grad_fmt, twin)
        return cached[2]
    if (t in DENSE_TYPES or isinstance(value, torch.Tensor)) and value.requires_grad:
        return value.detach()
    return value


def layout_of(value: Any) -> Any:
    """The layout class of a call argument: a layout class, ``torch.Tensor`` or ``None``."""
    t = type(value)
    if t in WRAPPER_TYPES:
        return type(value.wrapped_tensor)
    if t in DENSE_TYPES:
        return torch.Tensor
    if t in PLAIN_TYPES:
        return None
    if isinstance(value, SparseTensorWrapper):
        return type(value.wrapped_tensor)
    if isinstance(value, torch.Tensor):
        return torch.Tensor
    return None


def detach_at(values: list, positions: Any) -> list:
    """``values`` with the tensors at ``positions`` detached (see ``detached``)."""
    values = list(values)
    with torch._C.DisableTorchFunctionSubclass():
        for i in positions:
            values[i] = detached(values[i])
    return values


def densify(value: Any) -> Any:
    """A wrapper's dense tensor (keeping nothing of autograd); others unchanged."""
    if type(value) in WRAPPER_TYPES or isinstance(value, SparseTensorWrapper):
        return to_dense_tensor(value.wrapped_tensor)
    return value


def refuse_sharding(tree: Any, what: Any) -> None:
    """A ``NotImplementedError`` where FSDP reaches a sparse wrapper in ``tree`` (``what``: the
    operator, or the call in words): it shards parameters through dense operators, so the
    wrapper would be sharded as its dense copy and trained dense, its pattern lost without a word."""
    if not called_from(FSDP_MODULES):
        return
    found: list = []
    map_tensors(lambda t: found.append(t) if isinstance(t, SparseTensorWrapper) else None, tree)
    if found:
        layout = type(found[0].wrapped_tensor).__name__
        raise NotImplementedError(
            f"FSDP (torch.distributed.fsdp) reached a sparse {layout} parameter of shape {tuple(found[0].shape)} "
            f"({what if isinstance(what, str) else op_name(what)}): it shards parameters as dense tensors, which would drop the layout and train it dense. "
            "Wrap sparse models with DistributedDataParallel (sten.sparse_ddp), or leave the sparse parameters "
            "out of FSDP (fully_shard(..., ignored_params=...), FullyShardedDataParallel(ignored_states=...))")


def densify_tree(tree: Any) -> Any:
    """``densify`` applied through tuples, lists and dicts."""
    return map_tensors(densify, tree)


def map_tensors(fn: Any, tree: Any, leaf: type | None = None) -> Any:
    """``tree`` (lists, tuples, named tuples, torch return types, dicts) with each
    tensor ``t`` in it replaced by ``fn(t)``; with ``leaf``, each instance of that
    class instead.

    Example:
        >>> map_tensors(lambda t: t * 2, {"a": [torch.ones(1), 3]})
        {'a': [tensor([2.]), 3]}
    """
    t = type(tree)
    if leaf is not None:
        if t is leaf:
            return fn(tree)
    elif t in DENSE_TYPES or t in WRAPPER_TYPES or (t not in PLAIN_TYPES and isinstance(tree, torch.Tensor)):
        return fn(tree)
    if t is list or t is tuple or (isinstance(tree, (list, tuple)) and not isinstance(tree, torch.Size)):
        return rebuild_seq(tree, [map_tensors(fn, v, leaf) for v in tree])
    if isinstance(tree, dict):
        return {k: map_tensors(fn, v, leaf) for k, v in tree.items()}
    return tree


def rebuild_seq(like: Any, items: list) -> Any:
    """A list, tuple, named tuple or torch return type like ``like`` with ``items``."""
    t = type(like)
    if t is list or t is tuple:
        return t(items)
    if hasattr(like, "_fields"):
        return t(*items)
    try:
        return t(items)  # torch.return_types (structseq)
    except TypeError:
        return tuple(items)


def _detach(self: SparseTensorWrapper) -> SparseTensorWrapper:
    """``w.detach()``: an alias (same layout cell, same version counter) without history."""
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor.detach(self)   # (grad_fmt kept: nn.Parameter(w) and Module._apply detach)


def _requires_grad_(self: SparseTensorWrapper, requires_grad: bool = True) -> SparseTensorWrapper:
    with torch._C.DisableTorchFunctionSubclass():
        torch.Tensor.requires_grad_(self, requires_grad)
    if self._is_param:  # not while nn.Parameter(w) makes a parameter of it: it checks the class first
        sync_class(self)
    return self


def _set_requires_grad(self: SparseTensorWrapper, requires_grad: bool) -> None:
    with torch._C.DisableTorchFunctionSubclass():
        torch.Tensor.requires_grad.__set__(self, requires_grad)
    if self._is_param:
        sync_class(self)


def _to_dense_method(self: SparseTensorWrapper, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self.to_dense()


def _get_data(self: SparseTensorWrapper) -> SparseTensorWrapper:
    """``w.data``: the same values without history (an alias of the layout cell;
    unlike ``detach()``, autograd does not see changes made through it)."""
    return _alias(self)


def _set_data(self: SparseTensorWrapper, value: torch.Tensor) -> None:
    """``w.data = t``: a wrapper's layout, or a dense tensor held exactly in ``w``'s
    layout class (``replacement_layout``: a ``ValueError`` where it cannot be); shape,
    dtype and device follow the new value (``Module._apply``). Autograd does not see it
    (no version bump), as ``x.data = t`` on a dense tensor."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"data must be a tensor, got {type(value).__name__}")
    refuse_sharding(self, "w.data = t")
    _store(self, _replacement(self, value, "w.data = t"))


def _set_(self: SparseTensorWrapper, source: torch.Tensor) -> SparseTensorWrapper:
    """``w.set_(t)`` (``aten.set_.source_Tensor``, reached below autograd, which checked the
    call and bumps the version counter): ``w``'s contents replaced by ``t`` as by
    ``w.data = t``, exactly or with a ``ValueError``."""
    _store(self, _replacement(self, source, "w.set_(t)"))
    return self


def _replacement(target: SparseTensorWrapper, value: torch.Tensor, what: str) -> Any:
    """The layout object that replaces ``target``'s contents with ``value``: a wrapper's
    own layout (shared, as ``w.data = t`` shares ``t``'s storage), else ``replacement_layout``."""
    if isinstance(value, SparseTensorWrapper):
        return value.wrapped_tensor
    return replacement_layout(target, value.detach(), what, REPLACE_ADVICE)


def _store(target: SparseTensorWrapper, layout: Any) -> None:
    """Make ``layout`` ``target``'s layout object, with its shape, dtype and device
    (no version bump: callers that autograd must see bump it)."""
    shape, dtype, device = layout_metadata(layout)
    if (shape, dtype, device) != (target.shape, target.dtype, target.device):
        shell = SparseTensorWrapper(layout)
        with torch._C.DisableTorchFunctionSubclass():
            torch.Tensor.data.__set__(target, shell)  # the tensor's own metadata
    target._cell[0] = layout
    sync_class(target)


def _view_as(self: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``t.view_as(w)`` is ``t.view(w.shape)``, as torch defines it: for a dense ``t`` a dense
    view with no dispatch (what ``vector_to_parameters`` assigns to ``w.data``; it fell back
    with a warning, an error in raise mode), for a wrapper its dispatched ``view``."""
    same = _differentiable_self_view(self, other)
    return same if same is not None else self.view(other.shape)


def _switched_off_dropout(func: Any) -> Callable:
    """The handler of a dropout function (``F.dropout``, ``F.alpha_dropout``, ...): a call that drops
    nothing (``training=False``, as an ``nn.Dropout`` in eval mode calls it, or ``p=0``) returns its
    input itself, as dense torch does. It ran densely: a sparse intermediate reached the next layer
    as a dense view, which then ran its dense kernel instead of the sparse one."""
    signature = inspect.signature(func)

    def handler(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            bound = None
        if bound is not None:
            bound.apply_defaults()
            given, p, training = bound.arguments["input"], bound.arguments["p"], bound.arguments["training"]
            if isinstance(given, SparseTensorWrapper) and isinstance(p, (int, float)) and 0 <= p <= 1 \
                    and (not training or p == 0):
                return given
        return _DISPATCH
    return handler


def _module_load(self: torch.Tensor, other: Any, assign: bool = False) -> Any:
    """``Tensor.module_load``: what ``load_state_dict`` swaps into a parameter when
    ``torch.__future__.set_swap_module_params_on_conversion(True)`` is on. As without the flag
    (``param.copy_(value)``), a wrapper gets the value by ``copy_`` rules (exact, or at its stored
    positions, or the ``ValueError``), here into a copy of itself; torch's default copied into
    the dense view and swapped that in, so the weight lost its layout and the next optimizer step
    failed. ``assign=True`` and a dense ``self`` run torch's default."""
    if assign or not isinstance(self, SparseTensorWrapper):
        return other.detach() if assign else self.copy_(other).detach()
    cls = SparseParameterWrapper if isinstance(self, SparseParameterWrapper) else SparseTensorWrapper
    new = cls(_copy_layout(self.wrapped_tensor), self.requires_grad, self.grad_fmt)   # the same class
    with torch.no_grad():
        new.copy_(other)
    new._is_param = self._is_param   # (nn.Parameter(wrapper) too)
    return new


def _expand_as(self: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``t.expand_as(w)`` is ``t.expand(w.shape)`` (see ``_differentiable_self_view``)."""
    same = _differentiable_self_view(self, other)
    return same if same is not None else self.expand(other.shape)


def _differentiable_self_view(self: torch.Tensor, other: torch.Tensor) -> torch.Tensor | None:
    """For a wrapper that requires grad viewed or expanded to its own shape, its differentiable
    dense value (``to_dense()``), whose ``grad_fn`` leads straight to the wrapper's own node:
    torch finds a leaf's gradient accumulator as ``w.view_as(w).grad_fn.next_functions[0][0]``
    (``get_gradient_edge``, ``register_multi_grad_hook``; Megatron-LM and Apex hook
    ``w.expand_as(w)``'s), and the dense path's extra view put an unused densify node there:
    the hooks never fired and ``autograd.grad`` refused the edge. ``None`` otherwise."""
    if not isinstance(self, SparseTensorWrapper) or not self.requires_grad or not torch.is_grad_enabled() \
            or tuple(other.shape) != tuple(self.shape) or torch.compiler.is_compiling():
        return None
    return services.dense_with_grad(self)


_T = torch.Tensor
_PASSTHROUGH = {
    _T.grad.__set__,
    _T.size, _T.dim, _T.numel, _T.nelement, _T.element_size, _T.stride, _T.is_contiguous,
    _T.is_floating_point, _T.is_complex, _T.get_device, _T.retain_grad,
    _T.register_hook, _T.register_post_accumulate_grad_hook, _T.backward, _T.__hash__,
    _T.__len__, _T.data_ptr, _T._is_view, _T.__setstate__, _T.dim_order, _T.is_inference,
    torch.is_complex, torch.is_floating_point, torch.numel, torch.is_tensor,
    torch.autograd.backward, torch.autograd.grad, torch._has_compatible_shallow_copy_type,
    # metadata that torch.compile reads when it fakes a traceable wrapper
    _T.untyped_storage, _T.storage_offset, _T.is_conj, _T.is_neg, _T._is_zerotensor, _T.__dir__,
}
for _name in ("shape", "dtype", "device", "requires_grad", "grad", "grad_fn", "is_leaf", "layout",
              "ndim", "is_cuda", "is_sparse", "is_quantized", "is_meta", "_version", "is_nested",
              "names", "output_nr", "_base", "retains_grad", "_post_accumulate_grad_hooks",
              "_backward_hooks", "is_mkldnn", "is_sparse_csr", "is_xpu", "is_mps", "itemsize",
              "nbytes", "is_cpu", "_is_param", "grad_dtype"):
    _prop = getattr(_T, _name, None)
    if _prop is not None and hasattr(_prop, "__get__"):
        _PASSTHROUGH.add(_prop.__get__)
_SPECIAL = {_T.detach: _detach, _T.to_dense: _to_dense_method, _T.data.__get__: _get_data,
            _T.data.__set__: _set_data, _T.requires_grad_: _requires_grad_,
            _T.requires_grad.__set__: _set_requires_grad, _T.view_as: _view_as, _T.expand_as: _expand_as,
            _T.module_load: _module_load}
_F = torch.nn.functional
_SPECIAL.update({f: _switched_off_dropout(f) for f in (_F.dropout, _F.dropout1d, _F.dropout2d, _F.dropout3d,
                                                        _F.alpha_dropout, _F.feature_alpha_dropout)})
_PASS = object()  # marks functions that run as on any tensor (metadata)
_DISPATCH = object()  # a handler's answer: this call goes through the dispatcher after all
_HANDLERS: dict = {**{f: _PASS for f in _PASSTHROUGH}, **_SPECIAL}
