"""Pointwise fusion: the micro cases of the seed are one kernel each, and match eager."""
import pytest
import torch
import torch.nn.functional as F

from tests.codegen.util import aten_ops, check, fused, kernels


from kiln_bench.suites.micro import gelu_bias, hard_mish, hard_sigmoid, hard_swish, mish, swish  # noqa: E402


MICRO = [gelu_bias, swish, mish, hard_sigmoid, hard_swish, hard_mish]


@pytest.mark.parametrize("fn", MICRO, ids=lambda f: f.__name__)
def test_micro_forward_is_one_kernel(fn):
    args = [torch.randn(1000) for _ in range(fn.__code__.co_argcount)]
    gm = check(fn, *args, n_kernels=1, atol=1e-5, rtol=1e-5)
    assert aten_ops(gm) == []


@pytest.mark.parametrize("fn", [gelu_bias, mish, hard_swish], ids=lambda f: f.__name__)
def test_micro_backward_is_one_kernel(fn):
    def fwd_bwd(*args):
        args = [a.detach().requires_grad_() for a in args]
        out = fn(*args)
        return torch.autograd.grad(out, args, torch.ones_like(out))
    args = [torch.randn(256) for _ in range(fn.__code__.co_argcount)]
    gm, n = fused(fwd_bwd, *args)
    ref = fwd_bwd(*args)
    for o, r in zip(gm(*args), ref):
        torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5)
    assert n == 1


def test_views_fuse_through_index_arithmetic():
    def fn(x):
        y = (x + 1).view(2, 16) * 3
        return y.reshape(4, 8).t().contiguous() + 1, (x + 1).view(4, 2, 4).permute(0, 2, 1).reshape(4, 8) * 2
    check(fn, torch.randn(4, 8), n_kernels=1)   # same number of elements: one kernel walks both


def test_views_of_inputs_fuse_into_the_kernel():
    """A kernel reads an input through a view's index arithmetic: no view call left in the wrapper."""
    gm = check(lambda x: (x.permute(1, 0) * 2).sin(), torch.randn(4, 8), n_kernels=1)
    assert aten_ops(gm) == []
    gm = check(lambda x, b: x.view(2, 16) + b.view(1, 16).expand(2, 16).t().t(), torch.randn(4, 8),
               torch.randn(16), n_kernels=1)
    assert aten_ops(gm) == []


def test_views_of_inputs_read_by_a_library_call_stay_views():
    """A view chain that an extern (mm) and a kernel both read: ATen views for the extern, no copy."""
    def fn(x, w):
        wt = w.view(8, 4).t()   # view, then permute of the view
        return x @ wt, (wt * 2).sum()
    gm = check(fn, torch.randn(3, 4), torch.randn(32), n_kernels=1)
    assert [op for op in aten_ops(gm) if op is not torch.ops.aten.mm.default] == \
        [torch.ops.aten.view.default, torch.ops.aten.permute.default]


def test_broadcast_and_type_promotion():
    def fn(a, b, c):
        return a * b + c, (a > 0.5) & (c < 2), a.to(torch.float16) * 3, b // 2, b % 3 - a
    a, b, c = torch.rand(4, 1, 8), torch.randint(-9, 9, (3, 1)), torch.randn(8, dtype=torch.float64)
    check(fn, a, b, c, atol=1e-3, rtol=1e-3)


