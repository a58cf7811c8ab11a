"""Input mutations stay in kiln's graphs (AOTAutograd's keep_inference_input_mutations): what the
caller sees after a call is eager's, in training and inference graphs, through views, and when the
mutated input is read again after the write."""
import re

import pytest
import torch

import kiln

CODEGENS = ["aten", "triton", "cpp"]   # the C++ and Triton kernels write mutated inputs in place


@pytest.mark.parametrize("codegen", CODEGENS)
def test_running_average_buffer_in_a_training_step(codegen):
    """An EMA buffer (no grad) updated in place beside a differentiable computation."""
    def f(x, w, ema):
        y = torch.tanh(x @ w)
        with torch.no_grad():
            ema.mul_(0.9).add_(y.mean(0), alpha=0.1)
        return (y * ema).sum()

    torch._dynamo.reset()
    x, w = torch.randn(4, 3), torch.randn(3, 5, requires_grad=True)
    ema_k, ema_e = torch.zeros(5), torch.zeros(5)
    w_e = w.detach().clone().requires_grad_(True)
    g = kiln.compile(f, codegen=codegen)
    for _ in range(3):
        g(x, w, ema_k).backward()
        f(x, w_e, ema_e).backward()
    torch.testing.assert_close(ema_k, ema_e)
    torch.testing.assert_close(w.grad, w_e.grad)


@pytest.mark.parametrize("codegen", CODEGENS)
def test_inference_mutation_then_read(codegen):
    def f(x, y):
        x.add_(1)
        y[:, 0].mul_(2)          # through a view
        return x * y.sum()

    torch._dynamo.reset()
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    a2, b2 = a.clone(), b.clone()
    with torch.no_grad():
        out = kiln.compile(f, codegen=codegen)(a, b)
        ref = f(a2, b2)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(a, a2)
    torch.testing.assert_close(b, b2)


@pytest.mark.parametrize("codegen,in_place", [("aten", False), ("triton", False), ("triton", True)])
def test_many_mutated_inputs_batch_into_one_copy(codegen, in_place):
    """An optimizer-like update of several tensors: one foreach copy, values as eager's; or, where kernels
    may write them in place (``tuning.write_mutations``), one kernel writing all four, no copy."""
    def step(ps, gs):
        for p, gr in zip(ps, gs):
            p.sub_(0.1 * gr)

    torch._dynamo.reset()
    ps = [torch.randn(8) for _ in range(4)]
    gs = [torch.randn(8) for _ in range(4)]
    ref = [p.clone() for p in ps]
    with torch.no_grad():
        _, code = kiln.run_and_get_code(kiln.compile(step, codegen=codegen, **{"tuning.write_mutations": in_place}),
                                        ps, gs)
        step(ref, gs)
    for p, r in zip(ps, ref):
        torch.testing.assert_close(p, r)
    wrapper = next(c for c in code if c.startswith("# kiln wrapper"))
    assert wrapper.count("foreach_copy(") == (not in_place), wrapper
    assert bool(re.search(r"into=\((arg\d+_1, ){3}arg\d+_1\)", wrapper)) == in_place, wrapper


@pytest.mark.parametrize("budget", [1.0, 0.5, 0.0])
@pytest.mark.parametrize("write_first", [True, False])
def test_backward_never_reads_an_input_the_graph_wrote(write_first, budget):
    """An input that needs no gradient is written inside the training graph (its ``copy_`` stays in the
    graph). The backward must not recompute from that input: by then it holds the new value (fuzz seed
    10 #6889: the grad came out as if the add ran twice)."""
    def f(w, a):
        if write_first:
            a.add_(1)
        y = w * a.exp().sin()
        if not write_first:
            a.add_(1)
        return y

    torch._dynamo.reset()
    w, a = torch.randn(5, requires_grad=True), torch.randn(5)
    w_e, a_e = w.detach().clone().requires_grad_(True), a.clone()
    kiln.compile(f, codegen="aten", partitioner="mincut", activation_memory_budget=budget,
                 cache=False)(w, a).sum().backward()
    f(w_e, a_e).sum().backward()
    torch.testing.assert_close(w.grad, w_e.grad)
    torch.testing.assert_close(a, a_e)



@pytest.mark.parametrize("codegen", ["triton", "cpp"])
def test_a_fused_kernel_reads_an_input_before_its_write(codegen):
    """``a0 - a1`` is computed before ``a1`` is written, but fused into a kernel stored late (with the
    select_scatter of ``v0[0] = a3``); the copy into ``a1`` must wait for it (fuzz seed 11 #2718: the
    kernel read the written a1, -inf + inf = NaN)."""
    def f(a0, a1, a3):
        v0 = a0 - a1
        v1 = v0.unsqueeze(-3)
        a1[..., :1].add_(float("inf"))
        v0[0] = a3
        return (v1,)

    torch._dynamo.reset()
    a0, a1, a3 = torch.randn(7, 2, 1), torch.randn(7, 1, 1), torch.randn(1, 2, 1)
    a1[4] = -float("inf")
    a1_k, a1_e = a1.clone(), a1.clone()
    out = kiln.compile(f, codegen=codegen, cache=False)(a0, a1_k, a3)[0]
    ref = f(a0, a1_e, a3)[0]
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(a1_k, a1_e, equal_nan=True)
