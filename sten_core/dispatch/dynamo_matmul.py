"""Keep ``W @ x`` from becoming ``x @ W`` under ``torch.compile``.

While Dynamo traces, a sparse wrapper is a user-defined object, not a traced
tensor. For ``a @ b`` whose left operand is not a traced tensor, Dynamo
(``BuiltinVariable._handle_insert_op_in_graph``, torch 2.13) swaps the operands
and calls the operator's reverse tensor method; ``operator.matmul`` has no entry
in its reverse map (its ``rskips``), so it calls ``Tensor.matmul(x, W)``: a shape
error, or for square operands a silently wrong ``x @ W``. The reverse method it
lacks is ``Tensor.__rmatmul__`` (``x.__rmatmul__(W) == W @ x``), whose dense and
compiled paths the dispatcher already serves.

``install()`` adds that entry when Dynamo's module is imported (an import hook,
so importing STen does not import Dynamo), or at once if it already is.

Example:
    >>> import torch, sten_core as sten
    >>> w = sten.SparseTensorWrapper(sten.DenseTensor.from_dense(torch.tensor([[0., 1.], [0., 0.]])))
    >>> x = torch.tensor([[1., 2.], [3., 4.]])
    >>> torch.compile(lambda x: w @ x, backend="eager")(x)
    tensor([[3., 4.],
            [0., 0.]])
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import operator
import sys
from types import ModuleType
from typing import Any

import torch

DYNAMO_BUILTINS = "torch._dynamo.variables.builtin"


def add_reverse_matmul(builtin: ModuleType) -> None:
    """Give Dynamo's reverse-operator map the entry ``@`` lacks (no-op where it has one)."""
    reverse = getattr(builtin, "BUILTIN_TO_TENSOR_RFN_MAP", None)
    populate = getattr(builtin, "populate_builtin_to_tensor_fn_map", None)
    if reverse is None or populate is None:  # a torch whose Dynamo is organised otherwise
        return
    populate()
    reverse.setdefault(operator.matmul, torch.Tensor.__rmatmul__)


class _AfterDynamoImport(importlib.abc.MetaPathFinder):
    """Runs ``add_reverse_matmul`` right after Dynamo's builtin module executes."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != DYNAMO_BUILTINS:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            add_reverse_matmul(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Fix the map now if Dynamo is loaded, else when it is (once per process)."""
    if DYNAMO_BUILTINS in sys.modules:
        add_reverse_matmul(sys.modules[DYNAMO_BUILTINS])
    elif not any(isinstance(finder, _AfterDynamoImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterDynamoImport())
