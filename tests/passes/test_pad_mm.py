"""pad_matmuls: misaligned mm / addmm / bmm padded to tensor-core alignment, same values as eager."""
import warnings

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import kiln  # registers the backend
from kiln.debug import counters
from kiln.passes.pad_mm import mm_cols, mm_rows, pad_matmuls
from tests.numerics import assert_product_close

# Padding and blocking change the BLAS call (its shape, its leading dimensions, a block's width), so the
# BLAS may sum K in another order than eager's one product: which order depends on the host's kernels (MKL's
# AVX2 paths on AMD, AVX-512 on most Xeons; MKL_ENABLE_INSTRUCTIONS=AVX2 shows it here). Values are compared
# with the float64 product of the same inputs, within K terms' rounding (tests/numerics.py).

aten = torch.ops.aten


SMALL_OPTIONS = {"tuning.pad_mm_kernel_bytes": 0, "tuning.pad_mm_min_flops_per_byte": 0}


@pytest.fixture
def small():
    """Pad even the small matmuls of these tests: the thresholds as options (in force for torch.compile)
    and as the arguments of ``pad_matmuls`` (the fixture's value)."""
    with kiln.config.patch(**SMALL_OPTIONS):
        yield {"kernel_bytes": 0, "min_flops_per_byte": 0}


