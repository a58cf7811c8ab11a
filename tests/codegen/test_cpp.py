"""The C++ emitter (codegen='cpp'): values and gradients against eager, kernel counts like the Triton
emitter's, vectorized inner loops, declined kernels and failed builds falling back to ATen."""
import copy
import re
import shutil
import subprocess
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import kiln
from kiln.codegen.target import resolve
from kiln.debug import counters
from kiln.options import current
from kiln.runtime import cpp_build
from tests.codegen.test_reduction import LOOPED, grads, layer_norm, rms_norm
from tests.codegen.util import assert_close, compare, decompositions, fuse_graph, kernels

pytestmark = pytest.mark.skipif(not cpp_build.find_compiler(current()), reason="no C++ compiler (g++, clang++, $CXX)")


def fused(fn, *args, units=None, **opts):
    """(graph module with C++ kernels, number of C++ kernels) for ``fn`` traced on ``args``; ``units``: a
    list that receives the translation units built."""
    gm = make_fx(fn, decomposition_table=decompositions(), tracing_mode="fake")(*args)
    f = fuse_graph(gm, args, current(codegen="cpp", **opts))
    if units is not None:
        units.extend(f.units)
    ks = kernels(gm)
    assert all("cpp_build" in k.source for k in ks)
    return gm, len(ks)


def check(fn, *args, n_kernels=None, atol=1e-5, rtol=1e-5, exact=False, **opts):
    gm, n = fused(fn, *args, **opts)
    before = counters["codegen"]["runtime_fallback"]
    out = gm(*args)
    assert counters["codegen"]["runtime_fallback"] == before, "a kernel fell back to ATen (see the log)"
    if exact:   # equal values, NaN where eager has NaN, the sign of every zero
        ref = fn(*args)
        for o, r in zip(out if isinstance(out, (tuple, list)) else [out], ref if isinstance(ref, (tuple, list)) else [ref]):
            torch.testing.assert_close(o, r, atol=0, rtol=0, equal_nan=True)
            if o.is_floating_point():   # (a NaN's sign bit is unspecified)
                assert torch.equal(torch.signbit(o)[~r.isnan()], torch.signbit(r)[~r.isnan()])
    else:   # against float64, widened by eager's own error: the kernel's sums run in the host's vector width
        compare(out, fn, *args, atol=atol, rtol=rtol)
    if n_kernels is not None:
        assert n == n_kernels, f"expected {n_kernels} kernels, got {n}:\n{gm.code}"
    return gm


def gelu_bias(x, b):
    return F.gelu(x + b)


def mish(x):
    return x * torch.tanh(F.softplus(x))


@pytest.mark.parametrize("fn", [gelu_bias, lambda x, b: F.gelu(x + b, approximate="tanh"),
                                lambda x, b: mish(x) * b, lambda x, b: F.hardswish(x) - torch.sigmoid(b),
                                lambda x, b: F.silu(x) * torch.exp(b).clamp(max=2.0)],
                         ids=["gelu", "gelu_tanh", "mish", "hardswish", "silu"])
def test_pointwise_chains_are_one_kernel(fn):
    check(fn, torch.randn(33, 70), torch.randn(70), n_kernels=1, atol=1e-5, rtol=1e-5)
    check(grads(fn, 2), torch.randn(33, 70), torch.randn(70), torch.randn(33, 70), atol=1e-4, rtol=1e-4)


def test_broadcasting_and_non_contiguous_inputs():
    x = torch.randn(40, 24).t()            # transposed
    y = torch.randn(48, 40)[::2]           # a strided slice
    z = torch.randn(24, 1)                 # broadcast along columns
    check(lambda x, y, z: x * y + z, x, y, z, n_kernels=1)
    check(lambda x, z: (x + z).sum(1), x, z, n_kernels=1, atol=1e-4, rtol=1e-5)


def test_layer_norm_forward_is_one_kernel():
    for n in (8, 100, LOOPED):
        check(layer_norm, torch.randn(4, n), torch.randn(n), torch.randn(n), n_kernels=1, atol=1e-4, rtol=1e-4)


