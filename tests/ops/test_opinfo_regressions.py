"""Failures the OpInfo sweep found (issue #18; ``benchmarks/opinfo/REPORT.md``), each reduced to a small
graph and compared with eager on the Triton target (Triton's CPU interpreter here)."""
import pytest
import torch

import kiln
from kiln.debug import counters


def compiled(fn, codegen="triton"):
    torch._dynamo.reset()
    return kiln.compile(fn, codegen=codegen)


def bits(x):
    """bf16 values as their bits, every NaN as one NaN."""
    return torch.where(x.isnan(), torch.tensor(float("nan"), dtype=x.dtype), x).view(torch.int16)


def test_fp32_to_bf16_rounds_to_nearest_even():
    """OpInfo ``bfloat16`` (fp32): ``x.bfloat16()`` rounds to nearest even, as eager and Triton on GPUs do;
    Triton 3.6's interpreter truncates (0.0625 off at 8..16), so kiln rounds by hand there
    (``to_triton.ops.convert``). Ties both ways, NaN, infinities, overflow to inf, subnormals, -0.0, and
    random bit patterns."""
    special = torch.tensor([8.06, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(2.0 + 2 ** -7), float("nan"), float("inf"),
                            -float("inf"), 3.4e38, -3.4e38, 1e-40, -1e-40, 0.0, -0.0, 0.1])
    noise = torch.randint(-2 ** 31, 2 ** 31, (4096,), generator=torch.Generator().manual_seed(0),
                          dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([special, noise])
    got = compiled(lambda x: x.bfloat16())(x)
    assert torch.equal(bits(got), bits(x.bfloat16()))


def test_bf16_results_of_fp32_math_round_to_nearest_even():
    """A bf16 op computed in fp32 stores its result rounded to nearest even (the sweep's bf16 backward
    mismatches of softmax, layer_norm, tanh, ... were truncations by the interpreter). Each output is one
    correctly rounded fp32 operation, so kiln's bits are eager's."""
    x = torch.randn(64, 33, dtype=torch.bfloat16)
    fn = lambda x: (x * 3.1, x / 7, x + x.flip(0), x.float().amax(0).bfloat16() * 0.3)  # noqa: E731
    for got, want in zip(compiled(fn)(x), fn(x)):
        assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("fill", [1.0, -0.0, 0.1, float("inf"), float("nan")])
def test_bf16_constant_kernel_runs(fill):
    """OpInfo ``ones_like``/``full_like``/``fill``/``max_pool2d_with_indices_backward`` (bf16): a kernel storing a
    bf16 constant built ``tl.full(.., tl.bfloat16)``, which the interpreter cannot build (no ``get_bf16``):
    every such kernel fell back to ATen at its first call."""
    x = torch.randn(3, 5, dtype=torch.bfloat16)
    fn = lambda x: (torch.full_like(x[:, :2], fill), x * 2)  # noqa: E731
    before = counters["codegen"]["runtime_fallback"]
    got = compiled(fn)(x)
    assert counters["codegen"]["runtime_fallback"] == before
    for a, b in zip(got, fn(x)):
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("include_self", [False, True])
def test_scatter_reduce_mean_backward(include_self):
    """OpInfo ``scatter_reduce.mean`` (fp32, backward): the backward counts with ``scatter_add`` of ones,
    a constant value that kiln broadcast to the block; Triton 3.6's interpreter reads a broadcast
    (stride-0) value of ``tl.atomic_add`` as garbage (gradients inf, NaN, off by 1.6)."""
    torch.manual_seed(0)
    idx = torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 4, 0], [0, 0, 1, 1, 2], [9, 8, 7, 6, 5], [0, 9, 0, 9, 0]])
    x0, src0, g = torch.randn(10, 5), torch.randn(5, 5), torch.randn(10, 5)

    def f(x, src):
        return x.scatter_reduce(0, idx, src, "mean", include_self=include_self)

    def grads(fn):
        x, src = x0.clone().requires_grad_(), src0.clone().requires_grad_()
        out = fn(x, src)
        return (out, *torch.autograd.grad(out, (x, src), g))

    for got, want in zip(grads(compiled(f)), grads(f)):
        torch.testing.assert_close(got, want)


def test_scatter_add_of_a_constant():
    idx = torch.tensor([0, 1, 1, 3, 0])
    fn = lambda idx: torch.zeros(4).scatter_add(0, idx, torch.ones(5))  # noqa: E731
    assert compiled(fn)(idx).tolist() == fn(idx).tolist() == [2.0, 2.0, 0.0, 1.0]


def test_logcumsumexp_bf16_backward_near_the_lowest_bf16():
    """OpInfo ``logcumsumexp`` (bf16, backward, a row holding 9984): the gradient was ~6e27 where eager gives
    0, from truncating fp32 results to bf16 near bf16's lowest value (the backward's stand-in for log(0))."""
    x0 = torch.tensor([[1.0, 9984.0, -3.0, 2.0], [0.5, -9.0, 4.0, 1.0]], dtype=torch.bfloat16).t().contiguous()
    g = torch.tensor([[1.0, -0.5, 2.0, 0.25], [-1.0, 1.5, 0.5, 2.0]], dtype=torch.bfloat16).t().contiguous()

    def grad(fn):
        x = x0.clone().requires_grad_()
        return torch.autograd.grad(fn(x), x, g)[0]

    f = lambda x: torch.logcumsumexp(x, 0)  # noqa: E731
    torch.testing.assert_close(grad(compiled(f)), grad(f), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("codegen", ["aten", "triton"])
def test_invoke_quant_backward_partitions(codegen):
    """hop_db ``invoke_quant.simple`` (backward): the joint graph makes the ``InvokeQuant`` options object from
    no inputs and both halves take it; the partitioner banned recomputing it (not on the cheap list, its
    backward user does not fuse) though it cannot be saved: no finite cut (PartitionError)."""
    from torch._higher_order_ops import InvokeQuant
    quant = InvokeQuant()

    def f(x):
        return quant(lambda x, y: (torch.sin(x) * y,), x, x)[0] * 2.0

    x0 = torch.rand(2, 2, 2)
    x, y = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    got, want = compiled(f, codegen)(x), f(y)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), x)[0], torch.autograd.grad(want.sum(), y)[0])


def test_batch_norm_with_update_bf16_kernels_run():
    """OpInfo ``_batch_norm_with_update`` (bf16): a cast to bf16 of a value the kernel holds in bf16 (the IR
    says fp32) failed to build at its first call when the rounding helper bitcast it as fp32 bits; the
    helper converts to fp32 first."""
    from kiln_bench import opinfo_cases, opinfo_sample
    op = opinfo_cases.find("_batch_norm_with_update")
    sample = opinfo_cases.samples(op, torch.bfloat16, 1)[0]
    rec = opinfo_sample.run(op, sample, torch.bfloat16, "kiln-triton", 0, "forward")
    assert rec["status"] == "pass" and rec["runtime_fallback"] == 0, rec
