"""The public API for plugins: everything a layout plugin imports from STen,
and the only module it imports (``tests/test_architecture.py`` checks the
plugins in this repository).

- hooks: ``hookimpl`` and the records hooks take (``BenchLayout``);
- the programming model: ``Layout`` and the protocols a layout may implement
  (``DenseConvertible``, ``StoredValues``, ``StateTensors``, ``Movable``;
  ``implements(layout, Protocol)`` checks them), the wrappers, sparsifiers,
  the registry and its keys, the built-in torch layouts;
- dispatch: ``sparsify``, ``convert``, errors and the failure mode; the warnings a plugin
  may filter (``DispatchWarning``; ``OverrideWarning``: a registration replaced another
  plugin's; ``PluginHookWarning``: a plugin's hook raised; ``PluginLoadWarning``: a plugin
  failed to load); ``note(text)``
  says which variant an implementation picked (a tuned kernel, say): ``sten explain``
  shows it under the running call's row (``observing()``: whether anyone listens);
- one-shot pruning, for layouts with their own masks: ``CalibratedSparsifier``,
  ``WandaSparsifier``, ``SparseGPTSparsifier``, ``sparsegpt`` and its ``ChunkRule``;
- helpers for the code every plugin writes: argument checks that name the
  argument (``check_tensor``, ``check_nm``), the inputs and flags of an
  implementation (``linear_inputs``, ``needs_grad``, ``wrap_layout``,
  ``bias_grad``), the registration of a product with a sparse weight
  (``register_weight_product``: forward and backward of ``F.linear`` with
  and without a bias, or of ``mm`` / ``matmul``), the autograd formula of
  a compiled linear on member tensors (``register_member_linear_autograd``), and
  the wrapper of a layout sharing another wrapper's storage (``storage_view``: a
  transpose of the same arrays, whose writes must keep the pattern).

Example (a plugin module):
    >>> import torch
    >>> from sten_core import plugin_api as sten
    >>> @sten.hookimpl
    ... def sten_register(registry):
    ...     sten.register_weight_product(registry, torch.nn.functional.linear, MyLayout,
    ...                                  forward=my_linear, backward=my_linear_backward)  # doctest: +SKIP
    >>> sten.check_nm(2, 4)
    (2, 4)
"""

from __future__ import annotations

from typing import Any

from sten_core.builtin.torch_layouts import CooTensor, CscTensor, CsrTensor, DenseTensor
from sten_core.dispatch import (DispatchError, DispatchWarning, Unsupported, convert, failure_mode, get_dispatch_failure,
                                lossy_fallback, note, observing, set_dispatch_failure, sparsify)
from sten_core.machine import cpu_model
from sten_core.model.helpers import (FLOAT_DTYPES, bias_grad, check_nm, check_tensor, linear_inputs, member_grads,
                                     needs_grad, register_member_linear_autograd, register_weight_product,
                                     wrap_layout)
from sten_core.model.layouts import (DenseConvertible, Layout, Movable, StateTensors, StoredValues,
                                     builds_from_dense, implements, layout_metadata, supports_values,
                                     to_dense_tensor)
from sten_core.model.registry import (Entry, OpKey, OverrideWarning, Registry, entry_for, normalize_inp,
                                      normalize_out_pairs, registry, trim)
from sten_core.model.signatures import op_name
from sten_core.model.sparsifiers import (BLOCKING, BUILTIN_SPARSIFIERS, BlockwiseFractionSparsifier, KeepAll,
                                         PerBlockFractionSparsifier, RandomFractionSparsifier,
                                         SameFormatSparsifier, ScalarFractionSparsifier,
                                         ScalarThresholdSparsifier, Sparsifier, block_keep_mask, nm_keep_mask)
from sten_core.model.spec import OutputSpec
from sten_core.model.tensor import SparseParameterWrapper, SparseTensorWrapper, densify, storage_view
from sten_core.plugins import register_plugin, unregister_plugin
from sten_core.plugins.manager import PluginHookWarning, PluginLoadWarning
from sten_core.training.pruning import METHODS, CalibratedSparsifier, SparseGPTSparsifier, WandaSparsifier, sparsegpt
from sten_core.training.pruning.sparsegpt import ChunkRule, NMRule
from sten_core.plugins.bench_layouts import BenchLayout, nm_for_sparsity, nm_label
from sten_core.plugins.hookspecs import hookimpl

def register_traceable_layout(*args: Any, **kwargs: Any) -> Any:
    """Make wrappers of a layout traceable tensor subclasses so compiled training
    steps keep the layout (see ``sten_core.dispatch.traceable.register_traceable_layout``;
    imported on first use: it defines custom operators)."""
    from sten_core.dispatch.traceable import register_traceable_layout as register

    return register(*args, **kwargs)


__all__ = [
    "CalibratedSparsifier", "ChunkRule", "METHODS", "NMRule", "SparseGPTSparsifier", "WandaSparsifier", "sparsegpt",
    "BLOCKING", "BUILTIN_SPARSIFIERS", "BenchLayout", "BlockwiseFractionSparsifier", "CooTensor", "CscTensor",
    "CsrTensor", "DenseConvertible", "DenseTensor", "DispatchError", "DispatchWarning", "Entry", "FLOAT_DTYPES",
    "KeepAll", "Layout", "Movable", "OpKey", "OutputSpec", "OverrideWarning", "PerBlockFractionSparsifier",
    "PluginHookWarning", "PluginLoadWarning",
    "RandomFractionSparsifier", "Registry", "SameFormatSparsifier", "ScalarFractionSparsifier",
    "ScalarThresholdSparsifier", "SparseParameterWrapper", "SparseTensorWrapper", "Sparsifier", "StateTensors",
    "StoredValues", "bias_grad", "block_keep_mask", "builds_from_dense", "check_nm", "check_tensor", "convert", "cpu_model",
    "densify", "entry_for", "failure_mode", "get_dispatch_failure", "hookimpl", "implements", "layout_metadata",
    "linear_inputs", "lossy_fallback", "member_grads", "needs_grad", "nm_for_sparsity", "nm_keep_mask", "nm_label",
    "normalize_inp", "note", "observing", "normalize_out_pairs", "op_name", "register_member_linear_autograd", "register_plugin", "register_traceable_layout", "register_weight_product", "registry",
    "set_dispatch_failure", "sparsify", "storage_view", "supports_values", "to_dense_tensor", "trim", "Unsupported",
    "unregister_plugin",
    "wrap_layout",
]
