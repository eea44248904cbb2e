"""Arguments a call gives past the implementation's input pattern.

An implementation receives as many bound arguments as its pattern lists. Before, a call
giving a further argument a value other than its default (``torch.add(W, x, alpha=3)`` for an
implementation registered on ``(MyLayout, torch.Tensor)``, ``torch.sum(W, dim=1)`` on
``(MyLayout,)``) ran the implementation without it: the result was the call without that
argument, silently. Now such a call takes the dense path with a ``DispatchWarning`` that names
the argument; a pattern ending with ``...`` receives every argument.
"""

import warnings

import pytest
import torch

import sten_core as sten
from fake_layouts import DenseCopyLayout

OWNER = "test-arguments-past-pattern"


class Listed(DenseCopyLayout):
    """A layout whose implementations are registered in the tests below."""


@pytest.fixture
def seen():
    """Register ``torch.add`` on ``(Listed, T)`` and ``torch.sub`` on ``(Listed, T, ...)``;
    the inputs each implementation received are recorded."""
    calls = []

    def add_two(ctx, inputs, outs):
        calls.append(("add", len(inputs)))
        return inputs[0].wrapped_tensor.data + inputs[1]

    def sub_all(ctx, inputs, outs):
        calls.append(("sub", len(inputs)))
        w, x, alpha, out = inputs  # every argument of torch.sub, in signature order
        assert out is None
        return w.wrapped_tensor.data - alpha * x

    try:
        with sten.registry.owner(OWNER):
            sten.registry.register_layout(Listed)
            sten.registry.register_fwd_op_impl(torch.add, (Listed, torch.Tensor), None, add_two)
            sten.registry.register_fwd_op_impl(torch.sub, (Listed, torch.Tensor, ...), None, sub_all)
        sten.dispatch.reset_warnings()
        yield calls
    finally:
        sten.registry.remove_owner(OWNER)
        sten.dispatch.reset_warnings()


def listed(shape=(3, 4)):
    torch.manual_seed(0)
    return sten.SparseTensorWrapper(Listed.from_dense(torch.randn(*shape)))


def dispatch_warnings(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, [str(c.message) for c in caught if issubclass(c.category, sten.DispatchWarning)]


def test_the_listed_arguments_run_the_implementation(seen):
    w, x = listed(), torch.randn(3, 4)
    for _ in range(2):  # the second call takes the cached fast path
        got, messages = dispatch_warnings(lambda: torch.add(w, x))
        torch.testing.assert_close(got, w.to_dense() + x)
        assert messages == []
    got, _ = dispatch_warnings(lambda: torch.add(w, x, alpha=1))  # the default, spelled out
    torch.testing.assert_close(got, w.to_dense() + x)
    assert seen == [("add", 2)] * 3


@pytest.mark.parametrize("call", ["kwarg", "positional after a fast call"])
def test_an_argument_past_the_pattern_runs_dense_and_is_named(seen, call):
    w, x = listed(), torch.randn(3, 4)
    if call == "positional after a fast call":
        torch.add(w, x)  # caches the plan of two positional arguments
        seen.clear()
    for attempt in range(2):
        got, messages = dispatch_warnings(lambda: torch.add(w, x, alpha=3))
        torch.testing.assert_close(got, w.to_dense() + 3 * x)
        assert (len(messages) == 1) == (attempt == 0), messages  # once per key
        if messages:
            assert "alpha=3" in messages[0] and "end inp with ..." in messages[0]
    assert seen == []


def test_sten_raise_mode_refuses_the_ignored_argument(seen):
    w, x = listed(), torch.randn(3, 4)
    with sten.dispatch.failure_mode("raise"), pytest.raises(sten.DispatchError, match="alpha=3"):
        torch.add(w, x, alpha=3)


@pytest.mark.parametrize(("args", "kwargs"), [((), {}), ((), {"alpha": 2}), ((), {"alpha": 0.5})])
def test_a_pattern_ending_with_ellipsis_receives_every_argument(seen, args, kwargs):
    w, x = listed(), torch.randn(3, 4)
    for _ in range(2):
        got, messages = dispatch_warnings(lambda: torch.sub(w, x, *args, **kwargs))
        torch.testing.assert_close(got, torch.sub(w.to_dense(), x, *args, **kwargs))
        assert messages == []
    assert seen == [("sub", 4)] * 2


def test_an_ellipsis_pattern_is_the_same_key_as_without_it():
    """``(L, ...)`` serves the calls ``(L,)`` names: one key, not two."""
    impl = lambda ctx, inputs, outs: None  # noqa: E731
    try:
        with sten.registry.owner(OWNER):
            sten.registry.register_layout(Listed)
            sten.registry.register_fwd_op_impl(torch.sum, (Listed, ...), None, impl)
        entry = sten.registry.impls[sten.OpKey("fwd", torch.sum, (Listed,), ((sten.KeepAll, torch.Tensor),))]
        assert entry.fn is impl and entry.all_args and entry.nargs == 1
    finally:
        sten.registry.remove_owner(OWNER)


def test_ellipsis_only_ends_a_pattern():
    with pytest.raises(TypeError, match=r"inp\[1\]"):
        sten.registry.register_fwd_op_impl(torch.add, (Listed, ..., torch.Tensor), None, lambda c, i, o: None)


@pytest.mark.parametrize("op", [torch.sum, torch.Tensor.sum, torch.mean, torch.prod], ids=lambda op: op.__qualname__)
def test_reduction_options_reach_their_own_slots(op):
    """STen knew ``torch.sum`` as ``(input, dim)`` and ``torch.prod`` as ``(input, dtype)``:
    ``torch.sum(w, dim=1, dtype=torch.float64)`` reached an implementation of
    ``(L, None, None)`` as ``[w, 1, float64]`` (``keepdim=float64``) and ``torch.prod(w, 1)``
    put the 1 into ``dtype``: a float32 ``(3, 1)`` result where dense gives float64 ``(3,)``."""
    seen = []

    def reduce(ctx, inputs, outs):
        w, dim, keepdim = inputs
        seen.append((dim, keepdim))
        return op(w.wrapped_tensor.data, dim, keepdim)

    try:
        with sten.registry.owner(OWNER):
            sten.registry.register_layout(Listed)
            sten.registry.register_fwd_op_impl(op, (Listed, None, None), None, reduce)
        sten.dispatch.reset_warnings()
        w = listed()
        for args, kwargs, runs in (((1,), {}, True), ((1, True), {}, True), ((), {"dim": 0, "keepdim": True}, True),
                                   ((1,), {"dtype": torch.float64}, False)):
            seen.clear()
            got, messages = dispatch_warnings(lambda: op(w, *args, **kwargs))
            want = op(w.to_dense(), *args, **kwargs)
            assert got.shape == want.shape and got.dtype == want.dtype
            torch.testing.assert_close(got, want)
            assert bool(seen) == runs, (args, kwargs)
            if not runs:
                assert "dtype=torch.float64" in messages[0]
    finally:
        sten.registry.remove_owner(OWNER)
        sten.dispatch.reset_warnings()
