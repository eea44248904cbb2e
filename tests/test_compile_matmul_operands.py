"""``@`` under torch.compile keeps its operands in order with a sparse wrapper on either side.

Dynamo (torch 2.13) traced ``W @ x`` with a wrapper ``W`` as ``x @ W``: silently
wrong for square operands (``sten_core/dispatch/dynamo_matmul.py``)."""

import pytest
import torch

import sten_core as sten

LAYOUTS = [sten.DenseTensor, sten.CsrTensor, sten.CscTensor, sten.CooTensor]
PRODUCTS = {
    "W @ x": (lambda w, x: w @ x, lambda w, x: w @ x),
    "x @ W": (lambda w, x: x @ w, lambda w, x: x @ w),
    "W @ vector": (lambda w, x: w @ x[:, 0], lambda w, x: w @ x[:, 0]),
    "W @ x + x @ W": (lambda w, x: w @ x + x @ w, lambda w, x: w @ x + x @ w),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("product", PRODUCTS)
def test_matmul_operator_order_under_compile(layout, product):
    torch.manual_seed(0)
    dense = torch.randn(8, 8) * (torch.rand(8, 8) > 0.5)
    x = torch.randn(8, 8)
    wrapper = sten.SparseTensorWrapper(layout.from_dense(dense))
    traced, reference = PRODUCTS[product]
    torch._dynamo.reset()
    got = torch.compile(lambda x: traced(wrapper, x))(x)
    torch.testing.assert_close(got, reference(dense, x))  # square, not symmetric: a swap shows


def test_reverse_matmul_entry_is_added_when_dynamo_loads():
    import operator

    from torch._dynamo.variables import builtin

    builtin.populate_builtin_to_tensor_fn_map()
    assert builtin.BUILTIN_TO_TENSOR_RFN_MAP[operator.matmul] is torch.Tensor.__rmatmul__
