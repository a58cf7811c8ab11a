"""Loop shapes of the C++ emitter that decide its speed: a reduction row read at ``r / K`` and ``r % K``
runs as nested loops over contiguous K-element pieces (``splits.row_split``), a pointwise kernel's inner
loop covers the trailing dims its per-channel loads do not depend on (``splits.pointwise_split``)."""
import re

import pytest
import torch
import torch.nn.functional as F

from kiln.codegen.ir.indexing import XINDEX, ModIdx, Ranges, simplify
from kiln.codegen.to_cpp.emit import XI, XO
from kiln.options import current
from kiln.runtime import cpp_build
from tests.codegen.test_cpp import fused
from tests.codegen.util import assert_close

pytestmark = pytest.mark.skipif(not cpp_build.find_compiler(current()), reason="no C++ compiler (g++, clang++, $CXX)")


def compiled(fn, *args, **tuning):
    """(graph module with C++ kernels, the C++ source of its unit)."""
    units = []
    gm, _ = fused(fn, *args, units=units, tuning=tuning)
    return gm, "\n".join(u.source for u in units)


def _c(v):   # a per-channel vector against NCHW
    return v[None, :, None, None]


def _bn_train(x, w, b):   # BatchNorm's training statistics over N, H, W (what kiln's decompositions give)
    mean = x.mean((0, 2, 3), keepdim=True)
    var = ((x - mean) ** 2).mean((0, 2, 3), keepdim=True)
    return F.relu((x - mean) * torch.rsqrt(var + 1e-5) * _c(w) + _c(b))


def _bn_eval(x, mean, var, w, b):
    return F.relu((x - _c(mean)) * _c(torch.rsqrt(var + 1e-5) * w) + _c(b)) + x


def _inner_loop_indices(src):
    """The indices of the loads in the innermost (vectorized) loops."""
    return re.findall(r"in_ptr\d+\[\(([^\]]*)\)\]", src)


@pytest.mark.parametrize("split", [16, 0])
def test_batch_norm_rows_run_as_contiguous_pieces(split):
    x, w, b = torch.randn(4, 8, 6, 32), torch.randn(8), torch.randn(8)
    gm, src = compiled(_bn_train, x, w, b, cpp_row_split=split)
    assert_close(gm(x, w, b), _bn_train(x, w, b), 1e-5, 1e-5)
    big = [i for i in _inner_loop_indices(src) if "x" in i]   # the per-element loads of x
    if split:
        assert "for (int32_t r1 = 0; r1 < 192; r1++)" in src, src
        assert big and not [i for i in big if "/" in i or "%" in i], big
    else:
        assert "int32_t r0 = 0" not in src and any("/" in i for i in big), big


def test_batch_norm_eval_hoists_the_channel():
    x = torch.randn(2, 8, 4, 16)
    stats = [torch.randn(8), torch.rand(8) + 0.5, torch.randn(8), torch.randn(8)]
    gm, src = compiled(_bn_eval, x, *stats)
    assert_close(gm(x, *stats), _bn_eval(x, *stats), 1e-5, 1e-5)
    assert "xo_n = 16, xi_n = 64;" in src, src   # the inner loop: H * W, the channel a function of xo
    assert "[(xo % 8)]" in src and not [i for i in _inner_loop_indices(src) if "xi" in i and "/" in i], src


def test_a_digit_of_a_split_index():
    """((1024 xo + xi) // 1024) % 32 is xo % 32 when xi < 1024; not when xi may reach 1024."""
    e = ModIdx(XINDEX, 1024, 32).xreplace({XINDEX: XO * 1024 + XI})
    assert simplify(e, Ranges({XO: 512, XI: 1024})) == ModIdx(XO, 1, 32)
    assert simplify(e, Ranges({XO: 8, XI: 1024})) == XO
    assert simplify(e, Ranges({XO: 512, XI: 2048})) != ModIdx(XO, 1, 32)


