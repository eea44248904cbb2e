"""Sparsifiers with extra inputs: scores computed from more than the tensor.

A sparsifier declares the inputs it needs besides the tensor in the class
attribute ``needs`` (names: ``"grad"`` the gradient, ``"score"`` a running
score, ``"step"`` the step number) and receives them as keyword arguments of
``score`` / ``mask``. Inputs are known only at some point of training (a
gradient exists after ``backward()``), so the sparsifier is applied then:

* by hand: ``sp.bind(grad=w.grad)`` returns a copy carrying its inputs; the
  copy is an ordinary sparsifier for ``sten.sparsify``, ``set_weight`` and
  registered implementations (``sparsifier.inputs``);
* by the ``SparsityScheduler`` (``sten_core.training.schedule``), which feeds ``grad``,
  ``step`` and the running ``score`` (the sum of ``score_increment`` over the
  optimizer steps) itself.

A running score is declared by ``"score" in needs`` plus a
``score_increment(tensor, grad)`` method.

Example:
    >>> import torch, sten_core as sten
    >>> from sten_core.training.scores import TaylorSparsifier
    >>> w, g = torch.tensor([[1., -2., 3., 4.]]), torch.tensor([[4., 1., -1., 0.]])
    >>> TaylorSparsifier(0.5).mask(w, grad=g).tolist()      # |w * g| = 4, 2, 3, 0
    [[True, False, True, False]]
    >>> sten.sparsify(TaylorSparsifier(0.5).bind(grad=g), w, sten.CsrTensor).to_dense().tolist()
    [[1.0, 0.0, 3.0, 0.0]]
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import torch

from sten_core.dispatch import sparsify
from sten_core.model.sparsifiers import MATERIALIZING, Sparsifier, _check_fraction, _keep_top, kept_count

KNOWN_INPUTS = ("grad", "score", "step")


class MissingInputError(ValueError):
    """A sparsifier was applied before an input it needs was available."""


def needs_of(sparsifier: Any) -> tuple[str, ...]:
    """The extra inputs ``sparsifier`` declares (``()`` for ordinary ones)."""
    needs = getattr(sparsifier, "needs", ())
    if isinstance(needs, str):
        needs = (needs,)
    return tuple(needs)


def check_inputs(sparsifier: Any, inputs: dict[str, Any], where: str = "") -> None:
    """Raise ``MissingInputError`` naming each input of ``needs`` that is absent or ``None``."""
    missing = [name for name in needs_of(sparsifier) if inputs.get(name) is None]
    if not missing:
        return
    where = f" of {where}" if where else ""
    hint = ""
    if "grad" in missing:
        hint = " A gradient exists only after loss.backward(): apply it after the first backward (e.g. " \
               "at the optimizer step), or bind one with .bind(grad=...)."
    elif "score" in missing:
        hint = " The running score is accumulated by SparsityScheduler.step() after each backward; " \
               "bind one with .bind(score=...)."
    raise MissingInputError(
        f"{type(sparsifier).__name__} needs {', '.join(repr(m) for m in missing)}{where}, which is not available.{hint}"
    )


class ScoreSparsifier(Sparsifier):
    """Keeps the ``1 - fraction`` of values with the highest ``score``.

    Subclasses set ``needs`` and implement ``score(tensor, **inputs)`` (higher
    is kept); a running score also implements ``score_increment``. Exactly
    ``round(numel * (1 - fraction))`` values are kept, ties to the earliest.

    >>> class Largest(ScoreSparsifier):
    ...     def score(self, tensor, **inputs):
    ...         return tensor
    >>> Largest(0.5).mask(torch.tensor([3., -5., 1., 2.])).tolist()
    [True, False, False, True]
    """

    kind = MATERIALIZING
    needs: ClassVar[tuple[str, ...]] = ()

    def __init__(self, fraction: float):
        self.fraction = _check_fraction(fraction)
        self._inputs: dict[str, Any] = {}

    # -- inputs ---------------------------------------------------------------
    @property
    def inputs(self) -> dict[str, Any]:
        """The inputs bound with ``bind``."""
        return dict(getattr(self, "_inputs", {}))

    def bind(self, **inputs: Any) -> "ScoreSparsifier":
        """A copy carrying ``inputs`` (e.g. ``grad=w.grad``); equal to ``self``."""
        unknown = sorted(set(inputs) - set(needs_of(self)))
        if unknown:
            raise TypeError(f"{type(self).__name__} does not take {', '.join(unknown)}; it needs {needs_of(self) or 'nothing'}")
        new = copy.copy(self)
        new._inputs = {**self.inputs, **inputs}
        return new

    # -- checkpoints -------------------------------------------------------------
    def state_dict(self) -> dict:
        """``fraction`` and the bound inputs (tensors, numbers), for ``torch.save``.

        >>> sp = TaylorSparsifier(0.5).bind(grad=torch.ones(2))
        >>> again = TaylorSparsifier(0.9); again.load_state_dict(sp.state_dict())
        >>> again.fraction, again.inputs["grad"].tolist()
        (0.5, [1.0, 1.0])
        """
        return {"fraction": self.fraction,
                "inputs": {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in self.inputs.items()}}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore ``state_dict()``: the fraction and the bound inputs."""
        if not isinstance(state_dict, dict) or set(state_dict) != {"fraction", "inputs"}:
            raise ValueError(f"state_dict must be a {type(self).__name__}.state_dict() with 'fraction' and 'inputs'")
        unknown = sorted(set(state_dict["inputs"]) - set(needs_of(self)))
        if unknown:
            raise ValueError(f"state_dict binds {', '.join(unknown)}, which {type(self).__name__} does not take")
        self.fraction = _check_fraction(state_dict["fraction"])
        self._inputs = dict(state_dict["inputs"])

    # -- scores ---------------------------------------------------------------
    def score(self, tensor: torch.Tensor, **inputs: Any) -> torch.Tensor:
        """Per-value score, the tensor's shape; higher is kept."""
        raise NotImplementedError(f"{type(self).__name__}.score")

    def score_increment(self, tensor: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """What one optimizer step adds to the running score (``"score"`` in ``needs``)."""
        raise NotImplementedError(f"{type(self).__name__} has no running score")

    def scores(self, tensor: torch.Tensor, **inputs: Any) -> torch.Tensor:
        """``score`` with bound and given inputs, checked against ``needs``."""
        merged = {**self.inputs, **{k: v for k, v in inputs.items() if v is not None}}
        check_inputs(self, merged)
        args = {k: _dense(merged[k]) for k in needs_of(self)}
        return self.score(_dense(tensor).detach(), **args)

    def mask(self, tensor: torch.Tensor, **inputs: Any) -> torch.Tensor:
        scores = self.scores(tensor, **inputs).detach()
        flat = scores.reshape(-1)
        keep = kept_count(flat.numel(), self.fraction)
        return _keep_top(flat, keep).view(scores.shape)


class TaylorSparsifier(ScoreSparsifier):
    """First-order Taylor score ``|w * grad|`` (the loss change from removing
    a weight, to first order); needs the gradient.

    >>> TaylorSparsifier(0.5).mask(torch.ones(4), grad=torch.tensor([1., 3., 2., 0.])).tolist()
    [False, True, True, False]
    """

    needs = ("grad",)

    def score(self, tensor: torch.Tensor, grad: torch.Tensor = None, **inputs: Any) -> torch.Tensor:
        return (tensor * grad.to(tensor.dtype)).abs()


class MovementSparsifier(ScoreSparsifier):
    """Movement pruning (Sanh et al. 2020): the running score ``S = sum_t -w_t * grad_t``
    keeps the weights moving away from zero (``SparsityScheduler`` passes the weight after the
    step's update as ``w_t``: docs/training.md says how that differs from the paper's).

    >>> sp = MovementSparsifier(0.5)
    >>> w = torch.tensor([1., 1., -1., -1.])
    >>> s = sp.score_increment(w, torch.tensor([-1., 1., -1., 1.]))   # [1, -1, -1, 1]
    >>> sp.mask(w, score=s).tolist()
    [True, False, False, True]
    """

    needs = ("score",)

    def score(self, tensor: torch.Tensor, score: torch.Tensor = None, **inputs: Any) -> torch.Tensor:
        return score

    def score_increment(self, tensor: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        return -(tensor * grad.to(tensor.dtype))


def _dense(value: Any) -> Any:
    to_dense = getattr(value, "wrapped_tensor", None)
    if to_dense is not None:
        return value.to_dense()
    return value


def sparsify_with(sparsifier: Any, tensor: torch.Tensor, out_format: type, **inputs: Any) -> Any:
    """``sten.sparsify`` for a sparsifier with extra inputs, given as keywords.

    >>> import sten_core as sten
    >>> w = sparsify_with(TaylorSparsifier(0.5), torch.ones(2, 2), sten.CooTensor, grad=torch.eye(2))
    >>> w.wrapped_tensor.nnz
    2
    """
    if needs_of(sparsifier):
        merged = {**getattr(sparsifier, "inputs", {}), **inputs}
        check_inputs(sparsifier, merged)
        sparsifier = sparsifier.bind(**{k: v for k, v in inputs.items() if v is not None})
    elif inputs:
        raise TypeError(f"{type(sparsifier).__name__} takes no extra inputs, got {', '.join(inputs)}")
    return sparsify(sparsifier, tensor, out_format)


__all__ = [
    "KNOWN_INPUTS", "MissingInputError", "MovementSparsifier", "ScoreSparsifier", "TaylorSparsifier",
    "check_inputs", "needs_of", "sparsify_with",
]
