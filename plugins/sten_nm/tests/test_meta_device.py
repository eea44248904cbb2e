"""The n:m layouts on the meta device: no C kernel ever runs on a tensor without CPU data (the
cases that used to crash the interpreter run in a subprocess, so a regression fails one test
instead of killing pytest); on meta the layouts keep their class and give meta tensors of the
right shape and dtype; ``Module.to("meta").to_empty(device="cpu")`` keeps the layout with a
valid pattern; ``torch.load(map_location="meta")`` names the layout and the meta device."""

from __future__ import annotations

import functools
import io
import subprocess
import sys
import textwrap
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_nm import ColumnGroupedNMTensor, GroupedNMTensor, NMTensor

from conftest import requires_kernel

LAYOUTS: dict[str, Callable[[torch.Tensor], Any]] = {
    "nm": lambda d: NMTensor.from_dense(d, 2, 4),
    "nm_dim0": lambda d: NMTensor.from_dense(d, 2, 4, dim=0),
    "grouped": lambda d: GroupedNMTensor.from_dense(d, 2, 4),
    "column_grouped": lambda d: ColumnGroupedNMTensor.from_dense(d, 2, 4),
}
OUT, IN = 20, 48   # 20 rows: a partial row group (16) and, for dim=0, a padded group of m


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # conversion notes of the core's dispatch
        yield


