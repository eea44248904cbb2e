"""``torch.compile`` support: the plugin's kernels as PyTorch custom operators (``sten_cuda24::...``).

While Dynamo traces a model, ``F.linear`` with a ``Sparse24Tensor`` or
``BlockSparseTensor`` weight (and ``mm`` / ``matmul`` / ``@`` with a 2:4 left
operand, ``F.linear`` with a 2:4 *activation*) becomes one custom-operator node
taking the layout's plain member tensors and its integer constants. Its
implementation rebuilds the layout around the members and runs the eager code
(cuSPARSELt / CUTLASS / Triton on CUDA, the dense product elsewhere: same
arithmetic, same results, same ``paths.last`` records); its fake implementation
gives the output's metadata; its autograd formula calls the gradient operators,
whose implementations are the eager backward kernels.

========================================  ==========================================
operator                                  layout (members; constants)
========================================  ==========================================
``sten_cuda24::linear24``                 ``Sparse24Tensor`` (packed, meta[, meta_t]
                                          [, live]; has_meta_t, has_live, *shape)
``sten_cuda24::linear_bsr``               ``BlockSparseTensor`` (crow, col, blocks;
                                          rows, cols)
``sten_cuda24::act24_linear``             a 2:4 activation times a dense weight
``sten_cuda24::sparsify24``               the 2:4 pruning kernels (Triton / nvcc)
========================================  ==========================================

``linear24`` and ``linear_bsr`` have ``<op>_grad_input`` (``gy @ W``, the sparse
kernel through the transposed pair / transposed BSR) and ``<op>_grad_values``
(the gradient of the stored values: sampled kernel or GEMM + gather), and both
layouts are traceable (``plugin_api.register_traceable_layout``), so a compiled
training step of weights whose gradient keeps their layout compiles whole.
``act24_linear`` has ``act24_linear_backward`` (values' and weight's gradients).

A layout rebuilt inside an operator is kept on its pattern member tensor, so the
GPU matmul operand (cuSPARSELt compressed buffer, CUTLASS metadata) and the
transposed pair are built once per weight, and refreshed in place after an
optimizer step, as in eager (``REBUILT`` counts the rebuilds).

Example:
    >>> import torch
    >>> from sten_cuda24 import sparsify_24
    >>> from sten_cuda24.compiled import members
    >>> w = sparsify_24(torch.ones(3, 16))
    >>> tensors, consts = members(w)
    >>> torch.ops.sten_cuda24.linear24(torch.ones(2, 16), tensors, consts, None).tolist()
    [[8.0, 8.0, 8.0], [8.0, 8.0, 8.0]]
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch
import torch.nn.functional as F

from sten_core import plugin_api

from . import encoding, ops
from .blocksparse import BlockSparseTensor
from .sparse24 import Sparse24Tensor

Tensor = torch.Tensor
_OWNER = "_sten_cuda24_layout"
REBUILT = {"count": 0}
"""How many layouts the operators rebuilt from member tensors (a weight: once)."""


# -- a layout as (member tensors, integer constants) and back -----------------------
def members(layout: Any) -> tuple[list[Tensor], list[int]]:
    """The plain member tensors and integer constants the custom operators take.

    >>> w = Sparse24Tensor.from_dense(torch.ones(2, 16) * torch.tensor([1., 0, 0, 1] * 4))
    >>> [tuple(t.shape) for t in members(w)[0]], members(w)[1]
    ([(2, 8), (2, 1)], [0, 0, 2, 16])
    """
    if isinstance(layout, Sparse24Tensor):
        tensors = [layout.packed, layout.meta]
        tensors += [t for t in (layout.meta_t, layout.live) if t is not None]
        return tensors, [int(layout.meta_t is not None), int(layout.live is not None), *layout.shape]
    if isinstance(layout, BlockSparseTensor):
        return [layout.crow, layout.col, layout.blocks], list(layout.shape)
    raise TypeError(f"layout must be a Sparse24Tensor or BlockSparseTensor, got {type(layout).__name__}")


def rebuild24(tensors: List[Tensor], consts: List[int]) -> Sparse24Tensor:
    """``members``' inverse for ``Sparse24Tensor`` (reads no tensor values: runs on fake tensors)."""
    has_t, has_live, *shape = consts
    meta_t = tensors[2] if has_t else None
    live = tensors[2 + has_t] if has_live else None
    return Sparse24Tensor(tensors[0], tensors[1], tuple(shape), meta_t, live)


