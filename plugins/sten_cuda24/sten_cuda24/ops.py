"""Operator implementations for ``Sparse24Tensor`` and ``BlockSparseTensor``.

- ``F.linear(x, W, bias)`` with a 2:4 or block-sparse weight: forward and
  backward (input gradient through the sparse weight; weight gradient dense or
  only at the kept positions, as the requested gradient format says).
- ``torch.mm`` / ``torch.matmul`` with a 2:4 left operand (2:4 along the
  contraction dim).
- ``F.linear(x, W)`` with a 2:4 *activation* ``x`` (runtime 2:4 sparsity).
- ``F.relu`` / ``F.gelu`` / ``F.silu`` whose output is sparsified inline by
  ``Sparse24Sparsifier``: activation and pruning fused in one Triton pass.

On CUDA the sparse kernels run (cuSPARSELt/CUTLASS, Triton); elsewhere the
same implementations compute through the dense tensor, so CPU runs give the
same results (slowly). ``sten_cuda24.paths.last`` records the path each call
took; a CUDA call that has to compute densely warns (or raises under
``set_dispatch_failure("raise")``).

One dtype rule on every device: the input (and bias) must have the sparse
weight's dtype, as for dense ``F.linear``; under ``torch.autocast`` the input,
bias and weight all run in the autocast dtype.

Example:
    >>> import torch, torch.nn.functional as F, sten_core as sten
    >>> from sten_cuda24 import Sparse24Sparsifier, Sparse24Tensor
    >>> w = sten.sparsify(Sparse24Sparsifier(), torch.randn(8, 16), Sparse24Tensor)  # doctest: +SKIP
    >>> F.linear(torch.randn(2, 16), w).shape                                         # doctest: +SKIP
    torch.Size([2, 8])
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from sten_core.plugin_api import bias_grad, linear_inputs, needs_grad, register_weight_product, wrap_layout

from . import _compat, encoding, paths
from .blocksparse import BlockSparseTensor
from .sparse24 import Sparse24Tensor

T = torch.Tensor


def dtype_mismatch(what: str, x_dtype: torch.dtype, w_dtype: torch.dtype) -> str:
    """The one message for an input whose dtype differs from the sparse weight's."""
    name = str(w_dtype).replace("torch.", "")
    return (f"{what}: input dtype {str(x_dtype).replace('torch.', '')} differs from the sparse weight's dtype {name}; "
            f"cast the input (x.to(torch.{name})) or run under torch.autocast")


def _operand_dtype(x: torch.Tensor, layout: Any, bias: torch.Tensor | None, what: str) -> tuple[torch.Tensor, Any, torch.Tensor | None]:
    """Apply the dtype rule: ``(x, layout, bias)`` in one dtype, or a ``TypeError``."""
    device = x.device.type
    if device in ("cuda", "cpu") and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x = x.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        return x, (layout if layout.dtype == dtype else layout.to(dtype=dtype)), bias
    if x.dtype != layout.dtype:
        raise TypeError(dtype_mismatch(what, x.dtype, layout.dtype))
    if bias is not None and bias.dtype != x.dtype:
        raise TypeError(f"{what}: bias dtype {bias.dtype} differs from the input and weight dtype {x.dtype}")
    return x, layout, bias


def _check_weight_2d(layout: Any) -> None:
    if len(layout.shape) != 2:
        raise ValueError(f"F.linear needs a 2-D weight [out_features, in_features]; the sparse weight has shape {tuple(layout.shape)}")


# -- 2:4 ------------------------------------------------------------------------------------