def test_layer_norm_backward_at_most_two_kernels():
    def bwd(g, x, mean, rstd, w, b):
        return torch.ops.aten.native_layer_norm_backward.default(g, x, [x.shape[-1]], mean, rstd, w, b,
                                                                 [True, True, True])
    x, w, b, g = torch.randn(64, 32), torch.randn(32), torch.randn(32), torch.randn(64, 32)
    _, mean, rstd = torch.ops.aten.native_layer_norm.default(x, [32], w, b, 1e-5)
    gm = check(bwd, g, x, mean, rstd, w, b, atol=1e-4, rtol=1e-4)
    assert len(kernels(gm)) <= 2
    x, g = torch.randn(6, 24), torch.randn(6, 24)
    check(grads(layer_norm, 3), x, torch.randn(24), torch.randn(24), g, atol=1e-4, rtol=1e-4)


def test_small_layer_norm_backward_folds_its_column_sums():
    """The weight and bias gradients of a LayerNorm backward over 64 x 32 rows of 48 (below the GPU's fold
    floors, split_min_r and split_min_numel) fold into its row kernel: one kernel fewer than unfolded."""
    x, w, b, g = torch.randn(64, 32, 48), torch.randn(48), torch.randn(48), torch.randn(64, 32, 48)
    tol = 2e-6 * (64 * 32) ** 0.5   # a column sum over 2048 rows, in another order than eager's
    n = {}
    for floor in (0, 1 << 30):   # 0: the C++ target folds at any size; 2**30 rows: never
        with kiln.config.patch(tuning=dict(fold_min_r=floor)):
            units = []
            gm, n[floor] = fused(grads(layer_norm, 3), x, w, b, g, units=units)
            compare(gm(x, w, b, g), grads(layer_norm, 3), x, w, b, g, atol=tol, rtol=tol)
        assert any("xpid" in u.source for u in units) == (floor == 0)
    assert n[0] == n[1 << 30] - 1, n


def test_bias_gradient_folds_into_the_norm_backward_making_its_input():
    """The bias gradient of a linear layer under a LayerNorm (the column sum of the norm backward's input
    gradient) folds into that norm's row kernel beside the norm's own weight and bias gradients."""
    def fn(x, W, b, w, c):
        return F.layer_norm(F.linear(x, W, b), (48,), w, c)
    args = [torch.randn(2048, 40), torch.randn(48, 40), torch.randn(48), torch.randn(48), torch.randn(48),
            torch.randn(2048, 48)]
    tol = 2e-6 * 2048 ** 0.5   # column sums over 2048 rows, in another order than eager's
    units = []
    gm, n = fused(grads(fn, 5), *args, units=units)
    compare(gm(*args), grads(fn, 5), *args, atol=tol, rtol=tol)
    assert n == 1, gm.code   # the matmuls run as ATen; every reduction sits in the norm's kernel
    assert sum(u.source.count("xpid <") for u in units) == 1   # one loop over chunks of rows: the fold


@pytest.mark.parametrize("n", [10, LOOPED], ids=["short", "long"])
def test_softmax_one_kernel_each_way(n):
    x = torch.randn(3, n)
    x[0, :3] = float("-inf")
    check(lambda x: torch.softmax(x, -1), x, n_kernels=1, atol=1e-5, rtol=1e-4)
    check(lambda x: torch.log_softmax(x, -1), x, n_kernels=1, atol=1e-5, rtol=1e-4)
    y = torch.softmax(x, -1)
    check(lambda g, y: torch.ops.aten._softmax_backward_data.default(g, y, -1, torch.float32),
          torch.randn(3, n), y, n_kernels=1, atol=1e-5, rtol=1e-4)


def test_cross_entropy():
    x, t = torch.randn(6, 10), torch.tensor([1, 2, 3, 0, 9, -100])
    check(lambda x, t: F.cross_entropy(x, t), x, t, n_kernels=1)
    check(lambda x, t, w: F.cross_entropy(x, t, weight=w), x, t, torch.rand(10), n_kernels=1)
    check(grads(lambda x, t: F.cross_entropy(x, t), 1), x, t, torch.tensor(1.0))


