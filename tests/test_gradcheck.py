"""``torch.autograd.gradcheck`` (float64) for every registered forward and
backward implementation of the core and the CPU plugins.

A sparse operand's stored values are the gradcheck input: ``values_to_wrapper``
builds the wrapper from them (pattern fixed), so the numerical gradient of the
values is compared with the registered backward's gradient at the stored
positions. Dense operands are gradcheck inputs as they are.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import sten_core as sten
from sten_core import plugins
from sten_core.model.layouts import supports_values
from sten_core.model.registry import registry
from sten_core.model.tensor import densify

OWNERS = ("builtin", "scipy", "nm")
ELEMENTWISE = {"add", "__add__", "__radd__", "mul", "__mul__", "__rmul__"}


class values_to_wrapper(torch.autograd.Function):
    """Stored values → a wrapper with ``pattern``'s positions (differentiably)."""

    @staticmethod
    def forward(ctx, values, pattern, grad_fmt):
        ctx.pattern = pattern
        return sten.SparseTensorWrapper(pattern.with_values(values), grad_fmt=grad_fmt)

    @staticmethod
    def backward(ctx, grad):
        return ctx.pattern.gather(densify(grad)), None, None


def registered_cases() -> list:
    """Every registered backward (with its forward) of the owners, for dense
    incoming gradients: ``(op, input layouts, gradient (sparsifier, format) per input, owner)``."""
    plugins.ensure_loaded()
    fwd = {(k.op, k.inp) for k in registry.impls if k.direction == "fwd"}
    cases = set()
    for key in registry.impls:
        if key.direction != "bwd" or (key.op, key.inp) not in fwd:
            continue
        owner = registry.owner_of("impls", key)
        if owner in OWNERS and all(g is torch.Tensor for g in key.grad_out):
            cases.add((key.op, key.inp, key.out, owner))
    return sorted(cases, key=case_ids)


def case_ids(case) -> str:
    op, inp, grads, owner = case
    name = lambda c: getattr(c, "__name__", "None")  # noqa: E731
    wanted = ",".join("-" if g is None else name(g[1]) for g in grads)
    return f"{owner}-{name(op)}-" + ",".join(name(i) for i in inp) + f"-grads:{wanted}"


def operand_shapes(name: str, inp: tuple) -> list | None:
    if name == "linear":
        return [(3, 8), (6, 8), (6,)][: len(inp)]
    if name in ("mm", "matmul", "__matmul__"):
        return [(6, 8), (8, 4)]
    if name == "addmm":  # bias, x, W [in, out] (GPT-2's Conv1D)
        return [(4,), (6, 8), (8, 4)]
    if name in ELEMENTWISE:
        return [(6, 8), (6, 8)][: len(inp)]
    if name in ("sum", "t", "transpose", "__get__"):  # __get__: the .T / .mT properties
        return [(6, 8)]
    return None


def build(layout: type, shape: tuple, seed: int):
    """A float64 wrapper of ``layout`` (about half zeros) and its stored values."""
    torch.manual_seed(seed)
    dense = torch.randn(*shape, dtype=torch.float64)
    dense = dense * (torch.rand(*shape) > 0.5)
    if getattr(layout, "__name__", "") in ("NMTensor", "GroupedNMTensor"):
        dense = torch.randn(*shape, dtype=torch.float64)
    pattern = layout.from_dense(dense)
    return pattern


@pytest.mark.parametrize("case", registered_cases(), ids=case_ids)
def test_gradcheck_registered_implementation(case):
    op, inp, grads, owner = case
    name = getattr(op, "__name__", "")
    shapes = operand_shapes(name, inp)
    assert shapes is not None, f"no operand shapes known for {name}: add them to operand_shapes"
    gc_inputs, makers = [], []
    for i, (layout, shape) in enumerate(zip(inp, shapes)):
        if layout is torch.Tensor:
            torch.manual_seed(10 + i)
            t = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
            gc_inputs.append(t)
            makers.append(lambda v: v)
            continue
        pattern = build(layout, shape, seed=i)
        assert supports_values(pattern), f"{layout.__name__}: gradcheck needs the stored-values protocol"
        gc_inputs.append(pattern.values().detach().clone().requires_grad_())
        wanted = grads[i] if i < len(grads) and grads[i] is not None else (sten.KeepAll, torch.Tensor)
        grad_fmt = None if wanted[1] is torch.Tensor else (wanted[0](), wanted[1], sten.KeepAll(), wanted[1])
        makers.append(lambda v, pattern=pattern, grad_fmt=grad_fmt: values_to_wrapper.apply(v, pattern, grad_fmt))
    extra = (2.5,) if name in ELEMENTWISE and len(inp) == 1 else ()
    extra = (0, 1) if name == "transpose" else extra

    def f(*values):
        args = [make(v) for make, v in zip(makers, values)]
        with warnings.catch_warnings():
            warnings.simplefilter("error", sten.DispatchWarning)  # the registered implementations run
            out = op(*args, *extra)
        return out.to_dense() if isinstance(out, sten.SparseTensorWrapper) else out

    assert torch.autograd.gradcheck(f, tuple(gc_inputs), eps=1e-6, atol=1e-5, rtol=1e-4)



WRAPPER_INPUT_FUNCTIONS = {
    "sin": torch.sin,
    "pow": lambda w: w.pow(2),
    "to_dense() * 3": lambda w: w.to_dense() * 3,
    "exp": torch.exp,
    "mm": lambda w: torch.mm(w, torch.linspace(-1, 1, 12, dtype=torch.float64).view(4, 3)),
}


@pytest.mark.parametrize("fn", WRAPPER_INPUT_FUNCTIONS)
def test_gradcheck_takes_a_dense_tensor_wrapper_as_input(fn):
    """gradcheck perturbs its inputs through ``x.data``; with a ``DenseTensor`` wrapper as the
    input, that write bumped the version of the dense tensor ``sin`` / ``pow`` had saved (the
    layout's own storage), and gradcheck raised "modified by an inplace operation"."""
    torch.manual_seed(0)
    w = sten.SparseTensorWrapper(sten.DenseTensor.from_dense(torch.randn(3, 4, dtype=torch.float64)),
                                 requires_grad=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)  # gradcheck's own indexing of the wrapper
        assert torch.autograd.gradcheck(WRAPPER_INPUT_FUNCTIONS[fn], (w,), eps=1e-6, atol=1e-5, rtol=1e-4)
