"""Keep Dynamo from compiling the eager dispatcher as a frame of its own.

When ``torch.compile`` gives up on a frame (a graph break it cannot resume, e.g. in
an optimizer's loop over parameters) the frame runs eagerly, but Dynamo still
compiles every Python frame it calls. ``dispatch_call`` would be one: Dynamo
traced it with guards on the argument types only, and the compiled copies kept
a plan and a dense result from the call they were traced on (found cached in
``entry._fast``) and replayed them for other operators: a compiled Adam step on
``DenseTensor`` weights updated ``exp_avg_sq`` with the wrong operator after one
eager step. Marking its code "skip, and skip what it calls" makes those calls
run as the eager dispatcher they are. Tracing a user's function is unaffected:
Dynamo never inlines ``dispatch_call`` (``SparseTensorWrapper.__torch_function__``
calls it through ``torch.compiler.disable`` while tracing).

Example:
    >>> from sten_core.dispatch.entry import dispatch_call
    >>> never_compiled(dispatch_call)
    True
"""

from __future__ import annotations

from typing import Callable


def never_compiled(fn: Callable) -> bool:
    """Mark ``fn``'s code so that Dynamo neither compiles it nor anything it calls.

    Free for eager calls (no wrapper: a flag on the code object). Returns
    whether the marking took (``False`` on a torch without the frame
    strategy API; then ``fn`` is left as it is).
    """
    try:  # torch's C module (``torch._dynamo`` re-exports these; importing it takes ~0.8 s)
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:  # a torch without this API: nothing to mark
        return False
    set_code_exec_strategy(fn.__code__, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
    return True
