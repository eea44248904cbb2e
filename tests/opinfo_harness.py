"""Drive PyTorch's OpInfo samples through STen wrappers and compare with plain torch.

Used by ``test_opinfo.py``; ``python -m tests.opinfo_harness`` prints every
mismatching sample (to refresh the test's list of known mismatches).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

import sten_core as sten

LAYOUTS_2D = ("CooTensor", "CsrTensor", "CscTensor")
MAX_SAMPLES = 4  # per operator: the first samples of its generator
UNINITIALISED = {"empty_like", "new_empty", "new_empty_strided", "empty", "empty_strided", "empty_permuted"}
"""Operators whose values are uninitialised memory: nothing to compare."""


@dataclass
class Outcome:
    op: str
    layout: str
    index: int
    status: str  # "match", "mismatch" or "skip"
    reason: str = ""


def _tree_map(fn: Callable, tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, (list, tuple)) and not isinstance(tree, torch.Size):
        items = [_tree_map(fn, v) for v in tree]
        return type(tree)(items) if not hasattr(tree, "_fields") else type(tree)(*items)
    if isinstance(tree, dict):
        return {k: _tree_map(fn, v) for k, v in tree.items()}
    return tree


def _leaves(tree: Any) -> list:
    out: list = []
    _tree_map(lambda t: out.append(t) or t, tree)
    return out


def _dense(value: Any) -> Any:
    return value.to_dense() if isinstance(value, sten.SparseTensorWrapper) else value


def _strided(t: torch.Tensor) -> torch.Tensor:
    return t.to_dense() if t.layout != torch.strided else t


def _wrappable(t: torch.Tensor, layout: str) -> bool:
    if t.dtype != torch.float32 or t.layout != torch.strided:
        return False
    return layout == "DenseTensor" or t.dim() == 2


def _make(t: torch.Tensor, layout: str, grad: bool) -> torch.Tensor:
    cls = getattr(sten, layout)
    return sten.SparseTensorWrapper(cls.from_dense(t.detach().clone()), requires_grad=grad)


def run_sample(op: Any, sample: Any, layout: str, grad: bool) -> tuple[str, str]:
    """``("match"|"mismatch"|"skip", reason)`` for one sample and layout."""
    args = (sample.input, *sample.args)
    kwargs = dict(sample.kwargs)
    tensors = [t for t in _leaves((args, kwargs)) if _wrappable(t, layout)]
    if not tensors:
        return "skip", "no float32 tensor of a shape this layout stores"
    want_grad = grad and op.supports_autograd

    def leaf(t: torch.Tensor, wrap: bool) -> torch.Tensor:
        needs = want_grad and t.dtype.is_floating_point
        if wrap and _wrappable(t, layout):
            return _make(t, layout, needs)
        return t.detach().clone().requires_grad_(needs) if t.dtype.is_floating_point else t.clone()

    ref_args = _tree_map(lambda t: leaf(t, False), (args, kwargs))
    our_args = _tree_map(lambda t: leaf(t, True), (args, kwargs))
    torch.manual_seed(0)
    try:
        expected = op.op(*ref_args[0], **ref_args[1])
    except Exception as error:  # the sample itself does not run densely
        return "skip", f"dense reference raised {type(error).__name__}"
    torch.manual_seed(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = op.op(*our_args[0], **our_args[1])
    except Exception as error:
        return "mismatch", f"raised {type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"
    exp_leaves = _leaves(expected)
    got_leaves = _leaves(got)
    if len(exp_leaves) != len(got_leaves):
        return "mismatch", f"{len(got_leaves)} tensor outputs, expected {len(exp_leaves)}"
    for e, g in zip(exp_leaves, got_leaves):
        g_dense = _dense(g)
        try:
            torch.testing.assert_close(g_dense.detach(), e.detach(), equal_nan=True, atol=1e-4, rtol=1e-4,
                                       check_stride=False)
        except AssertionError as error:
            return "mismatch", "values differ: " + str(error).splitlines()[0][:100]
    if not want_grad:
        return "match", ""
    ref_inputs = [t for t in _leaves(ref_args) if t.requires_grad]
    our_inputs = [t for t in _leaves(our_args) if t.requires_grad]
    outs = [(e, g) for e, g in zip(exp_leaves, got_leaves) if e.requires_grad and e.dtype.is_floating_point]
    if not outs or not ref_inputs:
        return "match", ""
    torch.manual_seed(1)
    weights = [torch.randn(e.shape) for e, _ in outs]
    try:
        ref_grads = torch.autograd.grad([(e * w).sum() for (e, _), w in zip(outs, weights)], ref_inputs,
                                        allow_unused=True)
    except Exception:  # no dense derivative either
        return "match", ""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            losses = [torch.sum(torch.mul(g, w)) for (_, g), w in zip(outs, weights)]
            if not all(loss.requires_grad for loss in losses):
                return "mismatch", "an output lost its autograd history"
            our_grads = torch.autograd.grad(losses, our_inputs, allow_unused=True)
    except Exception as error:
        return "mismatch", f"backward raised {type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"
    for r, g, ref_leaf in zip(ref_grads, our_grads, ref_inputs):
        if r is None and g is None:
            continue
        r = torch.zeros_like(ref_leaf) if r is None else _strided(r)  # unused: a zero gradient
        g = torch.zeros_like(ref_leaf) if g is None else _strided(_dense(g))
        try:
            torch.testing.assert_close(torch.broadcast_to(g, r.shape).detach(), r.detach(), equal_nan=True,
                                       atol=1e-4, rtol=1e-4, check_stride=False)
        except (AssertionError, RuntimeError) as error:
            return "mismatch", "gradients differ: " + str(error).splitlines()[0][:100]
    return "match", ""


def outcomes(layouts: tuple = ("DenseTensor",) + LAYOUTS_2D) -> Iterator[Outcome]:
    """Every (operator, sample, layout) outcome over ``op_db`` (float32, CPU)."""
    from torch.testing._internal.common_methods_invocations import op_db

    for op in op_db:
        if torch.float32 not in op.supported_dtypes("cpu") or op.name in UNINITIALISED:
            continue
        name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
        try:
            samples = list(_first(op.sample_inputs("cpu", torch.float32, requires_grad=False), MAX_SAMPLES))
        except Exception:
            continue
        for i, sample in enumerate(samples):
            for layout in layouts:
                status, reason = run_sample(op, sample, layout, grad=True)
                yield Outcome(name, layout, i, status, reason)


def _first(it: Iterator, n: int) -> Iterator:
    for i, value in enumerate(it):
        if i >= n:
            return
        yield value


if __name__ == "__main__":
    import time

    started = time.time()
    counts = {"match": 0, "mismatch": 0, "skip": 0}
    for o in outcomes():
        counts[o.status] += 1
        if o.status == "mismatch":
            print(f"{o.op}\t{o.layout}\t{o.index}\t{o.reason}")
    print(counts, f"{time.time() - started:.0f}s")
