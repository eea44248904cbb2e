"""``torch.compile`` of a whole training step (``opt.zero_grad()``, forward, ``loss.backward()``,
``opt.step()``) and of ``opt.step`` alone, over traceable sparse weights.

Both used to fail inside Dynamo for every traceable layout: the optimizer's in-place updates of a
weight that is a graph input raised ``UnsupportedTrainingOp`` inside fake-tensor propagation
(``TorchRuntimeError``), and the wrappers' eager code that runs after a graph break
(``loss.backward()``'s gradient accumulation, a compiled graph's wrapper outputs) was compiled as
frames of their own (``'dict' object has no attribute 'node'``, no ``_cell``). Now the optimizer's
calls on a trainable weight run the eager dispatcher after a graph break, so the compiled step ends
with eager's weights, pattern and optimizer state, equal to a dense model masked after each step.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable

import pytest
import torch

import sten_core as sten
from sten_core.model import torch_support
from sten_core.model.masks import stored_mask

pytestmark = pytest.mark.skipif(
    not torch_support.TRACEABLE_WRAPPERS,
    reason=f"traceable wrappers are off on torch {torch.__version__} (sten_core.model.torch_support)")

IN, OUT, STEPS = 32, 16, 3


def _plugin(module: str) -> Any:
    """The plugin module, or a skip naming why it cannot be imported."""
    try:
        return importlib.import_module(module)
    except Exception as e:  # an unavailable plugin: its layouts are skipped with the reason
        pytest.skip(f"{module} is not importable here: {type(e).__name__}: {e}")


def _masked(dense: torch.Tensor) -> torch.Tensor:
    keep = torch.rand(dense.shape, generator=torch.Generator().manual_seed(1)) > 0.5
    return dense * keep


def _block(dense: torch.Tensor) -> Any:
    mod = _plugin("sten_cuda24")
    keep = torch.zeros(-(-dense.shape[0] // 16), -(-dense.shape[1] // 16), dtype=torch.bool)
    keep.view(-1)[::2] = True
    return mod.BlockSparseTensor.from_dense_block_mask(dense, keep, (16, 16))


MAKERS: dict[str, Callable[[torch.Tensor], Any]] = {
    "CsrTensor": lambda d: sten.CsrTensor.from_dense(_masked(d)),
    "CscTensor": lambda d: sten.CscTensor.from_dense(_masked(d)),
    "NMTensor": lambda d: _plugin("sten_nm").NMTensor.from_dense(d, n=2, m=4),
    "GroupedNMTensor": lambda d: _plugin("sten_nm").GroupedNMTensor.from_dense(d, n=2, m=4),
    "ColumnGroupedNMTensor": lambda d: _plugin("sten_nm").ColumnGroupedNMTensor.from_dense(d, n=2, m=4),
    "ScipyCsrTensor": lambda d: _plugin("sten_scipy").ScipyCsrTensor.from_dense(_masked(d)),
    "ScipyCscTensor": lambda d: _plugin("sten_scipy").ScipyCscTensor.from_dense(_masked(d)),
    "Sparse24Tensor": lambda d: _plugin("sten_cuda24").sparsify_24(d),
    "BlockSparseTensor": _block,
}
"""Layout name -> ``make(dense)``: the core's traceable layouts and each plugin's."""

OPTIMIZERS: dict[str, Callable[[list], torch.optim.Optimizer]] = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.05),
    "SGD-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
}
MORE_OPTIMIZERS: dict[str, Callable[[list], torch.optim.Optimizer]] = {
    "SGD-foreach": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=True),
    "Adam-foreach": lambda p: torch.optim.Adam(p, lr=0.01, foreach=True),
    "AdamW-amsgrad": lambda p: torch.optim.AdamW(p, lr=0.01, amsgrad=True),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01),
}
OPTIMIZERS.update(MORE_OPTIMIZERS)


def _grad_fmt(kind: str, layout_cls: type) -> Any:
    return (sten.KeepAll(), layout_cls, sten.KeepAll(), layout_cls) if kind == "keep" else None


def _model(layout: str, grad_fmt: str) -> torch.nn.Linear:
    torch.manual_seed(0)
    lin = torch.nn.Linear(IN, OUT)
    made = MAKERS[layout](lin.weight.detach().clone())
    lin.weight = sten.SparseParameterWrapper(made, grad_fmt=_grad_fmt(grad_fmt, type(made)))
    return lin


def _dense_twin(lin: torch.nn.Linear) -> tuple[torch.nn.Linear, torch.Tensor]:
    """A dense ``Linear`` with ``lin``'s values and the mask of ``lin``'s stored positions."""
    dense = torch.nn.Linear(IN, OUT)
    with torch.no_grad():
        dense.weight.copy_(lin.weight.to_dense())
        dense.bias.copy_(lin.bias)
    return dense, stored_mask(lin.weight)


def _inputs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randn(8, IN, generator=gen) for _ in range(STEPS)]


def _step_fn(lin: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[[torch.Tensor], torch.Tensor]:
    def train_step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = lin(x).square().mean()
        loss.backward()
        opt.step()
        return loss

    return train_step


def _run(layout: str, grad_fmt: str, opt_name: str, mode: str,
         backend: Any = "inductor") -> tuple[torch.nn.Linear, torch.optim.Optimizer, list]:
    """``STEPS`` training steps: ``mode`` "eager", "whole" (the step compiled) or "step" (only
    ``opt.step`` compiled), with ``backend``. Returns the model, its optimizer and the losses."""
    torch._dynamo.reset()
    lin = _model(layout, grad_fmt)
    opt = OPTIMIZERS[opt_name](list(lin.parameters()))
    losses = []
    step = _step_fn(lin, opt)
    if mode == "whole":
        step = torch.compile(step, backend=backend)
    compiled_opt_step = torch.compile(opt.step, backend=backend) if mode == "step" else None
    for x in _inputs():
        if compiled_opt_step is None:
            losses.append(step(x).detach())
            continue
        opt.zero_grad()
        loss = lin(x).square().mean()
        loss.backward()
        compiled_opt_step()
        losses.append(loss.detach())
    return lin, opt, losses


def _dense_reference(layout: str, grad_fmt: str, opt_name: str) -> tuple[torch.nn.Linear, torch.optim.Optimizer, torch.Tensor]:
    """The same steps on a dense model whose weight is masked to the stored positions after each step."""
    dense, mask = _dense_twin(_model(layout, grad_fmt))
    opt = OPTIMIZERS[opt_name](list(dense.parameters()))
    for x in _inputs():
        opt.zero_grad()
        dense(x).square().mean().backward()
        opt.step()
        with torch.no_grad():
            dense.weight.mul_(mask)
    return dense, opt, mask


def _dense(value: Any) -> torch.Tensor:
    return value.to_dense() if isinstance(value, sten.SparseTensorWrapper) else value


def _layout_name(value: Any) -> str:
    return type(value.wrapped_tensor).__name__ if isinstance(value, sten.SparseTensorWrapper) else "dense"


def _check_state(got: torch.optim.Optimizer, want: torch.optim.Optimizer, weight: Any, want_weight: Any) -> None:
    """``got``'s state of ``weight`` equals ``want``'s of ``want_weight``: keys, layouts and values."""
    a, b = got.state[weight], want.state[want_weight]
    assert sorted(a) == sorted(b)
    for key in a:
        assert _layout_name(a[key]) == _layout_name(b[key]), key
        torch.testing.assert_close(_dense(a[key]), _dense(b[key]), msg=f"optimizer state {key!r}")


def _check_against_eager(layout: str, grad_fmt: str, opt_name: str, mode: str, backend: Any = "inductor") -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager, eager_opt, eager_losses = _run(layout, grad_fmt, opt_name, "eager")
        got, got_opt, got_losses = _run(layout, grad_fmt, opt_name, mode, backend)
        dense, dense_opt, mask = _dense_reference(layout, grad_fmt, opt_name)
    torch.testing.assert_close(torch.stack(got_losses), torch.stack(eager_losses))
    assert type(got.weight.wrapped_tensor) is type(eager.weight.wrapped_tensor)
    assert torch.equal(stored_mask(got.weight), mask), "the compiled step changed the weight's pattern"
    torch.testing.assert_close(got.weight.to_dense(), eager.weight.to_dense())
    torch.testing.assert_close(got.bias, eager.bias)
    _check_state(got_opt, eager_opt, got.weight, eager.weight)
    _check_state(got_opt, eager_opt, got.bias, eager.bias)
    torch.testing.assert_close(got.weight.to_dense(), dense.weight.detach())   # the dense masked model
    torch.testing.assert_close(got.bias, dense.bias)
    for key, value in got_opt.state[got.weight].items():
        want = dense_opt.state[dense.weight][key]
        torch.testing.assert_close(_dense(value) * mask if value.dim() else value,
                                   want * mask if want.dim() else want, msg=f"state {key!r} vs dense")


CORE = ("CsrTensor", "CscTensor")
PLUGIN_LAYOUTS = ("NMTensor", "GroupedNMTensor", "ColumnGroupedNMTensor", "ScipyCsrTensor", "ScipyCscTensor",
                  "Sparse24Tensor", "BlockSparseTensor")


@pytest.mark.parametrize("grad_fmt", ("none", "keep"))
@pytest.mark.parametrize("opt_name", ("SGD", "SGD-momentum", "Adam", "AdamW"))
@pytest.mark.parametrize("layout", CORE)
def test_compiled_training_step_matches_eager_core(layout, opt_name, grad_fmt):
    _check_against_eager(layout, grad_fmt, opt_name, "whole")


@pytest.mark.parametrize("grad_fmt", ("none", "keep"))
@pytest.mark.parametrize("opt_name", ("SGD-momentum", "AdamW"))
@pytest.mark.parametrize("layout", PLUGIN_LAYOUTS)
def test_compiled_training_step_matches_eager_plugins(layout, opt_name, grad_fmt):
    _check_against_eager(layout, grad_fmt, opt_name, "whole")


@pytest.mark.parametrize("grad_fmt", ("none", "keep"))
@pytest.mark.parametrize("opt_name", ("SGD", "SGD-momentum", "Adam", "AdamW"))
@pytest.mark.parametrize("layout", ("CsrTensor", "NMTensor"))
def test_compiled_optimizer_step_alone_matches_eager(layout, opt_name, grad_fmt):
    _check_against_eager(layout, grad_fmt, opt_name, "step")


@pytest.mark.parametrize("mode", ("whole", "step"))
@pytest.mark.parametrize("opt_name", tuple(MORE_OPTIMIZERS))
def test_foreach_amsgrad_and_rmsprop_steps_match_eager(opt_name, mode):
    _check_against_eager("CsrTensor", "keep", opt_name, mode)


@pytest.mark.parametrize("backend", ("eager", "aot_eager"))
@pytest.mark.parametrize("grad_fmt", ("none", "keep"))
def test_debug_backends_match_eager(grad_fmt, backend):
    """``backend="eager"`` runs the forward graph eagerly, so ``loss.backward()`` runs STen's eager
    backward from a graph break (Dynamo compiled its frames: ``IndexError`` in ``pgo``)."""
    _check_against_eager("CsrTensor", grad_fmt, "Adam", "whole", backend)


@pytest.mark.parametrize("grad_fmt", ("none", "keep"))
def test_the_compiled_step_runs_the_layouts_kernel(grad_fmt):
    """The forward and backward still compile, with CSR's own kernels on the weight's members
    (``sten_core::wrapper_linear`` below the subclass); only the optimizer's calls on the weight
    run eagerly."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def record(gm: torch.fx.GraphModule, inputs: list) -> Callable:
        graphs.append(str(gm.graph))
        return gm.forward

    torch._dynamo.reset()
    lin = _model("CsrTensor", grad_fmt)
    step = torch.compile(_step_fn(lin, torch.optim.Adam(lin.parameters(), lr=0.01)),
                         backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(_inputs()[0])
    assert any("sten_core.csr_mm." in g for g in graphs), graphs
    if grad_fmt == "keep":  # the values' gradient at the pattern
        assert any("sten_core.csr_sampled." in g for g in graphs), graphs


def _sgd_update(lin: torch.nn.Linear, g: torch.Tensor) -> None:
    with torch.no_grad():
        lin.weight.add_(g, alpha=-0.1)


def test_an_in_place_write_on_a_trainable_weight_names_the_op_and_layout_under_fullgraph():
    """``fullgraph=True`` refuses the graph break with STen's reason (the operator, the layout and
    what to do); without it the write runs eagerly, at the stored positions."""
    lin = _model("CsrTensor", "none")
    with pytest.raises(Exception, match=r"add_ on a CsrTensor wrapper runs eagerly.*call opt.step\(\) after it"):
        torch.compile(lambda g: _sgd_update(lin, g), fullgraph=True)(torch.ones(OUT, IN))
    torch._dynamo.reset()
    want = lin.weight.to_dense() - 0.1 * stored_mask(lin.weight)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.compile(lambda g: _sgd_update(lin, g))(torch.ones(OUT, IN))
    torch.testing.assert_close(lin.weight.to_dense(), want)
