"""STen: sparsity for PyTorch as a programming model.

Layouts say how values are stored, operators run on any combination of layouts,
sparsifiers decide which values are kept. ``import sten_core as sten`` runs the
STen paper's code.

Example:
    >>> import torch, sten_core as sten
    >>> w = sten.sparsify(sten.ScalarFractionSparsifier(0.9), torch.randn(30, 20), sten.CsrTensor)
    >>> w.wrapped_tensor.nnz
    60
"""

from __future__ import annotations

from typing import Any, Callable

from sten_core.version import __version__

from sten_core.plugins.hookspecs import hookimpl, hookspec
from sten_core.model.layouts import Layout
from sten_core.model.registry import OpKey, registry
from sten_core.model.sparsifiers import (
    BlockwiseFractionSparsifier,
    KeepAll,
    PerBlockFractionSparsifier,
    RandomFractionSparsifier,
    ScalarFractionSparsifier,
    ScalarThresholdSparsifier,
    SameFormatSparsifier,
    Sparsifier,
    random_mask_sparsify,
    scalar_mask_sparsify,
)
from sten_core.model.spec import OutputSpec
from sten_core.model.tensor import SparseParameterWrapper, SparseTensorWrapper
from sten_core.builtin.torch_layouts import CooTensor, CscTensor, CsrTensor, DenseTensor
from sten_core.dispatch import (
    DispatchError,
    DispatchWarning,
    Unsupported,
    convert,
    set_dispatch_failure,
    sparsified_op,
    sparsify,
)
from sten_core import plugins
from sten_core.training.builder import SparsityBuilder
from sten_core.training.schedule import GradualPruning, OneShot, PruneRegrow, SparsityScheduler
from sten_core.training.scores import MovementSparsifier, ScoreSparsifier, TaylorSparsifier
from sten_core.training.serialization import densify_state_dict, load_dense_state_dict
from sten_core.tools.summary import summary
from sten_core.training.pruning import SparseGPTSparsifier, WandaSparsifier, prune
from sten_core.model import jit_save as _jit_save

_jit_save.install()  # torch.jit.save of a scripted sparse module: an error, not a segfault


def register_fwd_op_impl(operator: Callable, inp: Any, out: Any = None) -> Callable:
    """Decorator: the forward implementation of ``operator`` for input layouts
    ``inp`` and outputs ``out`` (``[(SparsifierClass, tmp_format), ...]``;
    ``None`` or ``[]``: one dense output, the default).

    The implementation is ``impl(ctx, inputs, output_sparsifiers)``.
    """

    def decorate(impl: Callable) -> Callable:
        registry.register_fwd_op_impl(operator, inp, out, impl)
        return impl

    return decorate


def register_bwd_op_impl(operator: Callable, grad_out: Any, grad_inp: Any, inp: Any) -> Callable:
    """Decorator: the backward implementation of ``operator`` for incoming
    gradient layouts ``grad_out``, wanted input-gradient formats ``grad_inp``
    and input layouts ``inp``. The implementation is
    ``impl(ctx, grad_outputs, input_sparsifiers) -> grads``.
    """

    def decorate(impl: Callable) -> Callable:
        registry.register_bwd_op_impl(operator, grad_out, grad_inp, inp, impl)
        return impl

    return decorate


def register_sparsifier_implementation(sparsifier: type = None, inp: type = None, out: type = None, **kwargs: Any) -> Callable:
    """Decorator: how ``sparsifier`` turns layout ``inp`` into layout ``out``.

    The implementation is ``impl(sparsifier, tensor[, grad_fmt])`` and returns a
    wrapper (or a dense tensor for ``out=torch.Tensor``). The paper's spelling
    ``sparsifer=`` is accepted.
    """
    sparsifier = sparsifier if sparsifier is not None else kwargs.pop("sparsifer", None)
    if kwargs:
        raise TypeError(f"unexpected arguments: {', '.join(kwargs)}")
    if sparsifier is None or inp is None or out is None:
        raise TypeError("register_sparsifier_implementation needs sparsifier, inp and out")

    def decorate(impl: Callable) -> Callable:
        registry.register_sparsifier_implementation(sparsifier, inp, out, impl)
        return impl

    return decorate


def __getattr__(name: str) -> Any:
    if name == "explain":
        from sten_core.tools.explain import explain

        return explain
    raise AttributeError(f"module 'sten_core' has no attribute {name!r}")


__all__ = [
    "__version__", "GradualPruning", "MovementSparsifier", "OneShot", "PruneRegrow", "ScoreSparsifier",
    "SparsityScheduler", "TaylorSparsifier",
    "BlockwiseFractionSparsifier", "CooTensor", "CscTensor", "CsrTensor", "DenseTensor",
    "DispatchError", "DispatchWarning", "KeepAll", "Layout", "OpKey", "OutputSpec",
    "PerBlockFractionSparsifier", "RandomFractionSparsifier", "SameFormatSparsifier",
    "ScalarFractionSparsifier", "ScalarThresholdSparsifier", "SparseParameterWrapper",
    "SparseTensorWrapper", "Sparsifier", "SparsityBuilder", "convert", "hookimpl", "hookspec",
    "plugins", "random_mask_sparsify", "register_bwd_op_impl", "register_fwd_op_impl",
    "register_sparsifier_implementation", "registry", "scalar_mask_sparsify",
    "set_dispatch_failure", "sparsified_op", "sparsify", "densify_state_dict", "load_dense_state_dict",
    "summary", "Unsupported",
    "SparseGPTSparsifier", "WandaSparsifier", "prune",
]
