"""The per-machine choice between the exact n:m kernel and decompress + dense GEMM:
timed once, cached on disk, visible, switchable off; both choices equal dense."""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten
from sten_nm import NMTensor, nm_linear, nm_matmul, tuning

from conftest import requires_kernel

pytestmark = requires_kernel


@pytest.fixture
def tune(monkeypatch, tmp_path):
    monkeypatch.setenv("STEN_NM_TUNE", "1")
    monkeypatch.setenv("STEN_NM_TUNE_CACHE", str(tmp_path / "tuning.json"))
    tuning.forget()
    yield tmp_path / "tuning.json"
    tuning.forget()


def test_choice_is_timed_once_cached_on_disk_and_visible(tune, monkeypatch):
    t = NMTensor.from_dense(torch.randn(64, 96), 2, 4)
    x = torch.randn(20, 96)
    y = nm_linear(x, t)
    torch.testing.assert_close(y, F.linear(x, t.to_dense()), rtol=1e-4, atol=1e-4)
    ch = tuning.choices()
    assert len(ch) == 1
    (k, v), = ch.items()
    assert k.startswith("fwd R=64 C=96 2:4 a_is_w=1 B~32 float32") and v["choice"] in ("kernel", "dense")
    assert set(v["ms"]) == {"kernel", "dense"}
    saved = json.loads(tune.read_text())
    assert saved["choices"][k]["choice"] == v["choice"] and saved["build"] == tuning.build()
    calls = []
    monkeypatch.setattr(tuning, "_best_time", lambda fn, reps: calls.append(1) or 1.0)
    nm_linear(torch.randn(31, 96), t)          # same bucket: no new timing
    assert not calls
    # a fresh process reads the choice from the cache file
    out = subprocess.run([sys.executable, "-m", "sten_nm.tuning"], capture_output=True, text=True,
                         env={**__import__("os").environ}, check=True).stdout
    assert k in json.loads(out)["choices"]


@pytest.mark.parametrize("choice", ["kernel", "dense"])
@pytest.mark.parametrize("dim", [0, 1])
def test_both_choices_equal_dense(tune, choice, dim):
    """Force each choice through the cache: F.linear, matmul and the input gradient agree with dense."""
    w = torch.randn(30, 44)
    t = NMTensor.from_dense(w, 1, 4, dim=dim)
    forced = {tuning.KERNEL: 1.0, tuning.DENSE: 1.0}
    forced[choice] = 0.0
    orig = tuning.choose
    tuning.choose = lambda k, cands, reps=3: min(forced, key=forced.get)
    try:
        x = torch.randn(9, 44, requires_grad=True)
        W = sten.SparseParameterWrapper(t)
        y = F.linear(x, W)
        y.backward(torch.ones_like(y))
        xr = x.detach().requires_grad_()
        yr = F.linear(xr, t.to_dense())
        yr.backward(torch.ones_like(yr))
        torch.testing.assert_close(y, yr, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-4)
        s = NMTensor.from_dense(torch.randn(44, 30), 1, 4, dim=dim)
        xs = torch.randn(5, 44)
        torch.testing.assert_close(nm_matmul(xs, s), xs @ s.to_dense(), rtol=1e-4, atol=1e-4)
        b = torch.randn(30)
        torch.testing.assert_close(nm_linear(xs, t, b), F.linear(xs, t.to_dense(), b), rtol=1e-4, atol=1e-4)
    finally:
        tuning.choose = orig


def test_tuning_off_means_kernel(monkeypatch, tmp_path):
    monkeypatch.setenv("STEN_NM_TUNE", "0")
    monkeypatch.setenv("STEN_NM_TUNE_CACHE", str(tmp_path / "t.json"))
    tuning.forget()
    t = NMTensor.from_dense(torch.randn(16, 32), 2, 4)
    nm_linear(torch.randn(4, 32), t)
    assert tuning.choices() == {} and not (tmp_path / "t.json").exists()


