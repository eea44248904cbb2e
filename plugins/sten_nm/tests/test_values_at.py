"""The C kernels that read a dense matrix at a layout's stored positions (``gather``: the
backward's dense route, optimizers keeping sparsity) and the paper format's ``to_dense``,
against torch's indexing on every shape, pattern and orientation; where the C path must not
stand in (autograd, torch.func), the torch path still answers."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sten_nm import ColumnGroupedNMTensor, GroupedNMTensor, NMTensor, _kernel

from conftest import requires_kernel

pytestmark = requires_kernel

PATTERNS = st.sampled_from([(1, 2), (2, 4), (1, 4), (3, 8), (1, 10), (7, 16)])


def exact_reference(t: NMTensor, dense: torch.Tensor) -> torch.Tensor:
    a = dense.t() if t.dim == 0 else dense
    cols = t.columns()
    padded = torch.nn.functional.pad(a, (0, max(int(cols.max()) + 1 - a.shape[1], 0))) if cols.numel() else a
    return torch.where(cols < a.shape[1], padded.gather(1, cols), 0.0) if cols.numel() else a.new_zeros(cols.shape)


def paper_rows_cols(t: ColumnGroupedNMTensor) -> tuple[torch.Tensor, torch.Tensor]:
    return t._rows(), t.columns.long()[:, :, None, :]


def paper_reference_gather(t: ColumnGroupedNMTensor, dense: torch.Tensor) -> torch.Tensor:
    Nb, P, n, L = t.values().shape
    full = dense.new_zeros((Nb * t.m, P * L))
    full[:dense.shape[0], :dense.shape[1]] = dense
    rows, cols = paper_rows_cols(t)
    return full[rows, cols]


def paper_reference_dense(t: ColumnGroupedNMTensor) -> torch.Tensor:
    N, K = t.shape
    Nb, P, n, L = t.values().shape
    out = t.values().new_zeros((Nb * t.m, P * L))
    rows, cols = paper_rows_cols(t)
    out[rows, cols] = t.values()
    return out[:N, :K]


@settings(max_examples=60, deadline=None)
@given(R=st.integers(0, 23), C=st.integers(0, 41), nm=PATTERNS, dim=st.sampled_from([0, 1]),
       seed=st.integers(0, 2**16))
def test_exact_gather_in_c_equals_torch(R, C, nm, dim, seed):
    n, m = nm
    g = torch.Generator().manual_seed(seed)
    shape = (R, C) if dim == 1 else (C, R)
    t = NMTensor.from_dense(torch.randn(shape, generator=g), n, m, dim=dim)
    dense = torch.randn(shape, generator=g)
    got = t.gather(dense)
    assert got.shape == t.values().shape
    torch.testing.assert_close(got, exact_reference(t, dense), rtol=0, atol=0)
    if R and C:   # the stored values read back from the dense tensor
        torch.testing.assert_close(t.gather(t.to_dense()), t.values(), rtol=0, atol=0)


@settings(max_examples=60, deadline=None)
@given(N=st.integers(0, 29), K=st.integers(0, 37), nm=st.sampled_from([(1, 2), (2, 4), (1, 4), (2, 5), (1, 10)]),
       seed=st.integers(0, 2**16))
def test_paper_format_gather_and_to_dense_in_c_equal_torch(N, K, nm, seed):
    n, m = nm
    g = torch.Generator().manual_seed(seed)
    t = ColumnGroupedNMTensor.from_dense(torch.randn(N, K, generator=g), n, m)
    dense = torch.randn(N, K, generator=g)
    torch.testing.assert_close(t.gather(dense), paper_reference_gather(t, dense), rtol=0, atol=0)
    torch.testing.assert_close(t.to_dense(), paper_reference_dense(t), rtol=0, atol=0)


def test_grouped_gather_reads_the_stored_positions():
    t = GroupedNMTensor.from_dense(torch.randn(37, 24), 2, 4)
    d = torch.randn(37, 24)
    torch.testing.assert_close(t.with_values(t.gather(d)).to_dense(), d * t.mask())


def test_plain_float32_tensors_take_the_c_path(monkeypatch):
    calls = []
    for name in ("values_at", "colgrouped_values_at", "colgrouped_decompress"):
        fn = getattr(_kernel, name)
        monkeypatch.setattr(_kernel, name, lambda *a, fn=fn, name=name: calls.append(name) or fn(*a))
    w = torch.randn(8, 12)
    t, p = NMTensor.from_dense(w, 2, 4, dim=0), ColumnGroupedNMTensor.from_dense(w, 1, 4)
    calls.clear()
    t.gather(w)
    p.gather(w)
    p.to_dense()
    assert calls == ["values_at", "colgrouped_values_at", "colgrouped_decompress"]


def test_bf16_values_gather_float32_dense():
    """The pattern alone is read: a bf16 layout gathers a float32 matrix in float32."""
    w = torch.randn(12, 20)
    d = torch.randn(12, 20)
    for t in (NMTensor.from_dense(w, 2, 4).to(dtype=torch.bfloat16),
              ColumnGroupedNMTensor.from_dense(w, 1, 4).to(dtype=torch.bfloat16)):
        got = t.gather(d)
        assert got.dtype == torch.float32
        torch.testing.assert_close(t.with_values(got.to(torch.bfloat16)).to_dense().float(),
                                   (d * t.mask()).to(torch.bfloat16).float())


@pytest.mark.parametrize("make", [lambda w: NMTensor.from_dense(w, 2, 4),
                                  lambda w: ColumnGroupedNMTensor.from_dense(w, 2, 4)], ids=["exact", "paper"])
def test_autograd_and_torch_func_take_the_torch_path(make):
    """A dense tensor autograd follows gets a differentiable gather; torch.func's batched
    tensors (no data of their own) are gathered by torch, not handed to C."""
    t = make(torch.randn(8, 12))
    d = torch.randn(8, 12, requires_grad=True)
    t.gather(d).sum().backward()
    torch.testing.assert_close(d.grad, t.mask().float())
    batch = torch.randn(3, 8, 12)
    got = torch.func.vmap(t.gather)(batch)
    torch.testing.assert_close(got, torch.stack([t.gather(b) for b in batch]))
    assert not _kernel.can_read(torch.ones(2, requires_grad=True))
    with torch.no_grad():
        assert _kernel.can_read(torch.ones(2, requires_grad=True))


def test_one_row_with_any_stride():
    """A [1, K] tensor may have any row stride (torch calls it contiguous): a GPT-2 Conv1D
    weight [K, 1] transposed; the C path must not refuse it for its stride."""
    w = torch.randn(12, 1).t()
    assert w.stride() == (1, 1)
    p = ColumnGroupedNMTensor.from_dense(w, 2, 4)
    torch.testing.assert_close(p.gather(w), paper_reference_gather(p, w), rtol=0, atol=0)
    t = NMTensor.from_dense(w, 2, 4)
    torch.testing.assert_close(t.gather(w), exact_reference(t, w), rtol=0, atol=0)


@pytest.mark.parametrize("make", [lambda w: NMTensor.from_dense(w, 2, 4),
                                  lambda w: ColumnGroupedNMTensor.from_dense(w, 2, 4)], ids=["exact", "paper"])
def test_forward_mode_tangents_are_kept(make):
    """Dual tensors of torch.autograd.forward_ad are plain tensors: the C path would drop
    their tangents, so they take torch's."""
    import torch.autograd.forward_ad as fwAD

    t = make(torch.randn(4, 8))
    with fwAD.dual_level():
        d = fwAD.make_dual(torch.randn(4, 8), torch.ones(4, 8))
        tangent = fwAD.unpack_dual(t.gather(d)).tangent
        assert tangent is not None and float(tangent.sum()) == float(t.mask().sum())
        v = fwAD.make_dual(t.values().float(), torch.ones_like(t.values(), dtype=torch.float32))
        tangent = fwAD.unpack_dual(t.with_values(v).to_dense()).tangent
        assert tangent is not None and torch.equal(tangent != 0, t.mask())


