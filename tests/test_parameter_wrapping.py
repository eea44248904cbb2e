"""A sparse weight as ``torch.nn.utils`` and ``copy`` handle parameters: ``nn.Parameter(p)`` of a
sparse parameter (what ``parametrize`` and ``weight_norm`` do), deep copies and pickles of
``nn.Parameter(wrapper)``, ``detach()`` keeping the gradient format, and ``torch.func``
transforms / forward-mode AD naming STen when they cannot run.

Before: ``nn.Parameter(p)`` raised "detach() returns an instance of another type" (so
``weight_norm`` on a sparse weight crashed); a deep copy or pickle of ``nn.Parameter(wrapper)``
was no parameter (``AveragedModel``, ``copy.deepcopy(model)``: re-assigning it raised
``TypeError``); an eager-class wrapper's ``detach()`` (COO, ``DenseTensor``) dropped its
``grad_fmt`` where a traceable one (CSR) kept it; ``vmap`` / ``torch.func.grad`` / forward AD
raised torch's messages about a private ``autograd.Function``."""

import copy
import io
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F

import sten_core as sten

LAYOUTS = [sten.CsrTensor, sten.CscTensor, sten.CooTensor, sten.DenseTensor]


def masked(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * (torch.rand(*shape, generator=g) > 0.5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_parameter_of_a_sparse_parameter_is_a_parameter_of_the_same_weight(layout):
    fmt = (sten.KeepAll(), layout, sten.KeepAll(), layout)
    p = sten.SparseParameterWrapper(layout.from_dense(masked((3, 4))), grad_fmt=fmt)
    q = torch.nn.Parameter(p)
    assert isinstance(q, torch.nn.Parameter) and q.requires_grad
    assert q.grad_fmt == fmt and q.wrapped_tensor is p.wrapped_tensor
    d = p.detach()
    assert not d.requires_grad and d.grad_fmt == fmt and not isinstance(d, torch.nn.Parameter)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_weight_norm_on_a_sparse_weight_equals_dense(layout):
    dense, x = masked((4, 6), 1), torch.randn(3, 6)
    runs = []
    for sparse in (True, False):
        torch.manual_seed(0)
        lin = torch.nn.Linear(6, 4)
        if sparse:
            lin.weight = sten.SparseParameterWrapper(layout.from_dense(dense))
        else:
            lin.weight.data = dense.clone()
        torch.nn.utils.parametrizations.weight_norm(lin)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", sten.DispatchWarning)
            y = lin(x)
            y.square().sum().backward()
        g, v = lin.parametrizations.weight.original0, lin.parametrizations.weight.original1
        runs.append((y, g.grad, v.grad.to_dense() if isinstance(v.grad, sten.SparseTensorWrapper) else v.grad))
    for got, want in zip(*runs):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_of_a_parameter_made_from_a_wrapper_are_parameters(layout, how):
    p = torch.nn.Parameter(sten.SparseTensorWrapper(layout.from_dense(masked((3, 3)))))
    if how == "deepcopy":
        q = copy.deepcopy(p)
    elif how == "pickle":
        q = pickle.loads(pickle.dumps(p))
    else:
        buf = io.BytesIO()
        torch.save(p, buf)
        buf.seek(0)
        q = torch.load(buf, weights_only=True)
    assert isinstance(q, torch.nn.Parameter) and q.requires_grad
    assert torch.equal(q.to_dense(), p.to_dense())
    m = torch.nn.Linear(3, 3)
    m.weight = q   # a module takes it as a parameter (it raised TypeError)
    assert any(t is q for t in m.parameters())


def test_frozen_sparse_weights_run_under_vmap():
    w = sten.SparseTensorWrapper(sten.CsrTensor.from_dense(masked((4, 6))))
    x = torch.randn(5, 6)
    torch.testing.assert_close(torch.func.vmap(lambda v: F.linear(v, w))(x), F.linear(x, w.to_dense()))


@pytest.mark.parametrize("transform", ["vmap", "grad", "jacfwd", "forward AD"])
def test_transforms_over_a_trainable_sparse_weight_name_sten(transform):
    w = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(masked((4, 6))))
    x = torch.randn(2, 6)
    runs = {
        "vmap": lambda: torch.func.vmap(lambda v: F.linear(v, w))(x),
        "grad": lambda: torch.func.grad(lambda v: F.linear(v, w).sum())(x),
        "jacfwd": lambda: torch.func.jacfwd(lambda v: F.linear(v, w))(x),
    }
    with pytest.raises(NotImplementedError, match=r"STen: torch.nn.functional.linear .*\(CsrTensor\)"):
        if transform == "forward AD":
            import torch.autograd.forward_ad as fwAD

            with fwAD.dual_level():
                F.linear(fwAD.make_dual(x, torch.ones_like(x)), w)
        else:
            runs[transform]()


def test_state_dict_entries_load_as_tensors_and_a_saved_parameter_as_a_parameter():
    """As for dense: ``state_dict()`` holds detached tensors (no parameters), a saved parameter
    loads as one."""
    m = torch.nn.Linear(4, 3)
    m.weight = sten.SparseParameterWrapper(sten.CsrTensor.from_dense(masked((3, 4))))
    for value, is_param in ((m.state_dict(), False), (m.weight, True)):
        buf = io.BytesIO()
        torch.save(value, buf)
        buf.seek(0)
        loaded = torch.load(buf)
        loaded = loaded["weight"] if isinstance(loaded, dict) else loaded
        assert isinstance(loaded, torch.nn.Parameter) is is_param
        assert torch.equal(loaded.to_dense(), m.weight.to_dense())
