"""What ``sten explain`` runs: a named example (``bert``: a BERT layer with
sparse weights, built from a config) or a user's ``module:function`` that
returns ``(model, inputs)``.

Example:
    >>> sorted(EXAMPLES)
    ['bert']
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from typing import Any, Iterator

import torch

from sten_core.tools.explain import Report, explain


def example(size: str = "base", batch: int = 2, seq_len: int = 16) -> tuple[torch.nn.Module, tuple]:
    """The built-in example: a BERT encoder layer with CSR weights (90 %) and
    its GELU output stored as COO (90 % random), feeding ``output.dense``
    (``F.linear`` on a COO input and a CSR weight: the paper's A.1 combination).

    ``size`` is ``"base"`` (BERT-base) or ``"tiny"`` (hidden 64, for tests).
    """
    from sten_core.training.builder import SparsityBuilder
    from sten_core.builtin.torch_layouts import CooTensor, CsrTensor
    from sten_core.model.sparsifiers import KeepAll, RandomFractionSparsifier, ScalarFractionSparsifier

    from sten_core.tools.bench.models import bert_case

    case = bert_case(batch=batch, seq_len=seq_len, size=size)
    layer = case.model
    builder = SparsityBuilder(layer)
    for path, module in layer.named_modules():
        if isinstance(module, torch.nn.Linear):
            builder.set_weight(f"{path}.weight", initial_sparsifier=ScalarFractionSparsifier(0.9), out_format=CsrTensor)
    builder.set_interm("intermediate.gelu", inline_sparsifier=RandomFractionSparsifier(0.9), tmp_format=CooTensor,
                       external_sparsifier=KeepAll(), out_format=CooTensor)
    return builder.get_sparse_model(), case.inputs


EXAMPLES = {"bert": example}


@contextlib.contextmanager
def working_directory_importable() -> Iterator[None]:
    """Put the working directory first on ``sys.path`` for the block (as
    ``python -m`` does; the ``sten`` script's ``sys.path[0]`` is its ``bin/``),
    and take it off again afterwards if it was not there before.

    >>> with working_directory_importable():
    ...     os.getcwd() in sys.path or "" in sys.path
    True
    """
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def load_target(spec: str, **example_args: Any) -> tuple[torch.nn.Module, tuple]:
    """``"bert"`` (built in) or ``"module:factory"``: a callable returning
    ``(model, inputs)`` (inputs: a tensor or a tuple of arguments)."""
    if spec in EXAMPLES:
        return EXAMPLES[spec](**example_args)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"model {spec!r}: expected a built-in example ({', '.join(EXAMPLES)}) or module:factory")
    with working_directory_importable():
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ValueError(f"model {spec!r}: cannot import {module_name!r} (from the working directory or "
                             f"sys.path): {error}") from None
        factory = getattr(module, attr, None)
        if not callable(factory):
            raise ValueError(f"model {spec!r}: {module_name} has no callable {attr!r}")
        made = factory()  # it may import its neighbours
    if isinstance(made, dict):
        made = (made.get("model"), made.get("inputs"))
    if not (isinstance(made, (tuple, list)) and len(made) == 2 and isinstance(made[0], torch.nn.Module)):
        raise ValueError(f"model {spec!r}: the factory must return (model, inputs), got {type(made).__name__}")
    model, inputs = made
    return model, inputs if isinstance(inputs, tuple) else (tuple(inputs) if isinstance(inputs, list) else (inputs,))


def run_explained(model: torch.nn.Module, inputs: tuple, backward: bool = False) -> Report:
    """Run ``model(*inputs)`` once (and its backward) and report what ran."""
    with explain(model) as report:
        if backward:
            out = model(*inputs)
        else:
            with torch.no_grad():
                out = model(*inputs)
        if backward:
            first = out[0] if isinstance(out, (tuple, list)) else out
            first.float().sum().backward()
    return report
