"""Conv-BN folding (kiln/passes/conv_bn.py) on small ATen graphs with get_attr constants."""
import pytest
import torch
import torch.nn.functional as F

from kiln.passes.conv_bn import bn_to_affine, fold_conv_bn
from kiln.passes.constant_fold import fold_constants
from tests.freezing.helpers import aten_graph, ops

aten = torch.ops.aten


def _bn_params(c, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [t.to(dtype) for t in (torch.randn(c, generator=g), torch.rand(c, generator=g) + 0.5,
                                  torch.randn(c, generator=g), torch.randn(c, generator=g))]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("affine", [True, False])
def test_conv_bn_folds_into_conv(bias, affine):
    w, b = torch.randn(8, 3, 3, 3), torch.randn(8) if bias else None
    mean, var, gamma, beta = _bn_params(8)
    gamma, beta = (gamma, beta) if affine else (None, None)
    fn = lambda x: F.batch_norm(F.conv2d(x, w, b), mean, var, gamma, beta, False, 0.1, 1e-3)  # noqa: E731
    x = torch.randn(2, 3, 8, 8)
    gm = aten_graph(fn, x)
    assert fold_conv_bn(gm) == 1
    assert ops(gm, aten.native_batch_norm) + ops(gm, aten._native_batch_norm_legit_no_training) == 0
    assert ops(gm, aten.convolution) == 1
    torch.testing.assert_close(gm(x), fn(x), atol=1e-5, rtol=1e-5)


def test_bf16_folds_in_float32_once():
    w = torch.randn(8, 3, 3, 3, dtype=torch.bfloat16)
    mean, var, gamma, beta = _bn_params(8, torch.bfloat16)
    fn = lambda x: F.batch_norm(F.conv2d(x, w), mean, var, gamma, beta, False, 0.1, 1e-5)  # noqa: E731
    x = torch.randn(2, 3, 8, 8, dtype=torch.bfloat16)
    gm = aten_graph(fn, x)
    assert fold_conv_bn(gm) == 1
    out = gm(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, fn(x), atol=5e-2, rtol=5e-2)


def test_shared_weight_is_not_changed():
    w = torch.randn(4, 4, 1, 1)
    mean, var, gamma, beta = _bn_params(4)
    fn = lambda x, y: F.conv2d(x, w) + F.batch_norm(F.conv2d(y, w), mean, var, gamma, beta)  # noqa: E731
    x, y = torch.randn(2, 4, 5, 5), torch.randn(2, 4, 5, 5)
    gm = aten_graph(fn, x, y)
    assert fold_conv_bn(gm) == 1
    assert ops(gm, aten.convolution) == 2
    torch.testing.assert_close(gm(x, y), fn(x, y), atol=1e-5, rtol=1e-5)


def test_conv_with_other_users_is_not_folded():
    w = torch.randn(4, 4, 1, 1)
    mean, var, gamma, beta = _bn_params(4)

    def fn(x):
        y = F.conv2d(x, w)
        return y.relu() + F.batch_norm(y, mean, var, gamma, beta)

    x = torch.randn(2, 4, 5, 5)
    gm = aten_graph(fn, x)
    assert fold_conv_bn(gm) == 0  # folding would run the convolution twice
    torch.testing.assert_close(gm(x), fn(x))


def test_transposed_conv_is_not_folded():
    w = torch.randn(4, 4, 3, 3)
    mean, var, gamma, beta = _bn_params(4)
    fn = lambda x: F.batch_norm(F.conv_transpose2d(x, w), mean, var, gamma, beta)  # noqa: E731
    x = torch.randn(1, 4, 5, 5)
    gm = aten_graph(fn, x)
    assert fold_conv_bn(gm) == 0
    torch.testing.assert_close(gm(x), fn(x))


def test_folding_after_constant_folding_of_statistics():
    w = torch.randn(4, 3, 1, 1)
    stats = torch.rand(2, 4) + 0.5  # the running statistics come out of a constant subgraph
    fn = lambda x: F.batch_norm(F.conv2d(x, w), stats[0] * 0, stats[1])  # noqa: E731
    x = torch.randn(2, 3, 4, 4)
    gm = aten_graph(fn, x)
    assert fold_conv_bn(gm) == 0  # statistics are not constants yet
    fold_constants(gm)
    assert fold_conv_bn(gm) == 1
    torch.testing.assert_close(gm(x), fn(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bn_to_affine(dtype):
    mean, var, gamma, beta = _bn_params(3, dtype)
    fn = lambda x: F.batch_norm(x, mean, var, gamma, beta, False, 0.1, 1e-5)  # noqa: E731
    x = torch.randn(2, 3, 4, 4, dtype=dtype)
    gm = aten_graph(fn, x)
    assert bn_to_affine(gm) == 1
    assert ops(gm, aten.native_batch_norm) == 0 and ops(gm, aten.mul) == 1 and ops(gm, aten.add) == 1
    out = gm(x)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, fn(x), atol=tol, rtol=tol)
