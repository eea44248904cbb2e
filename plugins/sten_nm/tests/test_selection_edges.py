"""n:m edge cases against dense torch: which positions a layout keeps (float64 ranked in float64,
NaN kept by the paper format too), a bias of the output's shape on the 16-row layout (refused like
the other n:m layouts: the kernel added bias[:N] to every row), and ``addmm``'s ``beta=0``."""

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_nm import ColumnGroupedNMTensor, GroupedNMSparsifier, GroupedNMTensor, NMSparsifier, NMTensor
from sten_nm.nm_tensor import largest_n

from conftest import requires_kernel


def test_float64_weights_are_ranked_in_float64():
    a = torch.tensor([[1.0, 1.0 + 1e-12, 0.0, 0.0], [1e-300, 2e-300, 0.0, 0.0], [1e39, 1e40, 0.0, 0.0]],
                     dtype=torch.float64)
    want = torch.zeros_like(a)
    want[:, 1] = a[:, 1]
    for dim in (1, 0):
        src = a if dim == 1 else a.t().contiguous()
        got = NMTensor.from_dense(src, 1, 4, dim=dim).to_dense()
        assert torch.equal(got, want if dim == 1 else want.t()), dim
    assert torch.equal(sten.sparsify(NMSparsifier(1, 4), a, NMTensor).to_dense(), want)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_largest_n_keeps_what_the_kernel_keeps(dtype):
    torch.manual_seed(0)
    a = torch.randn(5, 11).to(dtype)   # distinct magnitudes: the same ranking in either dtype
    a[0, 3] = float("nan")
    kernel = NMTensor.from_dense(a.float(), 2, 4).to_dense()
    assert torch.equal(largest_n(a, 2, 4), (kernel != 0) | kernel.isnan())
    ties = largest_n(torch.ones(1, 6, dtype=dtype), 2, 4)   # ties: the lower index
    assert ties.tolist() == [[True, True, False, False, True, True]]


@pytest.mark.parametrize("special", ["nan", "inf"])
def test_the_paper_format_keeps_a_nan_or_inf_weight(special):
    torch.manual_seed(1)
    for trial in range(10):
        a = torch.randn(8, 24)
        r, c = trial % 8, (3 * trial) % 24
        a[r, c] = float(special)
        got = ColumnGroupedNMTensor.from_dense(a, 2, 4, g=1).to_dense()
        assert got[r, c].isnan() if special == "nan" else got[r, c] == float("inf"), (trial, r, c)


@requires_kernel   # (without it F.linear runs densely, which takes such a bias)
def test_the_grouped_layout_refuses_a_bias_of_the_outputs_shape():
    w = GroupedNMTensor.from_dense(torch.randn(16, 8), 2, 4)
    with pytest.raises(ValueError, match=r"bias must be 1-D of size 16, got shape \(3, 16\)"):
        F.linear(torch.randn(3, 8), sten.SparseTensorWrapper(w), torch.randn(3, 16))


def test_addmm_with_beta_zero_ignores_input():
    w = NMTensor.from_dense(torch.randn(4, 4), 2, 4, dim=0)
    c, x = torch.full((1, 4), float("nan")), torch.ones(1, 4)
    got = torch.addmm(c, x, sten.SparseTensorWrapper(w), beta=0)
    torch.testing.assert_close(got, torch.addmm(c, x, w.to_dense(), beta=0))
    assert not got.isnan().any()


@pytest.mark.parametrize("shape", [(64, 64), (40, 8), (16, 12), (33, 20)])
@pytest.mark.parametrize("n, m", [(2, 4), (1, 4)])
def test_resparsifying_a_grouped_weight_keeps_it(shape, n, m):
    """``GroupedNMTensor.from_dense(g.to_dense())`` regrouped the rows by magnitude-weighted
    similarity and split rows of one mask across groups: 30 entries of a 64x64 2:4 weight changed
    (1.2 % of the kept magnitude, 4.5 % at 40x8), with no warning, when a densified checkpoint was
    sparsified again. A weight already in the grouped pattern is now stored as it is."""
    torch.manual_seed(0)
    d = GroupedNMTensor.from_dense(torch.randn(*shape), n, m).to_dense()
    assert torch.equal(GroupedNMTensor.from_dense(d, n, m).to_dense(), d)
    assert torch.equal(sten.sparsify(GroupedNMSparsifier(n, m), d, GroupedNMTensor).to_dense(), d)
    assert GroupedNMTensor.from_dense(torch.ones(16, 8), 1, 4).nnz == 32   # a dense weight is still grouped
