"""Conformance kit for layout plugins.

A layout plugin calls these from its own test suite; each compares with the
dense reference and raises ``AssertionError`` with the failing case.

Example (in a plugin's tests):
    >>> import sten_core as sten
    >>> from sten_core.testing import check_checkpoint, check_layout, check_linear
    >>> check_layout(sten.CsrTensor)
    >>> check_linear(sten.CsrTensor)
    >>> check_checkpoint(sten.CsrTensor)
    >>> check_to(sten.CsrTensor)
    >>> report = check_compile(sten.CsrTensor)
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F

from sten_core import dispatch, plugins
from sten_core.model.layouts import StateTensors, implements, layout_metadata, supports_values, to_dense_tensor
from sten_core.model.registry import registry
from sten_core.training.serialization import densify_state_dict
from sten_core.model.sparsifiers import KeepAll, ScalarFractionSparsifier
from sten_core.model.tensor import SparseParameterWrapper, SparseTensorWrapper

DEFAULT_SHAPES = ((5, 8), (1, 1), (7, 13), (16, 32))
DEFAULT_DTYPES = (torch.float32, torch.float64)


def _tolerances(dtype: torch.dtype) -> dict:
    if dtype in (torch.float16, torch.bfloat16):
        return {"rtol": 2e-2, "atol": 2e-2}
    return {"rtol": 1e-4, "atol": 1e-5}


def _sample(shape: tuple, dtype: torch.dtype, sparsifier: Any, device: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype).to(device)
    return dense * sparsifier.mask(dense)


def check_layout(layout_cls: type, *, shapes: Iterable[tuple] = DEFAULT_SHAPES,
                 dtypes: Iterable[torch.dtype] = DEFAULT_DTYPES, sparsifier: Any = None,
                 device: str = "cpu") -> None:
    """Round trip, metadata, ``nnz``, wrapper, pickling, checkpoints
    (``check_checkpoint``), conversions, the stored-values protocol and
    sparsifying into ``layout_cls``."""
    plugins.ensure_loaded()
    sparsifier = sparsifier or ScalarFractionSparsifier(0.5)
    for i, shape in enumerate(shapes):
        for dtype in dtypes:
            case = f"{layout_cls.__name__} shape={tuple(shape)} dtype={dtype}"
            dense = _sample(tuple(shape), dtype, sparsifier, device, seed=i)
            obj = layout_cls.from_dense(dense)
            back = to_dense_tensor(obj)
            assert back.dtype == dtype, f"{case}: to_dense dtype {back.dtype}"
            assert torch.equal(back.cpu(), dense.cpu()), f"{case}: to_dense(from_dense(x)) != x"
            got_shape, got_dtype, got_device = layout_metadata(obj)
            assert tuple(got_shape) == tuple(shape) and got_dtype == dtype, f"{case}: metadata {got_shape}, {got_dtype}"
            nnz = getattr(obj, "nnz", None)
            if nnz is not None:
                assert nnz >= int((dense != 0).sum()), f"{case}: nnz {nnz} below the nonzero count"
            wrapper = SparseTensorWrapper(obj)
            assert wrapper.shape == dense.shape and wrapper.dtype == dtype and wrapper.dim() == dense.dim()
            assert torch.equal(wrapper.to_dense().cpu(), dense.cpu()), f"{case}: wrapper.to_dense()"
            loaded = pickle.loads(pickle.dumps(wrapper))
            assert torch.equal(loaded.to_dense().cpu(), dense.cpu()), f"{case}: pickle round trip"
            param = SparseParameterWrapper(obj)
            assert isinstance(param, torch.nn.Parameter) and param.requires_grad, f"{case}: parameter"
            kept = dispatch.sparsify(KeepAll(), dense, layout_cls)
            assert torch.equal(kept.to_dense().cpu(), dense.cpu()), f"{case}: sparsify(KeepAll(), x, layout)"
            _check_values_protocol(obj, dense, case)
            _check_conversions(layout_cls, wrapper, dense, case)
            _check_checkpoint(obj, layout_cls.from_dense(_sample(tuple(shape), dtype, sparsifier, device, seed=i + 50)), case)


def check_checkpoint(layout_cls: type, *, shapes: Iterable[tuple] = ((16, 32), (5, 8)),
                     dtypes: Iterable[torch.dtype] = (torch.float32,), sparsifier: Any = None,
                     device: str = "cpu", make: Callable[[torch.Tensor], Any] | None = None) -> None:
    """A model holding a ``layout_cls`` weight saves with ``torch.save(model.state_dict())``
    and loads with the default ``torch.load`` (``weights_only=True``), exactly: into a
    fresh sparse model (other values and pattern before loading) and, through
    ``densify_state_dict``, into a dense one.

    ``make(dense)`` builds the layout object (default ``layout_cls.from_dense``);
    the dense samples are masked by ``sparsifier`` (default: 50 % magnitude).
    The layout must be registered and implement ``state_tensors()`` and the
    classmethod ``from_state_tensors(tensors, shape)`` (plain tensors only).
    """
    plugins.ensure_loaded()
    sparsifier = sparsifier or ScalarFractionSparsifier(0.5)
    make = make or layout_cls.from_dense
    for i, shape in enumerate(shapes):
        for dtype in dtypes:
            case = f"{layout_cls.__name__} shape={tuple(shape)} dtype={dtype}"
            saved = make(_sample(tuple(shape), dtype, sparsifier, device, seed=200 + i))
            other = make(_sample(tuple(shape), dtype, sparsifier, device, seed=300 + i))
            assert isinstance(saved, layout_cls), f"{case}: make() returned {type(saved).__name__}"
            _check_checkpoint(saved, other, case)


def check_to(layout_cls: type, *, shapes: Iterable[tuple] = ((16, 32), (5, 8)),
             dtypes: Iterable[torch.dtype] = (torch.float64, torch.float16, torch.bfloat16),
             sparsifier: Any = None, device: str = "cpu", make: Callable[[torch.Tensor], Any] | None = None,
             devices: Iterable[str] = ()) -> None:
    """Moves keep the layout: ``w.to(dtype)``, ``Module.to(dtype)`` / ``.half()`` /
    ``.double()`` and, for each of ``devices`` (e.g. ``("cuda",)``), ``w.to(device)``
    give the same layout class with the new dtype/device, values equal to the dense
    tensor moved the same way, and a module whose forward still runs.

    A layout moves through its own ``to(device=None, dtype=None)``, or its
    ``state_tensors()`` / ``from_state_tensors()``, or (dtype only) its stored
    values; one that can do none fails here with what to implement.
    """
    plugins.ensure_loaded()
    sparsifier = sparsifier or ScalarFractionSparsifier(0.5)
    make = make or layout_cls.from_dense
    for i, shape in enumerate(shapes):
        dense = _sample(tuple(shape), torch.float32, sparsifier, device, seed=400 + i)
        obj = make(dense)
        dense = to_dense_tensor(obj)  # what the layout stores
        targets = [{"dtype": d} for d in dtypes] + [{"device": torch.device(d)} for d in devices]
        for target in targets:
            case = f"{layout_cls.__name__} shape={tuple(shape)} to({target})"
            moved = SparseTensorWrapper(obj).to(**target)
            assert isinstance(moved, SparseTensorWrapper), f"{case}: returned a {type(moved).__name__}"
            assert type(moved.wrapped_tensor) is layout_cls, f"{case}: became {type(moved.wrapped_tensor).__name__}"
            want = dense.to(**target)
            got_shape, got_dtype, got_device = layout_metadata(moved.wrapped_tensor)
            assert (got_dtype, got_device) == (want.dtype, want.device), f"{case}: layout reports {got_dtype}, {got_device}"
            assert (moved.dtype, moved.device) == (want.dtype, want.device), f"{case}: wrapper reports {moved.dtype}"
            torch.testing.assert_close(to_dense_tensor(moved.wrapped_tensor).cpu(), want.cpu(), msg=f"{case}: values")
        for dtype in (d for d in dtypes if d == torch.float64):
            case = f"{layout_cls.__name__} shape={tuple(shape)} Module.to({dtype})"
            module = _Holder(SparseParameterWrapper(make(dense)), torch.zeros(shape[0]))
            module.to(dtype)
            assert isinstance(module.weight, SparseParameterWrapper), f"{case}: the parameter was replaced"
            assert type(module.weight.wrapped_tensor) is layout_cls, f"{case}: the layout changed"
            assert module.weight.dtype == dtype and module.bias.dtype == dtype, f"{case}: {module.weight.dtype}"
            x = torch.randn(3, shape[1], dtype=dtype, device=device)
            torch.testing.assert_close(module(x), F.linear(x, dense.to(dtype)), msg=f"{case}: forward")


class _Holder(torch.nn.Module):
    """A module with one weight (sparse or dense) and a dense bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.weight = weight
        self.bias = torch.nn.Parameter(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _check_checkpoint(saved: Any, other: Any, case: str) -> None:
    """Save a model with weight ``saved``; load into one with weight ``other`` and a dense one."""
    layout_cls = type(saved)
    dense = to_dense_tensor(saved)
    gen = torch.Generator().manual_seed(7)
    bias = torch.randn(dense.shape[0], generator=gen).to(dense.dtype).to(dense.device)
    model = _Holder(SparseParameterWrapper(saved), bias)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    try:
        loaded = torch.load(buf)  # the default: weights_only=True
    except pickle.UnpicklingError as error:
        raise AssertionError(
            f"{case}: torch.load(weights_only=True) cannot read a state dict holding this layout: register the "
            f"layout and give it state_tensors() and the classmethod from_state_tensors(tensors, shape) "
            f"(plain tensors only). torch said: {str(error).splitlines()[0]}"
        ) from None
    weight = loaded["weight"]
    assert isinstance(weight, SparseTensorWrapper) and type(weight.wrapped_tensor) is layout_cls, \
        f"{case}: loaded weight is {type(getattr(weight, 'wrapped_tensor', weight)).__name__}, expected {layout_cls.__name__}"
    _assert_same_layout(weight.wrapped_tensor, saved, f"{case}: torch.load")
    assert torch.equal(loaded["bias"], bias), f"{case}: bias after torch.load"

    fresh = _Holder(SparseParameterWrapper(other), torch.zeros_like(bias))
    fresh.load_state_dict(loaded)
    assert isinstance(fresh.weight, SparseParameterWrapper), f"{case}: fresh model's weight is no longer a sparse parameter"
    _assert_same_layout(fresh.weight.wrapped_tensor, saved, f"{case}: load_state_dict into a fresh sparse model")
    assert torch.equal(fresh.bias, bias), f"{case}: bias of the fresh sparse model"

    dense_model = _Holder(torch.nn.Parameter(torch.zeros_like(dense)), torch.zeros_like(bias))
    dense_model.load_state_dict(densify_state_dict(loaded))
    assert torch.equal(dense_model.weight.detach(), dense), f"{case}: load_state_dict(densify_state_dict(...)) into a dense model"


def _assert_same_layout(got: Any, want: Any, case: str) -> None:
    """Same class, dtype, shape, dense values and (where defined) stored tensors and pattern."""
    assert type(got) is type(want), f"{case}: {type(got).__name__} is not {type(want).__name__}"
    a, b = to_dense_tensor(got), to_dense_tensor(want)
    assert a.dtype == b.dtype and a.shape == b.shape, f"{case}: {a.dtype} {tuple(a.shape)} != {b.dtype} {tuple(b.shape)}"
    assert torch.equal(a.cpu(), b.cpu()), f"{case}: dense values differ"
    if implements(want, StateTensors):
        for j, (x, y) in enumerate(zip(got.state_tensors(), want.state_tensors())):
            assert x.dtype == y.dtype and torch.equal(x.cpu(), y.cpu()), f"{case}: state tensor {j} differs"
    if supports_values(want):
        assert want.same_pattern(got), f"{case}: the stored pattern differs"


def _check_values_protocol(obj: Any, dense: torch.Tensor, case: str) -> None:
    if not supports_values(obj):
        return
    values = obj.values()
    torch.testing.assert_close(obj.gather(dense), values, msg=f"{case}: gather(x) != values()")
    doubled = to_dense_tensor(obj.with_values(values * 2))
    torch.testing.assert_close(doubled, dense * 2, msg=f"{case}: with_values")
    assert obj.same_pattern(obj.with_values(values * 2)), f"{case}: same_pattern of with_values"


def _check_conversions(layout_cls: type, wrapper: SparseTensorWrapper, dense: torch.Tensor, case: str) -> None:
    for (src, dst) in list(registry.conversions):
        if src is not layout_cls:
            continue
        try:
            dst.from_dense(dense)
        except (ValueError, TypeError):
            continue  # the target cannot hold this shape or dtype at all
        converted = dispatch.convert(wrapper, dst)
        assert torch.equal(converted.to_dense().cpu(), dense.cpu()), f"{case}: conversion to {dst.__name__}"
        if dispatch.conversion_path(dst, src) is not None:
            again = dispatch.convert(converted, src)
            assert torch.equal(again.to_dense().cpu(), dense.cpu()), f"{case}: conversion {dst.__name__} -> back"


def check_linear(layout_cls: type, *, shapes: Iterable[tuple] = ((7, 16, 12), (1, 8, 4), (33, 20, 9)),
                 dtype: torch.dtype = torch.float32, sparsifier: Any = None, device: str = "cpu",
                 sparse_weight_grad: bool = True, require_registered: bool = True) -> None:
    """``F.linear(x, W, b)`` with ``W`` in ``layout_cls``: values and the
    gradients of ``x``, ``W`` (dense, and in ``layout_cls`` at the kept
    positions when ``sparse_weight_grad``) and ``b`` equal the dense ones.

    ``shapes`` are ``(batch, in_features, out_features)``.
    """
    plugins.ensure_loaded()
    sparsifier = sparsifier or ScalarFractionSparsifier(0.5)
    tol = _tolerances(dtype)
    plans: list[str] = []
    observer = lambda event: plans.append(event["plan"])  # noqa: E731
    dispatch.add_observer(observer)
    try:
        for i, (batch, k, n) in enumerate(shapes):
            grad_fmts = [None] + ([(KeepAll(), layout_cls, KeepAll(), layout_cls)] if sparse_weight_grad else [])
            for grad_fmt in grad_fmts:
                for with_bias in (True, False):
                    case = f"{layout_cls.__name__} linear x=[{batch},{k}] W=[{n},{k}] bias={with_bias} grad_fmt={grad_fmt and 'sparse'}"
                    w_dense = _sample((n, k), dtype, sparsifier, device, seed=100 + i)
                    weight = SparseParameterWrapper(layout_cls.from_dense(w_dense), grad_fmt=grad_fmt)
                    gen = torch.Generator().manual_seed(i)
                    x = torch.randn(batch, k, generator=gen).to(dtype).to(device).requires_grad_(True)
                    bias = torch.randn(n, generator=gen).to(dtype).to(device).requires_grad_(True) if with_bias else None
                    x_ref = x.detach().clone().requires_grad_(True)
                    w_ref = w_dense.clone().requires_grad_(True)
                    b_ref = bias.detach().clone().requires_grad_(True) if with_bias else None
                    plans.clear()
                    y = F.linear(x, weight, bias)
                    y_ref = F.linear(x_ref, w_ref, b_ref)
                    torch.testing.assert_close(y, y_ref, msg=lambda m: f"{case}: forward: {m}", **tol)
                    g = torch.randn(y_ref.shape, generator=gen).to(dtype).to(device)
                    y.backward(g)
                    y_ref.backward(g)
                    torch.testing.assert_close(x.grad, x_ref.grad, msg=lambda m: f"{case}: grad x: {m}", **tol)
                    grad_w = weight.grad
                    if grad_fmt is None:
                        torch.testing.assert_close(_dense(grad_w), w_ref.grad, msg=lambda m: f"{case}: grad W: {m}", **tol)
                    else:
                        assert isinstance(grad_w, SparseTensorWrapper) and isinstance(grad_w.wrapped_tensor, layout_cls), \
                            f"{case}: grad W is {type(grad_w).__name__}, expected a {layout_cls.__name__} wrapper"
                        mask = w_dense != 0
                        torch.testing.assert_close(_dense(grad_w) * mask, w_ref.grad * mask, msg=lambda m: f"{case}: grad W: {m}", **tol)
                    if with_bias:
                        torch.testing.assert_close(bias.grad, b_ref.grad, msg=lambda m: f"{case}: grad b: {m}", **tol)
                    if require_registered:
                        assert "fallback" not in plans, f"{case}: a dense fallback ran ({plans})"
    finally:
        dispatch.remove_observer(observer)


def check_compile(layout_cls: type, *, shapes: Iterable[tuple] = ((7, 16, 12), (2, 8, 4)),
                  dtype: torch.dtype = torch.float32, sparsifier: Any = None, device: str = "cpu",
                  require_compiled_impl: bool = False) -> dict:
    """Compile-readiness of ``layout_cls``: an inference ``Linear`` whose weight is
    in ``layout_cls`` compiles with no graph breaks, ``torch.compile(...,
    fullgraph=True)`` runs, and its output equals eager's and the dense one.
    With ``require_compiled_impl``, ``F.linear`` must also have a compiled
    implementation (``registry.register_compiled_impl``) rather than running
    densely on the traced ``to_dense()``.

    ``shapes`` are ``(batch, in_features, out_features)``. Raises
    ``AssertionError`` saying what is missing; returns a report:
    ``{"compiled_impl": name or None, "graph_breaks": int, "reasons": [...]}``.
    """
    import warnings

    from sten_core.dispatch.compiled import compiled_impl_for, dense_call

    plugins.ensure_loaded()
    sparsifier = sparsifier or ScalarFractionSparsifier(0.5)
    tol = _tolerances(dtype)
    name = layout_cls.__name__
    fix = (f"register a compiled implementation (custom operators on the layout's plain member tensors): "
           f"registry.register_compiled_impl(F.linear, (torch.Tensor, {name}, torch.Tensor), impl), "
           f"see docs/compile.md")
    report: dict = {"compiled_impl": None, "graph_breaks": 0, "reasons": []}
    for i, (batch, k, n) in enumerate(shapes):
        case = f"{name} compiled linear x=[{batch},{k}] W=[{n},{k}]"
        w_dense = _sample((n, k), dtype, sparsifier, device, seed=200 + i)
        linear = torch.nn.Linear(k, n).to(dtype).to(device)
        linear.weight = SparseParameterWrapper(layout_cls.from_dense(w_dense), requires_grad=False)
        linear.bias.requires_grad_(False)
        x = torch.randn(batch, k, generator=torch.Generator().manual_seed(i)).to(dtype).to(device)
        impl = compiled_impl_for(F.linear, (x, linear.weight, linear.bias))
        report["compiled_impl"] = None if impl in (None, dense_call) else getattr(impl, "__name__", repr(impl))
        if require_compiled_impl:
            assert report["compiled_impl"] is not None, \
                f"{case}: no compiled implementation of F.linear: it runs densely on to_dense() when compiled; {fix}"
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", dispatch.DispatchWarning)
            eager = linear(x)
            explained = torch._dynamo.explain(linear)(x)
            reasons = [str(r.reason).splitlines()[0] for r in explained.break_reasons]
            report["graph_breaks"] += explained.graph_break_count
            report["reasons"] += reasons
            assert explained.graph_break_count == 0, (
                f"{case}: {explained.graph_break_count} graph break(s): {'; '.join(reasons)}. Either make "
                f"{name}.to_dense() plain torch code on tensors the layout keeps as attributes (no sparse torch "
                f"tensors, no ctypes), or {fix}")
            torch._dynamo.reset()
            try:
                compiled = torch.compile(linear, fullgraph=True)(x)
            except Exception as error:  # what Dynamo, AOTAutograd or the backend refused
                first = str(error).strip().splitlines()[0] if str(error).strip() else ""
                report["reasons"].append(first)
                raise AssertionError(f"{case}: torch.compile(fullgraph=True) failed, a graph break: "
                                     f"{type(error).__name__}: {first}; {fix}") from error
            finally:
                torch._dynamo.reset()
        assert type(compiled) is torch.Tensor, f"{case}: compiled output is {type(compiled).__name__}"
        torch.testing.assert_close(compiled, eager, msg=lambda m: f"{case}: compiled vs eager: {m}", **tol)
        represented = _dense(linear.weight)  # what the layout stores (n:m layouts may drop more than w_dense)
        torch.testing.assert_close(compiled, F.linear(x, represented, linear.bias),
                                   msg=lambda m: f"{case}: compiled vs dense: {m}", **tol)
    return report


def compiled_training_grads(model: torch.nn.Module, x: torch.Tensor, *, fullgraph: bool = True,
                            loss: Callable | None = None) -> dict:
    """One training step's gradients, eager and compiled: what the compiled-training tests compare.

    Runs ``loss(model(x)).backward()`` eagerly, counts the graph breaks of ``model`` under
    ``torch._dynamo.explain``, then runs the same step through ``torch.compile(model,
    fullgraph=fullgraph)`` (Dynamo reset before and after). Gradients are taken per parameter
    (``model.parameters()`` order) then ``x``'s (when it requires grad); a sparse wrapper's
    gradient is kept as is (its layout is compared by the caller), others cloned.

    Returns ``{"eager": [...], "compiled": [...], "eager_out": tensor, "compiled_out": tensor,
    "graph_breaks": n, "reasons": [...]}``.

    Example:
        >>> import torch, sten_core as sten
        >>> lin = torch.nn.Linear(4, 3)
        >>> lin.weight = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(lin.weight.detach()))
        >>> r = compiled_training_grads(lin, torch.randn(2, 4))   # doctest: +SKIP
        >>> r["graph_breaks"], len(r["compiled"])                  # doctest: +SKIP
        (0, 2)
    """
    loss = loss or (lambda y: y.square().sum())
    params = list(model.parameters())

    def step(fn: Callable) -> tuple:
        for p in params:
            p.grad = None
        x.grad = None
        out = fn(x)
        loss(out).backward()
        grads = [p.grad if isinstance(p.grad, SparseTensorWrapper) else
                 (p.grad.clone() if p.grad is not None else None) for p in params]
        if x.requires_grad:
            grads.append(x.grad.clone() if x.grad is not None else None)
        return out.detach(), grads

    torch._dynamo.reset()
    eager_out, eager = step(model)
    explained = torch._dynamo.explain(model)(x)
    for p in params:
        p.grad = None
    torch._dynamo.reset()
    try:
        compiled_out, compiled = step(torch.compile(model, fullgraph=fullgraph))
    finally:
        torch._dynamo.reset()
    return {"eager": eager, "compiled": compiled, "eager_out": eager_out, "compiled_out": compiled_out,
            "graph_breaks": explained.graph_break_count,
            "reasons": [str(r.reason).splitlines()[0] for r in explained.break_reasons]}


def compile_whole(fn: Callable, *args: Any, backend: Any = "inductor") -> Any:
    """``fn(*args)`` through ``torch.compile(fn, fullgraph=True)`` after checking with
    ``torch._dynamo.explain`` that it has no graph break (``AssertionError`` listing the
    reasons otherwise). Dynamo is reset before and after.

    Example:
        >>> import torch
        >>> compile_whole(lambda x: x.relu() + 1, torch.zeros(2))   # doctest: +SKIP
        tensor([1., 1.])
    """
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args)
    assert explained.graph_break_count == 0, [str(r.reason) for r in explained.break_reasons]
    torch._dynamo.reset()
    try:
        return torch.compile(fn, backend=backend, fullgraph=True)(*args)
    finally:
        torch._dynamo.reset()


