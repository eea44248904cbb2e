"""``torch.compile`` support: the dispatch decision made while Dynamo traces.

While Dynamo traces a model (``torch.compiler.is_compiling()``), a wrapper's
``__torch_function__`` does not run the eager dispatcher (its autograd node,
plan caches and ctypes kernels are not traceable). It looks up, by operator
and input layouts, a *compiled implementation* registered with
``registry.register_compiled_impl``: traceable code that calls custom
operators (``torch.library.custom_op``) on the layouts' plain member tensors.
Dynamo traces through the look-up (it is ordinary Python on constants, guarded
on the layouts' classes), so the graph holds the chosen custom operator
directly. Calls without one, and calls whose sparse operands require grad
under grad mode (their gradient belongs to the wrapper, which a compiled graph
cannot take as an input yet), run the eager dispatcher: Dynamo breaks the graph
there and the results stay those of eager. Matrix products without a compiled
implementation (a third-party layout) run densely on the layout's ``to_dense()``,
traced into the graph when that method is plain torch code. In-place calls on a
traceable wrapper (a graph input) and a trainable weight's other calls without
grad mode (an optimizer step: its updates and state, which eager keeps in the
layout) run the eager dispatcher after a graph break too: Dynamo learns a graph
node's output by running it on fake tensors, where the eager path raises the
exception Dynamo turns into a graph break (``tensor._eager_or_graph_break``).

Example:
    >>> import torch, sten_core as sten
    >>> m = torch.nn.Linear(8, 4)
    >>> m.weight = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(m.weight.detach()), requires_grad=False)
    >>> x = torch.randn(2, 8)
    >>> torch._dynamo.explain(m)(x).graph_break_count
    0
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from sten_core.dispatch import compiled_products, dynamo_matmul
from sten_core.dispatch.eager_only import never_compiled
from sten_core.dispatch.errors import UnsupportedTrainingOp  # noqa: F401  (raised here; its home is errors)
from sten_core.model import tensor as tensor_module
from sten_core.model.layouts import to_dense_tensor
from sten_core.model.registry import registry
from sten_core.model.tensor import TRACEABLE_LAYOUTS, SparseTensorWrapper, services
from sten_core.plugins import manager as plugins

MISSING = object()
"""``compiled_call``'s answer when no compiled implementation applies."""


def compiled_impl_for(op: Any, args: tuple) -> Callable | None:
    """The compiled implementation for a call of ``op`` on ``args``, or ``None``
    when there is none or a sparse operand needs a gradient under grad mode.

    Example:
        >>> import torch, torch.nn.functional as F, sten_core as sten
        >>> w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(2)))
        >>> compiled_impl_for(F.linear, (torch.ones(1, 2), w)).__name__
        'csr_linear_kernel'
    """
    _plugins_loaded()
    grad = torch.is_grad_enabled()
    layouts = []
    training = dense_view = False
    for i, a in enumerate(args):
        if isinstance(a, SparseTensorWrapper):
            if grad and a.requires_grad:
                from sten_core.dispatch.traceable import (  # loaded with the plugins (not at import: custom ops)
                    gives_dense_grad, trains_compiled, traceable)

                if op is torch.nn.functional.linear and i == 1 and trains_compiled(a):
                    training = True  # a traceable wrapper: its gradient is computed in the graph
                elif i == 0 and compiled_products.is_weight_first_product(op, args) and trains_compiled(a):
                    training = True  # W @ x: F.linear(x^T, W)^T, the same gradient in the graph
                elif traceable(a) and gives_dense_grad(a.grad_fmt) and not _in_place(op):
                    dense_view = True  # any other operator: on its differentiable dense view (eager's gradient)
                elif traceable(a) and _in_place(op):
                    return None  # the eager dispatcher, after a graph break (an optimizer's update)
                elif traceable(a):  # a graph input: the eager dispatcher cannot run on its fake members
                    raise UnsupportedTrainingOp(unsupported_training_message(op, a))
                else:
                    return None
            layouts.append(type(a.wrapped_tensor))
        elif isinstance(a, torch.Tensor):
            layouts.append(torch.Tensor)
        else:
            layouts.append(None)
    while layouts and layouts[-1] is None:
        layouts.pop()
    if dense_view:
        return dense_training_call
    impl = registry.compiled.get((op, tuple(layouts)))
    if training:
        from sten_core.dispatch.traceable import linear_training

        if op is not torch.nn.functional.linear:  # W @ x
            impl = compiled_products.weight_first_impl(op, tuple(layouts))
            return compiled_products.weight_first_training if impl is not None else None
        return linear_training if impl is not None else None
    if impl is None:  # W @ x: the layout's compiled F.linear, transposed
        impl = compiled_products.weight_first_impl(op, tuple(layouts))
    if impl is None and op in DENSE_RESULT_OPS:
        return dense_call
    if impl is None and op in TRANSPOSES and layouts and layouts[0] in TRACEABLE_LAYOUTS:
        return dense_call  # W.t() of a frozen weight: its traced dense matrix, transposed (x @ W.t())
    inputs = [a for a in args if isinstance(a, SparseTensorWrapper) and hasattr(type(a), "__tensor_flatten__")]
    if impl is None and inputs:
        # a traceable wrapper is a graph input (fake members while tracing): the eager dispatcher
        # cannot run on it, so the operator runs on its traced to_dense() (eager's fallback too),
        # but for writes and a trainable weight's other calls without grad mode (an optimizer's
        # update and state: eager keeps them in the layout), which run eagerly after a graph break
        if _in_place(op) or any(a.requires_grad for a in inputs):
            return None
        return dense_call
    return impl


