"""The packed-x scratch buffer kept between calls (exact and paper-format forwards) and the
blocked x pack: calls of growing and shrinking size, strided x, widths that are not whole
16-column blocks, and concurrent calls from several Python threads, each against dense."""

import threading

import pytest
import torch
import torch.nn.functional as F

from sten_nm import ColumnGroupedNMTensor, NMTensor, _kernel, tuning

from conftest import requires_kernel

pytestmark = requires_kernel

# (B, K): widths below, at and past the 16-column blocks and their fetch-ahead distance,
# batches that are and are not whole batch chunks, large after small after large
SIZES = [(130, 200), (7, 37), (64, 16), (33, 50), (200, 333), (1, 5), (129, 112)]


def _x(B: int, K: int, strided: bool) -> torch.Tensor:
    """x[B, K], contiguous or a column slice of a wider matrix (row stride K + 9)."""
    return torch.randn(B, K + 9)[:, 3:3 + K] if strided else torch.randn(B, K)


@pytest.mark.parametrize("strided", [False, True])
def test_exact_and_paper_forward_reuse_the_scratch_buffer(isa, strided):
    for n, m in ((2, 4), (1, 10)):
        for B, K in SIZES:
            W = torch.randn(24, K)
            x = _x(B, K, strided)
            exact = NMTensor.from_dense(W, n, m)
            torch.testing.assert_close(_kernel.gather(exact.mat(), x), F.linear(x, exact.to_dense()),
                                       rtol=1e-4, atol=1e-4)
            paper = ColumnGroupedNMTensor.from_dense(W, n, m)
            for variant in ("stream", "tiled"):
                torch.testing.assert_close(_kernel.colgrouped_gather(paper.desc(), x, variant=variant),
                                           F.linear(x, paper.to_dense()), rtol=1e-4, atol=1e-4)


def test_concurrent_calls_get_their_own_buffers():
    """Calls from several threads at once (ctypes drops the GIL): one of them holds the
    cached buffer, the others allocate their own; every result equals dense."""
    cases = []
    for i, (B, K) in enumerate(SIZES[:4] * 2):
        W = torch.randn(16 + 4 * i, K)
        cases.append((NMTensor.from_dense(W, 2, 4), ColumnGroupedNMTensor.from_dense(W, 1, 4),
                      torch.randn(B, K)))
    errors: list[BaseException] = []

    def work(exact, paper, x):
        try:
            for _ in range(15):
                torch.testing.assert_close(_kernel.gather(exact.mat(), x, nthreads=1),
                                           F.linear(x, exact.to_dense()), rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(_kernel.colgrouped_gather(paper.desc(), x, nthreads=1),
                                           F.linear(x, paper.to_dense()), rtol=1e-4, atol=1e-4)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=c) for c in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_tuning_times_close_calls_again(monkeypatch, tmp_path):
    """A close call between candidates is timed for further rounds (up to MAX_ROUNDS), a
    clear one stops after MIN_ROUNDS."""
    monkeypatch.setenv("STEN_NM_TUNE_CACHE", str(tmp_path / "t.json"))
    tuning.forget()
    assert tuning._clear({"a": 1.0, "b": 1.2}) and not tuning._clear({"a": 1.0, "b": 1.02})
    assert tuning._clear({"only": 1.0})
    monkeypatch.setattr(tuning, "_best_time", lambda fn, reps: {"a": 1.0, "b": 1.01}[fn()])
    calls = []
    assert tuning.choose("close", {"a": lambda: calls.append("a") or "a",
                                   "b": lambda: calls.append("b") or "b"}) == "a"
    assert len(calls) == 2 * tuning.MAX_ROUNDS
    monkeypatch.setattr(tuning, "_best_time", lambda fn, reps: {"a": 1.0, "b": 2.0}[fn()])
    calls.clear()
    assert tuning.choose("clear", {"a": lambda: calls.append("a") or "a",
                                   "b": lambda: calls.append("b") or "b"}) == "a"
    assert len(calls) == 2 * tuning.MIN_ROUNDS
    tuning.forget()


@pytest.mark.parametrize("rows", [None, "64", "96"])
def test_exact_forward_units_of_several_row_blocks(isa, rows, monkeypatch):
    """The exact forward's units span several 32-row blocks (chosen from the L2 size, or
    STEN_NM_GATHER_ROWS): row counts that are not whole blocks or units, every batch chunk;
    K = 4100 makes a 64-row batch chunk's panel (1 MiB) crowd the L2 cache (more rows per unit)."""
    if rows:
        monkeypatch.setenv("STEN_NM_GATHER_ROWS", rows)
    for R, K in ((1100, 64), (200, 50), (300, 4100)):
        t = NMTensor.from_dense(torch.randn(R, K), 1, 4)
        for B in (3, 70, 130):
            x, b = torch.randn(B, K), torch.randn(R)
            for nth in (1, 2):
                torch.testing.assert_close(_kernel.gather(t.mat(), x, b, nthreads=nth),
                                           F.linear(x, t.to_dense(), b), rtol=1e-4, atol=1e-4)