def test_rms_norm_one_kernel_and_bf16():
    x, w = torch.randn(5, 64), torch.randn(64)
    check(rms_norm, x, w, n_kernels=1, atol=1e-5, rtol=1e-5)
    check(grads(rms_norm, 2), x, w, torch.randn(5, 64), atol=1e-4, rtol=1e-4)
    xb, wb = x.bfloat16(), w.bfloat16()
    check(rms_norm, xb, wb, n_kernels=1, atol=2e-2, rtol=2e-2)


def test_var_mean_std():
    x = torch.randn(7, 300) * 3 + 5
    check(lambda x: torch.var_mean(x, 1), x, atol=1e-4, rtol=1e-4)
    check(lambda x: (x.std(0), x.var(1, correction=0)), x, atol=1e-4, rtol=1e-4)


def test_bf16_stores_round_as_eager():
    x, y = torch.randn(64, 129).bfloat16(), torch.randn(129).bfloat16()
    check(lambda x, y: x * 1.37, x, y, exact=True)   # one op: eager rounds once too
    check(lambda x, y: x + y, x, y, exact=True)
    check(lambda x: (x.float() * 3.1).to(torch.bfloat16), x, exact=True)
    check(lambda x: x.sum(1), x, atol=1e-2, rtol=1e-2)
    h = torch.randn(10, 20).half()
    check(lambda h: h * 0.3, h, exact=True)


def test_empty_and_size_one_dims():
    check(lambda x: torch.relu(x) + 1, torch.randn(0, 5))
    check(lambda x: x.sum(1), torch.randn(0, 5))
    check(lambda x: x.sum(0) + 1, torch.randn(0, 5))
    check(lambda x: torch.softmax(x, -1), torch.randn(3, 1, 1))
    check(lambda x: x.amax(1) * 2, torch.randn(1, 1))


def test_nan_and_signed_zero_in_max_min():
    x = torch.tensor([[1.0, float("nan"), 3.0], [-0.0, 0.0, -1.0], [float("-inf"), -2.0, float("nan")]])
    check(lambda x: (x.amax(1), x.amin(1), x.argmax(1), x.argmin(1)), x)
    check(lambda x: (x.amax(0), x.amin(0), x.argmax(0), x.argmin(0)), x)   # over columns
    y = torch.randn(50, 70)
    y[3, 5] = y[7, 9] = float("nan")
    check(lambda y: (y.amax(0), y.argmin(0), y.sum(0), y.argmax(1)), y)
    check(lambda x, y: (torch.maximum(x, y), torch.minimum(x, y)), x, torch.zeros(3, 3), exact=True)
    check(lambda x: torch.clamp(x, min=0.0) * -1.0, x, exact=True)


