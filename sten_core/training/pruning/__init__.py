"""One-shot calibrated pruning: magnitude, Wanda and SparseGPT, unstructured or n:m.

* ``prune(model, batches, method=..., sparsity=... | pattern=(n, m), out_format=...)``
  prunes a trained model layer by layer (``sten_core.training.pruning.oneshot``);
* ``WandaSparsifier`` and ``SparseGPTSparsifier`` are sparsifiers with extra
  inputs (``input_norm``, ``hessian``) usable on their own with ``sten.sparsify``,
  ``SparsityBuilder.set_weight`` or ``sparsify_with``;
* ``input_norms`` / ``input_hessian`` (and the running ``InputNorms`` /
  ``InputHessian``) compute those inputs from a layer's calibration inputs.

Example:
    >>> import torch, sten_core as sten
    >>> from sten_core.training.pruning import WandaSparsifier, input_norms
    >>> _ = torch.manual_seed(0); x = torch.randn(32, 8); w = torch.randn(4, 8)
    >>> sp = WandaSparsifier(n=2, m=4).bind(input_norm=input_norms(x))
    >>> sten.sparsify(sp, w, sten.CooTensor).wrapped_tensor.nnz
    16
"""

from sten_core.training.pruning.base import CalibratedSparsifier
from sten_core.training.pruning.oneshot import METHODS, method_sparsifier, prune
from sten_core.training.pruning.sparsegpt import SparseGPTSparsifier, sparsegpt
from sten_core.training.pruning.statistics import InputHessian, InputNorms, input_hessian, input_norms
from sten_core.training.pruning.wanda import WandaSparsifier

__all__ = [
    "CalibratedSparsifier", "InputHessian", "InputNorms", "METHODS", "SparseGPTSparsifier", "WandaSparsifier",
    "input_hessian", "input_norms", "method_sparsifier", "prune", "sparsegpt",
]
