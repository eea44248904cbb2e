"""Shared helpers: the plugin registered (installed or not), sample tensors,
and a dense-reference check of values and gradients."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch

import sten_core as sten
from sten_scipy import ScipyCscTensor, ScipyCsrTensor

LAYOUTS = (ScipyCsrTensor, ScipyCscTensor)
TOL = {"rtol": 1e-4, "atol": 1e-5}


def _ensure_plugin() -> None:
    sten.plugins.ensure_loaded()
    if "ScipyCsrTensor" not in sten.registry.layouts:  # not installed: register it directly
        from sten_scipy import plugin

        sten.plugins.register_plugin(plugin, name="scipy")


_ensure_plugin()


@pytest.fixture(autouse=True)
def no_fallbacks():
    """Every test runs with dense fallbacks turned into errors."""
    sten.set_dispatch_failure("raise")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's "sparse CSR is beta" notices
        yield
    sten.set_dispatch_failure("warn")


def sample(shape: tuple, dtype: torch.dtype = torch.float32, fraction: float = 0.5, seed: int = 0) -> torch.Tensor:
    """A dense tensor with about ``fraction`` zeros."""
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    return dense * (torch.rand(shape, generator=gen) >= fraction)


def sparse_param(layout: type, dense: torch.Tensor, grad_fmt: Any = None) -> sten.SparseParameterWrapper:
    return sten.SparseParameterWrapper(layout.from_dense(dense), grad_fmt=grad_fmt)


def sparse_fmt(layout: type) -> tuple:
    """A grad_fmt asking for the gradient in ``layout`` at the kept positions."""
    return (sten.KeepAll(), layout, sten.KeepAll(), layout)


def dense_of(value: Any) -> Any:
    return value.to_dense() if isinstance(value, sten.SparseTensorWrapper) else value


def check_against_dense(fn: Callable, args: list, ref_args: list | None = None, masks: dict | None = None,
                        tol: dict | None = None, ref_fn: Callable | None = None) -> Any:
    """Run ``fn`` on ``args`` (wrappers and tensors) and on their dense copies;
    compare the outputs and every gradient. ``masks[i]`` restricts the
    comparison of argument ``i``'s gradient to its kept positions (sparse grad_fmt);
    ``ref_fn`` (default ``fn``) computes the reference."""
    tol = tol or TOL
    masks = masks or {}
    if ref_args is None:
        ref_args = [dense_of(a).detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                    for a in args]
    out = fn(*args)
    ref = (ref_fn or fn)(*ref_args)
    torch.testing.assert_close(dense_of(out), ref, **tol)
    if not ref.requires_grad:
        return out
    gen = torch.Generator().manual_seed(7)
    g = torch.randn(ref.shape, generator=gen, dtype=torch.float64).to(ref.dtype)
    out.backward(g)
    ref.backward(g)
    for i, (a, r) in enumerate(zip(args, ref_args)):
        if not (isinstance(a, torch.Tensor) and a.requires_grad):
            continue
        assert a.grad is not None, f"argument {i} got no gradient"
        got = dense_of(a.grad)
        want = r.grad if r.grad is not None else torch.zeros_like(r)
        if i in masks:
            want = want * masks[i]
            assert isinstance(a.grad, sten.SparseTensorWrapper), f"argument {i}: expected a sparse gradient"
        torch.testing.assert_close(got, want, msg=lambda m: f"gradient of argument {i}: {m}", **tol)
    return out
