"""Training with sparsity: ``SparsityBuilder`` (``builder``), sparsity
schedules (``schedule``), score sparsifiers (``scores``), one-shot pruning
(``pruning``), saving and loading (``serialization``) and the checks of
distributed training (``distributed``). The public names are re-exported by
``sten_core``.

Example:
    >>> import torch, sten_core as sten
    >>> sb = sten.SparsityBuilder(torch.nn.Linear(4, 4))
    >>> type(sb).__module__
    'sten_core.training.builder'
"""
