"""Bad input gets a clear ValueError / TypeError naming the argument."""

from __future__ import annotations

import pytest
import torch

import sten_core as sten

T = torch.Tensor


def test_unknown_layout_lists_the_known_ones():
    sten.plugins.ensure_loaded()
    with pytest.raises(ValueError, match=r"unknown layout 'nope'.*CsrTensor"):
        sten.registry.layout("nope")


@pytest.mark.parametrize("bad", [sten.ScalarFractionSparsifier, None,
                                 "magnitude",
                                 0.5])
def test_unknown_or_uninstantiated_sparsifier(bad):
    sten.set_dispatch_failure("raise")  # never a silent dense fallback here
    try:
        with pytest.raises(TypeError, match="sparsifier"):
            sten.sparsify(bad, torch.ones(2, 2), sten.CsrTensor)
    finally:
        sten.set_dispatch_failure("warn")


@pytest.mark.parametrize("bad", ["CsrTensor", None, sten.CsrTensor.from_dense(torch.eye(2))])
def test_bad_out_format(bad):
    with pytest.raises(TypeError, match="out_format"):
        sten.sparsify(sten.KeepAll(), torch.ones(2, 2), bad)


def test_wrong_pattern_arity_names_inp_and_the_signature():
    with pytest.raises(ValueError, match=r"inp has 5 entries but torch.add takes 4 arguments \(input, other, alpha, out\)"):
        sten.register_fwd_op_impl(torch.add, inp=(T, T, T, T, T))(lambda ctx, inputs, sp: None)
    with pytest.raises(ValueError, match="inp has 5 entries"):
        sten.register_bwd_op_impl(torch.add, grad_out=(T,), grad_inp=((sten.KeepAll, T),), inp=(T, T, T, T, T))(
            lambda ctx, g, sp: None)


def test_pattern_entries_must_be_layout_classes():
    with pytest.raises(TypeError, match=r"inp\[1\]"):
        sten.register_fwd_op_impl(torch.add, inp=(T, "CsrTensor"))(lambda ctx, inputs, sp: None)
    with pytest.raises(TypeError, match="operator"):
        sten.register_fwd_op_impl("torch.add", inp=(T, T))(lambda ctx, inputs, sp: None)


@pytest.mark.parametrize("fraction", [-0.1, 1.5, float("nan"), float("inf")])
@pytest.mark.parametrize("make", [
    sten.RandomFractionSparsifier,
    sten.ScalarFractionSparsifier,
    lambda f: sten.BlockwiseFractionSparsifier(f, (2, 2)),
])
def test_fraction_outside_unit_interval(make, fraction):
    with pytest.raises(ValueError, match=r"fraction must be in \[0, 1\]"):
        make(fraction)


@pytest.mark.parametrize("fraction", ["0.5", None, True])
def test_fraction_of_wrong_type(fraction):
    with pytest.raises(TypeError, match="fraction"):
        sten.ScalarFractionSparsifier(fraction)


def test_helper_fraction_is_checked():
    with pytest.raises(ValueError, match="frac"):
        sten.random_mask_sparsify(torch.ones(2), frac=2.0)


def test_n_greater_than_m():
    with pytest.raises(ValueError, match="n must be <= m"):
        sten.PerBlockFractionSparsifier(5, 4)
    with pytest.raises(ValueError, match="m"):
        sten.PerBlockFractionSparsifier(0, 0)
    with pytest.raises(TypeError, match="n must be an int"):
        sten.PerBlockFractionSparsifier(2.0, 4)


def test_bad_block_shape():
    with pytest.raises(ValueError, match="block_shape"):
        sten.BlockwiseFractionSparsifier(0.5, (0, 2))
    with pytest.raises(ValueError, match="block_shape"):
        sten.BlockwiseFractionSparsifier(0.5, ())


@pytest.mark.parametrize("bad", ["x", 2.5, None, (2, "x"), (True, 2)])
def test_block_shape_of_wrong_type(bad):
    """A float or ``None`` raised ``'float' object is not iterable``; a string was split into
    characters and rejected as a ValueError."""
    with pytest.raises(TypeError, match="^block_shape must be an int or a tuple of ints, got "):
        sten.BlockwiseFractionSparsifier(0.5, bad)


def test_threshold_must_be_a_number():
    with pytest.raises(TypeError, match="threshold"):
        sten.ScalarThresholdSparsifier("1")


@pytest.mark.parametrize("value", [[1, 2], (1.0,), 3.0, None])
def test_non_tensor_to_sparsify(value):
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor"):
        sten.sparsify(sten.KeepAll(), value, sten.CsrTensor)


def test_non_tensor_to_helpers():
    with pytest.raises(TypeError, match="tensor"):
        sten.random_mask_sparsify([1.0, 2.0], frac=0.5)
    with pytest.raises(TypeError, match="tensor"):
        sten.scalar_mask_sparsify([1.0, 2.0], frac=0.5)


def test_wrapper_of_a_plain_tensor():
    with pytest.raises(TypeError, match="wrapped_tensor must be a layout object"):
        sten.SparseTensorWrapper(torch.ones(2))


@pytest.mark.parametrize("make", [sten.SparseTensorWrapper, sten.SparseParameterWrapper,
                                  lambda v: sten.SparseTensorWrapper.wrapped_from_dense(v, torch.ones(2))],
                         ids=["SparseTensorWrapper", "SparseParameterWrapper", "wrapped_from_dense"])
@pytest.mark.parametrize("bad, got", [(3, "got int$"), (None, "got NoneType$"), ("csr", "got str$"),
                                      (sten.CsrTensor, r"CsrTensor.from_dense\(t\)\), got the class CsrTensor$")])