def traced(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def count(gm, target):
    return sum(n.target is target for n in gm.graph.nodes)


class CheckMeta(torch.fx.Interpreter):
    """Runs the graph and checks every tensor's shape, strides and dtype against its meta['val']."""

    def run_node(self, n):
        out = super().run_node(n)
        val = n.meta.get("val")
        if isinstance(out, torch.Tensor) and isinstance(val, torch.Tensor):
            assert (out.shape, out.stride(), out.dtype) == (val.shape, val.stride(), val.dtype), n.format_node()
        return out


def run_checked(gm, *args):
    return CheckMeta(gm).run(*args)


def test_pads_misaligned_n_and_keeps_values(small):
    a, b = torch.randn(64, 96), torch.randn(96, 1001)
    fn = lambda a, b: (a @ b).relu()  # noqa: E731
    gm = traced(fn, a, b)
    assert pad_matmuls(gm, devices=None, **small) == 1
    pads = [n for n in gm.graph.nodes if n.target is aten.constant_pad_nd.default]
    assert len(pads) == 1 and pads[0].meta["val"].shape == (96, 1004)   # fp32: multiple of 4
    assert count(gm, aten.slice.Tensor) == 1 and count(gm, aten.clone.default) == 1
    out = run_checked(gm, a, b)
    assert out.stride() == (1001, 1)
    assert_product_close(out, fn, a, b, terms=96)   # zero columns are exact, but N's blocking is the BLAS's


@pytest.mark.parametrize("bias_shape", [None, (1001,), (1, 1001), (66, 1001), (66, 1)])
def test_a_returned_product_is_computed_in_blocks_of_rows(small, bias_shape):
    """A padded product the graph returns would be alive beside its contiguous copy (twice the memory of,
    say, GPT-2's logits): ``mm_rows`` computes it a block of rows at a time, copying each into the result."""
    a, b = torch.randn(66, 98), torch.randn(98, 1001)
    args = (a, b) if bias_shape is None else (torch.randn(bias_shape), a, b)
    fn = torch.mm if bias_shape is None else (lambda bias, a, b: torch.addmm(bias, a, b, beta=0.5, alpha=2.0))
    gm = traced(fn, *args)
    assert pad_matmuls(gm, devices=None, out_blocks=4, **small) == 1
    calls = [n for n in gm.graph.nodes if n.target is mm_rows]
    assert len(calls) == 1 and calls[0].args[-1] == 17   # 66 rows in 4 blocks
    assert count(gm, aten.clone.default) == 0 and count(gm, aten.mm.default) + count(gm, aten.addmm.default) == 0
    out = run_checked(gm, *args)
    assert out.is_contiguous()
    assert_product_close(out, fn, *args, terms=a.shape[1] + 1)


@pytest.mark.parametrize("bias_shape", [None, (1001,), (1, 1001), (66, 1001), (66, 1)])
@pytest.mark.parametrize("weight", ["transposed", "row_major"])
def test_a_returned_product_misaligned_in_n_only_goes_by_blocks_of_columns(small, bias_shape, weight):
    """K aligned: blocks of columns, a Linear's transposed weight sliced as it is (only the last block padded),
    so no padded copy of the weight exists at all."""
    a = torch.randn(66, 96)
    b = torch.randn(1001, 96).t() if weight == "transposed" else torch.randn(96, 1001)
    args = (a, b) if bias_shape is None else (torch.randn(bias_shape), a, b)
    fn = torch.mm if bias_shape is None else (lambda bias, a, b: torch.addmm(bias, a, b, beta=0.5, alpha=2.0))
    gm = traced(fn, *args)
    assert pad_matmuls(gm, devices=None, out_blocks=4, **small) == 1
    calls = [n for n in gm.graph.nodes if n.target is mm_cols]
    assert len(calls) == 1 and calls[0].args[4] == 252   # ceil(1001 / 4) rounded up to 4 (fp32)
    assert count(gm, aten.constant_pad_nd.default) == 0 and count(gm, aten.clone.default) == 0
    out = run_checked(gm, *args)
    assert out.is_contiguous()
    assert_product_close(out, fn, *args, terms=a.shape[1] + 1)


def _product(bias):
    """mm_cols' product as a function of (a, b, bias), for ``assert_product_close``."""
    if bias is None:
        return lambda a, b, bias: torch.mm(a, b)
    return lambda a, b, bias: torch.addmm(bias, a, b, beta=0.5, alpha=2.0)


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("cols", [252, 1004, 8])
@pytest.mark.parametrize("weight", ["transposed", "row_major"])
@pytest.mark.parametrize("bias_shape", [None, (1001,), (66, 1001), (66, 1)])
def test_mm_cols_any_block_width(cols, weight, bias_shape, in_place):
    """One block wider than N (``pad_mm_out_blocks=1``), narrow blocks (more levels than rows need), either
    weight layout, in the result's storage or an allocated block: the values are the product's."""
    a = torch.randn(66, 96)
    b = torch.randn(1001, 96).t() if weight == "transposed" else torch.randn(96, 1001)
    bias = None if bias_shape is None else torch.randn(bias_shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # an ``out=`` of the wrong shape is resized with a warning
        got = mm_cols(a, b, bias, 4, cols, in_place, beta=0.5, alpha=2.0)
    assert_product_close(got, _product(bias), a, b, bias, terms=97)


@pytest.mark.parametrize("bias_shape", [None, (1001,), (66, 1001)])
def test_mm_cols_allocates_nothing_beside_its_result(bias_shape):
    """Each block's product is computed in the storage of result rows not yet written: no tensor of
    more than a bias block's size exists besides the result (GPT-2's logits: ~0 MiB instead of one block)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    a, b = torch.randn(66, 96), torch.randn(1001, 96).t()
    bias = None if bias_shape is None else torch.randn(bias_shape)
    sizes = []

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and func._schema.name not in ("aten::view", "aten::slice",
                                                                            "aten::alias", "aten::as_strided"):
                    sizes.append((func._schema.name, t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
            return out
    with Allocations():
        out = mm_cols(a, b, bias, 4, 252, beta=0.5, alpha=2.0)
    assert_product_close(out, _product(bias), a, b, bias, terms=97)
    ptr = out.untyped_storage().data_ptr()
    foreign = [(name, n) for name, p, n in sizes if p != ptr and n > 4 * 1001]
    assert not foreign, foreign


def test_aligned_or_tiny_left_alone(small):
    gm = traced(torch.mm, torch.randn(64, 96), torch.randn(96, 1000))
    assert pad_matmuls(gm, devices=None, **small) == 0
    assert count(gm, aten.constant_pad_nd.default) == 0


def test_default_thresholds():
    tiny = traced(torch.mm, torch.randn(64, 96), torch.randn(96, 1001))
    assert pad_matmuls(tiny, devices=None) == 0                      # 1.2e7 FLOPs
    mode = torch._subclasses.fake_tensor.FakeTensorMode()
    with mode:   # GPT-2's lm_head: fake tensors, nothing is computed
        x, w = torch.empty(8192, 768, dtype=torch.bfloat16), torch.empty(50257, 768, dtype=torch.bfloat16)
        g = torch.empty(8192, 50257, dtype=torch.bfloat16)
    lm_head = make_fx(lambda x, w: x @ w.t(), tracing_mode="fake")(x, w)
    grads = make_fx(lambda g, x, w: (g.t() @ x, g @ w), tracing_mode="fake")(g, x, w)
    assert pad_matmuls(lm_head, devices=None) == 1
    assert pad_matmuls(grads, devices=None) == 2
    with mode:   # decode-time logits (M = 8, d 4096): 3.3e9 FLOPs but 4 FLOPs per byte the pad copies
        x8, w8 = torch.empty(8, 4096, dtype=torch.bfloat16), torch.empty(50257, 4096, dtype=torch.bfloat16)
    assert pad_matmuls(make_fx(lambda x, w: x @ w.t(), tracing_mode="fake")(x8, w8), devices=None) == 0
    with mode:   # the same d 4096 with 2048 tokens: 8.4e11 FLOPs, ~680 FLOPs per byte
        x2k = torch.empty(2048, 4096, dtype=torch.bfloat16)
    assert pad_matmuls(make_fx(lambda x, w: x @ w.t(), tracing_mode="fake")(x2k, w8), devices=None) == 1
    with mode:   # MLP-Mixer's token mixing (196 tokens, batch 32 x 768 channels): 3.7e9 FLOPs, but the two
        # kernels padding adds cost more than it saves (H200: 33 us plain, 69 padded and copied back)
        xt, wt, bt = (torch.empty(24576, 384, dtype=torch.bfloat16), torch.empty(196, 384, dtype=torch.bfloat16),
                      torch.empty(196, dtype=torch.bfloat16))
        gt = torch.empty(24576, 196, dtype=torch.bfloat16)
    mix = make_fx(lambda x, w, b, g: (torch.addmm(b, x, w.t()), g @ w, g.t() @ x), tracing_mode="fake")
    assert pad_matmuls(mix(xt, wt, bt, gt), devices=None) == 0
    assert pad_matmuls(mix(xt, wt, bt, gt), devices=None, kernel_bytes=0) == 3   # the launches tip it
    with mode:   # a returned [8192, 1001] product (1.3e10 FLOPs) would go by 8 column blocks: 16 launches
        xc, wc = torch.empty(8192, 768, dtype=torch.bfloat16), torch.empty(1001, 768, dtype=torch.bfloat16)
    head = make_fx(lambda x, w: x @ w.t(), tracing_mode="fake")
    assert pad_matmuls(head(xc, wc), devices=None) == 0
    assert pad_matmuls(head(xc, wc), devices=None, out_blocks=1) == 1


def test_devices_filter(small):
    gm = traced(torch.mm, torch.randn(64, 96), torch.randn(96, 1001))
    assert pad_matmuls(gm, **small) == 0          # default: CUDA operands only


def test_gpt2_backward_shares_one_pad(small):
    """g.t() @ x pads M (g.t() is column-major), g @ w pads K: both read one padded g, in g's layout."""
    g, x, w = torch.randn(32, 1001), torch.randn(32, 24), torch.randn(1001, 24)
    gm = traced(lambda g, x, w: (g.t() @ x, g @ w), g, x, w)
    assert pad_matmuls(gm, devices=None, **small) == 2
    pads = [n for n in gm.graph.nodes if n.target is aten.constant_pad_nd.default]
    assert sorted(tuple(p.meta["val"].shape) for p in pads) == [(32, 1004), (1004, 24)]
    assert all(p.meta["val"].is_contiguous() for p in pads)
    dw, dx = run_checked(gm, g, x, w)
    # zero padding is exact, but a BLAS may block a padded K differently (another summation order)
    assert_product_close(dw, lambda g, x: g.t() @ x, g, x, terms=32)
    assert_product_close(dx, lambda g, w: g @ w, g, w, terms=1004)


def test_row_major_m_not_padded(small):
    gm = traced(torch.mm, torch.randn(1001, 96), torch.randn(96, 64))
    assert pad_matmuls(gm, devices=None, **small) == 0


@pytest.mark.parametrize("bias_shape", [(1001,), (1, 1001), (66, 1001), (66, 1)])
def test_addmm_bias_padded(small, bias_shape):
    bias, a, b = torch.randn(bias_shape), torch.randn(66, 98), torch.randn(98, 1001)
    fn = lambda bias, a, b: torch.addmm(bias, a, b, beta=0.5, alpha=2.0).relu()  # noqa: E731
    gm = traced(fn, bias, a, b)
    assert pad_matmuls(gm, devices=None, **small) == 1
    assert count(gm, aten.addmm.default) == 1 and count(gm, aten.mm.default) == 0
    assert_product_close(run_checked(gm, bias, a, b), fn, bias, a, b, terms=99)   # relu keeps the bound


def test_bmm_m_k_n(small):
    a, b = torch.randn(3, 50, 37).transpose(1, 2), torch.randn(3, 50, 23)   # a column-major, M = 37
    fn = lambda a, b: torch.bmm(a, b)  # noqa: E731
    gm = traced(fn, a, b)
    assert pad_matmuls(gm, devices=None, **small) == 1
    out = run_checked(gm, a, b)
    assert out.is_contiguous()
    assert_product_close(out, fn, a, b, terms=50)
    gm = traced(fn, torch.randn(3, 37, 52), torch.randn(3, 52, 24))           # row-major, all aligned but M
    assert pad_matmuls(gm, devices=None, **small) == 0


# -- through torch.compile ----------------------------------------------------------------------------

def compiled_grads(model, x, **options):
    """The compiled model's output and the gradients of ``out.square().sum()``: parameters', then x's."""
    out = torch.compile(model, backend="kiln", options=options)(x)
    out.square().sum().backward()
    return [out.detach()] + [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def _linear_step(x, w, b):
    """A Linear's output and the gradients of ``out.square().sum()`` (weight, bias, input) as
    ``compiled_grads`` lists them, written as products: with |x|, |w|, |b| each element's magnitude."""
    out = x @ w.t() if b is None else x @ w.t() + b
    g = 2 * out
    return [out, g.t() @ x] + ([] if b is None else [g.sum(0)]) + [g @ w]


def assert_linear_step(got, lin, x):
    """``compiled_grads``' values against the float64 step: a gradient sums M or N products of the
    output's K + 1 terms."""
    (m, k), n = x.shape, lin.out_features
    assert_product_close(got, _linear_step, x, lin.weight, lin.bias, terms=k + 2 + max(m, n))


@pytest.mark.parametrize("m,k,n,bias", [(64, 96, 1001, True), (61, 96, 64, False), (64, 97, 64, True),
                                        (63, 98, 1001, False)], ids=["N", "M", "K", "MKN"])
def test_compiled_linear_values_and_grads(small, m, k, n, bias):
    counters.clear()
    lin = torch.nn.Linear(k, n, bias=bias)
    x = torch.randn(m, k, requires_grad=True)
    got = compiled_grads(lin, x, pad_matmuls="always")
    assert_linear_step(got, lin, x)
    assert counters["kiln"]["pad_mm"] >= 1   # a misaligned M is K of the weight gradient


def test_compiled_bmm(small):
    counters.clear()

    def fn(a, b):
        return torch.bmm(a, b).relu()
    a = torch.randn(2, 33, 45, requires_grad=True)
    b = torch.randn(2, 45, 70, requires_grad=True)
    out = torch.compile(fn, backend="kiln", options={"pad_matmuls": "always"})(a, b)
    out.sum().backward()

    def step(a, b):   # the values and gradients as products (relu's mask: all ones for |a|, |b|)
        p = torch.bmm(a, b)
        mask = (p > 0).to(p.dtype)
        return p.relu(), torch.bmm(mask, b.transpose(1, 2)), torch.bmm(a.transpose(1, 2), mask)
    assert_product_close((out, a.grad, b.grad), step, a, b, terms=70)
    assert counters["kiln"]["pad_mm"] >= 2


def test_compiled_linear_triton_target(small):
    """Through fusion (Triton interpreter on the CPU): pads, slices and the copy lowered as kernels."""
    counters.clear()
    lin = torch.nn.Linear(36, 101)
    x = torch.randn(27, 36, requires_grad=True)
    got = compiled_grads(lin, x, pad_matmuls="always", codegen="triton")
    assert_linear_step(got, lin, x)
    assert counters["kiln"]["pad_mm"] == 3


def test_thresholds_are_options():
    """A small matmul pays under the default thresholds only when the options lower them."""
    for options, padded in (({}, False), (SMALL_OPTIONS, True)):
        counters.clear()
        torch._dynamo.reset()
        lin = torch.nn.Linear(96, 1001)
        x = torch.randn(64, 96, requires_grad=True)
        got = compiled_grads(lin, x, pad_matmuls="always", **options)
        assert_linear_step(got, lin, x)
        assert (counters["kiln"]["pad_mm"] > 0) == padded, options


@pytest.mark.parametrize("mode", ["never", "auto"])
def test_never_and_auto_on_cpu_leave_graph(small, mode):
    counters.clear()
    seen = []
    lin = torch.nn.Linear(96, 1001)
    x = torch.randn(64, 96, requires_grad=True)
    got = compiled_grads(lin, x, pad_matmuls=mode, post_grad_custom_post_pass=lambda g: seen.append(
        sum(n.target is aten.constant_pad_nd.default for n in g.nodes)))
    assert_linear_step(got, lin, x)
    assert counters["kiln"]["pad_mm"] == 0
    assert seen and not any(seen)


def test_always_reaches_post_grad_hook(small):
    seen = []
    lin = torch.nn.Linear(96, 1001)
    x = torch.randn(64, 96, requires_grad=True)
    compiled_grads(lin, x, pad_matmuls="always", post_grad_custom_post_pass=lambda g: seen.append(
        sum(n.target in (aten.constant_pad_nd.default, mm_cols, mm_rows) for n in g.nodes)))
    assert seen and all(seen)     # forward (its returned product by blocks) and backward both padded


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(512, 768, 1001), (333, 257, 515)])
def test_cuda_bf16_against_fp64(small, shape):
    m, k, n = shape
    counters.clear()
    lin = torch.nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    got = compiled_grads(lin, x)     # 'auto' pads on CUDA
    assert counters["kiln"]["pad_mm"] >= 2
    lin64 = torch.nn.Linear(k, n, device="cuda", dtype=torch.float64)
    lin64.load_state_dict({k_: v.double() for k_, v in lin.state_dict().items()})
    x64 = x.detach().double().requires_grad_()
    out64 = lin64(x64)
    out64.square().sum().backward()
    ref = [out64.detach()] + [p.grad for p in lin64.parameters()] + [x64.grad]
    for g, r in zip(got, ref):
        err = (g.double() - r).abs().max() / r.abs().max()
        assert err < 2e-2, err


@pytest.mark.parametrize("where,want", [("inference", {"inference": True, "forward": False}),
                                        ("always", {"inference": True, "forward": True}),
                                        ("never", {"inference": False, "forward": False})])
def test_returned_blocks_in_place_by_graph_kind(small, where, want):
    """``tuning.pad_mm_in_place``: a returned product's column blocks go into the result's own storage in
    inference graphs (the result dominates their peak), through one allocated block in training graphs."""
    got = {}
    for kind in ("inference", "forward"):
        torch._dynamo.reset()
        seen = []
        lin = torch.nn.Linear(96, 1001)
        x = torch.randn(64, 96, requires_grad=kind == "forward")
        fn = kiln.compile(lin, pad_matmuls="always", **{"tuning.pad_mm_in_place": where},
                          post_grad_custom_post_pass=lambda g: seen.extend(
                              n.args[5] for n in g.nodes if n.target is mm_cols))
        with torch.set_grad_enabled(kind == "forward"):
            assert_product_close(fn(x), lambda x, w, b: x @ w.t() + b, x, lin.weight, lin.bias, terms=97)
        assert len(seen) == 1, seen
        got[kind] = seen[0]
    assert got == want