def rebuild_bsr(tensors: List[Tensor], consts: List[int]) -> BlockSparseTensor:
    """``members``' inverse for ``BlockSparseTensor``."""
    return BlockSparseTensor(tensors[0], tensors[1], tensors[2], tuple(consts))


def _same_memory(a: Tensor, b: Tensor) -> bool:
    """``a`` is ``b`` or an alias of it (AOTAutograd hands saved inputs back as new aliases)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                      and a.dtype == b.dtype and a.device == b.device)


def _kept(tensors: List[Tensor], consts: List[int], rebuild: Callable) -> Any:
    """The layout of these members, rebuilt once and kept on its pattern member (``meta`` /
    ``crow``), so its GPU operand and transposed pair are cached as on the eager layout; the
    values may arrive as an alias of the kept layout's (same memory and version counter)."""
    anchor = tensors[1] if rebuild is rebuild24 else tensors[0]
    layout = anchor.__dict__.get(_OWNER)
    if layout is not None:
        mine, consts_now = members(layout)
        if consts_now == list(consts) and len(mine) == len(tensors) and all(map(_same_memory, mine, tensors)):
            return layout
    layout = rebuild(tensors, consts)
    REBUILT["count"] += 1
    anchor.__dict__[_OWNER] = layout
    return layout


# -- the operand rules, shared by the fake and the real implementations -------------------
def _check_linear(what: str, x: Tensor, shape: List[int], dtype: torch.dtype, bias: Optional[Tensor]) -> None:
    """Shapes and the dtype rule of ``F.linear(x, W, bias)`` with a sparse ``W`` of ``shape``/``dtype``."""
    if len(shape) != 2:
        raise ValueError(f"{what}: F.linear needs a 2-D weight [out_features, in_features]; "
                         f"the sparse weight has shape {tuple(shape)}")
    plugin_api.check_tensor(x, "input", where=what)
    if x.dim() < 1 or x.shape[-1] != shape[1]:
        raise ValueError(f"{what}: input must be a tensor whose last dimension is {shape[1]}, got {tuple(x.shape)}")
    if x.dtype != dtype:
        raise TypeError(ops.dtype_mismatch(what, x.dtype, dtype))
    if bias is not None and (tuple(bias.shape) != (shape[0],) or bias.dtype != dtype):
        raise ValueError(f"{what}: bias must be [{shape[0]}] {dtype}, got {tuple(bias.shape)} {bias.dtype}")


def _shape(layout_name: str, consts: List[int]) -> List[int]:
    return list(consts[2:]) if layout_name == "24" else list(consts)