def test_integer_and_bool_kernels():
    a, b = torch.randint(-9, 9, (5, 6)), torch.randint(1, 5, (5, 6))
    check(lambda a, b: (a // b, a % b, (a > 0) & (b > 2), a.sum(1), (a > 3).any(1)), a, b)


def test_outer_reductions_and_folded_column_partials():
    x = torch.randn(300, 40)
    check(lambda x: (x * 2).sum(), x, atol=1e-3, rtol=1e-5)
    check(lambda x: (x.sum(0), torch.softmax(x, -1)), x, atol=1e-4, rtol=1e-5)
    check(lambda x: (x - x.mean(1, keepdim=True)).abs().mean(), x, atol=1e-4, rtol=1e-5)
    with kiln.config.patch(tuning=dict(split_min_r=32, split_min_numel=256, fold_programs=8, fold_min_chunk=4,
                                       fold="always")):   # 299 rows: 8 chunks of 38, the last of 33
        units = []
        check(lambda x: (x.sum(0), torch.softmax(x, -1)), torch.randn(299, 40), atol=1e-4, rtol=1e-5, units=units)
    assert any("xo < 38 && xpid * 38 + xo < xnumel" in u.source for u in units)


def _random_kernels(fn, x, codegen):
    gm = make_fx(fn, decomposition_table=decompositions(), tracing_mode="fake")(x)
    before = counters["codegen"]["cpp_declined"]
    fuse_graph(gm, [x], current(codegen=codegen))
    assert counters["codegen"]["cpp_declined"] == before, gm.code   # not declined
    return gm


@pytest.mark.parametrize("kind", ["rand", "randn"])
def test_random_numbers_are_tritons(kind):
    """C++ kernels draw Triton's philox numbers: for the same seed the same uniforms, bit for bit (normals to
    the last ulps of log/cos), and their moments are a uniform's and a normal's."""
    x = torch.randn(300, 70)
    fn = (lambda x: torch.rand_like(x) + x * 0) if kind == "rand" else (lambda x: torch.randn_like(x) + x * 0)
    got = {}
    for codegen in ("cpp", "triton"):
        gm = _random_kernels(fn, x, codegen)
        torch.manual_seed(7)
        got[codegen] = gm(x)
    if kind == "rand":
        assert torch.equal(got["cpp"], got["triton"])
        assert 0 <= got["cpp"].min() and got["cpp"].max() < 1 and abs(got["cpp"].mean() - 0.5) < 0.01
    else:
        torch.testing.assert_close(got["cpp"], got["triton"], atol=1e-5, rtol=1e-5)
        assert abs(got["cpp"].mean()) < 0.02 and abs(got["cpp"].std() - 1) < 0.02
    torch.manual_seed(8)
    assert not torch.equal(_random_kernels(fn, x, "cpp")(x), got["cpp"])   # a new seed, new numbers


def test_dropout_trains_with_cpp_kernels():
    """Dropout in a C++ kernel: kept elements scaled by 1 / (1 - p), the backward through the same mask."""
    counters.clear()
    torch._dynamo.reset()
    x = torch.randn(64, 257, requires_grad=True)
    out = kiln.compile(lambda x: F.dropout(x * 2, 0.25, training=True), codegen="cpp")(x)
    out.sum().backward()
    kept = out != 0
    assert 0.7 < kept.float().mean() < 0.8
    torch.testing.assert_close(out[kept], (x * 2 / 0.75)[kept])
    torch.testing.assert_close(x.grad, kept.float() * 2 / 0.75)
    assert counters["codegen"]["cpp_declined"] == 0


def _disassembly(gm) -> str:
    flags = open("/proc/cpuinfo").read() if shutil.os.path.exists("/proc/cpuinfo") else ""
    if not (" avx512f" in flags or " avx2" in flags) or not shutil.which("objdump"):
        pytest.skip("no AVX2/AVX-512 host or no objdump")
    lib = cpp_build.library(re.search(r"cpp_build\.function\('(\w+)'", kernels(gm)[0].source).group(1))
    return subprocess.run(["objdump", "-d", lib], capture_output=True, text=True).stdout


def _packed(asm, ops):
    """The packed (vector) instructions among ``ops`` in ``asm``, at any vector width: -march=native picks it
    per CPU (g++ 12 tunes many AVX-512 Xeons to prefer 256-bit vectors, AMD's Zen 1 to prefer 128-bit ones,
    -mprefer-vector-width shows each here), so a loop that vectorizes may use xmm, ymm or zmm registers. Only
    float arithmetic counts on xmm (scalar code uses xmm too, for bitwise ``andps`` say: fabs)."""
    return re.findall(rf"\tv(?:{ops})\s+[^\n]*%[xyz]mm", asm)


_ARITH = "addps|subps|mulps|divps|maxps|minps|cmpps|blendvps|blendmps"


def test_inner_loops_vectorize():
    gm, _ = fused(gelu_bias, torch.randn(64, 256), torch.randn(256))
    asm = _disassembly(gm)
    assert _packed(asm, _ARITH), "no packed float arithmetic in the kernel"
    assert "_ZGV" in asm or not cpp_build.has_libmvec(), "erf is not called through its vector variant"


def test_random_numbers_and_a_compare_cast_to_float_vectorize():
    """Dropout's kernel: philox and ``(rand > p).float()`` (written as a select: g++ 12 vectorizes no loop
    converting a compare's bool with a cast; the kernel ran 6x slower, 2026-11-27, 2-core Xeon)."""
    gm = _random_kernels(lambda x: F.gelu((torch.rand_like(x) > 0.1).float() * x), torch.randn(64, 256), "cpp")
    asm = _disassembly(gm)
    assert re.search(r"\tvpmul(udq|lq|ld)\s", asm), "philox's multiplies are not vector instructions"


def test_a_channels_last_max_pool_vectorizes():
    """relu + 3x3/2 max-pool over channels-last data: the window's masks and row pointers are computed once per
    output position, masked rows read a row of zeros, the masked selects are bitwise and the running maximum
    is ``kiln_max_nan``, so the channel loop vectorizes (it ran scalar: a ResNet-18 step spent 69 ms there,
    eager's max-pool 3-5 ms); values, NaN and signed zeros as eager's."""
    x = torch.randn(2, 32, 12, 12)
    x[0, 3, 4, 5], x[1, 7, 0, 0], x[0, 0, 11, 11] = float("nan"), float("-inf"), float("inf")
    x[1, 2] = -0.0
    x = x.to(memory_format=torch.channels_last)
    fn = lambda a: F.max_pool2d(torch.relu(a), 3, 2, 1)  # noqa: E731
    gm, _ = fused(fn, x)
    out, ref = gm(x), fn(x)
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.nan_to_num(), ref.nan_to_num())
    assert torch.equal(out.signbit(), ref.signbit())
    asm = _disassembly(gm)   # any vector width (``_packed``); bitwise selects count on ymm and zmm only
    vector_ops = _packed(asm, "maxps|cmpps|blendmps|blendvps") + re.findall(
        r"\tv(?:andn?ps|orps|pandn?|por|pternlogd)\s+[^\n]*%[yz]mm", asm)
    assert vector_ops, "no vector compare, max or blend in the max-pool kernel's library"


@pytest.mark.parametrize("k,stride,pad,dil,w", [(3, 2, 1, 1, 112), (3, 2, 1, 1, 33), (2, 2, 0, 1, 40),
                                                 (3, 1, 1, 1, 24), (5, 3, 2, 1, 50), (3, 2, 1, 2, 37)])
def test_nchw_pooling_runs_its_interior_without_bounds_checks(k, stride, pad, dil, w):
    """A window over NCHW data checks its column against the row's edges; the span of output columns where
    every check holds runs a second copy of the loop with the checks taken as true, its rows read through
    per-row pointers at a stride (``row[2*xi]``), so it vectorizes (ResNet-18's relu + max-pool: 44 -> 4 ms,
    eager 31). The edges keep the checks: values, NaN, infinities and signed zeros as eager's."""
    x = torch.randn(2, 3, 9, w)
    x[0, 0, :, 0], x[0, 1, 2, -1], x[1, 2, 4, 1] = float("nan"), float("-inf"), float("inf")
    x[1, 0] = -0.0
    fns = [lambda a: F.max_pool2d(torch.relu(a), k, stride, pad, dil),
           lambda a: F.max_pool2d(a * 2, k, stride, pad, dil)]
    if dil == 1:
        fns.append(lambda a: F.avg_pool2d(a + 1, k, stride, pad))
    for fn in fns:
        gm, _ = fused(fn, x)
        out, ref = gm(x), fn(x)
        assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.signbit(), ref.signbit())
        torch.testing.assert_close(out.nan_to_num(), ref.nan_to_num(), rtol=1e-6, atol=1e-6)
    name = re.search(r"cpp_build\.function\('(\w+)'", kernels(fused(fns[0], x)[0])[0].source).group(1)
    src = open(cpp_build.library(name)[:-3] + ".cpp").read()
    body = src[src.index(f"void {name}("):]
    if pad and f"xi_n = {fns[0](x).shape[-1]};" in body:   # a left edge: three loops over the output's columns,
        # the middle one reading rows unconditionally
        assert body.count("for (int32_t xi = ") == 3, body
        middle = body.split("for (int32_t xi = ")[2]
        assert "? in_ptr" not in middle and re.search(r"row\d+\[(\d\*)?xi\]", middle), middle


