"""Checkpoints: ``torch.save(model.state_dict())`` then the default ``torch.load``
(``weights_only=True``), into a fresh sparse model and a dense one."""

import pytest
import torch

from sten_core.testing import check_checkpoint

from conftest import LAYOUTS


@pytest.mark.parametrize("layout", LAYOUTS)
def test_checkpoint(layout):
    check_checkpoint(layout, dtypes=(torch.float32, torch.float64))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("part, damage, message", [
    (0, lambda p: p.flip(0), "index pointer"),    # pointers not monotone
    (1, lambda p: p + 1000, "indices must be <"),  # an index out of range
])
def test_damaged_parts_fail_on_load(layout, part, damage, message, tmp_path):
    """A damaged checkpoint raises a clear error when loaded (it crashed the process in a product before)."""
    weight = torch.randn(16, 32) * (torch.rand(16, 32) > 0.5)
    parts = list(layout.from_dense(weight).state_tensors())
    parts[part] = damage(parts[part])
    with pytest.raises(ValueError, match=f"{layout.__name__}: the saved parts do not form a valid .*{message}"):
        layout.from_state_tensors(tuple(parts), (16, 32))
    state = layout.from_dense(weight).__getstate__()
    state["indices"] = state["indices"] + 1000
    with pytest.raises(ValueError, match="indices must be <"):
        layout.__new__(layout).__setstate__(state)
