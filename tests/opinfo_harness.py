"""Drive PyTorch's OpInfo samples through STen wrappers and compare with plain torch.

Used by ``test_opinfo.py`` (the core's layouts) and ``test_opinfo_plugins.py``
(every plugin layout); ``python tests/opinfo_harness.py [--samples=N] [LAYOUT ...]`` prints every
mismatching sample (to refresh the tests' lists of known mismatches) and the skip
reasons with their counts.

Each layout has a constructor in ``LAYOUTS`` (a :class:`LayoutSpec`): how a float32
tensor becomes that layout, whether that prunes (n:m, 2:4, block-sparse keep only part
of the values), and which shapes it cannot store. For a pruning layout the reference
is plain torch on the wrapped value's dense form (``layout.to_dense()``), not on the
sample. Gradients are compared in full: a leaf wrapper without a ``grad_fmt`` gets a
dense gradient everywhere (docs/concepts.md, "Gradients"; ``_Densify`` in
``sten_core/dispatch/autograd.py`` returns it through ``apply_grad_spec`` with the dense
spec), i.e. dense torch's gradient with respect to the dense form.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

import sten_core as sten

LAYOUTS_2D = ("CooTensor", "CsrTensor", "CscTensor")
PLUGIN_LAYOUTS = ("ScipyCsrTensor", "ScipyCscTensor", "NMTensor", "GroupedNMTensor", "ColumnGroupedNMTensor",
                  "Sparse24Tensor", "BlockSparseTensor")
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


@dataclass(frozen=True)
class LayoutSpec:
    """How the harness wraps a float32 tensor in one layout."""

    make: Callable[[torch.Tensor], Any]  # dense float32 tensor -> layout object
    any_rank: bool = False  # False: 2-D tensors only
    prunes: bool = False  # the layout keeps only part of the values: compare with its dense form
    refuses: Callable[[torch.Tensor], str | None] = lambda t: None  # why it cannot store t, or None


def _core(name: str) -> Callable[[torch.Tensor], Any]:
    return lambda t: getattr(sten, name).from_dense(t)


def _plugin(module: str, name: str, **kwargs: Any) -> Callable[[torch.Tensor], Any]:
    def make(t: torch.Tensor) -> Any:
        import importlib

        return getattr(importlib.import_module(module), name).from_dense(t, **kwargs)
    return make


def _sparse24(t: torch.Tensor) -> Any:
    from sten_cuda24.sparsifiers import sparsify_24  # 2:4 magnitude pruning (torch ops on CPU)

    return sparsify_24(t)


BLOCK = (2, 2)  # OpInfo's matrices are small (mostly 5 x 5 or smaller)


def _block_sparse(t: torch.Tensor) -> Any:
    from sten_cuda24 import BlockSparseTensor

    mask = sten.BlockwiseFractionSparsifier(0.5, BLOCK).mask(t)  # zero the weaker half of the 2 x 2 blocks
    return BlockSparseTensor.from_dense_block_mask(t, mask[::BLOCK[0], ::BLOCK[1]], BLOCK)


LAYOUTS: dict[str, LayoutSpec] = {
    "DenseTensor": LayoutSpec(_core("DenseTensor"), any_rank=True),
    "CooTensor": LayoutSpec(_core("CooTensor")),
    "CsrTensor": LayoutSpec(_core("CsrTensor")),
    "CscTensor": LayoutSpec(_core("CscTensor")),
    "ScipyCsrTensor": LayoutSpec(_plugin("sten_scipy", "ScipyCsrTensor")),
    "ScipyCscTensor": LayoutSpec(_plugin("sten_scipy", "ScipyCscTensor")),
    "NMTensor": LayoutSpec(_plugin("sten_nm", "NMTensor", n=2, m=4), prunes=True),
    "GroupedNMTensor": LayoutSpec(_plugin("sten_nm", "GroupedNMTensor", n=2, m=4), prunes=True),
    "ColumnGroupedNMTensor": LayoutSpec(_plugin("sten_nm", "ColumnGroupedNMTensor", n=2, m=4), prunes=True),
    "Sparse24Tensor": LayoutSpec(_sparse24, prunes=True),
    "BlockSparseTensor": LayoutSpec(_block_sparse, prunes=True),
}
"""Layout name -> constructor. The pruning ones keep 2 of every 4 (n:m, 2:4) or the
stronger half of the 2 x 2 blocks, so the wrapped values differ from the sample's."""