def test_a_wrapper_of_something_that_is_not_a_layout_object(make, bad, got):
    """``SparseTensorWrapper(3)`` raised ``AttributeError: 'int' object has no attribute 'to_dense'``
    from deep inside; the class itself (``SparseTensorWrapper(CsrTensor)``), a TypeError about
    ``self``."""
    with pytest.raises(TypeError, match="^wrapped_tensor must be a layout object .*" + got):
        make(bad)


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_a_wrapper_s_requires_grad_must_be_a_bool(bad):
    with pytest.raises(TypeError, match="^requires_grad must be a bool, got "):
        sten.SparseTensorWrapper(sten.CsrTensor.from_dense(torch.eye(2)), bad)


@pytest.mark.parametrize("kwargs, name", [({"ref": 3}, "ref"), ({"ref": "w"}, "ref"), ({"ref_sp_ten": 2.0}, "ref_sp_ten"),
                                          ({"ref": sten.CsrTensor}, "ref")])
def test_same_format_sparsifier_needs_a_reference_tensor(kwargs, name):
    """``SameFormatSparsifier(3)`` was accepted, and failed only where it was used."""
    with pytest.raises(TypeError, match=f"^SameFormatSparsifier: {name} must be the reference tensor"):
        sten.SameFormatSparsifier(**kwargs)
    layout = sten.CsrTensor.from_dense(torch.eye(2))
    for ref in (layout, sten.SparseTensorWrapper(layout), torch.eye(2)):   # what it takes
        assert sten.SameFormatSparsifier(ref).ref is ref


@pytest.mark.parametrize("layout", [sten.DenseTensor, sten.CooTensor, sten.CsrTensor, sten.CscTensor])
@pytest.mark.parametrize("bad", [3, "dense", "wrong torch layout"])
def test_a_torch_layout_constructor_names_what_it_takes(layout, bad):
    """``CooTensor(3)`` raised ``AttributeError: 'int' object has no attribute '_indices'``,
    ``CsrTensor(dense)`` one about ``crow_indices``, and ``DenseTensor(3)`` was accepted."""
    if bad == "dense":
        bad = torch.eye(2) if layout is not sten.DenseTensor else torch.eye(2).to_sparse()
    elif bad == "wrong torch layout":
        bad = torch.eye(2).to_sparse_csr() if layout is not sten.CsrTensor else torch.eye(2).to_sparse()
    with pytest.raises(TypeError, match=rf"^{layout.__name__}\(data\): data must be a torch\.\w+ torch\.Tensor, "
                                        rf"got .*{layout.__name__}\.from_dense"):
        layout(bad)


def test_wrapped_from_dense_needs_a_tensor():
    with pytest.raises(TypeError, match="dense must be a torch.Tensor"):
        sten.SparseTensorWrapper.wrapped_from_dense(sten.CooTensor.from_dense(torch.ones(2)), [1.0, 2.0])


def test_layout_from_dense_needs_a_tensor():
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor"):
        sten.CsrTensor.from_dense([[1.0, 0.0]])


def test_register_layout_needs_a_layout_class():
    with pytest.raises(TypeError, match="layout"):
        sten.registry.register_layout(object())

    class NoDense:
        pass

    with pytest.raises(TypeError, match="from_dense"):
        sten.registry.register_layout(NoDense)


@pytest.mark.parametrize("bad, match", [
    ((sten.KeepAll(), torch.Tensor, sten.KeepAll()), "4-tuple"),
    ((sten.KeepAll, torch.Tensor, sten.KeepAll(), torch.Tensor), "inline_sparsifier"),
    ((sten.KeepAll(), torch.Tensor, sten.KeepAll(), "CsrTensor"), "out_format"),
])
def test_bad_output_spec(bad, match):
    with pytest.raises((TypeError, ValueError), match=match):
        sten.sparsified_op(torch.add, out_fmt=bad)


def test_sparsified_op_needs_callable_and_out_fmt():
    with pytest.raises(TypeError, match="orig_op"):
        sten.sparsified_op("add", out_fmt=(sten.KeepAll(), T, sten.KeepAll(), T))
    with pytest.raises(ValueError, match="out_fmt"):
        sten.sparsified_op(torch.add, out_fmt=None)


def test_register_sparsifier_implementation_arguments():
    with pytest.raises(TypeError, match="unexpected arguments: sparsifyer"):
        sten.register_sparsifier_implementation(sparsifyer=sten.KeepAll, inp=T, out=T)
    with pytest.raises(TypeError, match="needs sparsifier, inp and out"):
        sten.register_sparsifier_implementation(sparsifier=sten.KeepAll, inp=T)


def test_block_sparsifier_on_too_few_dims():
    with pytest.raises(ValueError, match="at least 2 dims"):
        sten.sparsify(sten.BlockwiseFractionSparsifier(0.5, (2, 2)), torch.ones(4), torch.Tensor)


def test_set_dispatch_failure_names_mode():
    with pytest.raises(ValueError, match="mode must be 'warn' or 'raise'"):
        sten.set_dispatch_failure("loud")


def test_converting_a_3d_coo_tensor_to_a_2d_layout_names_the_layout():
    """The registered COO -> CSR step raised torch's "coo_to_sparse_csr: ... sparse_dim()!=2"; a step
    refusing the tensor now leaves it to the target layout, which says what it needs."""
    coo = sten.SparseTensorWrapper(sten.CooTensor.from_dense(torch.eye(4).reshape(2, 2, 4)))
    with pytest.raises(ValueError, match=r"CsrTensor.from_dense: tensor must be 2-D, got shape \(2, 2, 4\)"):
        sten.convert(coo, sten.CsrTensor)