def test_low_precision_computes_in_fp32():
    def fn(x, y):
        return (x * y + 1).exp() * 0.5
    x, y = torch.randn(64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    check(fn, x, y, n_kernels=1, atol=2e-2, rtol=2e-2, ref_fp64=True)


def test_where_masked_fill_and_casts():
    def fn(x):
        return torch.where(x > 0, x, x * 0.1).to(torch.float16), x.masked_fill(x < 0, 0), (x > 0).float().sum()
    check(fn, torch.randn(4, 8), atol=1e-3, rtol=1e-3)


def test_cat_stack_pad():
    def fn(x, y):
        return torch.cat([x * 2, y + 1], 1).relu(), torch.stack([x, x.exp()], 0), F.pad(x * 2, (1, 2, 0, 1), value=3.0)
    check(fn, torch.randn(4, 8), torch.randn(4, 3))


def test_slices_flip_scatters():
    def fn(x, y):
        return (x[1:3, ::2] * 2, x[:, 2] + 1, x.flip(0) + x, torch.select_scatter(x, y, 0, 1),
                torch.slice_scatter(x, x[:2] * 2, 0, 1, 3))
    check(fn, torch.randn(4, 8), torch.randn(8))


def test_integer_division_semantics():
    def fn(a, b):
        return a // b, a % b, torch.div(a, b, rounding_mode="trunc"), torch.div(a, b), torch.fmod(a, b)
    a = torch.randint(-20, 20, (64,))
    b = torch.randint(1, 5, (64,)) * (torch.randint(0, 2, (64,)) * 2 - 1)
    check(fn, a, b, n_kernels=1)


def test_math_ops():
    def fn(x):
        return (x.abs().sqrt(), x.expm1(), x.abs().log1p(), x.sinh(), x.cosh(), x.atan2(x + 1) if False else x.sign(),
                x.trunc(), x.round(), x.erf(), x.reciprocal(), x.abs().pow(1.7), torch.pow(x, 3), x.isnan())
    check(fn, torch.randn(64) * 3, n_kernels=1, atol=1e-4, rtol=1e-4)


def test_arange_full_rand():
    def fn(x):
        return x + torch.arange(8, dtype=torch.float32), torch.full((4, 8), 2.0) * x
    check(fn, torch.randn(4, 8), n_kernels=1)


def test_rand_is_uniform_and_seeded():
    gm, n = fused(lambda x: x + torch.rand_like(x), torch.zeros(64, 64))
    assert n == 1
    torch.manual_seed(3)
    a = gm(torch.zeros(64, 64))
    torch.manual_seed(3)
    b = gm(torch.zeros(64, 64))
    c = gm(torch.zeros(64, 64))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert 0 <= a.min() and a.max() < 1 and abs(a.mean().item() - 0.5) < 0.02
    gm, _ = fused(lambda x: torch.randn_like(x) + x, torch.zeros(64, 64))
    r = gm(torch.zeros(64, 64))
    assert abs(r.mean().item()) < 0.05 and abs(r.std().item() - 1) < 0.05


def test_native_dropout_mask_and_output_agree():
    def fn(x):
        out, mask = torch.ops.aten.native_dropout.default(x, 0.25, True)
        return out, mask
    gm, n = fused(fn, torch.ones(32, 32))
    out, mask = gm(torch.ones(32, 32))
    assert n == 1
    assert torch.equal(out != 0, mask)
    assert torch.allclose(out[mask], torch.full_like(out[mask], 1 / 0.75))
    assert 0.65 < mask.float().mean().item() < 0.85


def test_unsupported_op_stays_aten():
    def fn(x):
        return torch.cumsum(x * 2, 0) + 1
    gm = check(fn, torch.randn(16), n_kernels=2)
    assert torch.ops.aten.cumsum.default in aten_ops(gm)
    assert len(kernels(gm)) == 2


def test_compiled_adamw_step(monkeypatch):
    """A compiled AdamW step (its bias correction is ``beta ** step`` with a 0-d step tensor): the pow
    helper combined a 0-d mask and a [1] one with ``&``, which Triton's interpreter refuses (every
    compiled HF training step with its optimizer failed there). Three steps match eager."""
    import copy

    import kiln
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    m = torch.nn.Linear(8, 4)
    m2 = copy.deepcopy(m)
    o1, o2 = torch.optim.AdamW(m.parameters(), lr=1e-2), torch.optim.AdamW(m2.parameters(), lr=1e-2)
    x = torch.randn(16, 8)

    def step(model, opt):
        opt.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    cstep = kiln.compile(step, codegen="triton")
    for _ in range(3):
        torch.testing.assert_close(cstep(m2, o2), step(m, o1), atol=1e-5, rtol=1e-5)
    for a, b in zip(m2.parameters(), m.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_pow_with_negative_bases():
    a = torch.tensor([-2.0, -2.0, -2.0, 2.0, 0.0, -0.5, 3.0, -1.0])
    b = torch.tensor([2.0, 3.0, 0.5, -1.5, 2.0, -3.0, 0.0, 7.0])
    gm, _ = fused(torch.pow, a, b)
    torch.testing.assert_close(gm(a, b), torch.pow(a, b), atol=1e-6, rtol=1e-6, equal_nan=True)



def amin_backward_bf16(x, m, g):
    """amin's backward on a value computed in the kernel, ``eq(x ** 3, amin)``, in bf16; ``m`` the minimum
    (an input, as from the forward graph, or None: computed here)."""
    c = x ** 3
    hit = c == (c.amin(0, keepdim=True) if m is None else m)
    return g * hit / hit.sum(0, keepdim=True)


def test_comparisons_round_bf16_operands_first():
    """A comparison sees its operands in their own dtype, as eager does: the cube of a bf16 input is
    rounded to bf16 before ``eq`` with the minimum (the forward graph's, rounded, or this kernel's);
    compared unrounded with the forward's minimum, no element matched and the gradient was NaN (fuzz seed
    14, program 369, Triton and C++ targets)."""
    x = (torch.randint(-12, 13, (8, 4)).double() / 4).bfloat16()
    g = torch.randn(8, 4).bfloat16()
    m = (x ** 3).amin(0, keepdim=True)
    for args in ((x, m, g), (x, None, g)):
        assert not amin_backward_bf16(*args).isnan().any()
        check(amin_backward_bf16, *args, atol=0, rtol=0)   # exact in any order: a min, a count, pointwise ops
    from tests.codegen import test_cpp
    if test_cpp.cpp_build.find_compiler(test_cpp.current()):
        test_cpp.check(amin_backward_bf16, x, m, g, exact=True)
        test_cpp.check(amin_backward_bf16, x, None, g, exact=True)


@pytest.mark.parametrize("inference", [True, False])
def test_cheap_loads_stores_a_sum_that_reads_many_buffers(inference):
    """``tuning.cheap_loads``: a value of few ops read by kernels on both sides of a matmul is recomputed in
    each unless it reads more buffers at every element than the option allows; then it is stored once (a
    residual stream summed over layers). Inference graphs use ``tuning.cheap_loads_inference`` (default 2:
    stored), forward and backward graphs ``tuning.cheap_loads`` (default unlimited: recomputed)."""
    import kiln

    def f(a, b, c, w):
        r = a + b + c
        return torch.relu(r) + (r * 2) @ w
    knob = "tuning.cheap_loads_inference" if inference else "tuning.cheap_loads"
    readers = {}
    for limit in (1 << 30, 2, None):
        args = [torch.randn(16, 16, requires_grad=not inference) for _ in range(4)]
        torch._dynamo.reset()
        with torch.set_grad_enabled(not inference):
            out, code = kiln.run_and_get_code(
                kiln.compile(f, codegen="triton", **({} if limit is None else {knob: limit})), *args)
        torch.testing.assert_close(out, f(*args))
        src = next(x for x in code if x.startswith("# kiln wrapper"))
        readers[limit] = sum("arg0_1, arg1_1, arg2_1" in ln or "primals_1, primals_2, primals_3" in ln
                             for ln in src.splitlines() if "= kiln_" in ln)
    assert readers == {1 << 30: 2, 2: 1, None: 1 if inference else 2}, readers