_IN_PLACE_DUNDERS = frozenset({"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul", "iand",
                               "ior", "ixor", "ilshift", "irshift"})


def _in_place(op: Any) -> bool:
    """Whether ``op`` changes its first operand in place (``add_``, ``__iadd__``; not ``__matmul__``).

    >>> _in_place(torch.Tensor.add_), _in_place(torch.Tensor.__iadd__), _in_place(torch.Tensor.__matmul__)
    (True, True, False)
    """
    name = getattr(op, "__name__", "")
    if name.startswith("__") and name.endswith("__"):
        return name[2:-2] in _IN_PLACE_DUNDERS
    return name.endswith("_")


def eager_only_message(op: Any, args: tuple) -> str:
    """Why a call on a traceable wrapper runs eagerly, after a graph break (Dynamo's reason).

    Example:
        >>> import torch, sten_core as sten
        >>> w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(2)))
        >>> eager_only_message(torch.Tensor.mul_, (w, 2)).split(";")[0]
        'STen: the in-place mul_ on a CsrTensor wrapper runs eagerly (a graph break)'
    """
    name = getattr(op, "__name__", repr(op))
    found: list = []
    tensor_module.map_tensors(found.append, args)  # (the lists of a _foreach_ call too)
    layouts = ", ".join(sorted({type(a.wrapped_tensor).__name__ for a in found if isinstance(a, SparseTensorWrapper)}))
    kind = "the in-place " if _in_place(op) else ""
    return (f"STen: {kind}{name} on a {layouts} wrapper runs eagerly (a graph break); to compile without it, "
            f"change the weight outside the compiled function (call opt.step() after it)")


def dense_training_call(op: Any, *args: Any, **kwargs: Any) -> Any:
    """``op`` while compiling a training step, a trainable wrapper argument (traceable, dense
    ``grad_fmt``) replaced by its differentiable dense view (``sten_core::wrapper_dense``: the
    weight's gradient a plain dense tensor, as eager gives it), other wrappers by their dense
    matrix: ``torch.mm(x, W.t())``, ``x @ W.t()``, ``torch.addmm(b, x, W.t())`` train compiled.

    Example:
        >>> import torch, sten_core as sten
        >>> w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(torch.eye(2)))
        >>> dense_training_call(torch.Tensor.t, w).sum().backward(); w.grad.tolist()
        [[1.0, 1.0], [1.0, 1.0]]
    """
    from sten_core.dispatch.dense_view import dense_view

    def dense(a: Any) -> Any:
        if isinstance(a, SparseTensorWrapper):
            return dense_view(a) if a.requires_grad and torch.is_grad_enabled() else _dense_of(a)
        return a

    return op(*[dense(a) for a in args], **{k: dense(v) for k, v in kwargs.items()})



_WEIGHT_PRODUCTS = {torch.mm: "torch.mm", torch.matmul: "torch.matmul", torch.addmm: "torch.addmm",
                    torch.Tensor.mm: "Tensor.mm", torch.Tensor.matmul: "Tensor.matmul",
                    torch.Tensor.__matmul__: "@", torch.Tensor.__rmatmul__: "@", torch.Tensor.t: "Tensor.t",
                    torch.t: "torch.t", torch.Tensor.transpose: "Tensor.transpose"}