def test_one_hot_row_sums_need_no_loop():
    """Cross-entropy's backward sums a one-hot row (``sum_r where(r == t, -w*g, 0)``): the C++ kernel writes
    it as the row's one match plus the rest, with no loop over the row (BERT's 30522-class rows); values as
    eager's, ignored targets, out-of-range matches, infinities and NaN included."""
    import kiln
    logits = torch.randn(6, 50, requires_grad=True)
    target = torch.tensor([3, -100, 49, 0, 7, -100])
    ce = lambda x, t: F.cross_entropy(x, t, ignore_index=-100) * 1.5  # noqa: E731
    step = lambda f: torch.autograd.grad(f(logits, target), logits)[0]  # noqa: E731
    got, sources = kiln.run_and_get_code(lambda: step(kiln.compile(ce, codegen="cpp", cache=False)))
    names = set(re.findall(r"cpp_build\.function\('(\w+)'", "".join(sources)))
    assert any("hits" in open(cpp_build.library(n)[:-3] + ".cpp").read() for n in names)
    torch.testing.assert_close(got, step(ce), rtol=1e-6, atol=1e-7)

    def onehot(b, t):
        r = torch.arange(40)
        return (torch.where(r == t[:, None], -2.0, 0.0) * b[:, None]).sum(-1)
    b = torch.tensor([1.0, float("inf"), float("nan"), -0.0, 3.0, -1.0])
    t = torch.tensor([5, 0, 39, 2, 40, -1])   # the last two match nothing
    gm, _ = fused(onehot, b, t)
    out, ref = gm(b, t), onehot(b, t)
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.nan_to_num(), ref.nan_to_num())
    assert torch.equal(out.signbit(), ref.signbit())


