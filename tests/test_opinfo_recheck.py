"""The OpInfo harness's recheck of a mismatching sample (``opinfo_harness._recheck``).

``torch.linalg.lstsq`` (gelsy) of a pruned wide matrix returns another solution now and then
(about 1 call in 65 on an Intel Xeon): a wrapped call that drew it was a mismatch whenever the
reference's 32 reruns all drew the usual one, and CI failed at random. Now a wrapped result that
plain torch gives on some rerun matches, and the gradients are compared against that run.
"""

import itertools
import types

import torch

import opinfo_harness as harness


def flaky_op(usual, rare, every):
    calls = itertools.count()

    def op(x):
        return (rare if next(calls) % every == every - 1 else usual) * x.sum()

    return types.SimpleNamespace(op=op)


def test_a_result_plain_torch_also_gives_matches_with_that_run_as_the_reference():
    op = flaky_op(torch.tensor([1.0, 2.0]), torch.tensor([5.0, 6.0]), every=65)
    x = torch.ones(3)
    verdict = harness._recheck(op, ((x,), {}), [torch.tensor([3.0, 6.0])], [torch.tensor([15.0, 18.0])])
    assert verdict[0] == "match"
    torch.testing.assert_close(verdict[2][0], torch.tensor([15.0, 18.0]))


def test_a_deterministic_reference_that_differs_stays_a_mismatch():
    op = types.SimpleNamespace(op=lambda x: x * 2)
    x = torch.ones(2)
    assert harness._recheck(op, ((x,), {}), [torch.full((2,), 2.0)], [torch.full((2,), 3.0)]) is None


def test_a_reference_that_varies_but_never_gives_the_wrapped_result_is_skipped():
    op = flaky_op(torch.tensor([1.0]), torch.tensor([2.0]), every=3)
    verdict = harness._recheck(op, ((torch.ones(1),), {}), [torch.tensor([1.0])], [torch.tensor([9.0])])
    assert verdict == ("skip", "dense reference not reproducible")


def test_reruns_see_the_arguments_at_other_addresses():
    seen = set()

    def op(x):
        seen.add(x.data_ptr() % 64)
        return x * 0

    harness._recheck(types.SimpleNamespace(op=op), ((torch.ones(4),), {}), [torch.zeros(4)], [torch.ones(4)])
    assert len(seen) > 1


def _counting_op(name):
    """An OpInfo stand-in whose wrapped call differs from plain torch every time (a deterministic
    mismatch), counting the plain-torch calls."""
    import sten_core as sten

    calls = []

    def op(x):
        if isinstance(x, sten.SparseTensorWrapper):
            return x.to_dense() * 2
        calls.append(1)
        return x * 1

    return types.SimpleNamespace(op=op, name=name, variant_test_name="", supports_autograd=False), calls


def test_a_deterministic_mismatch_is_rerun_briefly_unless_its_operator_is_known_to_vary(monkeypatch):
    monkeypatch.setattr(harness, "REPEATS", 3 * harness.QUICK_REPEATS)
    sample = types.SimpleNamespace(input=torch.ones(2, 2), args=(), kwargs={})
    quick, quick_calls = _counting_op("made_up_op")
    assert harness.run_sample(quick, sample, "DenseTensor", grad=False)[0] == "mismatch"
    assert len(quick_calls) == 1 + harness.QUICK_REPEATS  # the reference, then the reruns
    listed, listed_calls = _counting_op("linalg.lstsq")
    assert harness.run_sample(listed, sample, "DenseTensor", grad=False)[0] == "mismatch"
    assert len(listed_calls) == 1 + harness.REPEATS
