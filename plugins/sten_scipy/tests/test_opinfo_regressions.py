"""Regressions found by running PyTorch's OpInfo samples through the scipy layouts
(``tests/test_opinfo_plugins.py`` at the repository root), checked against dense torch.

``torch.matmul(W, b)`` with a batched ``b`` whose batch or last dim is empty
(``[0, 0] @ [5, 0, 0]``, OpInfo's ``matmul`` sample 10) raised ``cannot reshape tensor of
0 elements into shape [0, -1]`` (``reshape(K, -1)`` in ``linear._columns``).
"""

from __future__ import annotations

import pytest
import torch

import sten_core as sten

from conftest import LAYOUTS, check_against_dense, sample


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("a_shape, b_shape", [
    ((0, 0), (5, 0, 0)), ((3, 0), (2, 0, 4)), ((3, 4), (0, 4, 2)), ((3, 4), (2, 4, 0)), ((0, 4), (2, 3, 4, 2)),
])
def test_matmul_with_empty_batch_or_columns_matches_dense(layout, a_shape, b_shape):
    w = sten.SparseTensorWrapper(layout.from_dense(sample(a_shape)), requires_grad=True)
    b = sample(b_shape, seed=1).requires_grad_()
    check_against_dense(torch.matmul, [w, b])