def unsupported_training_message(op: Any, weight: Any) -> str:
    """What ``UnsupportedTrainingOp`` says: the operator, the weight's layout, what to use instead.

    Example:
        >>> import torch, sten_core as sten
        >>> w = sten.SparseTensorWrapper(sten.DenseTensor.from_dense(torch.ones(2, 2)))
        >>> unsupported_training_message(torch.mm, w).split(": only")[0]
        'torch.compile: torch.mm on a trainable DenseTensor weight whose grad_fmt keeps its layout'
    """
    name = _WEIGHT_PRODUCTS.get(op) or getattr(op, "__qualname__", None) or getattr(op, "__name__", repr(op))
    layout = type(weight.wrapped_tensor).__name__
    from sten_core.dispatch.compiled_regrad import resparsifies

    fmt = "re-sparsifies its gradient" if resparsifies(weight.grad_fmt, type(weight.wrapped_tensor)) else "keeps its layout"
    return (f"torch.compile: {name} on a trainable {layout} weight whose grad_fmt {fmt}: only "
            f"F.linear(x, weight, bias) (nn.Linear) and W @ x (torch.mm(W, x), torch.matmul(W, x)) compute that "
            f"gradient in a compiled graph; a "
            f"weight product such as x @ W.t(), torch.mm(x, W.t()), torch.matmul(x, W.t()) or "
            f"torch.addmm(b, x, W.t()) must be written F.linear(x, W, b) to train compiled (the eager one densifies "
            f"W and re-sparsifies its gradient, a new pattern); or give W a dense gradient (grad_fmt=None or "
            f"(KeepAll(), Tensor, KeepAll(), Tensor): any operator then trains compiled on its dense view), run "
            f"this step eagerly, or freeze W (requires_grad=False) for inference. See docs/compile.md")


def _plugins_loaded() -> bool:
    """Load the plugins (their compiled implementations) before the first look-up; Dynamo
    runs this at trace time instead of tracing it (loading takes a lock, imports)."""
    plugins.ensure_loaded()
    return True


# What torch.compiler.assume_constant_result(_plugins_loaded) sets; calling it here would
# import torch._dynamo with sten_core (seconds; tests/test_import.py keeps the import light).
_plugins_loaded._dynamo_marked_constant = True  # type: ignore[attr-defined]


TRANSPOSES = frozenset({torch.t, torch.Tensor.t, torch.transpose, torch.Tensor.transpose})
"""Transpositions of a frozen weight: while compiled, the transposed traced dense matrix (eager gives
a dense or a transposed sparse tensor of the same values; what follows is a product)."""

DENSE_RESULT_OPS = frozenset({
    torch.nn.functional.linear, torch.mm, torch.matmul, torch.addmm, torch.bmm,
    torch.Tensor.mm, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
})
"""Operators whose eager result is a dense tensor whatever the layouts: without a
compiled implementation they run on the layouts' ``to_dense()`` while compiled."""


def dense_call(op: Any, *args: Any, **kwargs: Any) -> Any:
    """``op`` on the dense tensors of its wrapper arguments: the compiled graph holds
    the layout's ``to_dense`` (traced; a graph break where it is not traceable) and
    the dense operator."""
    dense = [_dense_of(a) if isinstance(a, SparseTensorWrapper) else a for a in args]
    return op(*dense, **kwargs)


TRACED_DENSE: dict = {}
"""Layout class -> ``dense(layout)`` from its member tensors, for layouts whose ``to_dense()``
reads state a traceable wrapper does not carry while traced (the torch CSR/CSC tensor)."""


def _dense_of(wrapper: SparseTensorWrapper) -> torch.Tensor:
    layout = wrapper.wrapped_tensor
    if type(layout) in TRACED_DENSE:  # (CSR/CSC: to_dense() reads a torch sparse tensor, which Dynamo cannot wrap)
        return TRACED_DENSE[type(layout)](layout)
    if type(layout) in TRACEABLE_LAYOUTS:  # one sten_core::members_to_dense node: the layout's own to_dense()
        from sten_core.dispatch.dense_view import traced_dense

        return traced_dense(layout)
    return to_dense_tensor(layout)


def compiled_call(op: Any, args: tuple, kwargs: dict) -> Any:
    """Run a call's compiled implementation (while Dynamo traces); ``MISSING`` if none applies.
    ``x.__rmatmul__(W)`` (how Dynamo traces ``W @ x``, see ``dynamo_matmul``) is ``torch.matmul(W, x)``."""
    if op is torch.Tensor.__rmatmul__ and len(args) == 2 and not kwargs:
        op, args = torch.matmul, (args[1], args[0])
    impl = compiled_impl_for(op, args)
    if impl is None:
        return MISSING
    if impl is dense_training_call:
        return dense_training_call(op, *args, **kwargs)
    if impl is compiled_products.weight_first_training:  # (out=...: torch's own error for out= under autograd)
        return dense_training_call(op, *args, **kwargs) if kwargs else impl(*args, op=op)
    if impl is dense_call or (kwargs and impl in _WEIGHT_FIRST):  # (out=...: eager's dense fallback)
        return dense_call(op, *args, **kwargs)
    if torch._C._are_functorch_transforms_active():   # compiled vmap / vmap(grad): the layouts' custom
        return dense_call(op, *args, **kwargs)         # operators have no batching rules (eager: dense too)
    return autocast_result(op, args, impl(*args, **kwargs))


