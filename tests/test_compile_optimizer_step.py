"""``torch.compile`` of an optimizer step over wrapper parameters whose calls run eagerly.

Dynamo gives up on Adam's step frame (a graph break in its loop) and runs it
eagerly, compiling the frames it calls. It used to compile STen's eager
dispatcher too, keyed on argument types only, and the compiled copies replayed
the plan of the call they were traced on: after one eager step of the same
shapes, ``exp_avg_sq`` was updated with the wrong operator (the weight stalled),
silently. The dispatcher's code is now marked never to be compiled
(``sten_core/dispatch/eager_only.py``).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import sten_core as sten
from sten_core.dispatch import entry


def _steps(layout: type, opt_cls: type, clear_fast_path: bool) -> tuple[torch.Tensor, torch.Tensor]:
    torch._dynamo.reset()
    warm = sten.SparseParameterWrapper(layout.from_dense(torch.ones(2, 3)))
    warm_opt = opt_cls([warm], lr=0.01)
    warm.grad = torch.ones(2, 3)
    warm_opt.step()  # an eager STen step of the same shapes first
    if clear_fast_path:
        entry._fast.clear()
    w = sten.SparseParameterWrapper(layout.from_dense(torch.ones(2, 3)))
    ref = torch.nn.Parameter(torch.ones(2, 3))
    opt, ref_opt = opt_cls([w], lr=0.01), opt_cls([ref], lr=0.01)
    step = torch.compile(opt.step)
    for k in range(3):
        grad = torch.full((2, 3), float(k + 1))
        w.grad, ref.grad = grad.clone(), grad.clone()
        step()
        ref_opt.step()
    return w.to_dense(), ref.detach()


@pytest.mark.parametrize("clear_fast_path", (False, True), ids=("warm-cache", "cleared-cache"))
@pytest.mark.parametrize("opt_cls", (torch.optim.Adam, torch.optim.AdamW), ids=lambda c: c.__name__)
@pytest.mark.parametrize("layout", (sten.DenseTensor, sten.CooTensor), ids=lambda c: c.__name__)
def test_compiled_step_after_eager_step_matches_dense(layout, opt_cls, clear_fast_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, want = _steps(layout, opt_cls, clear_fast_path)
    torch.testing.assert_close(got, want)


def test_dispatcher_code_is_never_compiled():
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    from sten_core.dispatch.entry import _dispatch_general, dispatch_call

    torch._dynamo.reset()
    w = sten.SparseParameterWrapper(sten.DenseTensor.from_dense(torch.ones(2, 3)))
    opt = torch.optim.Adam([w], lr=0.01)
    w.grad = torch.ones(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.compile(opt.step, backend="eager")()
    assert _debug_get_cache_entry_list(dispatch_call.__code__) == []
    assert _debug_get_cache_entry_list(_dispatch_general.__code__) == []