@pytest.mark.parametrize("cache", [16384, 0])
def test_softmax_computes_each_exponential_once(cache):
    """A softmax sums its exponentials in one loop over the row and divides them by the sum in the next:
    the first loop keeps them (``tuning.cpp_row_cache``), the second reads them back."""
    x = torch.randn(8, 300)
    x[0, :5] = float("-inf")
    gm, src = compiled(lambda x: torch.softmax(x, -1), x, cpp_row_cache=cache)
    assert_close(gm(x), torch.softmax(x, -1), 1e-6, 1e-6)
    body = src[src.index('extern "C" void kiln_cpp_'):]
    assert body.count("expf(") == (1 if cache else 2), body
    assert ("kept" in body) == bool(cache)


def test_a_quotient_of_a_row_and_its_column():
    """(128 x + r) // 16384 is x // 128 when r < 128 (an attention row of 128 in heads of 128 rows): no
    division per element (a GPT's attention-softmax backward divided at every element)."""
    from kiln.codegen.ir.indexing import RINDEX, FloorDiv
    r = Ranges({XINDEX: 2048, RINDEX: 128})
    assert simplify(FloorDiv(RINDEX + 128 * XINDEX, 16384), r) == FloorDiv(XINDEX, 128)
    assert simplify(128 * FloorDiv(RINDEX + 128 * XINDEX, 16384) + ModIdx(XINDEX, 1, 128), r) == XINDEX
    assert simplify(ModIdx(RINDEX + 128 * XINDEX, 256, 8), r) == ModIdx(XINDEX, 2, 8)
    assert simplify(FloorDiv(RINDEX + 100 * XINDEX, 16384), r) == FloorDiv(RINDEX + 100 * XINDEX, 16384)


def test_a_quotient_and_remainder_by_symbolic_sizes():
    """The same with sizes only known at run time (a dynamic graph): ``(128 x + r) // (128 s)`` is
    ``x // s`` and ``(128 x + r) % (128 s)`` is ``128 (x % s) + r`` when r < 128: the division moves out of
    the element loop (a dynamic GPT-2's layer-norm backward divided at every element: 2x its static time)."""
    import sympy

    from kiln.codegen.ir.indexing import RINDEX, FloorDiv
    s, t = sympy.symbols("ks_s0 ks_s1", integer=True, positive=True)
    r = Ranges({XINDEX: 64 * s, RINDEX: 128})
    assert simplify(FloorDiv(RINDEX + 128 * XINDEX, 128 * s), r) == FloorDiv(XINDEX, s)
    assert simplify(FloorDiv(RINDEX + 128 * XINDEX, 128 * (s + t)), r) == FloorDiv(XINDEX, s + t)
    assert simplify(ModIdx(RINDEX + 128 * XINDEX, 1, 128 * s), r) == 128 * ModIdx(XINDEX, 1, s) + RINDEX
    # not provable: the division stays
    assert simplify(FloorDiv(RINDEX + 100 * XINDEX, 128 * s), r) == FloorDiv(RINDEX + 100 * XINDEX, 128 * s)


def test_multiplying_by_one_keeps_one_expression():
    """``x * 1.0`` is ``x`` (exactly, NaN and -0.0 too): softplus's backward computes ``exp(x * beta)`` with
    beta 1, which then is the forward's ``exp(x)`` and is computed once in mish's backward."""
    x = torch.tensor([-0.0, 0.0, float("nan"), float("inf"), -3.0, 25.0, 0.5])
    g = torch.randn(7)

    def mish_grad(x, g):   # the parts of mish's backward that read exp(x)
        return torch.exp(x) * g + torch.ops.aten.softplus_backward(g, x, 1.0, 20.0)
    gm, src = compiled(mish_grad, x, g)
    assert_close(gm(x, g), mish_grad(x, g), 1e-6, 1e-6)
    body = src[src.index('extern "C" void kiln_cpp_'):]
    assert body.count("expf(") == 1, body


