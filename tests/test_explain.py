"""``sten_core.explain``: what ran, conversions, fallbacks and their fixes."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_core import dispatch
from sten_core.model.tensor import densify


def csr(shape=(6, 8), fraction=0.5, seed=0):
    torch.manual_seed(seed)
    return sten.sparsify(sten.ScalarFractionSparsifier(fraction), torch.randn(*shape), sten.CsrTensor)


def test_impl_row_and_result_matches_dense():
    w, x = csr(), torch.randn(3, 8)
    with sten.explain() as report:
        y = F.linear(x, w)
    torch.testing.assert_close(y, F.linear(x, densify(w)))
    (row,) = report.rows
    assert (row.kind, row.plan, row.calls) == ("op", "impl", 1)
    assert "linear_fwd" in row.ran and "[builtin]" in row.ran
    assert row.fix is None and report.fallbacks == []
    assert row.seconds > 0


def test_counts_accumulate_per_key():
    w = csr()
    with sten.explain() as report:
        for _ in range(3):
            F.linear(torch.randn(2, 8), w)
    assert [r.calls for r in report.rows] == [3]


def test_conversion_rows():
    torch.manual_seed(1)
    dense_w = torch.randn(4, 6)
    w = sten.SparseTensorWrapper(sten.DenseTensor.from_dense(dense_w))
    x = torch.randn(3, 6)
    with sten.explain() as report:
        y = F.linear(x, w)
    torch.testing.assert_close(y, F.linear(x, dense_w))
    op = next(r for r in report.rows if r.kind == "op")
    assert op.plan == "convert" and "DenseTensor -> CooTensor" in op.ran
    assert [r.what for r in report.conversions] == ["convert DenseTensor -> CooTensor"]


class _Unregistered:
    """A sparsifier class with no implementation anywhere."""


def test_sparsifier_fallback_row_and_fix():
    x = torch.randn(4, 4)
    with sten.explain() as report:
        out = sten.sparsify(_Unregistered(), x, sten.CsrTensor)
    torch.testing.assert_close(densify(out), x)
    (fb,) = report.fallbacks
    assert fb.kind == "sparsifier"
    assert fb.fix == "@sten.register_sparsifier_implementation(sparsifier=_Unregistered, inp=torch.Tensor, out=CsrTensor)"


def test_fallback_warning_silenced_and_dispatcher_restored():
    observers, originals = dispatch.observers.active(), (dispatch.sparsify, dispatch.convert, dispatch.errors.report_missing)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sten.explain():
            sten.sparsify(_Unregistered(), torch.randn(2, 2), sten.CooTensor)
    assert not [w for w in caught if issubclass(w.category, sten.DispatchWarning)]
    assert dispatch.observers.active() == observers
    assert (dispatch.sparsify, dispatch.convert, dispatch.errors.report_missing) == originals


def test_empty_report_text():
    with sten.explain() as report:
        torch.ones(2) + 1
    assert report.rows == [] and "nothing was dispatched" in str(report)


# -- the built-in example: a BERT layer with a COO intermediate --------------------

transformers = pytest.importorskip("transformers")
FIX = ("@sten.register_fwd_op_impl(operator=torch.sin, inp=(CooTensor,), "
       "out=[(KeepAll, torch.Tensor)])")


@pytest.fixture(scope="module")
def example():
    from sten_core.tools.explain_targets import example as make

    return make("tiny", batch=1, seq_len=4)


def _run(model, inputs, backward=False):
    from sten_core.tools.explain_targets import run_explained

    torch.manual_seed(123)  # the intermediate's random sparsifier
    return run_explained(model, inputs, backward=backward)


def _dense_reference(model, inputs):
    """Run the example with its weights and intermediate densified (same random mask)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        torch.manual_seed(123)
        with torch.no_grad():
            out = model(*inputs)
    return densify(out[0] if isinstance(out, tuple) else out)


def test_example_runs_sparse_everywhere(example):
    model, inputs = example
    report = _run(model, inputs)
    assert report.fallbacks == []
    a1 = next(r for r in report.rows if "CooTensor, CsrTensor" in r.what)
    assert a1.plan == "impl" and "linear_sparse_sparse_fwd" in a1.ran and "output.dense" in a1.sites
    impl = next(r for r in report.rows if r.plan == "impl" and r.kind == "op")
    assert impl.calls == 5  # the other five linears run the CSR implementation
    assert "0 dense fallbacks" in str(report)


def _sin_model():
    """A COO intermediate fed to ``torch.sin``, which has no implementation."""

    class SinOfSparse(torch.nn.Module):
        def forward(self, x):
            return torch.sin(sten.sparsify(sten.KeepAll(), x, sten.CooTensor))

    return SinOfSparse(), (torch.randn(3, 4),)