def _wrappable(t: torch.Tensor, layout: str) -> bool:
    if t.dtype != torch.float32 or t.layout != torch.strided:
        return False
    return LAYOUTS[layout].any_rank or t.dim() == 2


def _make(t: torch.Tensor, layout: str, grad: bool) -> torch.Tensor:
    return sten.SparseTensorWrapper(LAYOUTS[layout].make(t.detach().clone()), requires_grad=grad)


def _recheck(op: Any, ref_args: Any, exp_leaves: list, got_leaves: list, repeats: int | None = None) -> tuple | None:
    """A mismatching sample's plain-torch reference run again (same seed and values, every other
    call on the arguments at another address: the wrapped call computes on copies of its own):
    ``("match", args, leaves)`` as soon as plain torch gives the wrapped result too (that run's
    arguments and outputs, the reference for the gradients), ``("skip", reason)`` where it gives
    different values from call to call but never that one, else ``None``.

    Plain torch is not always deterministic: ``torch.linalg.lstsq(a, b, driver="gelsy")`` of a
    wide float32 matrix with a zero column (what pruning makes) gives another solution in about
    one call of five on an AMD EPYC and one of 65 on an Intel Xeon, where 32 reruns all agreeing
    with the first reference made a wrapped call that drew the other solution a mismatch.
    ``repeats`` (default ``REPEATS``) bounds the reruns: ``run_sample`` gives the operators of
    ``NONDETERMINISTIC_REFERENCES`` the full count and every other one ``QUICK_REPEATS``.
    """
    varies, started = False, time.perf_counter()
    for i in range(REPEATS if repeats is None else repeats):
        torch.manual_seed(0)
        args = ref_args if i % 2 == 0 else _tree_map(lambda t: _moved(t, i // 2 % 16), ref_args)
        try:
            again = _leaves(op.op(*args[0], **args[1]))
        except Exception:
            return "skip", "dense reference not reproducible"
        if _all_close(again, got_leaves):
            return "match", args, again
        varies = varies or not _all_close(again, exp_leaves)
        if time.perf_counter() - started > RECHECK_SECONDS:
            break
    return ("skip", "dense reference not reproducible") if varies else None


def _all_close(leaves: list, others: list) -> bool:
    try:
        for a, e in zip(leaves, others, strict=True):
            torch.testing.assert_close(_dense(a).detach(), _dense(e).detach(), equal_nan=True, atol=1e-4, rtol=1e-4,
                                       check_stride=False)
    except Exception:
        return False
    return True


def _moved(t: torch.Tensor, offset: int) -> torch.Tensor:
    """``t``'s values in fresh memory ``offset`` elements past an allocation's start (another
    alignment: BLAS and LAPACK kernels may take other paths on it)."""
    buffer = torch.empty(t.numel() + offset, dtype=t.dtype)
    moved = buffer[offset:].view(t.shape).copy_(t.detach())
    return moved.requires_grad_(t.requires_grad) if t.is_floating_point() else moved


REPEATS = 2000
"""How often, at most, a mismatching sample's dense reference is run again (``_recheck``)."""
RECHECK_SECONDS = 3.0
"""And for how long, at most (a few ms for lstsq's 2000 reruns)."""
QUICK_REPEATS = 32
"""The reruns of an operator not listed in ``NONDETERMINISTIC_REFERENCES``: enough to see a
reference that changes often; the known mismatches (random fills, rerun with the same seed:
the same values every time) then cost 32 reruns instead of ``RECHECK_SECONDS`` each (about 90 s
of the plugins' OpInfo run)."""

NONDETERMINISTIC_REFERENCES = {
    "linalg.lstsq": "gelsy on a wide float32 matrix with a zero column: another solution in ~1 call of 5",
    "linalg.lstsq.grad_oriented": "the same",
}
"""Operators whose plain-torch reference may change from call to call on the pruned values, rarely
(one call in 65 on an Intel Xeon): their mismatches are rerun ``REPEATS`` times. A sample whose
reference varies but never gives the wrapped result is skipped as 'dense reference not
reproducible' (the plugin OpInfo test fails on any other operator skipped so)."""


def op_name(op: Any) -> str:
    """An OpInfo's name with its variant: ``"linalg.lstsq.grad_oriented"``."""
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def run_sample(op: Any, sample: Any, layout: str, grad: bool) -> tuple[str, str]:
    """``("match"|"mismatch"|"skip", reason)`` for one sample and layout."""
    args = (sample.input, *sample.args)
    kwargs = dict(sample.kwargs)
    spec = LAYOUTS[layout]
    tensors = [t for t in _leaves((args, kwargs)) if _wrappable(t, layout)]
    if not tensors:
        return "skip", "no float32 tensor of a shape this layout stores"
    for t in tensors:
        why = spec.refuses(t)
        if why:
            return "skip", f"{layout} cannot store {tuple(t.shape)}: {why}"
    want_grad = grad and op.supports_autograd
    stored: dict[int, torch.Tensor] = {}  # id(sample tensor) -> the wrapped value's dense form

    def leaf(t: torch.Tensor, wrap: bool) -> torch.Tensor:
        needs = want_grad and t.dtype.is_floating_point
        if wrap and _wrappable(t, layout):
            wrapper = _make(t, layout, needs)
            if spec.prunes:
                stored[id(t)] = wrapper.wrapped_tensor.to_dense().detach()
            return wrapper
        if not wrap and id(t) in stored:  # the reference runs on what the layout stores
            t = stored[id(t)]
        return t.detach().clone().requires_grad_(needs) if t.dtype.is_floating_point else t.clone()

    try:
        our_args = _tree_map(lambda t: leaf(t, True), (args, kwargs))
    except Exception as error:
        return "mismatch", f"wrapping raised {type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"
    ref_args = _tree_map(lambda t: leaf(t, False), (args, kwargs))
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
            repeats = REPEATS if op_name(op) in NONDETERMINISTIC_REFERENCES else QUICK_REPEATS
            rechecked = _recheck(op, ref_args, exp_leaves, [_dense(g) for g in got_leaves], repeats)
            if rechecked is not None:
                if rechecked[0] == "match":  # a result plain torch gives too: the reference from here on
                    _, ref_args, exp_leaves = rechecked
                    break
                return rechecked
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


def outcomes(layouts: tuple = ("DenseTensor",) + LAYOUTS_2D, max_samples: int = MAX_SAMPLES) -> Iterator[Outcome]:
    """Every (operator, sample, layout) outcome over ``op_db`` (float32, CPU)."""
    from torch.testing._internal.common_methods_invocations import op_db

    for op in op_db:
        if torch.float32 not in op.supported_dtypes("cpu") or op.name in UNINITIALISED:
            continue
        name = op_name(op)
        try:
            samples = list(_first(op.sample_inputs("cpu", torch.float32, requires_grad=False), max_samples))
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


def skip_kind(reason: str) -> str:
    """A skip reason without its shapes, for counting."""
    return reason.split(":")[0] if " cannot store " in reason else reason


if __name__ == "__main__":
    import collections
    import sys
    import time

    started = time.time()
    args = sys.argv[1:]
    samples = int(args.pop(0)[len("--samples="):]) if args and args[0].startswith("--samples=") else MAX_SAMPLES
    chosen = tuple(args) or ("DenseTensor",) + LAYOUTS_2D
    counts: dict = collections.Counter()
    skips: dict = collections.Counter()
    for o in outcomes(chosen, samples):
        counts[o.layout, o.status] += 1
        if o.status == "mismatch":
            print(f"{o.op}\t{o.layout}\t{o.index}\t{o.reason}")
        elif o.status == "skip":
            skips[o.layout, skip_kind(o.reason)] += 1
    for key, n in sorted(counts.items()):
        print(*key, n, sep="\t")
    for key, n in sorted(skips.items()):
        print("skip", *key, n, sep="\t")
    print(f"{time.time() - started:.0f}s")
