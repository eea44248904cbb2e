"""Sparsity during training: schedules and the ``SparsityScheduler``.

A *schedule* says, for every training step, the target sparsity of a weight
and whether its kept positions are recomputed at that step. The scheduler
re-applies a weight sparsifier on that schedule, stores the weight in the
configured layout, and keeps the optimizer's state consistent: state at
dropped positions is removed, state at newly kept positions starts as a new
parameter's would (``fresh_state``; the optimizer's step counter is kept), and
sparse state is always stored on the weight's own pattern (``state_like``).
Masks move one tensor at a time, each in O(size of that tensor).

Step semantics: ``add`` applies the schedule of step 0; ``step()`` (call it
once per training step, after ``optimizer.step()``) advances to the next step
and applies its schedule, using the gradients of the step just taken.

Schedules:

* ``OneShot(sparsity, step=0)``: prune once.
* ``GradualPruning(initial, final, start, end, every)``: gradual magnitude pruning
  with the cubic schedule of Zhu & Gupta (2017),
  ``s_t = s_f + (s_i - s_f) (1 - (t - start) / (end - start))**3``.
* ``PruneRegrow(sparsity, drop_fraction, start, end, every)``: RigL (Evci et
  al. 2020): drop the smallest magnitudes, regrow by gradient magnitude, at
  constant sparsity; regrown weights start at 0, their optimizer state fresh.

Example:
    >>> import torch, sten_core as sten
    >>> from sten_core.training.schedule import GradualPruning, SparsityScheduler
    >>> model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> sched = SparsityScheduler(model, opt)
    >>> sched.add("0.weight", GradualPruning(0.0, 0.75, start=0, end=4), layout=sten.CsrTensor)
    >>> for _ in range(4):
    ...     model(torch.randn(2, 16)).sum().backward(); opt.step(); opt.zero_grad(); sched.step()
    >>> model[0].weight.wrapped_tensor.nnz, sched.target_nnz("0.weight")
    (64, 64)
"""

from __future__ import annotations

import copy
import inspect
import math
import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from sten_core.dispatch.fresh_state import fresh_state
from sten_core.model.layouts import pattern_of_mask, supports_values
from sten_core.model.masks import masked, stored_mask
from sten_core.training.scores import ScoreSparsifier, check_inputs, needs_of
from sten_core.model.sparsifiers import (RandomFractionSparsifier, ScalarFractionSparsifier, Sparsifier, kept_count,
                                        magnitude)
from sten_core.model.tensor import SparseParameterWrapper, SparseTensorWrapper
from sten_core.training.weight_names import unknown_weight


