"""PyTorch's own OpInfo samples through every PLUGIN layout, all plugins installed at once.

The same harness as ``test_opinfo.py`` (``opinfo_harness.py``; its ``LAYOUTS`` maps each
layout to its constructor): each operator of ``op_db`` that supports float32 on the CPU
runs on its first ``MAX_SAMPLES`` samples with every 2-D float32 tensor argument wrapped
in the layout, and values and gradients must match plain torch. The pruning layouts
(``NMTensor``, ``GroupedNMTensor``, ``ColumnGroupedNMTensor`` at 2:4, ``Sparse24Tensor``,
``BlockSparseTensor`` with 2 x 2 blocks at half) keep only part of the sample, so the
reference is plain torch on the wrapped value's dense form. A leaf wrapper without a
``grad_fmt`` gets a dense gradient everywhere (docs/concepts.md, "Gradients"), so
gradients are compared in full.

All seven layouts run in one pass over ``op_db`` (the samples are made once), in one
pytest-xdist worker: about 90 s on an Intel Xeon (2 vCPUs). ``python tests/opinfo_harness.py --samples=12 NMTensor ...`` prints the
mismatches and the skip reasons with their counts.
"""

import collections

import pytest

from sten_core import plugins
from opinfo_harness import NONDETERMINISTIC_REFERENCES, PLUGIN_LAYOUTS, outcomes, skip_kind

pytestmark = pytest.mark.xdist_group("opinfo_plugins")  # one worker computes `results` once

MAX_SAMPLES = 12  # per operator; 4 x more than test_opinfo.py: the seven layouts share one pass

_RANDOM_FILL = ("uniform", "normal.in_place", "cauchy", "exponential", "geometric", "log_normal")
_N_M = ("NMTensor", "GroupedNMTensor", "ColumnGroupedNMTensor", "Sparse24Tensor")
_KEEPS_PATTERN = (
    "a random in-place fill (Tensor.uniform_ & co.) of a temporary reaches every position, its pattern "
    "grown to hold it, where its layout can (BlockSparseTensor); an n:m layout cannot hold every position "
    "(docs/concepts.md, 'Weights, temporaries and optimizer state'): it keeps its pattern with a "
    "DispatchWarning, so the pruned positions stay 0 where dense torch fills them too. The stored "
    "positions hold dense torch's values.")
_SCIPY_DTYPES = (
    "scipy's sparse arrays hold float32 / float64 only (docs/scipy.md: float16/bfloat16 raise "
    "TypeError naming the dtypes), and a move keeps the layout (docs/concepts.md, 'Moves')")
_SPARSE24_DTYPES = (
    "2:4 layouts store float16, bfloat16, float32 (docs/cuda24.md, the layout table; "
    "TypeError naming them), and a move keeps the layout (docs/concepts.md, 'Moves')")

KNOWN_MISMATCHES: dict[tuple[str, str, int], str] = {
    # (operator, layout, sample index): why the wrapped result differs from plain torch
    **{(op, layout, 0 if op == "normal.in_place" else 1): _KEEPS_PATTERN for op in _RANDOM_FILL for layout in _N_M},
    **{(op, layout, i): _SCIPY_DTYPES for op in ("half", "bfloat16") for layout in ("ScipyCsrTensor", "ScipyCscTensor")
       for i in (2, 3)},
    **{("double", "Sparse24Tensor", i): _SPARSE24_DTYPES for i in (2, 3)},
}

ALLOWED_SKIPS = ("no float32 tensor of a shape this layout stores", "dense reference raised",
                 "dense reference not reproducible")
"""Skip reasons that hide nothing: no argument to wrap, or plain torch itself rejects the
(pruned) arguments (a singular matrix, ...). A layout refusing a shape would add
'<layout> cannot store'; none of the plugin layouts refuses one of op_db's 2-D shapes."""


@pytest.fixture(scope="module", autouse=True)
def every_plugin_installed():
    names = {row["name"] for row in plugins.plugin_report()}
    assert {"nm", "scipy", "cuda24"} <= names, f"the OpInfo run needs every plugin installed, got {sorted(names)}"


@pytest.fixture(scope="module")
def results():
    """Every plugin layout's outcomes, from one pass over op_db."""
    by_layout = collections.defaultdict(list)
    for o in outcomes(PLUGIN_LAYOUTS, MAX_SAMPLES):
        by_layout[o.layout].append(o)
    return by_layout


@pytest.mark.parametrize("layout", PLUGIN_LAYOUTS)
def test_opinfo_samples_match_plain_torch(results, layout):
    mine = results[layout]
    ran = [o for o in mine if o.status != "skip"]
    mismatches = {(o.op, o.layout, o.index): o.reason for o in ran if o.status == "mismatch"}
    unexplained = {k: v for k, v in mismatches.items() if k not in KNOWN_MISMATCHES}
    assert not unexplained, "\n".join(f"{k}: {v}" for k, v in unexplained.items())
    stale = [k for k in KNOWN_MISMATCHES if k[1] == layout and k not in mismatches]
    assert not stale, f"listed as mismatching but now matching (remove them): {stale}"
    assert len(ran) > 1500, f"only {len(ran)} samples ran"
    assert sum(o.status == "match" for o in ran) / len(ran) >= 0.99


@pytest.mark.parametrize("layout", PLUGIN_LAYOUTS)
def test_opinfo_skips_hide_nothing(results, layout):
    skips = collections.Counter(skip_kind(o.reason) for o in results[layout] if o.status == "skip")
    odd = {reason: n for reason, n in skips.items() if not reason.startswith(ALLOWED_SKIPS)}
    assert not odd, f"unexpected skip reasons: {odd}"
    flaky = {o.op for o in results[layout] if o.reason == "dense reference not reproducible"}
    assert flaky <= set(NONDETERMINISTIC_REFERENCES), f"skipped as irreproducible: {flaky - set(NONDETERMINISTIC_REFERENCES)}"


def test_known_mismatches_name_plugin_layouts():
    assert {k[1] for k in KNOWN_MISMATCHES} <= set(PLUGIN_LAYOUTS)
    assert all(reason for reason in KNOWN_MISMATCHES.values())