def _run_isolated(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter: a crash there (SIGSEGV) is a return code, not pytest's end."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300)


@functools.lru_cache(maxsize=None)
def _meta_round_trip() -> subprocess.CompletedProcess:
    """The audit's repro (SIGSEGV before) in a fresh interpreter: ``to_dense`` of every n:m layout
    on meta, and ``model.to("meta").to_empty(device="cpu")`` then a forward."""
    return _run_isolated("""
        import torch, warnings, sten_core as sten
        from sten_nm import NMTensor, GroupedNMTensor, ColumnGroupedNMTensor
        warnings.simplefilter("ignore")
        for cls in (NMTensor, GroupedNMTensor, ColumnGroupedNMTensor):
            w = sten.SparseTensorWrapper(cls.from_dense(torch.randn(32, 16), 2, 4)).to("meta")
            print(cls.__name__, w.to_dense().device, flush=True)
            m = torch.nn.Linear(16, 32)
            m.weight = sten.SparseParameterWrapper(cls.from_dense(m.weight.detach(), 2, 4))
            m = m.to("meta").to_empty(device="cpu")
            print(cls.__name__, type(m.weight.wrapped_tensor).__name__, m(torch.randn(2, 16)).shape, flush=True)
    """)


@pytest.fixture
def no_meta_crash() -> None:
    """Skip a test that runs the meta device in this process where the isolated repro crashed
    (it would end pytest; ``test_meta_to_dense_and_to_empty_do_not_crash`` fails instead)."""
    r = _meta_round_trip()
    if r.returncode < 0:
        pytest.skip(f"the meta device crashes the interpreter here (signal {-r.returncode})")


in_process = pytest.mark.usefixtures("no_meta_crash")


def _linear(make: Callable[[torch.Tensor], Any], dtype: torch.dtype = torch.float32,
            grad_fmt: Any = None) -> torch.nn.Linear:
    """A linear layer whose weight is ``make(weight)`` (a sparse parameter)."""
    layer = torch.nn.Linear(IN, OUT).to(dtype)
    layer.weight = sten.SparseParameterWrapper(make(layer.weight.detach()), grad_fmt=grad_fmt)
    return layer


def _kept_per_group(layout: Any) -> torch.Tensor:
    """Stored positions per group of ``m`` (along the layout's groups) of a CPU n:m layout."""
    mask = layout.mask()
    along_rows = isinstance(layout, ColumnGroupedNMTensor) or getattr(layout, "dim", 1) == 0
    a = mask.t() if along_rows else mask
    pad = -a.shape[1] % layout.m
    return F.pad(a.float(), (0, pad)).reshape(a.shape[0], -1, layout.m).sum(-1)


# -- no crash: the kernels refuse tensors without CPU data -----------------------------------
def test_meta_to_dense_and_to_empty_do_not_crash():
    """No crash, meta dense tensors, and the layouts kept by ``to_empty`` (:func:`_meta_round_trip`)."""
    r = _meta_round_trip()
    assert r.returncode == 0, f"return code {r.returncode}\n{r.stdout}\n{r.stderr[-2000:]}"
    for name in ("NMTensor", "GroupedNMTensor", "ColumnGroupedNMTensor"):
        assert f"{name} meta" in r.stdout
        assert f"{name} {name} torch.Size([2, 32])" in r.stdout


@requires_kernel
def test_every_kernel_entry_refuses_meta_tensors():
    """Each C entry point, called directly with a meta operand, raises a ValueError naming the
    meta device (a fresh interpreter: without the guard these read address 0)."""
    r = _run_isolated("""
        import torch
        from sten_nm import NMTensor, GroupedNMTensor, ColumnGroupedNMTensor, _kernel, _bf16x
        W = NMTensor.from_dense(torch.randn(8, 16), 2, 4)
        G = GroupedNMTensor.from_dense(torch.randn(16, 16), 2, 4)
        C = ColumnGroupedNMTensor.from_dense(torch.randn(8, 16), 2, 4)
        meta = lambda *s, dtype=torch.float32: torch.empty(s, device="meta", dtype=dtype)
        x8, x16, x3 = meta(3, 8), meta(3, 16), meta(3, 16, dtype=torch.bfloat16)
        calls = {
            "mat": lambda: W.to("meta").mat(),
            "grouped": lambda: G.to("meta").desc(),
            "colgrouped": lambda: C.to("meta").desc(),
            "gather": lambda: _kernel.gather(W.mat(), x16),
            "gather_bias": lambda: _kernel.gather(W.mat(), torch.randn(3, 16), meta(8)),
            "scatter": lambda: _kernel.scatter(W.mat(), x8),
            "tgather": lambda: _kernel.tgather(W.mat(), x8),
            "sddmm": lambda: _kernel.sddmm(W.mat(), x8, x16),
            "compress": lambda: _kernel.compress(meta(8, 16), 2, 4),
            "decompress": lambda: _kernel.decompress(W.to("meta").mat()),
            "grouped_gather": lambda: _kernel.grouped_gather(G.desc(), x16),
            "grouped_sddmm": lambda: _kernel.grouped_sddmm(G.desc(), x16, x16),
            "grouped_tgather": lambda: _kernel.grouped_tgather(G.desc(), x16),
            "colgrouped_gather": lambda: _kernel.colgrouped_gather(C.desc(), x16),
            "colgrouped_grad_input": lambda: _kernel.colgrouped_grad_input(C.desc(), x8),
            "colgrouped_grad_values": lambda: _kernel.colgrouped_grad_values(C.desc(), x8, x16),
            "to_bf16": lambda: _kernel.to_bf16(x16),
            "gather_bf16x": lambda: _bf16x.gather_bf16x(W.mat(), x3),
            "colgrouped_gather_bf16x": lambda: _bf16x.colgrouped_gather_bf16x(C.desc(), x3),
            "tgather_mixed": lambda: _bf16x.tgather_mixed(W.mat(), x8),
            "sddmm_mixed": lambda: _bf16x.sddmm_mixed(W.mat(), x8, x16),
            "grouped_tgather_mixed": lambda: _bf16x.grouped_tgather_mixed(G.desc(), x16),
        }
        for name, call in calls.items():
            try:
                call()
                print(name, "RETURNED", flush=True)
            except ValueError as e:
                print(name, "refused" if "meta device" in str(e) else f"other: {e}", flush=True)
    """)
    assert r.returncode == 0, f"return code {r.returncode}\n{r.stdout}\n{r.stderr[-2000:]}"
    lines = r.stdout.splitlines()
    assert len(lines) == 22 and all(line.endswith(" refused") for line in lines), r.stdout


def test_ptr_refuses_fake_tensors():
    """A tensor ``torch.compile`` traces reports the CPU but has no data: refused, no warning."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from sten_nm import _kernel

    with FakeTensorMode():
        fake = torch.empty(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"x is a CPU tensor without data of its own \(FakeTensor"):
            _kernel.ptr(fake, "x")
    assert _kernel.ptr(torch.empty(0), "x") is not None


@requires_kernel
def test_jvp_with_respect_to_an_nm_weight_gives_dense_torchs_tangent():
    """``torch.func.jvp`` over a parameter dict holding an n:m weight: ``jvp`` makes the weight dual
    (``_make_dual``, inside the transform) from its dense values, densified outside the transform.
    Densified inside it, the C kernel's decompress got a transform's tensor and raised; made dual
    outside it, the weight's tangent was lost (a silently wrong result)."""
    from torch.func import functional_call, jvp

    import sten_core as sten
    from sten_nm import NMTensor

    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8)
    lin.weight = sten.SparseParameterWrapper(NMTensor.from_dense(lin.weight.detach(), n=2, m=4))
    dense = torch.nn.Linear(16, 8)
    dense.weight = torch.nn.Parameter(lin.weight.to_dense().detach().clone())
    dense.bias = lin.bias
    params = {k: v.detach() for k, v in lin.named_parameters()}
    dense_params = {k: v.detach() for k, v in dense.named_parameters()}
    tangents = {k: torch.randn(v.shape) for k, v in params.items()}
    x = torch.randn(4, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sten.DispatchWarning)
        got = jvp(lambda p: functional_call(lin, p, (x,)), (params,), (tangents,))
    want = jvp(lambda p: functional_call(dense, p, (x,)), (dense_params,), (tangents,))
    torch.testing.assert_close(got, want)