def _int(value: Any, name: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _sparsity(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number in [0, 1), got {type(value).__name__}")
    value = float(value)
    if not (0.0 <= value < 1.0):
        raise ValueError(f"{name} must be in [0, 1), got {value}")
    return value


def _range(start: Any, end: Any) -> tuple[int, int]:
    start, end = _int(start, "start"), _int(end, "end")
    if end <= start:
        raise ValueError(f"the step range is empty: start={start}, end={end} (need start < end)")
    return start, end


# -- schedules ---------------------------------------------------------------------

class Schedule:
    """Target sparsity per step; subclasses implement ``sparsity`` and ``updates``."""

    regrows: ClassVar[bool] = False

    def sparsity(self, step: int) -> float:
        """The target sparsity at ``step``."""
        raise NotImplementedError

    def updates(self, step: int) -> bool:
        """Whether the kept positions are recomputed at ``step``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class OneShot(Schedule):
    """Prune to ``sparsity`` at ``step`` (dense before), then keep the mask.

    >>> OneShot(0.9, step=2).sparsity(1), OneShot(0.9, step=2).sparsity(2)
    (0.0, 0.9)
    """

    def __init__(self, sparsity: float, step: int = 0):
        self.final = _sparsity(sparsity, "sparsity")
        self.step = _int(step, "step")

    def sparsity(self, step: int) -> float:
        return self.final if step >= self.step else 0.0

    def updates(self, step: int) -> bool:
        return step == self.step


class GradualPruning(Schedule):
    """Zhu & Gupta's cubic schedule from ``initial`` to ``final`` sparsity,
    updated every ``every`` steps in ``[start, end]``.

    >>> s = GradualPruning(0.0, 0.9, start=0, end=100, every=10)
    >>> [round(s.sparsity(t), 4) for t in (0, 5, 10, 50, 100, 200)]
    [0.0, 0.0, 0.2439, 0.7875, 0.9, 0.9]
    """

    def __init__(self, initial: float = 0.0, final: float = 0.9, start: int = 0, end: int = 1000, every: int = 1):
        self.initial = _sparsity(initial, "initial sparsity")
        self.final = _sparsity(final, "final sparsity")
        if self.final < self.initial:
            raise ValueError(f"final sparsity {self.final} must be >= initial sparsity {self.initial}")
        self.start, self.end = _range(start, end)
        self.every = _int(every, "every", 1)

    def _last_update(self, step: int) -> int:
        if step <= self.start:
            return self.start
        if step >= self.end:
            return self.end
        return self.start + (step - self.start) // self.every * self.every

    def sparsity(self, step: int) -> float:
        t = self._last_update(step)
        frac = (t - self.start) / (self.end - self.start)
        return self.final + (self.initial - self.final) * (1.0 - frac) ** 3

    def updates(self, step: int) -> bool:
        return self.start <= step <= self.end and (step == self.end or (step - self.start) % self.every == 0)


class PruneRegrow(Schedule):
    """RigL-style prune-and-regrow at constant ``sparsity``.

    At steps ``start + k * every`` before ``end``, the ``drop_fraction(t)`` of
    kept weights with the smallest score (magnitude by default) are dropped
    and as many positions that were not kept are regrown, those with the
    largest gradient magnitude. ``drop_fraction`` decays with a cosine from
    ``drop_fraction`` at ``start`` to 0 at ``end`` (``decay="constant"`` keeps it).

    >>> s = PruneRegrow(0.9, drop_fraction=0.3, start=0, end=100, every=25)
    >>> [t for t in range(100) if s.updates(t)], round(s.drop_fraction_at(50), 3)
    ([25, 50, 75], 0.15)
    """

    regrows = True

    def __init__(self, sparsity: float, drop_fraction: float = 0.3, start: int = 0, end: int = 1000,
                 every: int = 100, decay: str = "cosine"):
        self.final = _sparsity(sparsity, "sparsity")
        if isinstance(drop_fraction, bool) or not isinstance(drop_fraction, (int, float)) or not 0.0 <= drop_fraction <= 1.0:
            raise ValueError(f"drop_fraction must be a number in [0, 1], got {drop_fraction!r}")
        self.drop_fraction = float(drop_fraction)
        self.start, self.end = _range(start, end)
        self.every = _int(every, "every", 1)
        if decay not in ("cosine", "constant"):
            raise ValueError(f"decay must be 'cosine' or 'constant', got {decay!r}")
        self.decay = decay

    def sparsity(self, step: int) -> float:
        return self.final

    def updates(self, step: int) -> bool:
        return self.start < step < self.end and (step - self.start) % self.every == 0

    def drop_fraction_at(self, step: int) -> float:
        """The fraction of kept weights replaced at ``step``."""
        if self.decay == "constant":
            return self.drop_fraction
        frac = (step - self.start) / (self.end - self.start)
        return self.drop_fraction / 2 * (1 + math.cos(math.pi * frac))


# -- masks and layouts ---------------------------------------------------------------

def selector_at(sparsifier: Any, sparsity: float) -> Any:
    """The sparsifier choosing the kept positions at ``sparsity`` from
    non-negative scores, or ``None`` where everything is kept.

    Fraction sparsifiers get ``fraction=sparsity``; n:m ones (``n``, ``m``
    attributes) keep ``n = round(m * (1 - sparsity))`` of every ``m``; score
    sparsifiers and ``RandomFractionSparsifier`` (random scores) choose
    unstructured. A sparsity whose ``n`` rounds to 0 is a ``ValueError``; a
    sparsifier with neither (a threshold, ``KeepAll``) a ``TypeError``.

    >>> from sten_core.model.sparsifiers import PerBlockFractionSparsifier
    >>> selector_at(PerBlockFractionSparsifier(3, 4), 0.5).n
    2
    """
    unstructured = sparsifier is None or isinstance(sparsifier, (ScoreSparsifier, RandomFractionSparsifier))
    has_nm = hasattr(sparsifier, "n") and hasattr(sparsifier, "m")
    if not (unstructured or hasattr(sparsifier, "fraction") or has_nm):
        raise TypeError(
            f"a schedule sets the sparsity of its weight, so its sparsifier must take one: a fraction "
            f"(ScalarFractionSparsifier, BlockwiseFractionSparsifier, a score sparsifier) or n:m (n, m: "
            f"PerBlockFractionSparsifier, NMSparsifier); {sparsifier!r} has neither. Apply it once with "
            "sten.sparsify / SparsityBuilder instead")
    if sparsity == 0.0:
        return None
    if unstructured:
        return ScalarFractionSparsifier(sparsity)
    if hasattr(sparsifier, "fraction"):
        new = copy.copy(sparsifier)
        new.fraction = sparsity
        return new
    n = kept_count(sparsifier.m, sparsity)
    if n >= sparsifier.m:
        return None
    if n < 1:
        raise ValueError(f"{sparsifier!r} cannot reach sparsity {sparsity:.4g}: that keeps n = round({sparsifier.m} * "
                         f"(1 - {sparsity:.4g})) = {n} of every {sparsifier.m}, and an n:m pattern keeps n >= 1 "
                         f"(its highest sparsity is {1 - 1 / sparsifier.m:.4g})")
    new = copy.copy(sparsifier)
    new.n = n
    return new


def selection_scores(selector: Any, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """What ``selector.mask`` chooses from at a pruning step: ``ranks`` of ``scores`` for a
    sparsifier that only compares them (ranks keep every position outside ``allowed`` below
    every one inside, even where scores tie at zero); for one that sums them (blocks, grouped
    n:m) the scores themselves, zero outside ``allowed``."""
    if getattr(selector, "compares_only", False):
        return ranks(scores, allowed)
    return masked(scores, allowed)


def ranks(scores: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Distinct positive ranks of ``scores`` (highest score → largest rank; among
    equal scores the earliest ranks higher); 0 where ``allowed`` is False."""
    flat = scores.detach().reshape(-1)
    if flat.dtype not in (torch.float32, torch.float64):
        flat = flat.float()
    order = torch.argsort(flat, descending=True, stable=True)
    dtype = torch.float32 if flat.numel() < (1 << 24) else torch.float64
    out = torch.empty(flat.numel(), dtype=dtype, device=flat.device)
    out[order] = torch.arange(flat.numel(), 0, -1, dtype=dtype, device=flat.device)
    out = out.view(scores.shape)
    if allowed is not None:
        out = out * allowed
    return out


def layout_from_mask(layout: type, dense: torch.Tensor, mask: torch.Tensor, params: dict | None = None) -> Any:
    """A ``layout`` object storing exactly the positions of ``mask`` (kept zeros
    included) with the values of ``dense``.

    Built in for COO, CSR and CSC; a layout whose ``from_dense`` takes ``mask``
    gets it (with the keyword arguments of ``params`` it accepts, e.g. ``n``,
    ``m``, ``dim``); a layout with the stored-values protocol gets its pattern
    from ``from_dense`` of a tensor that is nonzero exactly on ``mask``, then the
    values of ``dense`` (``with_values``, so zeros stay stored); any other is
    ``from_dense`` of ``dense`` kept at ``mask``, which keeps only the nonzeros.

    >>> import sten_core as sten
    >>> layout_from_mask(sten.CsrTensor, torch.zeros(2, 2), torch.eye(2, dtype=torch.bool)).nnz
    2
    """
    from sten_core.builtin.torch_layouts import CooTensor, CscTensor, CsrTensor

    dense = dense.detach()
    mask = mask.to(device=dense.device, dtype=torch.bool)
    if layout in (CsrTensor, CscTensor, CooTensor):
        return _torch_layout_from_mask(layout, dense, mask)
    kwargs, takes_mask = _from_dense_kwargs(layout, params)
    kept = masked(dense, mask)
    if takes_mask:
        return layout.from_dense(kept, mask=mask, **kwargs)
    exact = pattern_of_mask(layout, kept, mask, **kwargs)
    return exact if exact is not None else layout.from_dense(kept, **kwargs)


def _torch_layout_from_mask(layout: type, dense: torch.Tensor, mask: torch.Tensor) -> Any:
    """``layout_from_mask`` for the builtin ``CsrTensor``, ``CscTensor`` and ``CooTensor``."""
    from sten_core.builtin.torch_layouts import CooTensor, CscTensor, CsrTensor

    source = dense.t() if layout is CscTensor else dense
    keep = mask.t() if layout is CscTensor else mask
    idx = keep.nonzero().t()
    values = source[keep]
    if layout is CooTensor:
        return CooTensor(torch.sparse_coo_tensor(idx, values, dense.shape, is_coalesced=True, check_invariants=False))
    counts = keep.sum(1)
    crow = torch.zeros(keep.shape[0] + 1, dtype=torch.int64, device=dense.device)
    crow[1:] = torch.cumsum(counts, 0)
    make = torch.sparse_csr_tensor if layout is CsrTensor else torch.sparse_csc_tensor
    return layout(make(crow, idx[1].contiguous(), values, dense.shape, check_invariants=False))


def _check_dims(name: str, param: torch.Tensor, layout: type) -> None:
    """Refuse at ``add`` a weight that ``layout`` cannot hold for its number of dims (the
    builtin CSR/CSC hold matrices; a conv weight or a bias is not one)."""
    from sten_core.builtin.torch_layouts import CscTensor, CsrTensor

    if layout in (CsrTensor, CscTensor) and param.dim() != 2:
        raise ValueError(f"weight {name!r} has shape {tuple(param.shape)}, and layout {layout.__name__} holds 2-D "
                         f"tensors only{' (the default for a dense weight)' if layout is CsrTensor else ''}; pass "
                         "layout=sten.CooTensor (any number of dims) or layout=torch.Tensor (a masked dense weight)")


def _from_dense_kwargs(layout: type, params: dict | None) -> tuple[dict, bool]:
    """The entries of ``params`` that ``layout.from_dense`` takes, and whether it takes ``mask``."""
    try:
        accepted = inspect.signature(layout.from_dense).parameters
    except (TypeError, ValueError):
        accepted = {}
    return {k: v for k, v in (params or {}).items() if k in accepted and k != "mask"}, "mask" in accepted


def state_like(weight: SparseTensorWrapper, dense: torch.Tensor, grad_fmt: Any = None,
               params: dict | None = None) -> SparseTensorWrapper:
    """Optimizer state with the values of ``dense`` stored on ``weight``'s own pattern
    (stored zeros included), so that state and weight always share one pattern.

    Layouts without the stored-values protocol (which cannot tell a stored zero from
    an absent value) get ``layout_from_mask`` at the weight's nonzeros.

    >>> import sten_core as sten
    >>> w = sten.SparseTensorWrapper(layout_from_mask(sten.CsrTensor, torch.zeros(2, 2), torch.eye(2, dtype=torch.bool)))
    >>> state_like(w, torch.ones(2, 2)).wrapped_tensor.same_pattern(w.wrapped_tensor)
    True
    """
    layout = weight.wrapped_tensor
    if supports_values(layout):
        values = layout.gather(dense.to(layout.values().device)).to(dense.dtype)
        return SparseTensorWrapper(layout.with_values(values), False, grad_fmt)
    return SparseTensorWrapper(layout_from_mask(type(layout), dense, stored_mask(weight), params), False, grad_fmt)


# -- the scheduler -------------------------------------------------------------------

@dataclass
class _Entry:
    name: str
    module: torch.nn.Module
    attr: str
    schedule: Schedule
    layout: type
    sparsifier: Any
    mask: torch.Tensor | None = None
    score: torch.Tensor | None = None
    masked_dense: bool = False  # layout stores more than the mask: re-mask after each step
    history: list = field(default_factory=list)
    targets: dict = field(default_factory=dict)  # sparsity -> kept count (target_nnz cache)

    @property
    def param(self) -> Any:
        return getattr(self.module, self.attr)


class SparsityScheduler:
    """Re-applies weight sparsifiers on schedules during training.

    Args:
        model: the ``nn.Module`` whose weights are scheduled.
        optimizer: its optimizer (optional); its state follows the masks.

    Call ``add`` per weight, then ``step()`` once per training step, after
    ``optimizer.step()``.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.model, self.optimizer = model, optimizer
        self.step_count = 0
        self._ddp: list | None = None  # weak references to the DDPs holding the model, once looked for
        self.entries: dict[str, _Entry] = {}

    # -- configuration ----------------------------------------------------------
    def add(self, name: str, schedule: Schedule, layout: type | None = None, sparsifier: Any = None) -> None:
        """Schedule weight ``name``; applies the schedule's step-0 sparsity now.

        Args:
            name: fully-qualified parameter name (``"fc1.weight"``).
            schedule: a ``Schedule`` (``OneShot``, ``GradualPruning``, ``PruneRegrow``).
            layout: the storage layout (``sten.CsrTensor``, ``NMTensor``,
                ``torch.Tensor`` for a masked dense weight, ...); default: the
                weight's current layout, or ``CsrTensor`` for a dense weight.
            sparsifier: the criterion and structure (default: magnitude,
                unstructured): ``ScalarFractionSparsifier``, an n:m sparsifier
                (``PerBlockFractionSparsifier``/``NMSparsifier``; the schedule
                sets ``n``), or a score sparsifier (``TaylorSparsifier``, ...).
        """
        params = dict(self.model.named_parameters(remove_duplicate=False))  # tied weights under every name
        if not isinstance(name, str) or name not in params:
            raise unknown_weight(self.model, name)
        if name in self.entries:
            raise ValueError(f"weight {name!r} is already scheduled")
        tie = next((other for other, e in self.entries.items() if e.param is params[name]), None)
        if tie is not None:
            raise ValueError(f"weight {name!r} is tied to {tie!r} (one parameter under two names), which is already "
                             "scheduled; the schedule applies to both names")
        if not isinstance(schedule, Schedule):
            raise TypeError(f"schedule must be a Schedule (OneShot, GradualPruning, PruneRegrow), got {type(schedule).__name__}")
        if sparsifier is not None and (isinstance(sparsifier, type) or not isinstance(sparsifier, Sparsifier) and not callable(getattr(sparsifier, "mask", None))):
            raise TypeError(f"sparsifier must be a sparsifier instance, got {sparsifier!r}")
        param = params[name]
        if layout is None:
            from sten_core.builtin.torch_layouts import CsrTensor

            layout = type(param.wrapped_tensor) if isinstance(param, SparseTensorWrapper) else CsrTensor
        if not isinstance(layout, type):
            raise TypeError(f"layout must be a layout class, got {layout!r}")
        if layout is not torch.Tensor and not callable(getattr(layout, "from_dense", None)):
            raise TypeError(f"layout {layout.__name__} has no from_dense")
        _check_dims(name, param, layout)
        self._check_not_in_ddp(name, param, layout)
        try:
            selector_at(sparsifier, 0.0)
        except TypeError as err:
            raise TypeError(f"weight {name!r}: {err}") from None
        if schedule.regrows and not isinstance(selector_at(sparsifier, 0.5), ScalarFractionSparsifier):
            raise ValueError(f"PruneRegrow needs an unstructured sparsifier (magnitude or score), got {sparsifier!r}")
        path, _, attr = name.rpartition(".")
        entry = _Entry(name, self.model.get_submodule(path), attr, schedule, layout, sparsifier)
        self._check_final(entry)
        entry.mask = stored_mask(param)
        self.entries[name] = entry
        try:
            self._apply(entry, 0, force=True)
        except Exception:
            del self.entries[name]
            raise

    # -- training ----------------------------------------------------------------
    def step(self) -> None:
        """Advance one training step: accumulate running scores, then move
        the masks of the weights whose schedule updates at the new step."""
        for entry in self.entries.values():
            if "score" in needs_of(entry.sparsifier):
                grad = self._grad(entry, "its running score")
                inc = entry.sparsifier.score_increment(entry.param.to_dense() if isinstance(entry.param, SparseTensorWrapper)
                                                       else entry.param.detach(), grad)
                entry.score = inc if entry.score is None else entry.score + inc
        self.step_count += 1
        for entry in self.entries.values():
            self._apply(entry, self.step_count)

    def target_nnz(self, name: str, step: int | None = None) -> int:
        """How many positions of ``name`` the schedule keeps at ``step`` (default: now)."""
        entry = self._entry(name)
        step = self.step_count if step is None else step
        sparsity = entry.schedule.sparsity(step)
        cached = entry.targets.get(sparsity)
        if cached is not None:
            return cached
        selector = selector_at(entry.sparsifier, sparsity)
        numel = entry.param.numel()
        if selector is None:
            count = numel
        else:
            count = int(selector.mask(torch.arange(numel, 0, -1, dtype=torch.float32).view(entry.param.shape)).sum())
        entry.targets[sparsity] = count
        return count

    def nnz(self, name: str) -> int:
        """How many positions of ``name`` are kept now."""
        return int(self._entry(name).mask.sum())

    def sparsity(self, name: str) -> float:
        """The current sparsity of ``name`` (1 - kept / size)."""
        entry = self._entry(name)
        return 1.0 - self.nnz(name) / entry.mask.numel()

    def mask(self, name: str) -> torch.Tensor:
        """The current boolean keep-mask of ``name`` (a copy)."""
        return self._entry(name).mask.clone()

    # -- checkpoints ---------------------------------------------------------------
    def state_dict(self) -> dict:
        """The scheduler's progress, for ``torch.save`` (plain tensors and numbers:
        ``torch.load`` reads it with ``weights_only=True``).

        Holds the step count and, per scheduled weight, its keep-mask, running
        score, history and the sparsifier's own state; the schedules, layouts and
        sparsifiers themselves are configured by ``add`` when resuming.
        """
        entries = {}
        for name, entry in self.entries.items():
            sp_state = entry.sparsifier.state_dict() if callable(getattr(entry.sparsifier, "state_dict", None)) else None
            entries[name] = {
                "schedule": repr(entry.schedule),
                "layout": _class_name(entry.layout),
                "sparsifier": repr(entry.sparsifier),
                "sparsifier_state": sp_state,
                "mask": entry.mask.detach().clone(),
                "score": None if entry.score is None else entry.score.detach().clone(),
                "masked_dense": entry.masked_dense,
                "history": [list(h) for h in entry.history],
            }
        return {"step_count": self.step_count, "entries": entries}

    def load_state_dict(self, state_dict: dict, strict: bool = True) -> None:
        """Resume from ``state_dict()``: call ``add`` for the same weights first, and
        load the model and optimizer states before (or after) this one.

        With ``strict`` the scheduled weights, schedules, layouts and sparsifiers
        must be the ones saved; otherwise only the weights present in both are
        restored.

        >>> import torch, sten_core as sten
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8))
        >>> sched = SparsityScheduler(model)
        >>> sched.add("0.weight", OneShot(0.5), layout=sten.CsrTensor)
        >>> sched.step(); state = sched.state_dict()
        >>> again = SparsityScheduler(torch.nn.Sequential(torch.nn.Linear(8, 8)))
        >>> again.add("0.weight", OneShot(0.5), layout=sten.CsrTensor)
        >>> again.load_state_dict(state); again.step_count
        1
        """
        if not isinstance(state_dict, dict) or not {"step_count", "entries"} <= set(state_dict):
            raise ValueError("state_dict must be a SparsityScheduler.state_dict() (with 'step_count' and 'entries')")
        saved = state_dict["entries"]
        if strict and set(saved) != set(self.entries):
            missing, unexpected = sorted(set(saved) - set(self.entries)), sorted(set(self.entries) - set(saved))
            raise ValueError(
                f"state_dict schedules other weights: saved but not added here: {', '.join(missing) or 'none'}; "
                f"added here but not saved: {', '.join(unexpected) or 'none'} (call add() for the saved weights, "
                "or load with strict=False)"
            )
        for name, entry in self.entries.items():
            if name not in saved:
                continue
            state = saved[name]
            if strict:
                here = {"schedule": repr(entry.schedule), "layout": _class_name(entry.layout),
                        "sparsifier": repr(entry.sparsifier)}
                for key, value in here.items():
                    if state[key] != value:
                        raise ValueError(f"{name!r}: the checkpoint's {key} is {state[key]}, this scheduler's is "
                                         f"{value} (add() it as it was saved, or load with strict=False)")
            mask = state["mask"]
            if not isinstance(mask, torch.Tensor) or mask.shape != entry.mask.shape:
                raise ValueError(f"{name!r}: the saved mask has shape {tuple(getattr(mask, 'shape', ()))}, "
                                 f"the weight {tuple(entry.mask.shape)}")
            entry.mask = mask.to(device=entry.mask.device, dtype=torch.bool).clone()
            entry.score = None if state["score"] is None else state["score"].clone()
            entry.masked_dense = bool(state["masked_dense"])
            entry.history = [tuple(h) for h in state["history"]]
            if state["sparsifier_state"] is not None and callable(getattr(entry.sparsifier, "load_state_dict", None)):
                entry.sparsifier.load_state_dict(state["sparsifier_state"])
        self.step_count = _int(state_dict["step_count"], "state_dict['step_count']")

    # -- internals ---------------------------------------------------------------
    def _entry(self, name: str) -> _Entry:
        if name not in self.entries:
            raise ValueError(f"weight {name!r} is not scheduled; scheduled: {', '.join(self.entries) or 'none'}")
        return self.entries[name]

    def _grad(self, entry: _Entry, purpose: str) -> torch.Tensor:
        grad = entry.param.grad
        if grad is None:
            raise ValueError(
                f"{type(entry.sparsifier).__name__ if entry.sparsifier is not None else 'the schedule'} needs the gradient "
                f"of {entry.name!r} for {purpose} at step {self.step_count}, but it has none: call "
                "SparsityScheduler.step() after loss.backward() (and before optimizer.zero_grad()), and "
                "start schedules that need gradients at a step >= 1"
            )
        if isinstance(grad, SparseTensorWrapper):
            return grad.to_dense()
        return grad.detach()

    def _inputs(self, entry: _Entry) -> dict[str, Any]:
        needs = needs_of(entry.sparsifier)
        inputs: dict[str, Any] = {}
        if "grad" in needs:
            inputs["grad"] = self._grad(entry, "its score")
        if "step" in needs:
            inputs["step"] = self.step_count
        if "score" in needs:
            inputs["score"] = entry.score
            if entry.score is None:
                check_inputs(entry.sparsifier, inputs, f"{entry.name!r} at step {self.step_count} (no optimizer step "
                                                       "has been taken yet to accumulate it)")
        return inputs

    def _scores(self, entry: _Entry, dense: torch.Tensor) -> torch.Tensor:
        sp = entry.sparsifier
        if isinstance(sp, ScoreSparsifier) or callable(getattr(sp, "score", None)):
            return sp.scores(dense, **self._inputs(entry)) if hasattr(sp, "scores") else sp.score(dense, **self._inputs(entry))
        if isinstance(sp, RandomFractionSparsifier):
            return torch.rand(dense.shape, device=dense.device)
        return magnitude(dense)

    def _apply(self, entry: _Entry, step: int, force: bool = False) -> None:
        schedule = entry.schedule
        if not (force or schedule.updates(step)):
            self._remask(entry, stored_too=entry.masked_dense)
            return
        param = entry.param
        with torch.no_grad():
            dense = param.to_dense() if isinstance(param, SparseTensorWrapper) else param.detach()
            old = entry.mask.to(dense.device)
            sparsity = schedule.sparsity(step)
            selector = self._selector(entry, sparsity)
            if schedule.regrows and not force:
                new = self._regrow(entry, dense, old, step)
            elif selector is None:
                new = old.clone()
                if not bool(new.all()):
                    raise ValueError(f"{entry.name!r} is already sparser than {sparsity} and {type(schedule).__name__} only prunes")
            else:
                new = self._prune(entry, selector, selection_scores(selector, self._scores(entry, dense), old), old,
                                  sparsity)
            self._install(entry, dense, old, new, selector)
        entry.history.append((step, int(new.sum())))

    def _regrow(self, entry: _Entry, dense: torch.Tensor, old: torch.Tensor, step: int) -> torch.Tensor:
        if isinstance(entry.param.grad, SparseTensorWrapper):
            raise ValueError(f"{type(entry.schedule).__name__} regrows by the dense gradient of {entry.name!r}, but its "
                             "gradient is stored sparse (a weight-gradient format is set); leave its grad_fmt None")
        grad = self._grad(entry, f"regrowing ({type(entry.schedule).__name__})")
        kept = int(old.sum())
        drop = round(entry.schedule.drop_fraction_at(step) * kept)
        drop = min(drop, old.numel() - kept)
        if drop == 0:
            return old.clone()
        survive_rank = ranks(self._scores(entry, dense), old).reshape(-1)
        survivors = torch.zeros_like(survive_rank, dtype=torch.bool)
        survivors[torch.topk(survive_rank, kept - drop).indices] = True
        grow_rank = ranks(grad.abs(), ~old).reshape(-1)
        grown = torch.zeros_like(survivors)
        grown[torch.topk(grow_rank, drop).indices] = True
        return (survivors | grown).view(old.shape)

    def _where(self, entry: _Entry, sparsity: float | None = None) -> str:
        """How messages name a scheduled weight: ``'fc.weight' (layout CsrTensor, OneShot(...)) at sparsity 0.5``."""
        layout = getattr(entry.layout, "__name__", repr(entry.layout))
        at = "" if sparsity is None else f" at sparsity {sparsity:.4g}"
        return f"{entry.name!r} (layout {layout}, {entry.schedule!r}){at}"

    def _check_not_in_ddp(self, name: str, param: torch.Tensor, layout: type) -> None:
        """Refuse to swap a dense parameter that DistributedDataParallel already reduces
        (DDP would wait for its gradient forever: "Expected to have finished reduction").
        The DDPs holding the model are looked for once per scheduler."""
        from sten_core.training.distributed import ddp_wrappers, reduces

        if layout is torch.Tensor or isinstance(param, SparseTensorWrapper):
            return
        if self._ddp is None:
            found = ddp_wrappers(self.model)
            if found is None:
                return  # no process group (yet): no DDP
            self._ddp = [weakref.ref(w) for w in found]
        if not any(w() is not None and reduces(w(), param) for w in self._ddp):
            return
        raise ValueError(
            f"weight {name!r} is a dense parameter that DistributedDataParallel already reduces; add() would replace "
            "it with a sparse parameter that DDP never sees, and DDP's next iteration would fail. Call "
            "SparsityScheduler.add() before wrapping the model (then wrap it with sparse_ddp), or schedule it as a "
            "masked dense weight (layout=torch.Tensor)")

    def _check_final(self, entry: _Entry) -> None:
        """Refuse at ``add`` a schedule whose final sparsity the sparsifier cannot reach (n:m rounding to n = 0)."""
        final = getattr(entry.schedule, "final", None)
        if isinstance(final, float):
            self._selector(entry, final, "; choose a final sparsity the layout holds")

    def _selector(self, entry: _Entry, sparsity: float, hint: str = "") -> Any:
        """``selector_at`` for ``entry``; its error names the weight, layout and schedule."""
        try:
            return selector_at(entry.sparsifier, sparsity)
        except ValueError as err:
            raise ValueError(f"{self._where(entry)}: {err}{hint}") from err

    def _prune(self, entry: _Entry, selector: Any, scores: torch.Tensor, old: torch.Tensor, sparsity: float) -> torch.Tensor:
        """A pruning schedule's new mask: ``selector`` on scores within ``old``
        (``selection_scores``); it must keep a subset of ``old`` (a pruned position never comes back)."""
        try:
            new = selector.mask(scores).to(torch.bool)
        except ValueError as err:
            raise ValueError(f"{self._where(entry, sparsity)}: {err}") from err
        if not bool((new & ~old).any()):
            return new
        kept, wanted, name = int(old.sum()), int(new.sum()), type(entry.schedule).__name__
        if wanted > kept:
            raise ValueError(f"{entry.name!r} is already sparser than {sparsity:.4g} (keeps {kept} of {old.numel()}, "
                             f"the schedule {wanted}); {name} only prunes")
        raise ValueError(
            f"{self._where(entry, sparsity)}: {selector!r} chose {int((new & ~old).sum())} positions that an earlier step "
            f"pruned, although it keeps {wanted} of the {kept} still kept: its masks at successive sparsities are not "
            f"nested (it chooses its structure anew each time, as grouped n:m regroups rows), and {name} only prunes (a "
            "pruned position never comes back). Prune such a structure at one step (OneShot), or use a sparsifier "
            "whose masks nest (unstructured, or n:m such as NMSparsifier with NMTensor)")

    def _install(self, entry: _Entry, dense: torch.Tensor, old: torch.Tensor, new: torch.Tensor, selector: Any) -> None:
        """Store the weight with mask ``new``; dropped values and state go, newly
        kept positions start at zero weight and fresh state. One tensor at a time."""
        param = entry.param
        keep = new & old
        params = selector.params() if selector is not None else (entry.sparsifier.params() if entry.sparsifier is not None else {})
        if entry.layout is torch.Tensor:
            if isinstance(param, SparseTensorWrapper):
                raise ValueError(f"{entry.name!r} is a sparse wrapper; a masked dense layout needs a dense weight")
            param.data.masked_fill_(~keep.to(param.device), 0)   # (mul_ by the mask left NaN for a pruned inf)
            entry.masked_dense = True
        else:
            layout_obj = self._build(entry, masked(dense, keep), new, params)
            nnz = getattr(layout_obj, "nnz", None)
            entry.masked_dense = nnz is not None and nnz != int(new.sum())
            if isinstance(param, SparseTensorWrapper):
                param.wrapped_tensor = layout_obj
            else:
                self._replace_param(entry, param, SparseParameterWrapper(layout_obj, requires_grad=param.requires_grad))
        entry.mask = new
        self._remap_state(entry, old, new, params)
        if entry.masked_dense:
            self._remask(entry, stored_too=True)

    def _build(self, entry: _Entry, dense: torch.Tensor, new: torch.Tensor, params: dict) -> Any:
        """The layout object of ``entry`` storing the positions of ``new``; an error says
        why the layout cannot."""
        kept = int(new.sum())
        where = f"layout {entry.layout.__name__} cannot store {entry.name!r} at sparsity {1 - kept / new.numel():.4g}"
        try:
            layout_obj = layout_from_mask(entry.layout, dense, new, params)
        except ValueError as err:
            dense_start = "" if kept < new.numel() else (
                f" (the schedule keeps every value until it starts pruning, and {entry.layout.__name__} cannot hold "
                f"a dense weight: start the schedule at step 0, or keep the weight in a layout that holds any "
                f"pattern, such as torch.Tensor or CsrTensor)")
            raise ValueError(f"{where}: {err}{dense_start}") from err
        nnz = getattr(layout_obj, "nnz", None)
        if nnz is None or nnz >= kept:
            return layout_obj
        zeros = int((new & (dense == 0)).sum())
        if nnz + zeros >= kept:
            raise ValueError(f"{where}: it stores {nnz} of the {kept} kept positions, dropping those whose value is 0 "
                             f"({zeros} here; regrown weights start at 0): its from_dense keeps only nonzeros, and it has "
                             "neither the stored-values protocol (values, with_values, gather) nor a from_dense(mask=) "
                             "through which the scheduler stores kept zeros")
        raise ValueError(f"{where} (it stores {nnz} of the {kept} kept positions; configure a sparsifier whose "
                         "structure it holds)")

    def _remap_state(self, entry: _Entry, old: torch.Tensor, new: torch.Tensor, params: dict) -> None:
        """Optimizer state of the weight's shape follows the mask: kept positions keep
        their state, dropped ones lose it, regrown ones (``new & ~old``) get the
        optimizer's fresh state (``fresh_state``). Sparse state is rebuilt on the
        weight's own pattern (``state_like``)."""
        param = entry.param
        if self.optimizer is None or param not in self.optimizer.state:
            return
        state = self.optimizer.state[param]
        keep, grown = new & old, new & ~old
        fresh = None
        for key, value in list(state.items()):
            if not isinstance(value, torch.Tensor) or value.shape != param.shape:
                continue  # the step counter and scalars stay
            if fresh is None:
                fresh = fresh_state(self.optimizer, param) if bool(grown.any()) else {}
            sparse = isinstance(value, SparseTensorWrapper)
            dense = (value.to_dense() if sparse else value.detach()) * keep.to(value.device)
            if key in fresh and bool(fresh[key] != 0):
                dense = dense.masked_fill(grown.to(dense.device), fresh[key].to(dense.dtype))
            if not sparse:
                value.copy_(dense)
            elif isinstance(param, SparseTensorWrapper):
                state[key] = state_like(param, dense, value.grad_fmt, params)
            else:
                state[key] = SparseTensorWrapper(layout_from_mask(type(value.wrapped_tensor), dense, new, params), False,
                                                 value.grad_fmt)

    def _remask(self, entry: _Entry, stored_too: bool) -> None:
        """Zero the dropped positions of dense optimizer state (SGD's momentum
        of a sparse weight sees the dense gradient) and, with ``stored_too``,
        of a weight and state whose layout stores the dropped positions too."""
        param, mask = entry.param, entry.mask
        with torch.no_grad():
            targets = [param] if stored_too else []
            if self.optimizer is not None and param in self.optimizer.state:
                targets += [v for v in self.optimizer.state[param].values()
                            if isinstance(v, torch.Tensor) and v.shape == param.shape
                            and (stored_too or not isinstance(v, SparseTensorWrapper))]
            for t in targets:
                if isinstance(t, SparseTensorWrapper):
                    layout = t.wrapped_tensor
                    if supports_values(layout):
                        values = layout.values()
                        values.copy_(masked(values, layout.gather(mask.to(layout.dtype)) != 0))
                    else:
                        t.wrapped_tensor = type(layout).from_dense(masked(t.to_dense(), mask))
                else:
                    t.copy_(masked(t, mask))

    def _replace_param(self, entry: _Entry, old: torch.Tensor, new: SparseParameterWrapper) -> None:
        """Swap a dense parameter for its sparse wrapper in the module and the optimizer."""
        from sten_core.training.builder import _places_of

        if old.grad is not None:
            new.grad = old.grad  # a dense gradient, as backward gives a sparse weight with no grad_fmt
        for module, attr in _places_of(self.model, old) or [(entry.module, entry.attr)]:  # every name of a tied weight
            setattr(module, attr, new)
        if self.optimizer is None:
            return
        for group in self.optimizer.param_groups:   # (in place: LBFGS keeps the list itself as its _params)
            group["params"][:] = [new if p is old else p for p in group["params"]]
        if old in self.optimizer.state:
            self.optimizer.state[new] = self.optimizer.state.pop(old)


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


__all__ = [
    "GradualPruning", "OneShot", "PruneRegrow", "Schedule", "SparsityScheduler", "fresh_state", "layout_from_mask",
    "ranks", "selector_at", "state_like", "stored_mask",
]