def test_unreadable_cache_is_ignored(tune):
    tune.write_text("not json")
    tuning._loaded_from = None   # as in a fresh process
    assert tuning.choices() == {}
    t = NMTensor.from_dense(torch.randn(16, 32), 2, 4)
    torch.testing.assert_close(nm_linear(torch.ones(2, 32), t), F.linear(torch.ones(2, 32), t.to_dense()))
    assert len(tuning.choices()) == 1


def test_cache_from_another_build_is_timed_afresh(tune, monkeypatch):
    """Choices timed with another kernel build or torch are stale (a faster variant, another
    dense GEMM): a file written by another build is ignored and rewritten by this one."""
    t = NMTensor.from_dense(torch.randn(16, 32), 2, 4)
    x = torch.ones(2, 32)
    nm_linear(x, t)
    (k,) = tuning.choices()
    other = "dense" if tuning.choices()[k]["choice"] == "kernel" else "kernel"
    stale = {k: {"choice": other, "ms": {"kernel": 1.0, "dense": 1.0}}}
    timed = []
    best_time = tuning._best_time
    monkeypatch.setattr(tuning, "_best_time", lambda fn, reps: timed.append(1) or best_time(fn, reps))
    for written in ({"build": "kernel 000000000000, torch 1.0", "choices": stale}, stale):  # old build / old format
        tune.write_text(json.dumps(written))
        tuning._loaded_from = None   # as in a fresh process
        assert tuning.choices() == {} and tuning.status(k) == "not tuned yet"
        timed.clear()
        torch.testing.assert_close(nm_linear(x, t), F.linear(x, t.to_dense()))
        assert timed and json.loads(tune.read_text())["build"] == tuning.build()


def test_build_names_the_kernel_digest_and_torch():
    from sten_nm import _kernel

    assert tuning.build() == f"kernel {_kernel.build_id()}, torch {torch.__version__}"
    assert len(_kernel.build_id()) == 12


def test_batch_bucket():
    assert [tuning.batch_bucket(b) for b in (0, 1, 2, 3, 1000, 1024, 1025)] == [1, 1, 2, 4, 1024, 1024, 2048]


BACKWARD_LAYOUTS = {
    "exact": lambda w: NMTensor.from_dense(w, 2, 4),
    "exact dim=0": lambda w: NMTensor.from_dense(w, 1, 4, dim=0),
    "grouped": lambda w: __import__("sten_nm").GroupedNMTensor.from_dense(w, 2, 4),
    "paper": lambda w: __import__("sten_nm").ColumnGroupedNMTensor.from_dense(w, 2, 4),
}


@pytest.mark.parametrize("choice", ["kernel", "dense", "scatter", "exact"])
@pytest.mark.parametrize("sparse_grad", [True, False])
@pytest.mark.parametrize("layout", list(BACKWARD_LAYOUTS))
def test_backward_both_choices_equal_dense(tune, layout, choice, sparse_grad, monkeypatch):
    """Each gradient's choice forced (the input's and the weight's at the kept positions;
    ``scatter`` where a product X = Y A offers it, ``exact`` where the paper format offers
    exact n:m's kernels, else the first candidate, as for the paper format's forward loop
    order): F.linear and, for exact n:m, a product with the n:m operand on the right, against
    dense autograd (forwards included)."""
    asked, offered = [], set()

    def choose(k, cands, reps=3):
        asked.append(k.split()[0])
        offered.update(cands)
        return choice if choice in cands else next(iter(cands))

    monkeypatch.setattr(tuning, "choose", choose)
    torch.manual_seed(0)
    t = BACKWARD_LAYOUTS[layout](torch.randn(22, 40))
    cls = type(t)
    fmt = (sten.KeepAll(), cls, sten.KeepAll(), cls) if sparse_grad else None
    bias = torch.randn(22)
    products = [(t, lambda x, W: F.linear(x, W, bias), lambda x, D: F.linear(x, D, bias))]
    if cls is NMTensor:   # x @ S: the n:m operand [K, N] on the right
        s = NMTensor.from_dense(torch.randn(40, 22), 1, 4, dim=t.dim)
        products.append((s, lambda x, W: torch.matmul(x, W), lambda x, D: x @ D))
    for layout_t, op, ref in products:
        W = sten.SparseParameterWrapper(layout_t, grad_fmt=fmt)
        x = torch.randn(7, 40, requires_grad=True)
        y = op(x, W)
        gy = torch.randn_like(y)
        y.backward(gy)
        xr, wr = x.detach().requires_grad_(), layout_t.to_dense().requires_grad_()
        yr = ref(xr, wr)
        yr.backward(gy)
        torch.testing.assert_close(y, yr, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-4)
        gw = W.grad.wrapped_tensor.to_dense() if sparse_grad else W.grad
        torch.testing.assert_close(gw, wr.grad * layout_t.mask() if sparse_grad else wr.grad, rtol=1e-4, atol=1e-4)
    want = {"exact": {"bwd_x"}, "grouped": {"grouped_bwd_x"}, "paper": {"cg_bwd_x"}}[layout.split()[0]]
    if sparse_grad:
        want |= {w.replace("_x", "_w") for w in want}
    assert want <= set(asked)
    assert ("scatter" in offered) == (cls is NMTensor)   # exact n:m: a transposed product in every case
    assert ("exact" in offered) == (layout == "paper")