def test_fallback_row_with_fix_and_sites():
    model, inputs = _sin_model()
    report = _run(model, inputs)
    (fb,) = report.fallbacks
    assert fb.fix == FIX
    text = str(report)
    assert "fix: " + FIX in text and "1 dense fallback" in text


def test_registering_the_fix_removes_the_row():
    model, inputs = _sin_model()
    owner = "test_explain_fix"
    with sten.registry.owner(owner):
        @sten.register_fwd_op_impl(operator=torch.sin, inp=(sten.CooTensor,), out=[(sten.KeepAll, torch.Tensor)])
        def coo_sin(ctx, inputs, output_sparsifiers):
            return torch.sin(densify(inputs[0]))
    try:
        report = _run(model, inputs)
        assert report.fallbacks == []
        row = next(r for r in report.rows if "torch.sin" in r.what)
        assert row.plan == "impl" and "coo_sin" in row.ran and f"[{owner}]" in row.ran
        torch.testing.assert_close(model(*inputs), torch.sin(inputs[0]))
    finally:
        sten.registry.remove_owner(owner)


def test_backward_rows(example):
    model, inputs = example
    report = _run(model, inputs, backward=True)
    directions = {r.key.direction for r in report.rows if r.kind == "op"}
    assert directions == {"fwd", "bwd"}
    # a fallen-back forward runs its backward through dense autograd: no separate bwd fallback
    assert all(r.key.direction == "fwd" for r in report.fallbacks if r.kind == "op")

    model.zero_grad(set_to_none=True)


def test_backward_fallback_row_names_the_bwd_decorator():
    w = csr()
    owner = "test-explain-fwd-only"
    with sten.registry.owner(owner):
        @sten.register_fwd_op_impl(operator=torch.Tensor.sum, inp=(sten.CsrTensor,), out=None)
        def csr_sum(ctx, inputs, output_sparsifiers):
            return inputs[0].wrapped_tensor.data.values().sum()
    try:
        w.requires_grad_(True)
        with sten.explain() as report:
            torch.Tensor.sum(w).backward()
        torch.testing.assert_close(w.grad, torch.ones(6, 8))
        assert any(r.fix and r.fix.startswith("@sten.register_bwd_op_impl(") for r in report.fallbacks)
    finally:
        sten.registry.remove_owner(owner)


def test_plugin_notes_attach_to_the_running_call():
    """``plugin_api.note`` inside an implementation shows under that call's row (counted),
    and costs nothing (no listener) outside ``explain``."""
    from sten_core import plugin_api

    class Noted(sten.CsrTensor):
        pass

    heard = []
    assert not plugin_api.observing()
    plugin_api.note(lambda: heard.append("built") or "x")     # no listener: text never built
    assert heard == []
    w = csr()
    with sten.explain() as report:
        with dispatch.listening_to_notes(heard.append):
            plugin_api.note("outside any call")   # attaches to the next call that reports
            F.linear(torch.randn(2, 8), w)
            F.linear(torch.randn(2, 8), w)
    (row,) = report.rows
    assert row.notes == {"outside any call": 1}
    assert heard == ["outside any call"]
    assert "chose: outside any call (1 calls)" in str(report)
    assert report.as_dicts()[0]["notes"] == {"outside any call": 1}
    assert not plugin_api.observing()


def test_an_observed_conversion_is_described_by_its_layouts():
    """A conversion reaches observers with an ``OpKey`` whose operator is ``None``: its
    ``describe()`` read ``convert torch.None inp=(DenseTensor,) out=CooTensor`` (``op_name``
    took ``getattr(torch, "None", None) is None`` for a match), so a ``sten demo`` or a custom
    observer printed it."""
    w = sten.SparseTensorWrapper(sten.DenseTensor.from_dense(torch.eye(3)))
    seen = []
    with dispatch.observed(lambda event: seen.append((event["kind"], event["key"].describe()))):
        torch.mm(w, torch.ones(3, 2))
    conversions = [text for kind, text in seen if kind == "convert"]
    assert conversions == ["convert DenseTensor -> CooTensor"]
    assert not any("torch.None" in text for _, text in seen)


def test_op_names_of_operators_without_a_torch_name():
    """What explain rows, warnings and the fix decorators call an operator."""
    import functools

    from sten_core.model.signatures import op_name

    class Scale:
        def __call__(self, x):
            return 2 * x

    assert op_name(None) == "None"
    assert op_name(functools.partial(torch.mul, other=2)) == "functools.partial(torch.mul)"
    assert op_name(Scale()) == f"{__name__}.test_op_names_of_operators_without_a_torch_name.<locals>.Scale object"
    assert op_name(torch.ops.aten.add.Tensor) == "torch.ops.aten.add.Tensor"   # was torch._ops.aten.aten::add.Tensor
    assert (op_name(torch.add), op_name(torch.Tensor.add_), op_name(F.linear)) == (
        "torch.add", "Tensor.add_", "torch.nn.functional.linear")
