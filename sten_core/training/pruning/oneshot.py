"""``prune``: one-shot calibrated pruning of a trained model, layer by layer.

For each selected ``nn.Linear`` the calibration batches are run through the
model with a forward hook on that layer collecting what the method needs (the
inputs' column norms for Wanda, ``2XXᵀ/N`` for SparseGPT; nothing for
magnitude), then the layer's weight is replaced through a ``SparsityBuilder``
with the method's sparsifier (bound to those statistics) and ``out_format``.
Layers are visited in the order the forward calls them, so a later layer is
calibrated on the outputs of the already-pruned earlier ones (as in the Wanda
and SparseGPT papers); layers reading the very same input tensor (e.g. the
query, key and value projections) are calibrated together in one pass. Only
one group's statistics are held at a time. A forward pass stops as soon as the
group's layers have run.

Example:
    >>> import torch, sten_core as sten
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    >>> batches = [torch.randn(8, 16) for _ in range(4)]
    >>> model = sten.prune(model, batches, method="sparsegpt", pattern=(2, 4), out_format=sten.CsrTensor)
    >>> model[0].weight.wrapped_tensor.nnz, model[2].weight.wrapped_tensor.nnz
    (256, 64)
"""

from __future__ import annotations

import sys
import time
import warnings
from typing import Any, Callable, Iterable, Sequence

import torch

from sten_core.dispatch import DispatchWarning, sparsify
from sten_core.model.replacing import same_values
from sten_core.progress import show_progress
from sten_core.training.builder import SparsityBuilder
from sten_core.model.sparsifiers import PerBlockFractionSparsifier, ScalarFractionSparsifier, Sparsifier, _check_fraction
from sten_core.model.tensor import SparseTensorWrapper
from sten_core.training.pruning.base import CalibratedSparsifier
from sten_core.training.pruning.sparsegpt import SparseGPTSparsifier
from sten_core.training.pruning.statistics import InputHessian, InputNorms
from sten_core.training.pruning.wanda import WandaSparsifier

METHODS = ("magnitude", "wanda", "sparsegpt")


class _StopForward(Exception):
    """Raised by a hook once every layer of the group has run (ends the pass early)."""