@pytest.mark.parametrize("layout", list(BACKWARD_LAYOUTS))
def test_backward_choices_agree_under_autocast(tune, layout, monkeypatch):
    """A backward run inside CPU autocast: the dense routes compute in float32 as the kernels
    do, so the gradients do not depend on which one tuning picked (bf16 GEMMs differed by ~3e-3)."""
    grads = {}
    for choice in ("kernel", "dense"):
        monkeypatch.setattr(tuning, "choose", lambda k, cands, reps=3: choice if choice in cands else next(iter(cands)))
        torch.manual_seed(0)
        t = BACKWARD_LAYOUTS[layout](torch.randn(64, 96))
        cls = type(t)
        W = sten.SparseParameterWrapper(t, grad_fmt=(sten.KeepAll(), cls, sten.KeepAll(), cls))
        x = torch.randn(32, 96, requires_grad=True)
        y = F.linear(x, W)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y.backward(torch.randn_like(y))
        grads[choice] = (x.grad, W.grad.wrapped_tensor.to_dense())
    for a, b in zip(grads["kernel"], grads["dense"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_paper_format_backward_choice_is_cached(tune):
    from sten_nm import ColumnGroupedNMTensor

    t = ColumnGroupedNMTensor.from_dense(torch.randn(22, 40), 2, 4)
    W = sten.SparseParameterWrapper(t, grad_fmt=(sten.KeepAll(), ColumnGroupedNMTensor, sten.KeepAll(),
                                                 ColumnGroupedNMTensor))
    x = torch.randn(7, 40, requires_grad=True)
    F.linear(x, W).sum().backward()
    # each gradient by its own choice: the input's and the values'
    assert [k for k in tuning.choices() if k.startswith("cg_bwd_x R=22 C=40 2:4")]
    assert [k for k in tuning.choices() if k.startswith("cg_bwd_w R=22 C=40 2:4")]


def test_explain_shows_the_tuning_choice(tune, monkeypatch):
    """``sten explain`` names the chosen kernel: tuned on the first call, cached after it,
    and tuning turned off by the environment variable; ``status`` tells it without a call."""
    t = sten.SparseParameterWrapper(NMTensor.from_dense(torch.randn(32, 64), 2, 4))
    x = torch.randn(5, 64, requires_grad=True)
    k = tuning.key("fwd", 32, 64, 2, 4, True, 5, "float32", torch.get_num_threads(), sten_nm_isa())
    assert tuning.status(k) == "not tuned yet"
    with sten.explain() as report:
        F.linear(x, t).sum().backward()
    fwd, bwd = report.rows
    (text,) = fwd.notes
    assert text.startswith(f"sten_nm {k}: ") and "tuned on this call" in text
    assert any(n.startswith("sten_nm bwd_x R=32 C=64 2:4") for n in bwd.notes)
    choice = tuning.choices()[k]["choice"]
    assert tuning.status(k).startswith(f"{choice} (cached; ")
    with sten.explain() as report:
        F.linear(x, t)
    assert list(report.rows[0].notes) == [f"sten_nm {k}: {choice} (cached; " + text.split("(tuned on this call; ")[1]]
    assert f"chose: sten_nm {k}: {choice} (cached" in str(report)
    monkeypatch.setenv("STEN_NM_TUNE", "0")
    with sten.explain() as report:
        F.linear(x, t)
    assert list(report.rows[0].notes) == [f"sten_nm {k}: tuning off via STEN_NM_TUNE=0: kernel"]
    assert tuning.status(k) == "tuning off via STEN_NM_TUNE=0: kernel"


def sten_nm_isa() -> str:
    from sten_nm import _kernel

    return _kernel.isa()


def test_default_cache_file_is_per_cpu_model(monkeypatch, tmp_path):
    monkeypatch.delenv("STEN_NM_TUNE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(tuning, "cpu_model", lambda: "AMD EPYC (family 23 model 1)")
    zen1 = tuning.cache_path()
    monkeypatch.setattr(tuning, "cpu_model", lambda: "AMD EPYC (family 26 model 2)")
    zen5 = tuning.cache_path()
    assert zen1 != zen5 and all(p.startswith(str(tmp_path / ".cache" / "sten_nm")) for p in (zen1, zen5))
    assert "family-23-model-1" in zen1
    monkeypatch.setenv("STEN_NM_TUNE_CACHE", str(tmp_path / "mine.json"))
    assert tuning.cache_path() == str(tmp_path / "mine.json")


@pytest.mark.parametrize("vdtype", [torch.float32, torch.bfloat16])
def test_paper_format_bf16_x_widened_is_tuned_over_loop_orders(tune, vdtype):
    """bf16 x read by the widening path (fp32 values, or the vdpbf16ps path off) picks its loop
    order like float32 x, under its own key, and equals the product of the widened operands."""
    from sten_nm import ColumnGroupedNMTensor, _bf16x
    from sten_nm.column_grouped_ops import column_grouped_linear

    t = ColumnGroupedNMTensor.from_dense(torch.randn(26, 300).to(vdtype), 1, 4)
    x = torch.randn(40, 300).bfloat16()
    before = _bf16x.bf16_dot_enabled()
    _bf16x.set_bf16_dot(False)
    try:
        y = column_grouped_linear(x, t)
    finally:
        _bf16x.set_bf16_dot(before)
    ref = F.linear(x.double(), t.to_dense().double())
    torch.testing.assert_close(y.double(), ref, rtol=1e-2 if y.dtype == torch.bfloat16 else 1e-5, atol=1e-2)
    keys = [k for k in tuning.choices() if k.startswith("cg_fwd R=26 C=300 1:4")]
    assert len(keys) == 1 and "x=bfloat16" in keys[0]
    assert tuning.choices()[keys[0]]["choice"] in ("stream", "tiled")


def test_tuning_is_off_under_fake_tensors_and_while_compiling(tune):
    """Fake tensors cannot be timed: tuning says why it is off under a FakeTensorMode (also
    one entered inside another mode) and in code torch.compile traces, on again after."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    assert tuning.off_reason() is None
    with FakeTensorMode():
        assert tuning.off_reason() == "tuning off while torch.compile/export traces"
        with TorchDispatchMode():
            assert not tuning.enabled()
    assert tuning.enabled()

    def f(x):
        return x + (1.0 if tuning.enabled() else 2.0)

    torch._dynamo.reset()
    x = torch.zeros(3)
    assert torch.compile(f, backend="eager")(x).tolist() == [2.0] * 3
    assert f(x).tolist() == [1.0] * 3
