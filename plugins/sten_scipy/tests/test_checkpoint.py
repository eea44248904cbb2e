"""Checkpoints: ``torch.save(model.state_dict())`` then the default ``torch.load``
(``weights_only=True``), into a fresh sparse model and a dense one."""

import pytest
import torch

from sten_core.testing import check_checkpoint

from conftest import LAYOUTS


@pytest.mark.parametrize("layout", LAYOUTS)
def test_checkpoint(layout):
    check_checkpoint(layout, dtypes=(torch.float32, torch.float64))