def test_lazy_negation_is_not_read_in_c():
    t = NMTensor.from_dense(torch.randn(4, 8), 2, 4)
    d = torch.randn(4, 8)
    neg = torch._neg_view(d)
    assert not _kernel.can_read(neg)
    torch.testing.assert_close(t.gather(neg), -t.gather(d))


def test_the_c_entry_points_refuse_bad_arguments():
    t = NMTensor.from_dense(torch.randn(6, 8), 2, 4)
    with pytest.raises(ValueError, match=r"dense must be of shape \(6, 8\)"):
        _kernel.values_at(t.mat(), torch.randn(6, 9))
    p = ColumnGroupedNMTensor.from_dense(torch.randn(8, 12), 1, 4)
    with pytest.raises(ValueError, match=r"dense must be of shape \(8, 12\)"):
        _kernel.colgrouped_values_at(p.desc(), torch.randn(12, 8))
    bf16 = p.to(dtype=torch.bfloat16).desc()   # bf16 values: no float32 matrix to write
    with pytest.raises(RuntimeError, match="nm_colgrouped_decompress: kernel rejected"):
        _kernel.colgrouped_decompress(bf16)
    bad = ColumnGroupedNMTensor.from_dense(torch.randn(8, 12), 1, 4)
    bad.columns.view(-1)[0] = 10**6   # a column past the block's
    with pytest.raises(RuntimeError, match="nm_colgrouped_values_at: kernel rejected"):
        _kernel.colgrouped_values_at(bad.desc(), torch.randn(8, 12))