def sgd_steps_eager_and_compiled(make_model: Callable[[], torch.nn.Module], make_input: Callable[[], torch.Tensor],
                                 *, steps: int = 3, lr: float = 0.05, seed: int = 1
                                 ) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same ``steps`` SGD steps (loss ``model(x).square().sum()``) on two fresh models from
    ``make_model``: one eager, one through ``torch.compile(model, fullgraph=True)``. Inputs come
    from ``make_input`` after ``torch.manual_seed(seed)``, so both runs see the same ones.
    Returns ``(eager_model, compiled_model)`` to compare parameter by parameter.

    Example:
        >>> import torch
        >>> eager, compiled = sgd_steps_eager_and_compiled(lambda: torch.nn.Linear(4, 2),
        ...                                                lambda: torch.randn(3, 4))   # doctest: +SKIP
    """
    def run(compile_it: bool) -> torch.nn.Module:
        model = make_model()
        step = torch.compile(model, fullgraph=True) if compile_it else model
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        torch.manual_seed(seed)
        for _ in range(steps):
            opt.zero_grad()
            step(make_input()).square().sum().backward()
            opt.step()
        return model

    return run(False), run(True)


def check_compile_training(layout_cls: type, *, shapes: Iterable[tuple] = ((6, 16, 12), (2, 8, 4)),
                           dtype: torch.dtype = torch.float32, sparsifier: Any = None,
                           device: str = "cpu") -> dict:
    """Compiled training of ``layout_cls`` weights: a ``Linear`` whose weight is in
    ``layout_cls``, requires grad and keeps its layout and pattern in its gradient
    (``grad_fmt=(KeepAll(), layout_cls, KeepAll(), layout_cls)``) is a traceable
    wrapper, its training step compiles with no graph breaks (``fullgraph=True``),
    and every gradient equals eager's; the weight's equals the dense gradient at
    the stored positions (``layout.gather``).

    Raises ``AssertionError`` saying what is missing (``register_traceable_layout``,
    its gradient kernels, a graph break, a differing gradient); returns
    ``{"traceable": True, "graph_breaks": 0}``.

    Example:
        >>> import sten_core as sten
        >>> check_compile_training(sten.CsrTensor)   # doctest: +SKIP
        {'traceable': True, 'graph_breaks': 0}
    """
    from sten_core.dispatch.traceable import traceable, trains_compiled

    plugins.ensure_loaded()
    sparsifier = sparsifier or ScalarFractionSparsifier(0.5)
    tol = _tolerances(dtype)
    name = layout_cls.__name__
    keep = (KeepAll(), layout_cls, KeepAll(), layout_cls)
    fix = _training_fix(name)
    for i, (batch, k, n) in enumerate(shapes):
        case = f"{name} compiled training step x=[{batch},{k}] W=[{n},{k}]"
        linear = torch.nn.Linear(k, n).to(dtype).to(device)
        linear.weight = SparseParameterWrapper(layout_cls.from_dense(_sample((n, k), dtype, sparsifier, device, 300 + i)),
                                               requires_grad=True, grad_fmt=keep)
        assert traceable(linear.weight), f"{case}: its wrappers are not traceable tensor subclasses; {fix}"
        missing = []
        if layout_cls not in _traceable_grads():
            missing.append("no gradient kernels (register_traceable_layout's grad_input and grad_values)")
        if registry.compiled.get((F.linear, (torch.Tensor, layout_cls, torch.Tensor))) is None:
            missing.append(f"no compiled F.linear (registry.register_compiled_impl(F.linear, (torch.Tensor, {name}, "
                           f"torch.Tensor), impl) and (torch.Tensor, {name}))")
        assert trains_compiled(linear.weight) and not missing, f"{case}: {'; '.join(missing) or 'not trainable'}; {fix}"
        x = torch.randn(batch, k, generator=torch.Generator().manual_seed(i)).to(dtype).to(device).requires_grad_(True)

        try:
            run = compiled_training_grads(linear, x)
        except Exception as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise AssertionError(f"{case}: torch.compile(fullgraph=True) failed: {type(error).__name__}: {first}") from error
        eager, compiled = run["eager"], run["compiled"]
        assert run["graph_breaks"] == 0, f"{case}: {run['graph_breaks']} graph break(s): {'; '.join(run['reasons'])}"
        gw = compiled[0]
        assert isinstance(gw, SparseTensorWrapper) and type(gw.wrapped_tensor) is layout_cls, \
            f"{case}: the weight's compiled gradient is {type(gw).__name__}, not a {name} wrapper"
        for what, got, want in zip(("weight", "bias", "input"), compiled, eager):
            torch.testing.assert_close(_dense(got), _dense(want), msg=lambda m: f"{case}: {what} gradient vs eager: {m}", **tol)
        layout = linear.weight.wrapped_tensor
        w = to_dense_tensor(layout).requires_grad_(True)
        F.linear(x.detach(), w, linear.bias.detach()).square().sum().backward()
        if hasattr(layout, "gather") and supports_values(gw.wrapped_tensor):
            torch.testing.assert_close(gw.wrapped_tensor.values(), layout.gather(w.grad).to(dtype),
                                       msg=lambda m: f"{case}: weight gradient vs dense at the stored positions: {m}", **tol)
    return {"traceable": True, "graph_breaks": 0}


def _traceable_grads() -> dict:
    from sten_core.dispatch.traceable import _GRADS

    return _GRADS


def _training_fix(name: str) -> str:
    """What a layout following the plugin guide needs to train compiled (check_compile_training's advice)."""
    return (f"a layout trains compiled when (1) its kernels are custom operators (torch.library.custom_op) on its "
            f"plain member tensors with fake implementations: the forward F.linear and two gradient operators "
            f"(grad_input: gy @ W shaped like x; grad_values: the stored values' gradient shaped like the values "
            f"member); (2) registry.register_compiled_impl(F.linear, (torch.Tensor, {name}[, torch.Tensor]), impl) "
            f"calls the forward one; (3) sten_core.plugin_api.register_traceable_layout({name}, flatten, unflatten, "
            f"grad_input, grad_values, values_index) where flatten(layout) -> (member tensors, ints) and "
            f"unflatten(tensors, ints) -> layout reads no tensor values (it runs on fake tensors), called from the "
            f"plugin's sten_register; and (4) the weight's grad_fmt is (KeepAll(), {name}, KeepAll(), {name}) "
            f"(the stored values' gradient, pattern kept). Worked example: sten_example_plugin/compiled.py, "
            f"docs/guides/write-a-plugin.md and docs/compile.md")


def _dense(value: Any) -> torch.Tensor:
    return value.to_dense() if isinstance(value, SparseTensorWrapper) else value


FROZEN_WEIGHT_PRODUCTS: dict = {
    "x @ W": (lambda w, x: x @ w, 0), "torch.matmul(x, W)": (lambda w, x: torch.matmul(x, w), 0),
    "torch.mm(x, W)": (lambda w, x: torch.mm(x, w), 0),
    "W.matmul(x.t())": (lambda w, x: w.matmul(x.t()), 1), "W.mm(x.t())": (lambda w, x: w.mm(x.t()), 1),
    "x @ W.t()": (lambda w, x: x @ w.t(), 1),
    "torch.mm(x, W.transpose(0, 1))": (lambda w, x: torch.mm(x, w.transpose(0, 1)), 1),
}
"""``check_compile_weight_products``' products: ``name -> (fn(W, x), which of W's dims x's last is)``."""


def check_compile_weight_products(layout_cls: type, *, shape: tuple = (6, 16), batch: int = 5,
                                  dtype: torch.dtype = torch.float32, sparsifier: Any = None,
                                  device: str = "cpu", products: Iterable[str] | None = None) -> dict:
    """Products of a *frozen* ``layout_cls`` weight ``W`` [n, k] other than ``F.linear`` compile whole:
    ``x @ W``, ``torch.matmul(x, W)``, ``torch.mm(x, W)`` (the wrapper second) and the method calls
    ``W.matmul(x.t())``, ``W.mm(x.t())``, ``x @ W.t()``, ``torch.mm(x, W.transpose(0, 1))``. For
    each: no graph break under ``torch._dynamo.explain``, ``torch.compile(fullgraph=True)`` runs, and its output and ``x``'s gradient equal eager's and
    the dense product's. Raises ``AssertionError`` naming the product; returns ``{product: breaks}``.

    Example:
        >>> import sten_core as sten
        >>> check_compile_weight_products(sten.CsrTensor)["x @ W"]   # doctest: +SKIP
        0
    """
    import warnings

    plugins.ensure_loaded()
    tol = _tolerances(dtype)
    w = SparseParameterWrapper(layout_cls.from_dense(
        _sample(shape, dtype, sparsifier or ScalarFractionSparsifier(0.5), device, seed=400)), requires_grad=False)
    dense = _dense(w)
    report = {}
    for name in products or FROZEN_WEIGHT_PRODUCTS:
        fn, dim = FROZEN_WEIGHT_PRODUCTS[name]
        case = f"{layout_cls.__name__} frozen W={list(shape)}: {name}"
        x = torch.randn(batch, shape[dim], generator=torch.Generator().manual_seed(7)).to(dtype).to(device)
        runs = []
        for run in ("eager", "explain", "compiled", "dense"):
            xi = x.clone().requires_grad_(True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", dispatch.DispatchWarning)
                if run == "explain":
                    torch._dynamo.reset()
                    explained = torch._dynamo.explain(lambda t: fn(w, t))(xi)
                    report[name] = explained.graph_break_count
                    assert explained.graph_break_count == 0, \
                        f"{case}: {explained.graph_break_count} graph break(s): " \
                        f"{'; '.join(str(r.reason).splitlines()[0] for r in explained.break_reasons)}"
                    continue
                torch._dynamo.reset()
                try:
                    y = torch.compile(lambda t: fn(w, t), fullgraph=True)(xi) if run == "compiled" else \
                        fn(dense if run == "dense" else w, xi)
                except Exception as error:
                    raise AssertionError(f"{case}: {run}: {type(error).__name__}: {str(error).strip()[:300]}") from error
                finally:
                    torch._dynamo.reset()
            y.square().sum().backward()
            runs.append((run, y.detach(), xi.grad))
        (_, want, gwant), others = runs[0], runs[1:]
        for run, y, gx in others:
            torch.testing.assert_close(y, want, msg=lambda m: f"{case}: {run} vs eager: {m}", **tol)
            torch.testing.assert_close(gx, gwant, msg=lambda m: f"{case}: x's gradient, {run} vs eager: {m}", **tol)
    return report


TRAINING_WEIGHT_PRODUCTS: dict = {
    "torch.mm(x, W.t()) + b": lambda w, x, b: torch.mm(x, w.t()) + b,
    "x @ W.t() + b": lambda w, x, b: x @ w.t() + b,
    "torch.matmul(x, W.t()) + b": lambda w, x, b: torch.matmul(x, w.t()) + b,
    "torch.addmm(b, x, W.t())": lambda w, x, b: torch.addmm(b, x, w.t()),
    "(W @ x.t()).t() + b": lambda w, x, b: (w @ x.t()).t() + b,
}
"""``check_compile_training_products``' products of a trainable weight ``W`` [n, k] and bias ``b``."""


class _WeightProduct(torch.nn.Module):
    """A weight and a bias used by one of ``TRAINING_WEIGHT_PRODUCTS``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, product: str):
        super().__init__()
        self.weight, self.bias, self.product = weight, torch.nn.Parameter(bias.clone()), product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TRAINING_WEIGHT_PRODUCTS[self.product](self.weight, x, self.bias)


def check_compile_training_products(layout_cls: type, *, grad_fmt: Any = None, shape: tuple = (6, 16),
                                    batch: int = 5, dtype: torch.dtype = torch.float32, sparsifier: Any = None,
                                    device: str = "cpu", products: Iterable[str] | None = None,
                                    sgd_steps: int = 2) -> dict:
    """Compiled training through products other than ``F.linear`` of a trainable ``layout_cls`` weight
    whose gradient is dense (``grad_fmt`` ``None`` or ``(KeepAll(), Tensor, KeepAll(), Tensor)``):
    ``torch.mm(x, W.t())``, ``x @ W.t()``, ``torch.matmul(x, W.t())``, ``torch.addmm(b, x, W.t())``.
    For each: no graph break, ``fullgraph=True`` runs, every gradient (the weight's a plain tensor)
    equals eager's and the dense model's, and ``sgd_steps`` compiled SGD steps end with eager's
    weights. Raises ``AssertionError`` naming the product; returns ``{product: breaks}``.

    Example:
        >>> import sten_core as sten
        >>> check_compile_training_products(sten.CsrTensor)["torch.addmm(b, x, W.t())"]   # doctest: +SKIP
        0
    """
    import warnings

    plugins.ensure_loaded()
    tol = _tolerances(dtype)
    sample = _sample(shape, dtype, sparsifier or ScalarFractionSparsifier(0.5), device, seed=500)
    bias = torch.randn(shape[0], generator=torch.Generator().manual_seed(8)).to(dtype).to(device)

    def sparse_model(product: str) -> _WeightProduct:
        w = SparseParameterWrapper(layout_cls.from_dense(sample), requires_grad=True, grad_fmt=grad_fmt)
        return _WeightProduct(w, bias, product)

    report = {}
    for name in products or TRAINING_WEIGHT_PRODUCTS:
        case = f"{layout_cls.__name__} trainable W={list(shape)} grad_fmt={grad_fmt}: {name}"
        model = sparse_model(name)
        x = torch.randn(batch, shape[1], generator=torch.Generator().manual_seed(9)).to(dtype).to(device)
        x.requires_grad_(True)
        try:
            with warnings.catch_warnings():  # eager's W.t() densifies (a DispatchWarning says so)
                warnings.simplefilter("ignore", dispatch.DispatchWarning)
                run = compiled_training_grads(model, x)
        except Exception as error:
            raise AssertionError(f"{case}: {type(error).__name__}: {str(error).strip()[:400]}") from error
        report[name] = run["graph_breaks"]
        assert run["graph_breaks"] == 0, f"{case}: {run['graph_breaks']} graph break(s): {'; '.join(run['reasons'])}"
        assert type(run["compiled"][0]) is torch.Tensor, \
            f"{case}: the weight's compiled gradient is {type(run['compiled'][0]).__name__}, not a plain tensor"
        reference = _WeightProduct(torch.nn.Parameter(_dense(model.weight).detach().clone()), bias, name)
        xd = x.detach().clone().requires_grad_(True)
        reference(xd).square().sum().backward()
        dense = [p.grad for p in reference.parameters()] + [xd.grad]
        for what, got, want, ref in zip(("weight", "bias", "input"), run["compiled"], run["eager"], dense):
            torch.testing.assert_close(_dense(got), _dense(want), msg=lambda m: f"{case}: {what} gradient vs eager: {m}", **tol)
            torch.testing.assert_close(_dense(got), ref, msg=lambda m: f"{case}: {what} gradient vs dense: {m}", **tol)
        torch.testing.assert_close(run["compiled_out"], run["eager_out"], msg=lambda m: f"{case}: output: {m}", **tol)
    if sgd_steps:
        name = next(iter(products or TRAINING_WEIGHT_PRODUCTS))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", dispatch.DispatchWarning)
            eager, compiled = sgd_steps_eager_and_compiled(
                lambda: sparse_model(name), lambda: torch.randn(batch, shape[1]).to(dtype).to(device), steps=sgd_steps)
        for (pname, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(_dense(pc), _dense(pe), msg=lambda m: f"{layout_cls.__name__} {name}: "
                                       f"{pname} after {sgd_steps} SGD steps, compiled vs eager: {m}", **tol)
    return report


SHARED_WEIGHT_GRAD_FMTS: dict = {
    "default": lambda layout: None,
    "dense": lambda layout: (KeepAll(), torch.Tensor, KeepAll(), torch.Tensor),
    "keep-layout": lambda layout: (KeepAll(), layout, KeepAll(), layout),
}
"""``check_compile_shared_weight``'s gradient formats: ``name -> grad_fmt(layout_cls)``."""


class _SharedWeight(torch.nn.Module):
    """One square weight applied twice: ``F.linear(relu(F.linear(x, W)), W)``."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.weight).relu(), self.weight)


def check_compile_shared_weight(layout_cls: type, *, size: int = 16, batch: int = 5, sparsifier: Any = None,
                                grad_fmts: Iterable[str] | None = None, device: str = "cpu") -> None:
    """A trainable ``layout_cls`` weight used twice in one step trains compiled: for each of
    ``SHARED_WEIGHT_GRAD_FMTS`` (the default, the explicit dense, the pattern-keeping format) no
    graph break, ``fullgraph=True`` runs, and the weight's and input's gradients equal eager's and
    the dense model's (masked to the pattern for the pattern-keeping format, whose gradient stays
    a ``layout_cls`` wrapper). Raises ``AssertionError`` naming the format.

    Example:
        >>> import sten_core as sten
        >>> check_compile_shared_weight(sten.CsrTensor)   # doctest: +SKIP
    """
    import warnings

    plugins.ensure_loaded()
    sample = _sample((size, size), torch.float32, sparsifier or ScalarFractionSparsifier(0.5), device, seed=600)
    for fmt in grad_fmts or SHARED_WEIGHT_GRAD_FMTS:
        case = f"{layout_cls.__name__} used twice, grad_fmt {fmt}"
        w = SparseParameterWrapper(layout_cls.from_dense(sample), requires_grad=True,
                                   grad_fmt=SHARED_WEIGHT_GRAD_FMTS[fmt](layout_cls))
        model = _SharedWeight(w)
        x = torch.randn(batch, size, generator=torch.Generator().manual_seed(10)).to(device).requires_grad_(True)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", dispatch.DispatchWarning)
                run = compiled_training_grads(model, x)
        except Exception as error:
            raise AssertionError(f"{case}: {type(error).__name__}: {str(error).strip()[:400]}") from error
        assert run["graph_breaks"] == 0, f"{case}: {run['graph_breaks']} graph break(s): {'; '.join(run['reasons'])}"
        reference = _SharedWeight(torch.nn.Parameter(_dense(w).detach().clone()))
        xd = x.detach().clone().requires_grad_(True)
        reference(xd).square().sum().backward()
        want_w = reference.weight.grad
        if fmt == "keep-layout":
            layout = w.wrapped_tensor  # the stored positions (a stored value may be 0)
            want_w = want_w * (to_dense_tensor(layout.with_values(torch.ones_like(layout.values()))) != 0)
            got = run["compiled"][0]
            assert isinstance(got, SparseTensorWrapper) and type(got.wrapped_tensor) is layout_cls, \
                f"{case}: the weight's compiled gradient is {type(got).__name__}, not a {layout_cls.__name__} wrapper"
        for what, got, eager, ref in zip(("weight", "input"), run["compiled"], run["eager"], (want_w, xd.grad)):
            torch.testing.assert_close(_dense(got), _dense(eager), msg=lambda m: f"{case}: {what} gradient vs eager: {m}")
            torch.testing.assert_close(_dense(got), ref, rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"{case}: {what} gradient vs dense: {m}")
