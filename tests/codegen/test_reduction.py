"""Reductions with their prologues and epilogues: one kernel per row domain."""
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.codegen.schedule.split import split_count
from kiln.options import Tuning
from tests.codegen.util import aten_ops, check, fused, kernels


LOOPED = Tuning().persistent_max + 904   # a row length that loops (and is no multiple of a block)


def layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b)


def layer_norm_manual(x, weight, bias):   # the seed's test_layer_norm
    mean = torch.mean(x, -1, keepdim=True)
    centered = x - mean
    var = torch.sum(centered * centered, -1, keepdim=True) / x.size(-1)
    rvar = 1.0 / torch.sqrt(var + 1e-5)
    return (x - mean) * rvar * weight + bias


def rms_norm(x, w):   # T5 LayerNorm
    v = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return w * (x * torch.rsqrt(v + 1e-6)).to(x.dtype)


def grads(fn, n_inputs):
    """fn's forward+backward as one function returning input gradients."""
    def run(*args):
        ins = [a.detach().requires_grad_(i < n_inputs) for i, a in enumerate(args[:-1])]
        out = fn(*ins)
        return torch.autograd.grad(out, ins[:n_inputs], args[-1])
    return run


@pytest.mark.parametrize("fn", [layer_norm, layer_norm_manual], ids=["F.layer_norm", "manual"])
@pytest.mark.parametrize("n", [8, LOOPED], ids=["persistent", "looped"])
def test_layer_norm_forward_is_one_kernel(fn, n):
    check(fn, torch.randn(4, n), torch.randn(n), torch.randn(n), n_kernels=1, atol=1e-4, rtol=1e-4)


def test_layer_norm_backward_at_most_two_kernels():
    # the backward graph alone, as AOTAutograd hands it over: saved mean and rstd are inputs
    def bwd(g, x, mean, rstd, w, b):
        return torch.ops.aten.native_layer_norm_backward.default(g, x, [x.shape[-1]], mean, rstd, w, b,
                                                                 [True, True, True])
    x, w, b, g = torch.randn(6, 32), torch.randn(32), torch.randn(32), torch.randn(6, 32)
    _, mean, rstd = torch.ops.aten.native_layer_norm.default(x, [32], w, b, 1e-5)
    gm = check(bwd, g, x, mean, rstd, w, b, atol=1e-4, rtol=1e-4)
    assert len(kernels(gm)) <= 2


def test_layer_norm_forward_backward_numerics():
    fn = grads(layer_norm, 3)
    x, w, b, g = torch.randn(5, 24), torch.randn(24), torch.randn(24), torch.randn(5, 24)
    gm = check(fn, x, w, b, g, atol=1e-4, rtol=1e-4)
    assert len(kernels(gm)) <= 3   # forward statistics, row backward, column backward


def test_rms_norm_one_kernel_each_way():
    check(rms_norm, torch.randn(4, 64), torch.randn(64), n_kernels=1, atol=1e-5, rtol=1e-5)
    gm = check(grads(rms_norm, 2), torch.randn(4, 64), torch.randn(64), torch.randn(4, 64), atol=1e-4, rtol=1e-4)
    assert len(kernels(gm)) <= 2


def test_rms_norm_half():
    x, w = torch.randn(4, 64, dtype=torch.float16), torch.randn(64, dtype=torch.float16)
    check(rms_norm, x, w, n_kernels=1, atol=1e-2, rtol=1e-2, ref_fp64=True)


@pytest.mark.parametrize("n", [10, LOOPED], ids=["persistent", "looped"])
def test_softmax_forward_one_kernel_backward_one_kernel(n):
    x = torch.randn(3, n)
    check(lambda x: torch.softmax(x, -1), x, n_kernels=1, atol=1e-5, rtol=1e-4)
    check(lambda x: torch.log_softmax(x, -1), x, n_kernels=1, atol=1e-5, rtol=1e-4)
    check(grads(lambda x: torch.softmax(x, -1), 1), x, torch.randn(3, n), atol=1e-5, rtol=1e-4)
    gm, n_k = fused(lambda g, y: torch.ops.aten._softmax_backward_data.default(g, y, -1, torch.float32),
                    torch.randn(3, n), torch.softmax(x, -1))
    assert n_k == 1


