"""Linear concatenation (kiln/passes/concat_linear.py)."""
import pytest
import torch
import torch.nn.functional as F

import kiln

from kiln.passes.concat_linear import concat_linears
from kiln.passes.constant_fold import fold_constants
from tests.freezing.helpers import aten_graph, ops

aten = torch.ops.aten


def _prepared(fn, *inputs):
    gm = aten_graph(fn, *inputs)
    fold_constants(gm)  # the transposed weights become constants, as in the freezing pipeline
    return gm


def test_three_linears_become_one_matmul():
    ws = [torch.randn(n, 8) for n in (3, 5, 7)]
    bs = [torch.randn(3), torch.randn(1, 5), None]
    fn = lambda x: tuple(F.linear(x, w, b) for w, b in zip(ws, bs))  # noqa: E731
    x = torch.randn(4, 8)
    gm = _prepared(fn, x)
    assert concat_linears(gm) == 3
    assert ops(gm, aten.addmm) == 1 and ops(gm, aten.mm) == 0
    outs, ref = gm(x), fn(x)
    torch.testing.assert_close(outs, ref, atol=1e-5, rtol=1e-5)
    assert [o.stride() for o in outs] == [r.stride() for r in ref]


def test_3d_inputs_and_downstream_ops():
    w1, w2 = torch.randn(6, 8), torch.randn(6, 8)
    fn = lambda x: F.linear(x, w1).relu() + F.linear(x, w2)  # noqa: E731
    x = torch.randn(2, 3, 8)
    gm = _prepared(fn, x)
    assert concat_linears(gm) == 2
    torch.testing.assert_close(gm(x), fn(x), atol=1e-5, rtol=1e-5)


def test_full_matrix_bias_stays_out():
    w1, w2, w3 = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)
    b2, b3 = torch.randn(3), torch.randn(2, 3)  # b3 is [M, N]: not one row
    fn = lambda x: (F.linear(x, w1), F.linear(x, w2, b2), F.linear(x, w3, b3))  # noqa: E731
    x = torch.randn(2, 4)
    gm = _prepared(fn, x)
    ref = fn(x)
    assert concat_linears(gm) == 2
    assert ops(gm, aten.addmm) == 2
    torch.testing.assert_close(gm(x), ref, atol=1e-5, rtol=1e-5)


def test_different_inputs_are_not_merged():
    w1, w2 = torch.randn(3, 4), torch.randn(3, 4)
    fn = lambda x, y: (F.linear(x, w1), F.linear(y, w2))  # noqa: E731
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    gm = _prepared(fn, x, y)
    assert concat_linears(gm) == 0
    torch.testing.assert_close(gm(x, y), fn(x, y))


class _Attention(torch.nn.Module):
    """q, k, v projections of a 3-D input, each reshaped into heads: the merged GEMM's column slices
    flow through views of different layouts."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = torch.nn.Linear(32, 32), torch.nn.Linear(32, 16), torch.nn.Linear(32, 16)

    def forward(self, x):
        q = self.q(x).view(2, 16, 2, 16).transpose(1, 2)
        k = self.k(x).view(2, 16, 1, 16).transpose(1, 2)
        v = self.v(x).view(2, 16, 1, 16).transpose(1, 2)
        return (q @ k.transpose(-1, -2)).softmax(-1) @ v, self.v(x).sum(-1)


@pytest.mark.parametrize("codegen", ["aten", "triton"])
def test_merged_3d_linears_feeding_views(codegen, monkeypatch):
    """Each linear's result is a strided column slice of the merged GEMM: the views that read it are
    recomputed for the slice's layout (they once kept the old contiguous layout, and the wrapper's
    reinterpret of that stale layout read other columns: wrong values on 9 of 10 HF models)."""
    if codegen == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    kiln.counters.clear()
    m, x = _Attention().eval(), torch.randn(2, 16, 32)
    with torch.no_grad():
        ref = m(x)
        got = torch.compile(m, backend="kiln", options={"codegen": codegen, "freezing": True})(x)
    assert kiln.counters["kiln"]["concat_linear"] >= 3
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
