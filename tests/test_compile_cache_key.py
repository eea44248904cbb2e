"""The AOTAutograd cache key of a traceable wrapper (``_stable_hash_for_caching``): stable
for the same wrapper and code, different for another layout state, format or code version."""

import torch

import sten_core as sten
from sten_core.model import code_fingerprint

KEEP_CSR = (sten.KeepAll(), sten.CsrTensor, sten.KeepAll(), sten.CsrTensor)


def wrapper(dense: torch.Tensor, grad_fmt=KEEP_CSR) -> sten.SparseParameterWrapper:
    return sten.SparseParameterWrapper(sten.CsrTensor.from_dense(dense), requires_grad=True, grad_fmt=grad_fmt)


def test_traceable_wrapper_has_a_stable_cache_key():
    torch.manual_seed(0)
    dense = torch.randn(6, 5) * (torch.rand(6, 5) > 0.5)
    w = wrapper(dense)
    assert hasattr(type(w), "__tensor_flatten__"), "a CSR wrapper keeping its layout is traceable"
    key = w._stable_hash_for_caching()
    assert key == w._stable_hash_for_caching() == wrapper(dense)._stable_hash_for_caching()
    assert key != wrapper(torch.randn(6, 5))._stable_hash_for_caching(), "another nnz: other members"
    assert key != wrapper(dense.t().contiguous())._stable_hash_for_caching()


def test_cache_key_follows_the_code(monkeypatch):
    w = wrapper(torch.eye(4))
    before = w._stable_hash_for_caching()
    real = code_fingerprint.package_fingerprint
    monkeypatch.setattr(code_fingerprint, "package_fingerprint",
                        lambda name: real(name) + ("-edited" if name == "sten_core" else ""))
    assert w._stable_hash_for_caching() != before, "an edit of STen's code must not reuse cache entries"


def test_package_fingerprint_changes_with_a_source_file(tmp_path, monkeypatch):
    package = tmp_path / "fp_probe_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    first = code_fingerprint.package_fingerprint("fp_probe_pkg.sub")
    (package / "layout.py").write_text("y = 2\n")
    code_fingerprint.package_fingerprint.cache_clear()
    assert code_fingerprint.package_fingerprint("fp_probe_pkg") != first