# -- F.linear with a sparse weight: forward, input gradient, values' gradient --------------
def _define_linear(name: str, kind: str, rebuild: Callable, forward: Callable, grad_input: Callable,
                   grad_weight: Callable, values_index: int) -> tuple[Any, Any, Any]:
    """``sten_cuda24::<name>`` (forward, fake, autograd) and its two gradient operators."""
    qual = f"sten_cuda24::{name}"
    what = f"{qual} (F.linear with a {'2:4' if kind == '24' else 'block-sparse'} weight)"

    @torch.library.custom_op(qual, mutates_args=())
    def op(x: Tensor, tensors: List[Tensor], consts: List[int], bias: Optional[Tensor]) -> Tensor:
        _check_linear(what, x, _shape(kind, consts), tensors[values_index].dtype, bias)
        return forward(x, _kept(tensors, consts, rebuild), bias).contiguous()

    @op.register_fake
    def _(x: Tensor, tensors: List[Tensor], consts: List[int], bias: Optional[Tensor]) -> Tensor:
        shape = _shape(kind, consts)
        _check_linear(what, x, shape, tensors[values_index].dtype, bias)
        return x.new_empty((*x.shape[:-1], shape[0]))

    @torch.library.custom_op(f"{qual}_grad_input", mutates_args=())
    def op_grad_input(gy: Tensor, x: Tensor, tensors: List[Tensor], consts: List[int]) -> Tensor:
        g2 = gy.reshape(-1, gy.shape[-1])
        return grad_input(g2, _kept(tensors, consts, rebuild)).reshape(x.shape).to(x.dtype).contiguous()

    @op_grad_input.register_fake
    def _(gy: Tensor, x: Tensor, tensors: List[Tensor], consts: List[int]) -> Tensor:
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.custom_op(f"{qual}_grad_values", mutates_args=())
    def op_grad_values(gy: Tensor, x: Tensor, tensors: List[Tensor], consts: List[int]) -> Tensor:
        layout = _kept(tensors, consts, rebuild)
        g2 = gy.reshape(-1, gy.shape[-1])
        x2 = x.reshape(-1, x.shape[-1]).to(g2.dtype)
        grad = grad_weight(g2, x2, layout, True).wrapped_tensor.values()
        return grad.to(tensors[values_index].dtype).contiguous()

    @op_grad_values.register_fake
    def _(gy: Tensor, x: Tensor, tensors: List[Tensor], consts: List[int]) -> Tensor:
        return torch.empty_like(tensors[values_index], memory_format=torch.contiguous_format)

    plugin_api.register_member_linear_autograd(op, op_grad_input, op_grad_values, values_index=values_index)
    return op, op_grad_input, op_grad_values


linear24, linear24_grad_input, linear24_grad_values = _define_linear(
    "linear24", "24", rebuild24, ops.linear24, ops._grad_input24, ops._weight_grad24, values_index=0)
linear_bsr, linear_bsr_grad_input, linear_bsr_grad_values = _define_linear(
    "linear_bsr", "bsr", rebuild_bsr, ops.linear_bsr, ops._grad_input_bsr, ops._weight_grad_bsr, values_index=2)


# -- F.linear with a 2:4 activation and a dense weight ---------------------------------------
_ACT = "sten_cuda24::act24_linear (F.linear with a 2:4 activation)"


def _check_act(x_shape: List[int], x_dtype: torch.dtype, weight: Tensor, bias: Optional[Tensor]) -> None:
    plugin_api.check_tensor(weight, "weight", ndim=2, where=_ACT)
    if weight.shape[1] != x_shape[-1]:
        raise ValueError(f"{_ACT}: weight must be [out_features, {x_shape[-1]}], got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{_ACT}: bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")