def test_failed_build_falls_back_with_a_warning():
    """A unit that does not build (no compiler, a bad flag) is warned about when the runtime builds it,
    after code generation: the compiled graph then runs as ATen, as it was before fusion."""
    x, b = torch.randn(8, 16), torch.randn(16)
    scale = 1 + time.time_ns() % 997 / 1e4   # a unit of its own: no library of this process holds it

    def fn(x, b):
        return gelu_bias(x, b) * scale
    for opts, match in [(dict(cpp_compiler="/nonexistent/c++"), "cannot build C.. kernels"),
                        (dict(cpp_flags="-O1 --no-such-flag-kiln"), "exited with")]:
        before = dict(counters["codegen"])
        with pytest.warns(RuntimeWarning, match=match):
            out = kiln.compile(fn, codegen="cpp", **opts)(x, b)
        torch.testing.assert_close(out, fn(x, b))
        assert counters["codegen"]["cpp_build_failed"] == before.get("cpp_build_failed", 0) + 1
        assert counters["codegen"]["kernels"] > before.get("kernels", 0)   # fused, then not built
        assert counters["codegen"]["runtime_fallback"] == before.get("runtime_fallback", 0)


def test_compile_train_step_with_cpp_kernels():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 10))
    x, t = torch.randn(16, 32), torch.randint(0, 10, (16,))

    def step(m, x, t):
        loss = F.cross_entropy(torch.softmax(m(x), -1) * 3, t)
        loss.backward()
        return loss
    exact_model = copy.deepcopy(model).double()   # the float64 step: matmuls and norms sum in the host's order
    exact = step(exact_model, x.double(), t)
    ref = step(model, x, t)
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)   # the build must not fail
        out = kiln.compile(lambda x, t: step(model, x, t), codegen="cpp")(x, t)
    assert_close(out, ref, atol=1e-5, rtol=1e-5, exact=exact)
    for p, g, e in zip(model.parameters(), ref_grads, exact_model.parameters()):
        assert_close(p.grad, g, atol=1e-5, rtol=1e-4, exact=e.grad)


def test_auto_picks_cpp_on_the_cpu_when_a_compiler_works():
    x = torch.randn(4)
    assert resolve(current(codegen="auto"), [x]).name == "cpp"
    assert resolve(current(codegen="aten"), [x]).name == "aten"
    assert resolve(current(codegen="auto", cpp_compiler="/nonexistent/c++"), [x]).name == "aten"
    assert "no C++ compiler" in cpp_build.unusable(current(cpp_compiler="/nonexistent/c++"))
    assert "cannot build" in cpp_build.unusable(current(cpp_flags="-O1 --no-such-flag-kiln"))
    assert resolve(current(codegen="auto", cpp_flags="-O1 --no-such-flag-kiln"), [x]).name == "aten"
    counters.clear()
    with kiln.config.patch(codegen="auto"):   # what a user gets on the CPU: C++ kernels
        out, code = kiln.run_and_get_code(kiln.compile(lambda x: torch.sigmoid(x) * x + 1), x)
    torch.testing.assert_close(out, torch.sigmoid(x) * x + 1)
    assert "= kiln_pw_" in code[-1] and counters["codegen"]["kernels"] == 1, code[-1]
    assert counters["codegen"]["fallback"] == 0 and counters["codegen"]["cpp_build_failed"] == 0