def _one_loop_pair(gm):
    """Whether a kernel of ``gm`` updates a running max and a rescaled running sum in one loop."""
    srcs = [k.source for k in kernels(gm)]
    return any("tl.maximum(_acc" in s and "* tl.exp((_acc" in s for s in srcs)


@pytest.mark.parametrize("fn", [lambda x: torch.softmax(x, -1), lambda x: torch.log_softmax(x, -1),
                                lambda x: torch.logsumexp(x, -1)], ids=["softmax", "log_softmax", "logsumexp"])
def test_online_softmax_rows_with_infinities(fn):
    """Looped rows: the max and the sum of exponentials in one pass (the sum rescaled as the max grows)
    must equal eager on rows whose max comes late, rows of -inf (nan in eager), rows with +inf,
    masked rows and huge values, at a row length that is not a multiple of the block."""
    n = LOOPED
    x = torch.randn(8, n) * 3
    x[0] = torch.linspace(-50, 80, n)               # the max keeps growing: every block rescales
    x[1] = float("-inf")                             # eager: nan
    x[2, :n // 2] = float("-inf")                      # -inf blocks before the first finite value
    x[3, 7] = float("inf")                           # eager: nan where the max is inf
    x[4] = torch.randn(n) * 1e4                      # exp underflows for all but the max
    x[5, ::2] = float("-inf")
    x[6] = 88.0                                      # exp(88) near the fp32 limit, all equal
    gm = check(fn, x, atol=1e-5, rtol=1e-4)
    assert _one_loop_pair(gm) == (fn(torch.zeros(1, 1)).shape != (1,))   # logsumexp keeps two passes


def test_online_softmax_switch_gives_the_same_values():
    x = torch.randn(5, LOOPED)
    on = check(lambda x: torch.softmax(x, -1), x, atol=1e-5, rtol=1e-4)
    assert _one_loop_pair(on)
    with kiln.config.patch(**{"tuning.online_softmax": False}):
        off = check(lambda x: torch.softmax(x, -1), x, atol=1e-5, rtol=1e-4)
    assert not _one_loop_pair(off)


def test_online_cross_entropy_bf16_logits():
    """Cross-entropy over long bf16 rows (GPT-2's loss shape, small): forward and backward against fp64."""
    x = (torch.randn(6, LOOPED) * 4).to(torch.bfloat16)
    t = torch.tensor([1, LOOPED - 1, 3, 0, -100, 1500])
    gm = check(lambda x, t: F.cross_entropy(x.float(), t), x, t, atol=1e-4, rtol=1e-4, ref_fp64=True)
    assert _one_loop_pair(gm)
    check(grads(lambda x, t: F.cross_entropy(x.float(), t), 1), x, t, torch.tensor(1.0), atol=1e-2, rtol=1e-2,
          ref_fp64=True)


def test_row_loops_set_l2_eviction_policies():
    """A buffer that a later row loop reads again is loaded evict_last (it stays in L2 for the next
    pass), its last read evict_first; a one-loop kernel keeps the default policy (the next kernel may
    read its input from L2); the switch removes them."""
    x = torch.randn(3, LOOPED)
    src = kernels(check(lambda x: torch.softmax(x, -1), x, atol=1e-5, rtol=1e-4))[0].source
    first, second = src.split("for roffset")[1:3]
    assert "evict_last" in first and "evict_first" not in first
    assert "evict_first" in second and "evict_last" not in second
    src = kernels(check(lambda x: x.sum(-1), x, atol=1e-4, rtol=1e-4))[0].source
    assert "eviction_policy" not in src
    with kiln.config.patch(**{"tuning.evict_policies": False}):
        src = kernels(check(lambda x: torch.softmax(x, -1), x, atol=1e-5, rtol=1e-4))[0].source
    assert "eviction_policy" not in src
    with kiln.config.patch(**{"tuning.evict_single_pass": True}):   # one pass: streamed too
        src = kernels(check(lambda x: x.sum(-1), x, atol=1e-4, rtol=1e-4))[0].source
    assert "evict_first" in src and "evict_last" not in src


@pytest.fixture
def small_folds():
    """Fold column reductions of small test tensors: 8 programs of at least 4 rows."""
    with kiln.config.patch(tuning=dict(split_min_r=32, split_min_numel=256, fold_programs=8, fold_min_chunk=4)):
        yield


def _folded(gm):
    return [k for k in kernels(gm) if "xpid" in k.source]


@pytest.mark.parametrize("fn,shape,tol", [
    (lambda x: x.sum(0), (40, 48), 1e-4),                 # a bias gradient: 5 rows per program, 48 of 64 lanes
    (lambda x: (x.amax(0), x.amin(0)), (64, 33), 0),
    (lambda x: (x * 3).sum((0, 1)), (4, 16, 24), 1e-4),   # rows over two dims
    (lambda x: x.float().sum(0).to(torch.bfloat16), (96, 40), 2e-2),
], ids=["sum", "max_min", "two_row_dims", "cast"])
def test_folded_column_reduction(small_folds, fn, shape, tol):
    """A column reduction of short rows runs as one program per chunk of rows (each row read once,
    along its columns), its final pass over the chunks chained: one kernel, right on new values too
    (the chained final's counter is reset). Folded with no row kernel to join (``tuning.fold='always'``)."""
    x = torch.randn(shape)
    with kiln.config.patch(**{"tuning.fold": "always"}):
        gm = check(fn, x, n_kernels=1, atol=tol, rtol=tol)
    assert _folded(gm)
    x = torch.randn(shape)
    torch.testing.assert_close(gm(x), fn(x), atol=tol, rtol=tol)


@pytest.mark.parametrize("rows", [74, 37 * 8 + 3])
def test_folded_chunks_that_do_not_divide_the_rows(small_folds, rows):
    """Rows of no power-of-two factor (ViT's 32 x 197 tokens) keep the programs: ceil(rows / 8) rows per
    chunk, the last chunk short and masked, not 2 programs of 37 (or 1 of 299)."""
    from kiln.codegen.schedule.split import fold_split
    from kiln.options import current
    assert fold_split((rows, 48), (0,), current().tuning) == 8
    x, w, b, g = torch.randn(rows, 48), torch.randn(48), torch.randn(48), torch.randn(rows, 48)
    with kiln.config.patch(**{"tuning.fold": "always"}):
        gm = check(lambda x: x.sum(0), x, n_kernels=1, atol=1e-4, rtol=1e-4)
    (k,) = _folded(gm)
    assert f"xindex < {rows}" in k.source
    bwd = lambda g, x, m, r, w, b: torch.ops.aten.native_layer_norm_backward.default(  # noqa: E731
        g, x, [48], m, r, w, b, [True, True, True])
    _, mean, rstd = torch.ops.aten.native_layer_norm.default(x, [48], w, b, 1e-5)
    assert _folded(check(bwd, g, x, mean, rstd, w, b, atol=1e-4, rtol=1e-4))


def test_norm_backward_folds_weight_gradients_into_the_row_kernel(small_folds):
    """RMSNorm and layer norm backward: dx by rows, and the weight (and bias) gradients' partials in
    the same kernel, the weights' gradients being sums over the rows it already reads."""
    x, w, b, g = torch.randn(64, 48), torch.randn(48), torch.randn(48), torch.randn(64, 48)
    gm = check(grads(rms_norm, 2), x, w, g, atol=1e-4, rtol=1e-4)
    assert len(kernels(gm)) == 1 and _folded(gm)
    bwd = lambda g, x, m, r, w, b: torch.ops.aten.native_layer_norm_backward.default(  # noqa: E731
        g, x, [48], m, r, w, b, [True, True, True])
    _, mean, rstd = torch.ops.aten.native_layer_norm.default(x, [48], w, b, 1e-5)
    gm = check(bwd, g, x, mean, rstd, w, b, atol=1e-4, rtol=1e-4)
    assert len(kernels(gm)) == 1
    assert _folded(gm)[0].source.count("_col") >= 4   # two accumulators: the weight's and the bias's


def test_pointwise_producer_joins_the_folded_bias_gradient(small_folds):
    """GELU backward and its bias gradient: the pointwise gradient and the column sum of it in one
    kernel over (rows, columns) when kept folded; by default (no row reduction shares its reads) the
    classic split: column tiles, no program per chunk of rows. Right either way."""
    fn = grads(lambda x, b: F.gelu(x + b, approximate="tanh"), 2)
    x, b, g = torch.randn(64, 40), torch.randn(40), torch.randn(64, 40)
    gm = check(fn, x, b, g, atol=1e-4, rtol=1e-4)
    assert not _folded(gm)
    check(lambda x: x.sum(0), torch.randn(40, 48), atol=1e-4, rtol=1e-4)
    assert not _folded(check(lambda x: (x.amax(0), x.sum(0)), torch.randn(64, 48), atol=1e-4, rtol=1e-4))
    with kiln.config.patch(**{"tuning.fold": "always"}):
        gm = check(fn, x, b, g, atol=1e-4, rtol=1e-4)
    assert _folded(gm) and len(kernels(gm)) == 1


def test_folded_partials_with_an_unchained_final(small_folds):
    # 8 programs x 48 columns above tail_max: the final is a kernel of its own
    with kiln.config.patch(tuning=dict(fold="always", tail_max=16)):
        gm = check(lambda x: x.sum(0), torch.randn(40, 48), n_kernels=2, atol=1e-4, rtol=1e-4)
    assert _folded(gm)


def test_fold_switch(small_folds):
    with kiln.config.patch(**{"tuning.fold": "never"}):
        gm = check(lambda x: x.sum(0), torch.randn(40, 48), atol=1e-4, rtol=1e-4)
    assert not _folded(gm)
    with kiln.config.patch(**{"tuning.fold": "never"}):   # a norm backward's weight gradient: not folded either
        gm = check(grads(rms_norm, 2), torch.randn(64, 48), torch.randn(48), torch.randn(64, 48), atol=1e-4,
                   rtol=1e-4)
    assert not _folded(gm)


def test_softmax_over_outer_dim():
    check(lambda x: torch.softmax(x, 0), torch.randn(5, 7, 3), n_kernels=1, atol=1e-5, rtol=1e-5)


def test_cross_entropy_forward_is_one_kernel():
    # rows' max and sum-exp, the picked logit and the mean over rows (with ignore_index) in one pass
    x, t = torch.randn(6, 10), torch.tensor([1, 2, 3, 0, 9, -100])
    check(lambda x, t: F.cross_entropy(x, t), x, t, n_kernels=1, atol=1e-5, rtol=1e-5)
    check(lambda x, t: F.cross_entropy(x, t, reduction="sum"), x, t, n_kernels=1, atol=1e-5, rtol=1e-5)
    w = torch.rand(10)
    check(lambda x, t, w: F.cross_entropy(x, t, weight=w), x, t, w, n_kernels=1, atol=1e-5, rtol=1e-5)


def test_cross_entropy_backward():
    x, t = torch.randn(6, 10), torch.tensor([1, 2, 3, 0, 9, -100])
    check(grads(lambda x, t: F.cross_entropy(x, t), 1), x, t, torch.tensor(1.0), atol=1e-5, rtol=1e-5)


def test_whole_tensor_reduction_of_row_results_joins_the_row_kernel():
    def fn(x):
        m = x.amax(1)
        return m, (x - m[:, None]).exp().sum(1).log().mean(), x.sum(1).max()
    check(fn, torch.randn(9, 13), n_kernels=1, atol=1e-5, rtol=1e-5)


@kiln.config.patch(tuning=dict(outer_max=64, parts_block=2, xblock_max=4))
def test_large_outer_reduction_combines_in_the_last_program():
    """Above ``tuning.outer_max`` each program reduces its rows and the last to finish combines the
    partials: still one kernel, right for every reduction kind, every program count (4 rows a program)
    and a scalar epilogue; several steps over the partials (``parts_block``)."""
    def fn(x):
        m = x.amax(1)
        return (m, (x - m[:, None]).exp().sum(1).log().mean(), x.sum(1).max(), x.sum(1).min() * 2,
                (x.abs().amax(1) + 1).prod(), x.sum(1).mean())
    for shape in [(9, 13), (2, 200), (33, 5)]:
        gm = check(fn, torch.randn(*shape), n_kernels=1, atol=1e-4, rtol=1e-4)
    src = "\n".join(k.source for k in kernels(gm))
    assert "atomic_add" in src and "atomic_xchg" in src
    x = torch.randn(33, 5)
    for a, b in zip(gm(x), fn(x)):   # a second launch of the same kernel: the counter was set back to 0
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    x, t = torch.randn(40, 17), torch.randint(0, 17, (40,))
    check(lambda x, t: F.cross_entropy(x, t), x, t, n_kernels=1, atol=1e-5, rtol=1e-5)


def test_split_reductions():
    small = kiln.config.patch(tuning=dict(split_min_r=64, split_min_numel=256, split_min_chunk=64,
                                          split_min_chunk_outer=64))
    cases = [  # a full sum (padded chunks), a column sum, a max, and a norm's weight and bias gradients
        (lambda x: x.sum(), [torch.randn(1000)]), (lambda x: (x * 2).sum(0), [torch.randn(300, 5)]),
        (lambda x: x.amax(), [torch.randn(7, 131)]),
        (lambda g, x: ((g * x).sum(0), g.sum(0)), [torch.randn(512, 16), torch.randn(512, 16)])]
    for fn, args in cases:
        # the partial and the final pass: two kernels, or one when the final is chained to the
        # partial's last program (with the partials spread over many programs, or in one)
        with small, kiln.config.patch(**{"tuning.chain": False}):
            check(fn, *args, n_kernels=2, atol=1e-4, rtol=1e-4)
        with small:
            check(fn, *args, n_kernels=1, atol=1e-4, rtol=1e-4)
        with small, kiln.config.patch(**{"tuning.xblock_max": 2}):
            gm = check(fn, *args, n_kernels=1, atol=1e-4, rtol=1e-4)
        assert "_tail(" in kernels(gm)[0].source
        args = [torch.randn_like(a) for a in args]   # new values: stale partials would show
        torch.testing.assert_close(gm(*args), fn(*args), atol=1e-4, rtol=1e-4)   # again: the counter was reset
    t = Tuning()
    assert split_count((4, 1000000), [1], t) > 1 and split_count((64, 100000), [1], t) == 1
    assert split_count((65536, 512), [0], t) > 1 and split_count((64, 512), [0], t) == 1


def test_variance_and_std():
    def fn(x):
        return x.var(-1), x.std(0), torch.var_mean(x, 1, correction=0), x.var()
    check(fn, torch.randn(6, 9), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("n", [8, LOOPED], ids=["persistent", "looped"])
def test_min_max_arg_prod_any_all(n):
    def fn(x):
        return (x.argmax(1), x.argmin(0), x.max(1), x.amin(1, keepdim=True), x[:, :6].prod(1),
                (x > 1).any(1), (x > -3).all(), x.sum(), x.mean(0))
    x = torch.randn(3, n)
    x[1, 5] = x[1, 2] = x[1].max() + 1   # ties: first index wins
    check(fn, x, atol=1e-4, rtol=1e-4)


def test_column_reduction_and_sibling_fusion():
    def fn(g, y):
        return g.sum(0), (g * y).sum(0)
    check(fn, torch.randn(50, 7), torch.randn(50, 7), n_kernels=1, atol=1e-4, rtol=1e-4)


def test_reduction_of_a_view_and_epilogue_through_views():
    def fn(x):
        s = (x * 2).view(4, 3, 5).sum(-1)
        return (s.unsqueeze(-1) * x.view(4, 3, 5)).reshape(4, 15)
    check(fn, torch.randn(4, 15), n_kernels=1, atol=1e-5, rtol=1e-5)


def test_reduction_read_at_another_row_forces_a_new_kernel():
    def fn(x):
        s = x.sum(1, keepdim=True)
        return x * s.flip(0)
    gm = check(fn, torch.randn(4, 8), atol=1e-5, rtol=1e-5)
    assert len(kernels(gm)) == 2
    assert aten_ops(gm) == []