@torch.library.custom_op("sten_cuda24::act24_linear", mutates_args=())
def act24_linear(tensors: List[Tensor], consts: List[int], weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``F.linear(x24, weight, bias)``, ``x24`` the 2:4 activation given by its members."""
    layout = rebuild24(tensors, consts)  # a new activation per call: nothing to keep
    _check_act(list(layout.shape), layout.dtype, weight, bias)
    return ops.act24_linear(layout, weight, bias).contiguous()


@act24_linear.register_fake
def _(tensors: List[Tensor], consts: List[int], weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    shape = list(consts[2:])
    _check_act(shape, tensors[0].dtype, weight, bias)
    return weight.new_empty((*shape[:-1], weight.shape[0]))


@torch.library.custom_op("sten_cuda24::act24_linear_backward", mutates_args=())
def act24_linear_backward(gy: Tensor, tensors: List[Tensor], consts: List[int], weight: Tensor) -> List[Tensor]:
    """``[gradient of the activation's stored values, gradient of the weight]`` (eager's formula)."""
    layout = rebuild24(tensors, consts)  # a new activation per call: nothing to keep
    grad_x, grad_w = ops.act24_linear_grads(gy, layout, weight)
    return [layout.gather(grad_x).to(tensors[0].dtype).contiguous(), grad_w.to(weight.dtype).contiguous()]


@act24_linear_backward.register_fake
def _(gy: Tensor, tensors: List[Tensor], consts: List[int], weight: Tensor) -> List[Tensor]:
    return [torch.empty_like(tensors[0], memory_format=torch.contiguous_format),
            torch.empty_like(weight, memory_format=torch.contiguous_format)]


def _act_setup(ctx: Any, inputs: tuple, output: Tensor) -> None:
    tensors, consts, weight, bias = inputs
    ctx.save_for_backward(weight, *tensors)
    ctx.consts, ctx.has_bias = consts, bias is not None


def _act_backward(ctx: Any, gy: Tensor) -> tuple:
    weight, *tensors = ctx.saved_tensors
    need_t, _, need_w, need_b = ctx.needs_input_grad
    gt = gw = None
    if need_t or need_w:
        g_values, g_weight = act24_linear_backward(gy, tensors, ctx.consts, weight)
        if need_t:
            gt = [g_values] + [None] * (len(tensors) - 1)
        gw = g_weight if need_w else None
    return gt, None, gw, (plugin_api.bias_grad(gy) if ctx.has_bias and need_b else None)


act24_linear.register_autograd(_act_backward, setup_context=_act_setup)


# -- the 2:4 pruning kernels ---------------------------------------------------------------
@torch.library.custom_op("sten_cuda24::sparsify24", mutates_args=())
def sparsify24(dense: Tensor, transposable: bool, activation: Optional[str]) -> List[Tensor]:
    """``[packed, meta, meta_t, live]`` of ``sparsify_24(dense, transposable, activation)``
    (``meta_t`` empty unless ``transposable``; ``live`` all True when every slot is live)."""
    from .sparsifiers import sparsify_24

    s = sparsify_24(dense, transposable=transposable, activation=activation)
    meta_t = s.meta_t if s.meta_t is not None else s.meta.new_empty((0,))
    live = s.live if s.live is not None else torch.ones_like(s.packed, dtype=torch.bool)
    return [s.packed.contiguous(), s.meta.contiguous(), meta_t.contiguous(), live.contiguous()]


@sparsify24.register_fake
def _(dense: Tensor, transposable: bool, activation: Optional[str]) -> List[Tensor]:
    encoding.check_dtype(dense.dtype)
    if dense.dim() < 1 or (transposable and dense.dim() != 2):
        raise ValueError(f"sten_cuda24::sparsify24: dense must be {'2' if transposable else '>= 1'}-D, "
                         f"got shape {tuple(dense.shape)}")
    rows = 1
    for s in dense.shape[:-1]:
        rows *= s
    kp = encoding.padded_k(dense.shape[-1])
    packed = dense.new_empty((rows, kp // 2))
    meta = dense.new_empty((rows, kp // encoding.WORD), dtype=torch.int16)
    meta_t = (dense.new_empty((dense.shape[1], encoding.padded_k(dense.shape[0]) // encoding.WORD), dtype=torch.int16)
              if transposable else dense.new_empty((0,), dtype=torch.int16))
    return [packed, meta, meta_t, dense.new_empty((rows, kp // 2), dtype=torch.bool)]


# -- compiled implementations (what the wrapper runs while Dynamo traces) --------------------
def _autocast(x: Tensor, tensors: List[Tensor], values_index: int, bias: Optional[Tensor]) -> tuple:
    """Eager's dtype rule under ``torch.autocast``: input, bias and stored values in the autocast dtype."""
    device = x.device.type
    if device in ("cuda", "cpu") and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x = x.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        tensors = list(tensors)
        tensors[values_index] = tensors[values_index].to(dtype)
    return x, tensors, bias


def _linear_with(op: Any, values_index: int, name: str) -> Callable:
    def impl(x: Tensor, weight: Any, bias: Optional[Tensor] = None) -> Tensor:
        tensors, consts = members(weight.wrapped_tensor)
        x, tensors, bias = _autocast(x, tensors, values_index, bias)
        return op(x, tensors, consts, bias)

    impl.__name__ = f"{name}_compiled"
    impl.__doc__ = f"``F.linear`` while ``torch.compile`` traces: one ``sten_cuda24::{name}`` node."
    return impl


linear24_compiled = _linear_with(linear24, 0, "linear24")
linear_bsr_compiled = _linear_with(linear_bsr, 2, "linear_bsr")


def matmul24_compiled(a: Any, b: Tensor) -> Tensor:
    """``a @ b`` (``mm`` / ``matmul``) with a 2:4 ``a`` ``[M, K]`` and a dense ``b`` ``[K]`` or
    ``[K, N]`` while compiling: ``linear24(b.T, a).T``, one ``sten_cuda24::linear24`` node."""
    layout = a.wrapped_tensor
    plugin_api.check_tensor(b, "other", ndim=(1, 2), where="matmul with a 2:4 first operand")
    if b.shape[0] != layout.shape[-1]:
        raise ValueError(f"matmul with a 2:4 first operand: other must have {layout.shape[-1]} rows, "
                         f"got shape {tuple(b.shape)}")
    return linear24_compiled(b.t(), a).t()


def mm24_compiled(a: Any, b: Tensor) -> Tensor:
    """``torch.mm(a, b)`` with a 2:4 ``a`` while compiling (``b`` 2-D)."""
    plugin_api.check_tensor(b, "mat2", ndim=2, where="torch.mm with a 2:4 first operand")
    return matmul24_compiled(a, b)


def act24_linear_compiled(x: Any, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``F.linear(x24, weight, bias)`` with a 2:4 activation while compiling."""
    tensors, consts = members(x.wrapped_tensor)
    dtype = tensors[0].dtype
    return act24_linear(tensors, consts, weight.to(dtype), None if bias is None else bias.to(dtype))


def register(registry: Any) -> None:
    """Register the compiled implementations (called by the plugin's ``sten_register``)."""
    T = torch.Tensor
    for layout, impl in ((Sparse24Tensor, linear24_compiled), (BlockSparseTensor, linear_bsr_compiled)):
        for inp in ((T, layout, T), (T, layout)):
            registry.register_compiled_impl(F.linear, inp, impl)
    for op in (torch.mm, T.mm):
        registry.register_compiled_impl(op, (Sparse24Tensor, T), mm24_compiled)
    for op in (torch.matmul, T.matmul, T.__matmul__):
        registry.register_compiled_impl(op, (Sparse24Tensor, T), matmul24_compiled)
    for inp in ((Sparse24Tensor, T, T), (Sparse24Tensor, T)):
        registry.register_compiled_impl(F.linear, inp, act24_linear_compiled)


# -- traceable wrappers (compiled training of 2:4 and block-sparse weights) -----------------
def register_traceable() -> None:
    """Make both layouts' wrappers traceable (``plugin_api.register_traceable_layout``): a compiled
    training step of weights whose gradient keeps their layout and pattern compiles whole."""
    grads24 = plugin_api.member_grads(members, linear24_grad_input, linear24_grad_values)
    plugin_api.register_traceable_layout(Sparse24Tensor, members, rebuild24, *grads24, values_index=0)
    grads_bsr = plugin_api.member_grads(members, linear_bsr_grad_input, linear_bsr_grad_values)
    plugin_api.register_traceable_layout(BlockSparseTensor, members, rebuild_bsr, *grads_bsr, values_index=2)