def test_freezing_prepacks_convolutions_and_turns_batch_norm_affine_for_cpp():
    if not torch.backends.mkldnn.is_available():
        pytest.skip("needs mkldnn")
    conv = torch.nn.Conv2d(3, 8, 3)
    bn = torch.nn.BatchNorm2d(8)
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    mod = torch.nn.Sequential(conv, torch.nn.ReLU(), bn, torch.nn.ReLU()).eval()   # bn after relu: not folded
    x = torch.rand(2, 3, 10, 10)
    counters.clear()
    with torch.no_grad(), kiln.config.patch(freezing=True, codegen="cpp"):
        ref = mod(x)
        out, code = kiln.run_and_get_code(kiln.compile(lambda x: mod(x)), x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert "mkldnn__convolution_pointwise" in code[-1], code[-1]
    assert "batch_norm" not in code[-1] and counters["codegen"]["kernels"] >= 1, code[-1]


def _unit_function(gm, i=0) -> str:
    """The C++ text of the function kernel ``i`` of ``gm`` calls (from the library's saved source)."""
    name = re.search(r"cpp_build\.function\('(\w+)'", kernels(gm)[i].source).group(1)
    text = open(cpp_build.library(name)[:-3] + ".cpp").read()
    return text[text.index(f"void {name}("):].split("\n}\n")[0]


def test_parallel_regions_only_where_the_work_is_large():
    """Entering an OpenMP region costs about 2 us even under a false ``if``: static sizes below
    ``tuning.cpp_parallel_min`` get none, larger ones no ``if``."""
    gm, _ = fused(gelu_bias, torch.randn(8, 16), torch.randn(16))
    assert "omp parallel" not in _unit_function(gm) and "one thread" in _unit_function(gm)
    gm, _ = fused(gelu_bias, torch.randn(256, 256), torch.randn(256))
    text = _unit_function(gm)
    assert "#pragma omp parallel for" in text and " if(" not in text, text
    gm, _ = fused(lambda x: torch.softmax(x, -1), torch.randn(4, 16))
    assert "omp parallel" not in _unit_function(gm)


def test_launcher_checks_layouts_cheaply():
    x, y = torch.randn(16, 8), torch.randn(8, 16).t()   # y: a transposed graph input
    gm = check(lambda x, y: x * y, x, y, n_kernels=1)
    src = kernels(gm)[0].source
    assert "if not in0.is_contiguous():" in src and "if in1.stride() != (1, 16, ):" in src, src
    out = gm(x.t().contiguous().t(), y.contiguous())   # other layouts at run time: restrided copies
    torch.testing.assert_close(out, x * y)


def test_dump_writes_the_translation_unit(tmp_path):
    x = torch.randn(64, requires_grad=True)
    with kiln.config.patch(codegen="cpp", dump_dir=str(tmp_path)):
        kiln.compile(lambda x: (torch.sigmoid(x) * x).sum())(x).backward()
    units = sorted(p.name for p in tmp_path.rglob("*.cpp"))
    assert [u.split("_", 1)[1] for u in units] == ["kernels_forward.cpp", "kernels_backward.cpp"], units
    assert 'extern "C" void kiln_cpp_' in next(tmp_path.rglob("*kernels_forward.cpp")).read_text()


def test_row_loops_under_one_row_chunks_stay_vectorized():
    """A mean over few rows (cross-entropy's forward over 64 rows of 256) sums per-chunk partials; with one
    row per chunk g++ 12 proved the row loop runs once and left the row's exp loop scalar (94 us a call,
    eager's whole cross-entropy 18 us): the chunk count is opaque to it now, and the exp loop calls libmvec."""
    if not cpp_build.has_libmvec() or not shutil.which("objdump"):
        pytest.skip("no libmvec or no objdump")
    x, t = torch.randn(64, 256), torch.randint(0, 256, (64,))
    fn = lambda a, b: F.cross_entropy(a, b)  # noqa: E731
    gm, _ = fused(fn, x, t)
    compare(gm(x, t), fn, x, t, atol=1e-5, rtol=1.3e-6)
    names = [re.search(r"cpp_build\.function\('(\w+)'", k.source).group(1) for k in kernels(gm)]
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", cpp_build.library(names[0])],
                         capture_output=True, text=True).stdout
    body = asm.split(f"<{names[0]}>:\n", 1)[1].split("\n\n", 1)[0]
    assert "_ZGV" in body, "the exp loop of the cross-entropy kernel is scalar"


