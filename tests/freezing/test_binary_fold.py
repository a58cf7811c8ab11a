"""Binary folding (kiln/passes/binary_fold.py): add/sub/mul/div by constants into conv and linear."""
import pytest
import torch
import torch.nn.functional as F

from kiln.passes.binary_fold import fold_binary
from kiln.passes.constant_fold import fold_constants
from tests.freezing.helpers import aten_graph, ops

aten = torch.ops.aten
W, B = torch.randn(6, 3, 3, 3), torch.randn(6)
C = torch.rand(6, 1, 1) + 0.5  # per output channel
X = torch.randn(2, 3, 8, 8)

CONV_CASES = {
    "add": lambda x: F.conv2d(x, W, B) + C,
    "radd": lambda x: C + F.conv2d(x, W, B),
    "sub": lambda x: F.conv2d(x, W, B) - C,
    "mul": lambda x: F.conv2d(x, W, B) * C,
    "div": lambda x: F.conv2d(x, W, B) / C,
    "scalar_mul": lambda x: F.conv2d(x, W, B) * 2.5,
    "no_bias_add": lambda x: F.conv2d(x, W) + C,
    "chain": lambda x: (F.conv2d(x, W, B) - C) * C + 1.0,
}


@pytest.mark.parametrize("case", sorted(CONV_CASES))
def test_conv_binary_folds(case):
    fn = CONV_CASES[case]
    gm = aten_graph(fn, X)
    n = fold_binary(gm)
    assert n == (3 if case == "chain" else 1)
    assert not any(ops(gm, t) for t in (aten.add, aten.sub, aten.mul, aten.div))
    torch.testing.assert_close(gm(X), fn(X), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("other", [torch.randn(1, 6, 6, 6), torch.randn(2, 1, 1, 1), torch.randn(6)])
def test_conv_binary_needs_a_per_channel_constant(other):
    fn = lambda x: F.conv2d(x, W, B) + other  # noqa: E731
    gm = aten_graph(fn, X)
    assert fold_binary(gm) == 0
    torch.testing.assert_close(gm(X), fn(X))


def test_constant_minus_conv_is_not_folded():
    fn = lambda x: C - F.conv2d(x, W, B)  # noqa: E731
    gm = aten_graph(fn, X)
    assert fold_binary(gm) == 0
    torch.testing.assert_close(gm(X), fn(X))


def test_type_promotion_blocks_folding():
    w = W.to(torch.bfloat16)
    two = torch.full([1], 2.0)
    fn = lambda x: F.conv2d(x, w) * two  # noqa: E731  bf16 * f32[1] -> f32
    x = X.to(torch.bfloat16)
    gm = aten_graph(fn, x)
    assert fold_binary(gm) == 0
    assert gm(x).dtype == torch.float32


def test_conv_with_other_users_is_not_folded():
    fn = lambda x: (lambda y: (y * C, y))(F.conv2d(x, W, B))  # noqa: E731
    gm = aten_graph(fn, X)
    assert fold_binary(gm) == 0


LW, LB = torch.randn(5, 4), torch.randn(5)
LC = torch.rand(5) + 0.5


@pytest.mark.parametrize("shape", [(3, 4), (2, 3, 4)])
@pytest.mark.parametrize("op", ["mul", "add", "div", "sub"])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_binary_folds(op, bias, shape):
    f = {"mul": torch.mul, "add": torch.add, "div": torch.div, "sub": torch.sub}[op]
    fn = lambda x: f(F.linear(x, LW, LB if bias else None), LC)  # noqa: E731
    x = torch.randn(*shape)
    gm = aten_graph(fn, x)
    fold_constants(gm)  # the transposed weight becomes a constant first, as in the freezing pipeline
    assert fold_binary(gm) == 1
    assert ops(gm, getattr(aten, op)) == 0
    torch.testing.assert_close(gm(x), fn(x), atol=1e-5, rtol=1e-5)


def test_linear_row_constant_is_not_folded():
    rows = torch.randn(3, 1)
    fn = lambda x: F.linear(x, LW, LB) * rows  # noqa: E731
    x = torch.randn(3, 4)
    gm = aten_graph(fn, x)
    fold_constants(gm)
    assert fold_binary(gm) == 0
    torch.testing.assert_close(gm(x), fn(x))


def test_non_finite_or_zero_divisor_is_not_folded():
    zero = C.clone()
    zero[2] = 0.0
    for fn in (lambda x: F.conv2d(x, W, B) / zero, lambda x: F.conv2d(x, W, B) * (zero / 0)):
        gm = aten_graph(fn, X)
        assert fold_binary(gm) == 0
        torch.testing.assert_close(gm(X), fn(X), equal_nan=True)
