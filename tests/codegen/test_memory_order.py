"""Kernels walk a transposed copy in its memory order and column sums with a loop over many columns."""
import sympy
import torch

from kiln.codegen.ir.indexing import XINDEX
from kiln.codegen.schedule.domain import memory_unflatten
from tests.codegen.util import check, kernels


def _eval(exprs, flat):
    return [int(sympy.sympify(e).subs(XINDEX, flat).doit()) if not isinstance(e, int) else e for e in exprs]


def test_memory_unflatten_walks_a_transposed_layout_in_address_order():
    shape, stride = (3, 4), (1, 3)            # a [4, 3] row-major buffer seen as its transpose
    for flat in range(12):
        i, j = _eval(memory_unflatten(XINDEX, list(shape), stride), flat)
        assert i * stride[0] + j * stride[1] == flat
    # row-major and non-dense layouts keep the row-major walk
    assert _eval(memory_unflatten(XINDEX, [3, 4], (4, 1)), 5) == [1, 1]
    assert _eval(memory_unflatten(XINDEX, [3, 4], (1, 5)), 5) == [1, 1]


def _mlp_backward_like(x, g, w):
    # GPT-2's MLP backward: the recomputed GELU is stored transposed (for the weight-gradient
    # matmul) by the kernel that sums the bias gradient over all rows
    h = torch.nn.functional.gelu(x, approximate="tanh").view(-1, 8)
    return h.t() @ w, (g * x * 3).sum((0, 1))


def test_transposed_copy_fused_with_a_column_sum_is_stored_in_address_order():
    x, g, w = torch.randn(8, 1024, 8), torch.randn(8, 1024, 8), torch.randn(8192, 4)
    gm = check(_mlp_backward_like, x, g, w, atol=1e-4, rtol=1e-4)
    (k,) = kernels(gm)
    assert "empty_strided((8, 8192, ), (1, 8, )" in k.source   # the transposed copy is this kernel's
    assert "8192)" not in k.source.split("def call")[0], k.source   # ... written without a row-major walk


def test_long_column_sum_loops_over_a_tile_of_columns():
    from kiln.options import Tuning
    x = torch.randn(4 * Tuning().outer_persistent_max, 48)
    gm = check(lambda a: (a * 2).sum(0), x, atol=1e-4, rtol=1e-4)
    (k,) = kernels(gm)
    assert "for roffset in range" in k.source


def test_channels_last_pointwise_walks_memory_in_order():
    x = torch.randn(2, 6, 4, 5).to(memory_format=torch.channels_last)
    b = torch.randn(1, 6, 1, 1)
    gm = check(lambda a, c: torch.relu(a * 2 + c), x, b, atol=1e-5, rtol=1e-5)
    (k,) = kernels(gm)
    body = k.source.split("def call")[0]
    # the NHWC input is read and the NHWC output written at xindex itself (consecutive addresses)
    assert "tl.load(in_ptr0 + (xindex)" in body and "tl.store(out_ptr0 + (xindex)" in body, body