def test_scatters_are_cpp_kernels():
    """index_put (accumulating or not), scatter_add, index_add, index_copy and embedding's backward (repeated
    rows): a copy of the base then the writes in order, one thread; eager's values (bf16 within its rounding), nothing
    declined, and no module call left in the graph (a declined kernel's ATen nodes run inline)."""
    before = counters["codegen"]["cpp_declined"]
    x, v, i = torch.randn(5, 3), torch.randn(4, 3), torch.tensor([0, 4, 4, -1])
    check(lambda x, i, v: (x.index_put((i,), v, accumulate=True), x.index_put((i[:2],), v[:2] * 3)), x, i, v)
    check(lambda x, i, v: (x.scatter_add(0, i.abs().view(4, 1).expand(4, 3), v) * 2,
                           x.index_add(0, i.abs(), v, alpha=2.0), x.index_copy(0, i[:2], v[:2])), x, i, v)
    xb, vb = x.bfloat16(), v.bfloat16()
    check(lambda x, i, v: x.index_add(0, i.abs(), v * 2), xb, i, vb, atol=2e-2, rtol=2e-2)   # adds round: order

    def emb(w, idx, g):
        w = w.detach().requires_grad_()
        return torch.autograd.grad(F.embedding(idx, w, padding_idx=0), w, g)
    w, idx = torch.randn(6, 4), torch.tensor([[1, 1, 0], [5, 1, 2]])
    gm = check(emb, w, idx, torch.randn(2, 3, 4))
    assert counters["codegen"]["cpp_declined"] == before
    assert [k.name for k in kernels(gm) if k.name.startswith("kiln_scatter")] and not [
        n for n in gm.graph.nodes if n.op == "call_function" and "index_put" in str(n.target)], gm.code




def test_per_channel_values_of_a_channels_last_kernel_are_computed_once_per_channel():
    """Eval conv + batch norm + ReLU goes channels-last on the CPU (layout_devices='auto'), so the kernel after
    the convolution walks channels innermost: BN's scale (an rsqrt of the running variance) depends on the
    channel alone and is computed into a table before the loops (16 rsqrts, not one per element), which the
    inner loop reads; eager's values."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1, bias=False), torch.nn.BatchNorm2d(16),
                              torch.nn.ReLU(), torch.nn.Conv2d(16, 4, 1)).eval()   # the BN's output stays NHWC
    net[1].running_var.uniform_(0.5, 2.0)
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        out, code = kiln.run_and_get_code(torch.compile(net, backend="kiln", options={"codegen": "cpp"}), x)
        torch.testing.assert_close(out, net(x), atol=1e-5, rtol=1e-5)
    fns = [f for c in code for f in c.split('extern "C"')[1:] if "sqrtf" in f]
    assert len(fns) == 1, code
    prologue, loops = fns[0].split("xo_n", 1)
    assert "[16];" in prologue and "sqrtf" in prologue and "sqrtf" not in loops, fns[0]


def test_a_dispatch_mode_sees_the_kernels_allocations():
    """Launchers allocate through torch's C++ helper (no dispatcher), except under a dispatch mode (a memory or
    FLOP counter, kiln_bench.livemem), which must see every tensor a kernel makes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))
    gm, n = fused(lambda x: (x.sin() * 2).exp(), torch.randn(8, 8))
    assert n == 1
    with Seen() as seen:
        gm(torch.randn(8, 8))
    assert torch.ops.aten.empty_strided.default in seen.ops, seen.ops