def linear24(x: torch.Tensor, w: Sparse24Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + bias``: semi-structured kernel on CUDA, dense elsewhere."""
    _check_weight_2d(w)
    x, w, bias = _operand_dtype(x, w, bias, "F.linear with a 2:4 weight")
    if x.device.type == "cuda" and w.device.type == "cuda":
        if _compat.semi_structured_backend() is not None:
            from . import backends

            out = backends.linear(x, w, bias)
            paths.record("linear24", backends.last_path["path"], backends.last_path.get("why", ""))
            return out
        paths.dense("linear24", x, "no cuSPARSELt/CUTLASS semi-structured backend in this torch")
    else:
        paths.dense("linear24", x, f"tensors on {x.device}")
    return F.linear(x, w.to_dense(), bias)


def _grad_input24(g2: torch.Tensor, w: Sparse24Tensor) -> torch.Tensor:
    """``g @ W``: the sparse kernel through the transposed pair when there is one."""
    wt = w if g2.dtype == w.dtype else w.to(dtype=g2.dtype)
    if w.transposable and g2.device.type == "cuda" and _compat.semi_structured_backend() is not None:
        from . import backends

        out = backends.linear(g2, wt.transposed())
        paths.record("grad_input24", backends.last_path["path"], backends.last_path.get("why", ""))
        return out
    paths.record("grad_input24", "dense", "no transposed pair (Sparse24Sparsifier(transposable=True) makes one)" if not w.transposable else f"tensors on {g2.device}")
    return g2 @ wt.to_dense()


def linear24_fwd(ctx: Any, inputs: list, output_sparsifiers: list) -> torch.Tensor:
    x, w, bias = linear_inputs(inputs)
    ctx.save_for_backward(x, w)
    return linear24(x, w.wrapped_tensor, bias)


def _linear_bwd(grad_input: Any, weight_grad: Any, sparse_weight_grad: bool) -> Any:
    def impl(ctx: Any, grad_outputs: tuple, input_sparsifiers: list) -> tuple:
        x, w = ctx.saved_tensors
        (g,) = grad_outputs
        layout = w.wrapped_tensor
        g2 = encoding.as_rows(g)
        x2 = encoding.as_rows(x).to(g2.dtype)
        grad_x = grad_input(g2, layout).reshape(x.shape).to(x.dtype) if needs_grad(ctx, 0) else None
        grad_w = weight_grad(g2, x2, layout, sparse_weight_grad) if needs_grad(ctx, 1) else None
        has_bias = len(ctx.inputs) > 2 and ctx.inputs[2] is not None
        grad_b = bias_grad(g) if has_bias and needs_grad(ctx, 2) else None
        return grad_x, grad_w, grad_b

    return impl


WGRAD_CHOICE: dict[tuple, str] = {}
"""Per ``(N, K, tokens, dtype, device)``: which 2:4 weight-gradient kernel ran faster."""


def wgrad_mode() -> str:
    """``STEN_CUDA24_SAMPLED_WGRAD``: ``auto`` (default: time both once per shape on CUDA,
    keep the faster), ``always`` (the sampled Triton kernel) or ``never`` (GEMM + gather)."""
    import os

    mode = os.environ.get("STEN_CUDA24_SAMPLED_WGRAD", "auto")
    if mode not in ("auto", "always", "never"):
        raise ValueError(f"STEN_CUDA24_SAMPLED_WGRAD must be auto, always or never; got {mode!r}")
    return mode


def cuda_time(fn: Any) -> float:
    """Milliseconds of one call of ``fn`` after one warm-up call (CUDA events)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def pick_faster(key: tuple, candidates: dict[str, Any], timer: Any = cuda_time) -> str:
    """The name of the fastest candidate for ``key`` (timed once, then cached in ``WGRAD_CHOICE``)."""
    hit = WGRAD_CHOICE.get(key)
    if hit is None:
        hit = min(candidates, key=lambda name: timer(candidates[name]))
        WGRAD_CHOICE[key] = hit
    return hit


def _weight_grad24(g2: torch.Tensor, x2: torch.Tensor, layout: Sparse24Tensor, sparse: bool) -> Any:
    if not sparse:
        paths.record("grad_weight24", "dense", "a dense weight gradient was asked for")
        return g2.t() @ x2

    def gemm_gather() -> torch.Tensor:
        return layout.gather((g2.t() @ x2).to(layout.dtype))

    def sampled() -> torch.Tensor:
        from .triton_sdd24 import sdd24

        return sdd24(g2, x2, layout if g2.dtype == layout.dtype else layout.to(dtype=g2.dtype)).to(layout.dtype)

    mode = wgrad_mode()
    can_sample = len(layout.shape) == 2 and _compat.has_triton() and _compat.triton_runs_on(g2) \
        and _compat.triton_runs_on(x2)
    choice = "gemm+gather"
    if can_sample and mode == "always":
        choice = "sampled"
    elif can_sample and mode == "auto" and g2.device.type == "cuda":
        key = (tuple(layout.shape), g2.shape[0], g2.dtype, g2.device)
        choice = pick_faster(key, {"gemm+gather": gemm_gather, "sampled": sampled})
    paths.record("grad_weight24", choice)
    return wrap_layout(layout.with_values(sampled() if choice == "sampled" else gemm_gather()))


def _rows_last(t: torch.Tensor) -> torch.Tensor:
    """``B`` of ``A @ B`` (``[K]``, ``[K, N]`` or ``[..., K, N]``) with ``K`` last: ``F.linear``'s input."""
    return t if t.dim() == 1 else t.mT


def mm24_fwd(ctx: Any, inputs: list, output_sparsifiers: list) -> torch.Tensor:
    """``A @ B`` with ``A`` 2:4 ``[M, K]`` (2:4 along K) and ``B`` dense ``[K]``, ``[K, N]``
    or (``matmul``) a batch ``[..., K, N]``: ``F.linear(B.mT, A).mT``."""
    a, b = inputs[:2]
    layout = a.wrapped_tensor
    _check_weight_2d(layout)
    ctx.save_for_backward(a, b)
    return _rows_last(linear24(_rows_last(b), layout))


def mm24_bwd(sparse_grad: bool) -> Any:
    def impl(ctx: Any, grad_outputs: tuple, input_sparsifiers: list) -> tuple:
        a, b = ctx.saved_tensors
        (g,) = grad_outputs
        layout = a.wrapped_tensor
        x = _rows_last(b)                                  # [..., K]: F.linear's input
        g2 = encoding.as_rows(_rows_last(g))               # [T, M]: its output gradient as rows
        grad_a = grad_b = None
        if needs_grad(ctx, 0):  # g @ b.T summed over the batch, sampled when sparse
            grad_a = _weight_grad24(g2, encoding.as_rows(x).to(g2.dtype), layout, sparse_grad)
        if needs_grad(ctx, 1):
            grad_b = _rows_last(_grad_input24(g2, layout).reshape(x.shape).to(b.dtype))
        return grad_a, grad_b

    return impl


# -- runtime 2:4 activations -------------------------------------------------------------------

def act24_linear(layout: Sparse24Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x24 @ w.T + bias`` for a 2:4 activation ``layout``: the semi-structured kernel on CUDA."""
    if layout.device.type == "cuda" and _compat.semi_structured_backend() is not None:
        from . import backends

        return backends.sparse_activation_linear(layout, w.to(layout.dtype), bias)
    return F.linear(layout.to_dense().to(w.dtype), w, bias)


def act24_linear_grads(g: torch.Tensor, layout: Sparse24Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dense gradient of the activation, gradient of w)`` of ``act24_linear``."""
    g2 = encoding.as_rows(g)
    xd = encoding.as_rows(layout.to_dense()).to(g2.dtype)
    return (g2 @ w.to(g2.dtype)).reshape(layout.shape), g2.t() @ xd


def act24_linear_fwd(ctx: Any, inputs: list, output_sparsifiers: list) -> torch.Tensor:
    """``F.linear(x24, W, bias)`` with a 2:4 activation ``x24`` and a dense weight."""
    x, w, bias = linear_inputs(inputs)
    ctx.save_for_backward(x, w)
    return act24_linear(x.wrapped_tensor, w, bias)


def act24_linear_bwd(ctx: Any, grad_outputs: tuple, input_sparsifiers: list) -> tuple:
    x, w = ctx.saved_tensors
    (g,) = grad_outputs
    grad_x, grad_w = act24_linear_grads(g, x.wrapped_tensor, w)
    has_bias = len(ctx.inputs) > 2 and ctx.inputs[2] is not None
    return grad_x, grad_w, (bias_grad(g) if has_bias else None)


_ACTS = {F.relu: "relu", F.gelu: "gelu", F.silu: "silu"}


def _act_fwd(name: str) -> Any:
    def impl(ctx: Any, inputs: list, output_sparsifiers: list) -> Any:
        from .sparsifiers import sparsify_24

        x = inputs[0]  # the pattern is (T,): a call giving approximate= or inplace= runs densely (named)
        sp = output_sparsifiers[0] if output_sparsifiers else None
        if getattr(sp, "transposable", False):
            raise ValueError("the fused activation + 2:4 kernel makes row-wise masks only (transposable=False)")
        out = sparsify_24(x, activation=name)
        ctx.save_for_backward(x, out.mask())
        return wrap_layout(out)

    return impl


def _act_bwd(fn: Any) -> Any:
    def impl(ctx: Any, grad_outputs: tuple, input_sparsifiers: list) -> tuple:
        x, mask = ctx.saved_tensors
        (g,) = grad_outputs
        g = g.to_dense() if hasattr(g, "wrapped_tensor") else g
        with torch.enable_grad():
            xx = x.detach().requires_grad_(True)
            (grad,) = torch.autograd.grad(fn(xx), xx, g * mask.to(g.dtype))
        return (grad,)

    return impl


# -- block sparse ---------------------------------------------------------------------------------

def _triton_ok(x: torch.Tensor) -> bool:
    return _compat.has_triton() and _compat.triton_runs_on(x)


def _block_ok(w: BlockSparseTensor) -> bool:
    return all(16 <= s <= 128 and not s & (s - 1) for s in w.block_shape)


def _why_not_triton(x: torch.Tensor, w: BlockSparseTensor) -> str | None:
    """Why the Triton BSR kernels cannot run on ``x``/``w`` (None: they can)."""
    if x.device.type != "cuda" and not _compat.triton_interpret():
        return f"tensors on {x.device}"
    if not (_compat.triton_runs_on(x) and _compat.triton_runs_on(w)):
        return _compat.INTERPRETED_BF16
    if not _compat.has_triton():
        return "triton is not installed"
    if not _block_ok(w):
        return f"block shape {w.block_shape} (the kernel takes powers of two in 16..128)"
    if x.device != w.device:
        return f"input on {x.device}, weight on {w.device}"
    return None


def linear_bsr(x: torch.Tensor, w: BlockSparseTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + bias``: the Triton kernel on CUDA, dense elsewhere."""
    _check_weight_2d(w)
    x, w, bias = _operand_dtype(x, w, bias, "F.linear with a block-sparse weight")
    why = _why_not_triton(x, w)
    if why is None:
        from .triton_bsr import bsr_linear

        paths.record("linear_bsr", "triton")
        return bsr_linear(x, w, bias)
    paths.dense("linear_bsr", x, why)
    return F.linear(x, w.to_dense(), bias)


def _grad_input_bsr(g2: torch.Tensor, w: BlockSparseTensor) -> torch.Tensor:
    w = w if g2.dtype == w.dtype else w.to(dtype=g2.dtype)
    why = _why_not_triton(g2, w)
    if why is None:
        from .triton_bsr import bsr_linear

        paths.record("grad_input_bsr", "triton")
        return bsr_linear(g2, w.transposed())
    paths.dense("grad_input_bsr", g2, why)
    return g2 @ w.to_dense()


def _weight_grad_bsr(g2: torch.Tensor, x2: torch.Tensor, layout: BlockSparseTensor, sparse: bool) -> Any:
    if not sparse:
        paths.record("grad_weight_bsr", "dense", "a dense weight gradient was asked for")
        return g2.t() @ x2
    why = _why_not_triton(g2, layout)
    if why is None:
        from .triton_bsr import bsr_sdd

        paths.record("grad_weight_bsr", "triton")
        vals = bsr_sdd(g2, x2, layout if g2.dtype == layout.dtype else layout.to(dtype=g2.dtype))
        return wrap_layout(layout.with_values(vals.to(layout.dtype)))
    paths.dense("grad_weight_bsr", g2, why)
    return wrap_layout(layout.with_values(layout.gather((g2.t() @ x2).to(layout.dtype))))


def linear_bsr_fwd(ctx: Any, inputs: list, output_sparsifiers: list) -> torch.Tensor:
    x, w, bias = linear_inputs(inputs)
    ctx.save_for_backward(x, w)
    return linear_bsr(x, w.wrapped_tensor, bias)


def register(registry: Any) -> None:
    from sten_core.plugin_api import KeepAll

    from .sparsifiers import Sparse24Sparsifier

    keep = (KeepAll, T)
    for layout, fwd, grad_in, grad_w in (
        (Sparse24Tensor, linear24_fwd, _grad_input24, _weight_grad24),
        (BlockSparseTensor, linear_bsr_fwd, _grad_input_bsr, _weight_grad_bsr),
    ):  # F.linear(x, W[, bias]): dense or in-layout weight gradient
        register_weight_product(registry, F.linear, layout, forward=fwd, backward=_linear_bwd(grad_in, grad_w, False),
                                sparse_grad_backward=_linear_bwd(grad_in, grad_w, True))
    for op in (torch.mm, torch.matmul):
        registry.register_fwd_op_impl(op, (Sparse24Tensor, T), [keep], mm24_fwd)
        registry.register_bwd_op_impl(op, (T,), (keep, keep), (Sparse24Tensor, T), mm24_bwd(False))
        registry.register_bwd_op_impl(op, (T,), ((KeepAll, Sparse24Tensor), keep), (Sparse24Tensor, T), mm24_bwd(True))
    # F.linear(x24, W[, bias]): a 2:4 activation times a dense weight
    register_weight_product(registry, F.linear, T, forward=act24_linear_fwd, backward=act24_linear_bwd,
                            input_layout=Sparse24Tensor)
    for fn, name in _ACTS.items():
        registry.register_fwd_op_impl(fn, (T,), [(Sparse24Sparsifier, Sparse24Tensor)], _act_fwd(name))
        registry.register_bwd_op_impl(fn, (T,), (keep,), (T,), _act_bwd(fn))
