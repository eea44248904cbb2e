"""Which 2:4 GPU backend and cuSPARSELt algorithm are used, checked on CPU with the probes
stubbed (what the H100 run showed: torch's CUTLASS 2:4 kernels are sm_8x only, and an fp16
algorithm search could break the CUDA context)."""

import pytest
import torch

from sten_cuda24 import _compat, backends


@pytest.fixture
def fresh_probes():
    _compat.has_cutlass.cache_clear()
    backends.ALG_CACHE.clear()
    yield
    _compat.has_cutlass.cache_clear()
    backends.ALG_CACHE.clear()


def test_cutlass_is_offered_only_on_compute_capability_8(fresh_probes, monkeypatch):
    monkeypatch.setattr(_compat, "private_op", lambda name: (lambda *a, **k: None))
    for cap, offered in (((9, 0), False), ((8, 6), True), ((8, 0), True), ((10, 0), False), (None, True)):
        _compat.has_cutlass.cache_clear()
        monkeypatch.setattr(_compat, "cuda_capability", lambda device=None, cap=cap: cap)
        assert _compat.has_cutlass() is offered, cap


def _stub_cusparselt(monkeypatch, searched: int, product_of_alg):
    calls = []

    def search(*args, **kwargs):
        calls.append("search")
        return searched

    monkeypatch.setattr(_compat, "private_op", lambda name: search if name == "_cslt_sparse_mm_search" else None)
    monkeypatch.setattr(torch, "_cslt_sparse_mm", lambda *a, alg_id=0, **k: product_of_alg(alg_id), raising=False)
    prep = backends.Prepared("cusparselt", 8, 8, 32, 64, compressed=torch.zeros(1))
    return prep, calls


def test_the_algorithm_search_is_opt_in(fresh_probes, monkeypatch):
    prep, calls = _stub_cusparselt(monkeypatch, 7, lambda alg: torch.ones(4))
    monkeypatch.delenv("STEN_CUDA24_CSLT_SEARCH", raising=False)
    assert backends._cslt_alg(prep, torch.zeros(64, 16), None) == 0 and calls == []
    monkeypatch.setenv("STEN_CUDA24_CSLT_SEARCH", "0")
    assert backends._cslt_alg(prep, torch.zeros(64, 16), None) == 0 and calls == []


@pytest.mark.parametrize("agrees, expect", [(True, 7), (False, 0)])
def test_a_searched_algorithm_is_kept_only_if_it_equals_the_default(fresh_probes, monkeypatch, agrees, expect):
    prep, calls = _stub_cusparselt(monkeypatch, 7, lambda alg: torch.ones(4) * (1 if agrees or alg == 0 else 3))
    monkeypatch.setenv("STEN_CUDA24_CSLT_SEARCH", "1")
    assert backends._cslt_alg(prep, torch.zeros(64, 16), None) == expect
    assert backends._cslt_alg(prep, torch.zeros(64, 16), None) == expect and calls == ["search"]  # cached


def test_a_failing_search_or_product_keeps_the_default(fresh_probes, monkeypatch):
    def fails(alg):
        if alg:
            raise RuntimeError("CUDA error: internal error when calling cusparseLtMatmulAlgSelectionInit")
        return torch.ones(4)

    prep, _ = _stub_cusparselt(monkeypatch, 7, fails)
    monkeypatch.setenv("STEN_CUDA24_CSLT_SEARCH", "1")
    assert backends._cslt_alg(prep, torch.zeros(64, 16), None) == 0


def test_fp32_triton_dots_follow_torchs_tf32_setting():
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    try:
        matmul.allow_tf32 = False
        assert _compat.ieee_fp32_dot(torch.float32) and not _compat.ieee_fp32_dot(torch.bfloat16)
        matmul.allow_tf32 = True
        assert not _compat.ieee_fp32_dot(torch.float32)
    finally:
        matmul.allow_tf32 = before
