"""The comparisons of tests/numerics.py: another summation order passes, a real mistake does not."""
import pytest
import torch

from tests.numerics import assert_close_to_fp64, assert_product_close, assert_sum_close, fp64


def _by_blocks(a, b, cols):
    """a @ b a block of ``cols`` columns at a time (another BLAS call per block: another order)."""
    return torch.cat([a @ b[:, j:j + cols] for j in range(0, b.shape[1], cols)], 1)


def test_product_bound_passes_other_orders_and_catches_mistakes():
    a, b, bias = torch.randn(66, 96) * 3, torch.randn(96, 1001), torch.randn(1001)
    fn = lambda bias, a, b: torch.addmm(bias, a, b, beta=0.5, alpha=2.0)  # noqa: E731
    for got in (fn(bias, a, b), 0.5 * bias + 2.0 * _by_blocks(a, b, 8),
                0.5 * bias + 2.0 * (a.double() @ b.double()).float(),                  # the rounded exact product
                0.5 * bias + 2.0 * (a[:, :48] @ b[:48] + a[:, 48:] @ b[48:])):         # K split in two
        assert_product_close(got, fn, bias, a, b, terms=97)
    wrong = [fn(bias, a, b).clone() for _ in range(3)]
    wrong[0][5, 7] += 1e-2                                           # one element off
    wrong[1] = fn(bias, a.half().float(), b)                          # inputs rounded to float16
    wrong[2] = fn(bias, a, b) + 0.5 * bias                            # beta 1 instead of 0.5
    for got in wrong:
        with pytest.raises(AssertionError, match="outside the bound"):
            assert_product_close(got, fn, bias, a, b, terms=97)


def test_sum_bound_and_special_values():
    """The bound holds for every order, so it grows as K * sum |x|: at K = 512 a sum that drops its
    last term is still far outside it (at K = 5000 it would not be: a row test needs eager's error then,
    ``assert_close_to_fp64``)."""
    x = torch.randn(4, 512)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    exact = x.double().sum(1)
    scale = x.double().abs().nansum(1)
    for got in (x.sum(1), torch.stack([r.view(-1, 8).sum(0).sum() for r in x]), x.cumsum(1)[:, -1]):
        assert_sum_close(got, exact, terms=512, scale=scale)
    with pytest.raises(AssertionError, match="outside the bound"):
        assert_sum_close(x[:, :-1].sum(1), exact, terms=512, scale=scale)
    got = x.sum(1)
    got[3] = float("nan")
    with pytest.raises(AssertionError, match="NaN"):
        assert_sum_close(got, exact, terms=512, scale=scale)


def test_close_to_fp64_holds_where_eager_is_close_and_widens_by_eagers_error():
    a, b = torch.randn(64, 512) * 4, torch.randn(512, 64)
    ref, exact = a @ b, fp64(a) @ fp64(b)
    own = (ref.double() - exact).abs().max().item()
    assert_close_to_fp64(_by_blocks(a, b, 8), ref, exact, atol=0, rtol=0)        # another order: within 2x
    near = ref + 1e-6 * torch.randn_like(ref)                                 # within the tolerance of eager
    assert_close_to_fp64(near, ref, exact, atol=1e-5, rtol=1e-5)
    far = ref.clone()
    far[3, 4] += 10 * own + 1e-3
    with pytest.raises(AssertionError, match="outside the bound"):
        assert_close_to_fp64(far, ref, exact, atol=1e-5, rtol=1e-5)
    nan = ref.clone()
    nan[0, 0] = float("nan")
    with pytest.raises(AssertionError):
        assert_close_to_fp64(nan, ref, exact, atol=1e-5, rtol=1e-5)


def test_close_to_fp64_keeps_exact_comparisons_where_they_are_the_point():
    """16-bit and integer results, and eager's non-finite values, compare with eager's as they are."""
    x = torch.randn(100).bfloat16()
    ref, exact = x * 3, fp64(x) * 3
    assert_close_to_fp64(ref.clone(), ref, exact, atol=0, rtol=0)
    with pytest.raises(AssertionError):
        assert_close_to_fp64((x.float() * 3).bfloat16() + 1, ref, exact, atol=0, rtol=0)
    i = torch.arange(5)
    with pytest.raises(AssertionError):
        assert_close_to_fp64(i + 1, i, i, atol=1e-5, rtol=1e-5)
    y = torch.tensor([1.0, float("inf"), float("nan")])
    assert_close_to_fp64(y.clone(), y, y.double(), atol=1e-5, rtol=1e-5)
    with pytest.raises(AssertionError):
        assert_close_to_fp64(torch.tensor([1.0, 3.0, float("nan")]), y, y.double(), atol=1e-5, rtol=1e-5)