AUTOCAST_PRODUCTS = frozenset({
    torch.nn.functional.linear, torch.mm, torch.matmul, torch.addmm, torch.bmm,
    torch.Tensor.mm, torch.Tensor.matmul, torch.Tensor.__matmul__,
})
"""Products on CPU autocast's lower-precision list: eager's sparse kernels (and dense torch) return
the autocast dtype for them."""


def autocast_result(op: Any, args: tuple, result: Any) -> Any:
    """``result`` of a layout's compiled operator for ``op``, in CPU autocast's dtype when autocast is
    on, as eager and dense torch return it. The custom operators in the graph have no autocast rule,
    so without this a compiled product under ``torch.autocast("cpu", torch.bfloat16)`` returned
    float32 where eager returns bfloat16 (values rounded once, at the end; eager rounds the operands:
    equal within the autocast dtype's precision). Float64 operands are never cast, as in torch, nor
    results of a layout whose class sets ``ignores_autocast = True`` (its eager kernels compute in the
    weight's dtype under autocast too, e.g. the scipy layouts).

    Example:
        >>> import torch, torch.nn.functional as F
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     autocast_result(F.linear, (torch.ones(1, 2), torch.ones(3, 2)), torch.ones(1, 3)).dtype
        torch.bfloat16
    """
    if op not in AUTOCAST_PRODUCTS or not isinstance(result, torch.Tensor) or result.device.type != "cpu":
        return result
    if not torch.is_autocast_enabled("cpu") or not result.is_floating_point() or result.dtype == torch.float64:
        return result
    if any(isinstance(a, torch.Tensor) and a.dtype == torch.float64 for a in args):
        return result
    if any(getattr(type(a.wrapped_tensor), "ignores_autocast", False) for a in args if isinstance(a, SparseTensorWrapper)):
        return result
    dtype = torch.get_autocast_dtype("cpu")
    return result if result.dtype == dtype else result.to(dtype)


_WEIGHT_FIRST = (compiled_products.weight_first_matmul, compiled_products.weight_first_mm)


def _mark_eager_code() -> None:
    """Keep Dynamo from compiling STen's eager machinery as frames of their own (see ``eager_only``):
    code run eagerly after a graph break (``loss.backward()`` in a compiled training step, an
    optimizer's update of a weight) or by a compiled graph's runtime (its wrapper outputs) calls
    them, and Dynamo compiling them failed inside (``'dict' object has no attribute 'node'`` in
    ``_alias``, no ``_cell`` in a wrapper built by a compiled ``__new__``, ``IndexError`` in Dynamo's
    ``pgo`` in the eager backward of a step compiled with ``backend="eager"``) or changed a value's
    layout (a scipy weight's gradient rebuilt by a compiled ``__tensor_unflatten__``). Only frames
    Dynamo would compile on their own are affected: it still inlines these while tracing.
    (``__torch_function__`` is not marked: Dynamo compiling it where a model's frame breaks is what
    ``testing.check_compile`` reports; the eager ``dispatch_call`` it reaches is marked.)"""
    from sten_core.dispatch import autograd, dense_path, entry  # (import nothing of this module)

    t = tensor_module
    wrapper = t.SparseTensorWrapper.__dict__
    functions = [entry.dispatch_call, wrapper["__torch_dispatch__"].__func__,
                 t.SparseTensorWrapper.__new__, t.SparseParameterWrapper.__new__,
                 t._Traceable.__tensor_unflatten__, t._Traceable.__tensor_flatten__,
                 t._alias, t.sync_class, t.write_back, t.detached]
    for function_cls in (autograd._DispatchFunction, autograd._Densify, autograd._Sparsify, dense_path._InPlace):
        functions += [function_cls.forward, function_cls.backward]
    for fn in functions:
        never_compiled(fn)


_mark_eager_code()
# handed to the wrapper now, so tracing never sets a global
services.install(compiled_call=compiled_call, MISSING=MISSING, eager_only_message=eager_only_message)
dynamo_matmul.install()