def test_bool_tensors_are_bytes():
    """A bool input is read as bytes compared with 0 (g++ vectorized ``bool`` loads badly: a masked softmax
    row ran 3.8x slower), a bool output is written as 0 or 1."""
    x = torch.randn(6, 40)
    mask = torch.rand(6, 40) > 0.3
    mask[2] = False   # a row masked whole: NaN, as eager

    def masked_softmax(x, m):
        return torch.softmax(torch.where(m, x, float("-inf")), -1), m & (x > 0)
    gm, src = compiled(masked_softmax, x, mask)
    for got, ref in zip(gm(x, mask), masked_softmax(x, mask)):
        torch.testing.assert_close(got, ref, equal_nan=True)
    assert "const uint8_t* __restrict__ in_ptr" in src and "const bool* " not in src, src
    assert re.search(r"in_ptr\d+\[[^\]]*\] != 0\)", src), src


@pytest.mark.parametrize("flip", [False, True])
def test_masked_exponentials_are_split_by_the_mask(flip):
    """``exp(where(m, score, -inf) - max)`` runs as ``where(m, exp(score - max), exp(-inf - max))``: the same
    values (a row masked whole is NaN, as eager's), the masked side computed once per row, and no -inf reaches
    the vector exponential (libmvec's slow path: a masked attention softmax ran 2.2x slower)."""
    x = torch.randn(6, 40)
    x[4, 3] = float("nan")
    mask = torch.rand(6, 40) > 0.3
    mask[2] = False

    def masked_softmax(x, m):
        s = torch.where(~m, float("-inf"), x) if flip else torch.where(m, x, float("-inf"))
        return torch.softmax(s, -1)
    gm, src = compiled(masked_softmax, x, mask)
    torch.testing.assert_close(gm(x, mask), masked_softmax(x, mask), equal_nan=True)
    body = src[src.index('extern "C" void kiln_cpp_'):]
    per_row = re.search(r"const float (tmp\d+) = \(\(-\(float\)INFINITY\) - red\d+\);\s*const float tmp\d+ = expf\(\1\);",
                        body)
    assert per_row, body


def test_a_row_over_a_symbolic_batch_runs_without_division():
    """Batch norm's statistics over (N, H, W) with a symbolic N: the row of N * 1024 elements runs as r0 < N
    around a vectorized r1 < 1024, as the static graph's does (the dynamic kernels divided r by 1024 at every
    element: a CNN over batch sizes took 1.7x eager's step, 2026-11-28, CPU)."""
    import kiln
    x = torch.randn(4, 8, 32, 32)
    torch._dynamo.mark_dynamic(x, 0)

    def bn(x):   # the statistics as training's decomposition computes them
        m = x.mean((0, 2, 3), keepdim=True)
        v = (x - m).square().mean((0, 2, 3), keepdim=True)
        return ((x - m) * torch.rsqrt(v + 1e-5)).relu()
    out, code = kiln.run_and_get_code(torch.compile(bn, backend="kiln", options={"codegen": "cpp"}), x)
    assert_close(out, bn(x), 1e-5, 1e-5)
    body = "\n".join(c for c in code if 'extern "C"' in c)
    assert "ks_" in body and "r0 < rnumel / 1024" in body, body
    assert "r / 1024" not in body and "r % 1024" not in body, body