# -- the layouts on meta: class, shapes, dtypes ----------------------------------------------
@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("kind", LAYOUTS)
def test_layout_on_meta_keeps_class_shape_dtype(kind, dtype):
    layout = LAYOUTS[kind](torch.randn(OUT, IN, dtype=dtype))
    w = sten.SparseTensorWrapper(layout).to("meta")
    meta = w.wrapped_tensor
    assert type(meta) is type(layout) and meta.device.type == "meta" and meta.dtype == dtype
    for dense, want_dtype in ((w.to_dense(), dtype), (meta.to_dense(), dtype), (meta.mask(), torch.bool)):
        assert dense.device.type == "meta" and dense.shape == (OUT, IN) and dense.dtype == want_dtype
    assert meta.values().shape == layout.values().shape and meta.with_values(meta.values()).device.type == "meta"
    assert meta.gather(torch.empty(OUT, IN, device="meta", dtype=dtype)).shape == layout.values().shape
    assert type(layout).__name__ in repr(meta)


@in_process
@pytest.mark.parametrize("sparse_grad", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("kind", LAYOUTS)
def test_products_on_meta_infer_shapes(kind, dtype, sparse_grad):
    """``F.linear`` forward and backward on meta: meta results of dense torch's shapes and dtypes."""
    cls = type(LAYOUTS[kind](torch.randn(OUT, IN)))
    layer = _linear(LAYOUTS[kind], dtype, (sten.KeepAll(), cls, sten.KeepAll(), cls) if sparse_grad else None)
    layer = layer.to("meta")
    x = torch.randn(2, 3, IN, dtype=dtype, device="meta", requires_grad=True)
    y = layer(x)
    assert y.device.type == "meta" and y.shape == (2, 3, OUT) and y.dtype == dtype
    y.sum().backward()
    assert x.grad.device.type == "meta" and x.grad.shape == x.shape and x.grad.dtype == dtype
    g = layer.weight.grad
    assert g.device.type == "meta" and g.shape == (OUT, IN)
    assert isinstance(getattr(g, "wrapped_tensor", None), cls) == sparse_grad


@in_process
def test_nm_matmul_forms_on_meta():
    w = sten.SparseTensorWrapper(NMTensor.from_dense(torch.randn(8, 16), 2, 4)).to("meta")
    meta = lambda *s: torch.empty(s, device="meta")  # noqa: E731
    assert (w @ meta(16, 3)).shape == (8, 3)
    assert torch.mm(meta(3, 8), w).shape == (3, 16)
    assert torch.addmm(meta(16), meta(3, 8), w).shape == (3, 16)


@in_process
@requires_kernel
def test_autocast_on_meta():
    """The plugin's own products (registered with the extension) follow CPU autocast on meta too."""
    w = sten.SparseTensorWrapper(NMTensor.from_dense(torch.randn(8, 16), 2, 4)).to("meta")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.linear(torch.empty(3, 16, device="meta"), w).dtype == torch.bfloat16


@in_process
@requires_kernel   # (without the extension the products are STen's dense fallback: torch's own error)
@pytest.mark.parametrize("kind", LAYOUTS)
def test_meta_weight_with_cpu_input_is_a_clear_error(kind):
    layer = _linear(LAYOUTS[kind]).to("meta")
    with pytest.raises(ValueError, match="input must be on the meta device, as the weight is, got device cpu"):
        layer(torch.randn(3, IN))
    cpu = _linear(LAYOUTS[kind])
    with pytest.raises(ValueError, match="input must be on the CPU, got device meta"):
        cpu(torch.randn(3, IN, device="meta"))


def test_column_grouped_nnz_on_meta():
    """Known on meta when every row block is full; with a padded last block it depends on the
    columns' data: a NotImplementedError naming the meta device (repr shows ``nnz=?``)."""
    full = ColumnGroupedNMTensor.from_dense(torch.randn(16, IN), 2, 4)
    assert full.to("meta").nnz == full.nnz
    padded = ColumnGroupedNMTensor.from_dense(torch.randn(OUT + 1, IN), 2, 4).to("meta")
    assert "nnz=?" in repr(padded)
    with pytest.raises(NotImplementedError, match="nnz on the meta device"):
        padded.nnz


# -- to_empty / empty_like keep the layout ------------------------------------------------------
@in_process
@pytest.mark.parametrize("kind", LAYOUTS)
def test_meta_to_empty_round_trip_keeps_layout(kind):
    """Build on meta, ``to_empty(device="cpu")``: the layout class, a valid pattern (the
    validating constructor accepts it, at most n of every m), then a checkpoint loads exactly."""
    source = _linear(LAYOUTS[kind])
    state = source.state_dict()
    layer = _linear(LAYOUTS[kind]).to("meta").to_empty(device="cpu")
    layout = layer.weight.wrapped_tensor
    assert type(layout) is type(source.weight.wrapped_tensor) and layout.device.type == "cpu"
    assert layout.to_dense().shape == (OUT, IN)
    type(layout).from_state_tensors(layout.state_tensors(), tuple(layout.shape))   # checks the pattern
    assert bool((_kept_per_group(layout) <= layout.n).all())
    layer.load_state_dict(state)
    x = torch.randn(3, IN)
    torch.testing.assert_close(layer(x), source(x))


@pytest.mark.parametrize("kind", LAYOUTS)
def test_empty_like_keeps_layout_and_pattern(kind):
    w = sten.SparseTensorWrapper(LAYOUTS[kind](torch.randn(OUT, IN)))
    e = torch.empty_like(w)
    assert type(e.wrapped_tensor) is type(w.wrapped_tensor) and e.wrapped_tensor.same_pattern(w.wrapped_tensor)
    d = torch.empty_like(w, dtype=torch.float64, device="meta")
    assert type(d.wrapped_tensor) is type(w.wrapped_tensor) and d.device.type == "meta" and d.dtype == torch.float64


# -- torch.load(map_location="meta") ----------------------------------------------------------
@pytest.mark.parametrize("kind", LAYOUTS)
def test_load_onto_meta_names_layout(kind):
    """The pattern parameters (n, m, ...) are saved as tensor data, which a meta load does not
    read: a NotImplementedError naming the layout and the meta device (not torch's "Cannot copy
    out of meta tensor"); a CPU load then ``.to("meta")`` works."""
    w = sten.SparseTensorWrapper(LAYOUTS[kind](torch.randn(OUT, IN)))
    buf = io.BytesIO()
    torch.save({"w": w}, buf)
    name = type(w.wrapped_tensor).__name__
    buf.seek(0)
    with pytest.raises(NotImplementedError, match=f"{name} cannot be rebuilt on the meta device"):
        torch.load(buf, map_location="meta")
    buf.seek(0)
    moved = torch.load(buf, map_location="cpu")["w"].to("meta")
    assert type(moved.wrapped_tensor).__name__ == name and moved.device.type == "meta"
