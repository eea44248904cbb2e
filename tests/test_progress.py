"""Progress bars are drawn only when the output is a terminal (no ``\\r`` noise in CI logs)."""

from __future__ import annotations

import io
import sys

import pytest
import torch

import sten_core as sten
from sten_core.tools.bench import layouts, models
from sten_core.tools.bench.runner import Settings, run
from sten_core.progress import is_terminal, show_progress


class FakeTerminal(io.StringIO):
    """A stream that says it is a terminal and keeps what was written."""

    def isatty(self) -> bool:
        return True


def tiny_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def test_default_follows_the_stream():
    assert show_progress(None, FakeTerminal()) is True
    assert show_progress(None, io.StringIO()) is False


def test_default_stream_is_stderr_at_call_time(monkeypatch):
    monkeypatch.setattr(sys, "stderr", FakeTerminal())
    assert show_progress() is True
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert show_progress() is False


@pytest.mark.parametrize("stream", [FakeTerminal(), io.StringIO()], ids=["terminal", "pipe"])
def test_explicit_choice_wins(stream):
    assert show_progress(True, stream) is True
    assert show_progress(False, stream) is False


def test_streams_that_cannot_answer_are_not_terminals():
    closed = io.StringIO()
    closed.close()  # isatty() on a closed stream raises ValueError
    assert is_terminal(closed) is False
    assert is_terminal(object()) is False  # no isatty at all


@pytest.mark.parametrize("bad", ["yes", 1, 0.5])
def test_bad_value_names_the_argument(bad):
    with pytest.raises(TypeError, match="progress must be True, False or None"):
        show_progress(bad, io.StringIO())


def test_prune_draws_its_line_only_on_a_terminal(monkeypatch):
    batches = [torch.randn(8, 16)]
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    sten.prune(tiny_mlp(), batches, "wanda", sparsity=0.5)
    assert sys.stderr.getvalue() == ""
    monkeypatch.setattr(sys, "stderr", FakeTerminal())
    sten.prune(tiny_mlp(), batches, "wanda", sparsity=0.5)
    drawn = sys.stderr.getvalue()
    assert "\r" in drawn and "2/2" in drawn


def _bench(progress: bool | None) -> list[dict]:
    return run(lambda: models.linear_case(8, 16, 4), layouts.choose(["dense", "csr"], "cpu"),
               Settings(sparsities=[0.5], repeats=1, warmup=0, check=True), progress=progress)


def test_bench_draws_no_bar_into_a_pipe(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    rows = _bench(None)
    assert [r["layout"] for r in rows] == ["dense", "torch_csr"]
    assert "\r" not in sys.stderr.getvalue()


def test_bench_draws_its_bar_on_a_terminal(monkeypatch):
    pytest.importorskip("tqdm", reason="the bar needs tqdm, from the optional `bench` extra")
    monkeypatch.setattr(sys, "stderr", FakeTerminal())
    _bench(None)
    assert "\r" in sys.stderr.getvalue()