@pytest.mark.parametrize("stride", [1, 2])
def test_rows_over_symbolic_spatial_sizes_run_without_division(stride):
    """The same with N, H and W symbolic (H != W) after a 3x3 convolution, its output H' = (H - 1)//2 + 1
    with stride 2: the row runs as r0 < N around r1 < H'*W', one compile for both sizes. The loop bound was
    printed ``rnumel / ks_h*ks_w`` (a wrong row length), and H' divided r at every element (a fully dynamic
    CNN took 3.3x eager's training step, 2026-11-28, CPU)."""
    import kiln

    def bn(x, w):
        x = F.conv2d(x, w, stride=stride, padding=1)
        m = x.mean((0, 2, 3), keepdim=True)
        v = (x - m).square().mean((0, 2, 3), keepdim=True)
        return ((x - m) * torch.rsqrt(v + 1e-5)).relu()
    c = torch.compile(bn, backend="kiln", options={"codegen": "cpp"})
    xs, w = [torch.randn(3, 4, 12, 10), torch.randn(2, 4, 17, 9)], torch.randn(8, 4, 3, 3)
    for x in xs:
        torch._dynamo.mark_dynamic(x, (0, 2, 3))
    out, code = kiln.run_and_get_code(lambda: [c(x, w) for x in xs])
    for o, x in zip(out, xs):
        assert_close(o, bn(x, w), 1e-4, 1e-4)
    body = "\n".join(c for c in code if 'extern "C"' in c)
    assert body.count('extern "C"') == 1 and "r0 < rnumel / (" in body, code
    loads = [re.sub(r"\(\(1 \+ ks_s\d+\) / 2\)", "H", i) for i in _inner_loop_indices(body)]   # H' is a size
    assert loads and not [i for i in loads if "/" in i or "%" in i], loads


def _cnn_tail(x, w, mean, var, g, b):   # conv, eval BatchNorm, ReLU, 2x2 max-pool, global average pool
    y = F.relu(F.batch_norm(F.conv2d(x, w, padding=1), mean, var, g, b, training=False))
    return F.adaptive_avg_pool2d(F.max_pool2d(y, 2), 1).flatten(1)


def test_a_channels_last_pool_sums_columns_without_division():
    """A CNN's last BatchNorm + ReLU + max-pool fused into its global average pool is a reduction over H, W of
    a channels-last tensor, the channel innermost: its columns run as ``xo * C + xi`` (``splits.column_split``),
    each channel's BatchNorm scale once in a table, no division in the vectorized loop (it divided by C at every
    element and computed a rsqrt per element: 300 us of the user suite's 4 ms CNN step, inductor's kernel 45).
    Its 1024 elements read 4 values each: 4096 reads reach ``cpp_parallel_min`` 2048, so the threads share it."""
    import kiln
    args = [torch.randn(2, 8, 8, 8), torch.randn(32, 8, 3, 3), torch.randn(32), torch.rand(32) + 0.5,
            torch.randn(32), torch.randn(32)]
    opts = {"codegen": "cpp", "tuning": {"cpp_parallel_min": 2048}}
    out, code = kiln.run_and_get_code(torch.compile(_cnn_tail, backend="kiln", options=opts), *args)
    assert_close(out, _cnn_tail(*args), 1e-5, 1e-5)
    body = next(f for c in code for f in c.split('extern "C"')[1:] if "acc" in f)   # the pool's reduction
    assert "rnumel = 16;" in body and "#pragma omp parallel for collapse(2)" in body, body
    loop = body[body.index("for (int32_t r = 0"):]
    assert "tab" in body and "sqrtf" not in loop, body
    big = [i for i in _inner_loop_indices(loop) if "xi" in i]   # (a row position r may be divided)
    assert big and not [i for i in big if re.search(r"\bxi? [/%]", i)], body


def test_an_image_goes_channels_last_in_its_read_order():
    """NCHW to channels-last with 3 channels (a CNN's input image): the copy walks the image as it lies,
    xo over N * C and a vectorized xi over H * W (``splits.load_order_split``), not as one loop over the output
    dividing each position by 3 and by H * W to find what to read (127 us against inductor's 44)."""
    x = torch.randn(2, 3, 8, 16)
    gm, src = compiled(lambda x: x.contiguous(memory_format=torch.channels_last) * 2, x)
    out = gm(x)
    assert out.stride() == (384, 1, 48, 3)
    torch.testing.assert_close(out, x * 2, atol=0, rtol=0)
    assert "xo_n = 6, xi_n = 128;" in src, src
    assert _inner_loop_indices(src) == ["xi + 128*xo"], src
