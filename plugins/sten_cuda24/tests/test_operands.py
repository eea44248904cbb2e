"""GPU operands built from a 2:4 weight's values and metadata, and refreshed in place
after optimizer steps (pure tensor code, checked on CPU against the encoders)."""

from __future__ import annotations

import pytest
import torch
from torch.sparse._semi_structured_conversions import sparse_semi_structured_from_dense_cutlass as torch_from_dense

from sten_cuda24 import Sparse24Sparsifier, Sparse24Tensor, backends, encoding, operands, sparsify_24


def operand_dense(prep: backends.Prepared) -> torch.Tensor:
    """The dense matrix a CUTLASS operand multiplies by (cut to the logical shape)."""
    if prep.packed.dtype == torch.float32:
        meta = encoding.cutlass_unreorder(prep.meta)
        codes = encoding.unpack_codes(meta)                   # one code per pair: 0b0100 first, 0b1110 second
        r = prep.packed.shape[0]
        pairs = torch.zeros(r, codes.shape[1], 2)
        pairs.scatter_(-1, (codes == 0b1110).long().unsqueeze(-1), prep.packed.unsqueeze(-1))
        return pairs.reshape(r, -1)[: prep.n, : prep.k]
    return encoding.from_cutlass(prep.packed, prep.meta)[: prep.n, : prep.k]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 128), (37, 50), (96, 200)])
def test_cutlass_operand_from_metadata(dtype, shape):
    w = sparsify_24(torch.randn(*shape).to(dtype))
    prep = backends.build(w, "cutlass")
    assert torch.equal(operand_dense(prep), w.to_dense())
    if shape == (64, 128):                                    # aligned: the operand is our values, no copy
        assert prep.packed is w.packed and prep.refresh == "view"
        ref_packed, ref_meta = torch_from_dense(w.to_dense())  # bit-identical to torch's converter
        assert torch.equal(prep.packed, ref_packed) and torch.equal(prep.meta, ref_meta)
    else:
        assert prep.refresh == "copy"


def test_fp32_operand_needs_one_slot_per_pair():
    one2 = torch.randn(40, 72) * torch.zeros(40, 36, 2, dtype=torch.bool).scatter_(-1, torch.randint(0, 2, (40, 36, 1)), True).reshape(40, 72)
    prep = backends.build(Sparse24Tensor.from_dense(one2), "cutlass")
    assert prep is not None and torch.equal(operand_dense(prep), one2)
    aligned = one2[:32, :64]
    prep = backends.build(Sparse24Tensor.from_dense(aligned), "cutlass")
    ref_packed, ref_meta = encoding.fp32_to_cutlass(aligned)
    assert torch.equal(prep.packed, ref_packed) and torch.equal(prep.meta, ref_meta)
    assert backends.build(sparsify_24(torch.randn(32, 64)), "cutlass") is None   # two slots in one pair


def sgd_steps(w: Sparse24Tensor, steps: int):
    """Optimizer-like in-place updates of the stored values (what write_back does)."""
    for i in range(steps):
        values = w.values()
        new = w.gather(w.to_dense() * 0.5 + torch.randn(w.shape).to(w.dtype))
        values.copy_(new.masked_fill(new == 0, 1.0))   # no kept zeros: compress() then names every slot
        w = w.with_values(values)
        yield w


@pytest.mark.parametrize("transposable", [False, True])
def test_cutlass_operand_refreshed_in_place(transposable):
    dense = torch.randn(37, 72).half()
    w = sparsify_24(dense, transposable=transposable)
    prep = backends.build(w, "cutlass")
    buffer = prep.packed
    for w in sgd_steps(w, 4):
        backends.sync(prep, w)
        assert prep.packed is buffer                                # no new operand
        assert torch.equal(operand_dense(prep), w.to_dense())


def fake_compressors(dtype):
    """Stand-ins for cuSPARSELt's opaque buffer: values in some order, then metadata bits, as a
    2-D ``[rows, -1]`` tensor like ``torch._cslt_compress`` returns (its matmul refuses 1-D)."""
    def rows(compress):
        return lambda dense: compress(dense).view(dense.shape[0], -1)

    def tail(meta):
        return meta.reshape(-1).view(dtype) if dtype != torch.float32 else meta.reshape(-1).to(torch.int32).view(dtype)

    def prefix(dense):
        values, meta = encoding.compress(dense, strict=False)
        return torch.cat([values.reshape(-1), tail(meta)])

    def column_major(dense):
        values, meta = encoding.compress(dense, strict=False)
        return torch.cat([tail(meta), values.t().reshape(-1)])

    def shuffled(dense):
        values, meta = encoding.compress(dense, strict=False)
        perm = torch.randperm(values.numel(), generator=torch.Generator().manual_seed(5))
        return torch.cat([values.reshape(-1)[perm], tail(meta)])

    def scaled(dense):                                               # not a permutation of the values
        values, meta = encoding.compress(dense, strict=False)
        return torch.cat([values.reshape(-1) * 0.5, tail(meta)])

    return {"prefix": rows(prefix), "scatter": rows(column_major), "shuffled": rows(shuffled), "recompress": rows(scaled)}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["prefix", "scatter", "shuffled", "recompress"])
def test_discovered_layout_refresh_equals_compress(dtype, layout):
    compress = fake_compressors(dtype)[layout]
    w = sparsify_24(torch.randn(64, 128).to(dtype))
    prep = backends.build(w, "cusparselt", compress=compress)
    assert prep.refresh == "pending"
    for w in sgd_steps(w, 3):
        backends.sync(prep, w, compress=compress)
        expect = {"shuffled": "scatter"}.get(layout, layout)
        assert prep.refresh == expect
        padded = encoding.decompress(operands.padded_values(w, 64, 128), operands.padded_meta(w, 64, 128))
        # equal to compressing the current weight (fillers included: a probe fixes the metadata)
        got, want = prep.compressed, compress(padded)
        assert got.shape == want.shape                              # the buffer keeps its shape
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_prepare_shares_operands_across_optimizer_steps(sten):
    """``with_values`` on the tensor's own storage keeps the cache: prepared operands and the
    transposed pair are refreshed in place, never rebuilt."""
    w = sparsify_24(torch.randn(64, 128).half(), transposable=True)
    t0 = w.transposed()
    w.values().mul_(2.0)
    w2 = w.with_values(w.values())
    assert w2._cache is w._cache
    t1 = w2.transposed()
    assert t1 is t0 and torch.equal(t1.to_dense(), w2.to_dense().t())
    assert not w.with_values(w.values().clone())._cache                 # other storage: its own cache