def method_sparsifier(method: str, sparsity: float | None, pattern: tuple[int, int] | None,
                      percdamp: float = 0.01, blocksize: int = 128) -> Sparsifier:
    """The sparsifier of ``method`` for ``sparsity`` or ``pattern=(n, m)`` (unbound).

    >>> method_sparsifier("magnitude", None, (2, 4))
    PerBlockFractionSparsifier(n=2, m=4)
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(repr(m) for m in METHODS)}, got {method!r}")
    if (sparsity is None) == (pattern is None):
        raise TypeError("give exactly one of sparsity (unstructured, e.g. 0.5) and pattern (n:m, e.g. (2, 4))")
    n = m = None
    if sparsity is not None:
        sparsity = _check_fraction(sparsity, "sparsity")
    if pattern is not None:
        if not isinstance(pattern, (tuple, list)) or len(pattern) != 2:
            raise TypeError(f"pattern must be a pair (n, m), e.g. (2, 4), got {pattern!r}")
        n, m = pattern
        CalibratedSparsifier.check_pattern(None, n, m)
    if method == "magnitude":
        return ScalarFractionSparsifier(sparsity) if n is None else PerBlockFractionSparsifier(n, m)
    if method == "wanda":
        return WandaSparsifier(sparsity) if n is None else WandaSparsifier(n=n, m=m)
    if n is None:
        return SparseGPTSparsifier(sparsity, percdamp=percdamp, blocksize=blocksize)
    return SparseGPTSparsifier(n=n, m=m, percdamp=percdamp, blocksize=blocksize)


def _check_storable(sparsifier: Sparsifier, weight: torch.Tensor, out_format: type) -> None:
    """The ``ValueError`` of the calibrated methods, before anything changes, where ``out_format``
    cannot store the mask a plain sparsifier (magnitude) chooses: an ``NMTensor`` asked for 50 %
    re-pruned the unstructured mask to 2:4 (27 of the 32 values kept) with only a warning."""
    if out_format is torch.Tensor:
        return
    from sten_core.training.pruning.plugin import cannot_store

    expected = sparsify(sparsifier, weight, torch.Tensor)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DispatchWarning)   # (the lossy conversion's: raised below)
        stored = sparsify(sparsifier, weight, out_format)
    if not same_values(stored.to_dense(), expected):
        raise cannot_store(out_format, sparsifier)


def select_layers(model: torch.nn.Module, layers: Any) -> dict[str, torch.nn.Linear]:
    """The ``nn.Linear`` modules to prune: all (``None``), the names listed, or
    those for which ``layers(name, module)`` is true."""
    modules = dict(model.named_modules())
    if layers is None or callable(layers):
        chosen = {name: mod for name, mod in modules.items()
                  if isinstance(mod, torch.nn.Linear) and (layers is None or layers(name, mod))}
    else:
        if isinstance(layers, str):
            raise TypeError(f"layers must be a list of module names or a predicate, got the string {layers!r} (wrap it in a list)")
        chosen = {}
        for name in layers:
            if name not in modules:
                raise ValueError(f"layers: no submodule {name!r}; the model's Linear layers are: "
                                 f"{', '.join(n for n, m in modules.items() if isinstance(m, torch.nn.Linear))}")
            if not isinstance(modules[name], torch.nn.Linear):
                raise TypeError(f"layers: {name!r} is a {type(modules[name]).__name__}; only nn.Linear layers are pruned")
            chosen[name] = modules[name]
    if not chosen:
        raise ValueError("layers: no nn.Linear layer selected")
    for name, mod in chosen.items():
        if isinstance(mod.weight, SparseTensorWrapper):
            raise TypeError(f"layers: {name}.weight is already sparse ({type(mod.weight.wrapped_tensor).__name__}); "
                            "prune() starts from a dense trained model")
    return chosen


def _run(model: torch.nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _layer_input(name: str, args: tuple, kwargs: dict) -> torch.Tensor:
    """The input tensor of a ``Linear`` call (positional or ``input=``)."""
    if args:
        return args[0]
    if "input" in kwargs:
        return kwargs["input"]
    raise ValueError(f"layer {name} was called without an input tensor")


def forward_order(model: torch.nn.Module, batch: Any, layers: dict[str, torch.nn.Module]) -> tuple[list[list[str]], bool]:
    """Groups of layer names in the order the forward calls them (consecutive
    layers reading the same input tensor form one group), and whether every
    layer runs exactly once per forward."""
    calls: list[tuple[str, Any]] = []
    handles = []
    for name, mod in layers.items():
        handles.append(mod.register_forward_pre_hook(
            lambda mod, args, kwargs, name=name: calls.append((name, _layer_input(name, args, kwargs))), with_kwargs=True))
    try:
        with torch.no_grad():
            _run(model, batch)
    finally:
        for h in handles:
            h.remove()
    called = [name for name, _ in calls]
    missing = [name for name in layers if name not in called]
    if missing:
        raise ValueError(f"layers {', '.join(missing)} did not run in the model's forward on the first calibration batch")
    groups: list[list[str]] = []
    last_input = None
    seen: set[str] = set()
    for name, x in calls:
        if name in seen:
            continue
        seen.add(name)
        if groups and x is last_input:
            groups[-1].append(name)
        else:
            groups.append([name])
        last_input = x
    once = len(called) == len(set(called))
    return groups, once


class _Progress:
    """One line per layer group on stderr, only when stderr is a terminal."""

    def __init__(self, total: int, method: str, enabled: bool | None):
        self.total, self.method, self.done = total, method, 0
        self.enabled = show_progress(enabled)
        self.started = time.perf_counter()

    def update(self, names: Sequence[str]) -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 30
        filled = int(width * self.done / self.total)
        line = (f"\rprune [{self.method}] [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                f"{', '.join(names)[:60]:<60} {time.perf_counter() - self.started:6.1f}s")
        sys.stderr.write(line)
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _collect(model: torch.nn.Module, batches: Sequence[Any], group: list[str], layers: dict[str, torch.nn.Linear],
             need: str, stop_early: bool) -> dict[str, torch.Tensor]:
    """Run the calibration batches with hooks on ``group``; the statistic ``need`` per layer."""
    make = InputNorms if need == "input_norm" else InputHessian
    stats = {name: make(layers[name].in_features, layers[name].weight.device) for name in group}
    pending: set[str] = set()

    def hook(mod: torch.nn.Module, args: tuple, kwargs: dict, name: str) -> None:
        stats[name].update(_layer_input(name, args, kwargs))
        pending.discard(name)
        if stop_early and not pending:
            raise _StopForward

    handles = [layers[name].register_forward_pre_hook(
        lambda mod, args, kwargs, name=name: hook(mod, args, kwargs, name), with_kwargs=True) for name in group]
    try:
        with torch.no_grad():
            for batch in batches:
                pending.update(group)
                try:
                    _run(model, batch)
                except _StopForward:
                    pass
    finally:
        for h in handles:
            h.remove()
    return {name: acc.result() for name, acc in stats.items()}


def prune(model: torch.nn.Module, calibration_batches: Iterable[Any] | None = None, method: str = "wanda", *,
          sparsity: float | None = None, pattern: tuple[int, int] | None = None,
          layers: Sequence[str] | Callable[[str, torch.nn.Module], bool] | None = None,
          out_format: type = torch.Tensor, sequential: bool = True, percdamp: float = 0.01,
          blocksize: int = 128, progress: bool | None = None) -> torch.nn.Module:
    """Prune ``model``'s linear layers one-shot, in place, and return it.

    Args:
        model: a trained model; its selected ``nn.Linear`` weights must be dense.
        calibration_batches: inputs to ``model`` (a tensor → ``model(x)``, a tuple
            → ``model(*x)``, a dict → ``model(**x)``); iterated once per layer
            group, so a list is best. Not needed for ``"magnitude"``.
        method: ``"magnitude"`` (per layer), ``"wanda"`` or ``"sparsegpt"``.
        sparsity: unstructured sparsity, e.g. ``0.5``; or
        pattern: ``(n, m)``: keep ``n`` of every ``m`` inputs, e.g. ``(2, 4)``.
        layers: ``None`` (every ``nn.Linear``), a list of module names, or a
            predicate ``layers(name, module)``. Language models usually leave
            the output head dense.
        out_format: the layout each pruned weight is stored in (``torch.Tensor``
            keeps it dense with zeros; ``sten.CsrTensor``, ``NMTensor``,
            ``Sparse24Tensor``, ... through the ``SparsityBuilder``). A layout
            with its own pattern provides a classmethod
            ``pruning_sparsifier(method, sparsity=, pattern=, percdamp=, blocksize=)``
            that gives each method's sparsifier for it (sten_nm's
            ``ColumnGroupedNMTensor``: ``pattern=(n, m)`` or ``(n, m, g)``, n of m
            output rows per column, grouped; ``GroupedNMTensor``: rows in groups
            of 16 sharing one n:m mask).
        sequential: calibrate each layer on the outputs of the already-pruned
            earlier layers (the papers' choice); ``False`` calibrates every layer
            in one pass on the dense model.
        percdamp, blocksize: SparseGPT's dampening and lazy-update block size.
        progress: a per-layer progress bar on stderr; default: when stderr is a terminal.

    Returns:
        ``model``, with the selected weights replaced by new parameters: make the optimizer
        for fine-tuning after pruning (one made before keeps the old, dense parameters).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(method, str):
        raise TypeError(f"method must be a string ({', '.join(METHODS)}), got {type(method).__name__}")
    if not isinstance(out_format, type):
        raise TypeError(f"out_format must be a layout class (e.g. sten.CsrTensor or torch.Tensor), got {out_format!r}")
    own = getattr(out_format, "pruning_sparsifier", None)  # a layout with its own pattern (e.g. grouped n:m)
    if callable(own):
        base = own(method, sparsity=sparsity, pattern=pattern, percdamp=percdamp, blocksize=blocksize)
    else:
        base = method_sparsifier(method, sparsity, pattern, percdamp, blocksize)
    chosen = select_layers(model, layers)
    needs = getattr(base, "needs", ())
    batches: list[Any] = []
    if needs:
        if calibration_batches is None:
            raise ValueError(f"method={method!r} needs calibration_batches (inputs to the model)")
        if isinstance(calibration_batches, torch.Tensor):
            raise TypeError("calibration_batches must be an iterable of batches (e.g. a list of tensors), "
                            "not one tensor: wrap it in a list")
        batches = list(calibration_batches)
        if not batches:
            raise ValueError("calibration_batches is empty")
    elif calibration_batches is not None and isinstance(calibration_batches, torch.Tensor):
        raise TypeError("calibration_batches must be an iterable of batches, not one tensor: wrap it in a list")

    was_training = model.training
    model.eval()
    try:
        if needs:
            groups, once = forward_order(model, batches[0], chosen)
            if not sequential:
                groups = [[name for group in groups for name in group]]
        else:
            groups, once = [[name] for name in chosen], True
        bar = _Progress(len(groups), method, progress)
        for group in groups:
            stats = _collect(model, batches, group, chosen, needs[0], once) if needs else {}
            builder = SparsityBuilder(model)
            for name in group:
                sparsifier = base.bind(**{needs[0]: stats.pop(name)}) if needs else base
                if not needs:
                    _check_storable(sparsifier, chosen[name].weight.detach(), out_format)
                builder.set_weight(f"{name}.weight", sparsifier, out_format=out_format)
            builder.sparsify_model_and_optimizer_inplace()
            del stats, builder
            bar.update(group)
    finally:
        model.train(was_training)
    return model
