"""What users write: graph breaks, mutation, aliasing, dynamic shapes, RNG, autocast, low precision."""
import re

import pytest
import torch
import torch.nn as nn

import kiln


def test_graph_break_training():
    def f(x):
        y = x.sin() * 2
        torch._dynamo.graph_break()
        return (y.cos() + x).sum()

    x = torch.randn(5, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    explain = torch._dynamo.explain(f)(x.detach())
    assert explain.graph_break_count == 1
    torch._dynamo.reset()
    f(x).backward()
    kiln.compile(f)(x2).backward()
    torch.testing.assert_close(x2.grad, x.grad)


def test_input_mutation_through_view():
    def f(x):
        x.view(3, 2).mul_(2)
        return x + 1

    x = torch.arange(6.0)
    x_ref = x.clone()
    out = kiln.compile(f)(x)
    ref = f(x_ref)
    torch.testing.assert_close(x, x_ref)
    torch.testing.assert_close(out, ref)


def test_view_of_mutated_base_shows_mutation():
    def f(x):
        v = x.view(2, 3)
        x.add_(1)
        return v

    x = torch.zeros(6)
    v = kiln.compile(f)(x)
    torch.testing.assert_close(v, torch.ones(2, 3))
    x.add_(1)  # the returned view aliases the caller's tensor
    torch.testing.assert_close(v, torch.full((2, 3), 2.0))


def test_outputs_alias_inputs_and_params():
    lin = nn.Linear(3, 3)

    def f(x):
        return x, x.t(), lin.weight, lin(x)

    x = torch.randn(3, 3)
    out = kiln.compile(f)(x)
    assert out[0] is x or out[0].data_ptr() == x.data_ptr()
    assert out[1].data_ptr() == x.data_ptr()
    assert out[2].data_ptr() == lin.weight.data_ptr()
    torch.testing.assert_close(out[3], lin(x))


def test_dynamic_true_sizes_stay_symbolic():
    from kiln.debug import Trace

    def f(x):
        return (x * x.shape[0]).sum(0)

    cf = kiln.compile(f, dynamic=True)
    before = Trace._count
    with torch.no_grad():
        _, code = kiln.run_and_get_code(cf, torch.randn(3, 4))
        for n in (3, 5, 7):
            x = torch.randn(n, 4)
            torch.testing.assert_close(cf(x), (x * n).sum(0))
    assert Trace._count - before == 1  # compiled once: one graph serves every size
    body = "\n".join(line.split("#")[0] for line in code[-1].splitlines())
    assert not re.search(r"\b3\b", body), body  # the size is read from the inputs, never baked in


def test_mark_dynamic_training():
    lin = nn.Linear(4, 2)
    cf = kiln.compile(lin)
    frames = []
    for n in (3, 6, 9):
        x = torch.randn(n, 4, requires_grad=True)
        torch._dynamo.mark_dynamic(x, 0)
        x2 = x.detach().clone().requires_grad_()
        cf(x).sum().backward()
        lin(x2).sum().backward()
        torch.testing.assert_close(x.grad, x2.grad)
        frames.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert frames[-1] == frames[0]  # no recompile for new sizes


def test_recompile_on_new_shape():
    cf = kiln.compile(lambda x: x.relu() + 1)
    for shape in ((2, 3), (4, 5)):
        x = torch.randn(shape)
        torch.testing.assert_close(cf(x), x.relu() + 1)


def test_random_ops_differ_between_calls():
    cf = kiln.compile(lambda: torch.rand(4, 4) + 1)
    a, b = cf(), cf()
    assert not torch.equal(a, b)
    assert ((a >= 1) & (a < 2)).all()


def test_dropout_training_grads_consistent():
    def f(x):
        return torch.nn.functional.dropout(x, 0.5, training=True) * 3

    x = torch.randn(64, requires_grad=True)
    out = kiln.compile(f)(x)
    out.sum().backward()
    kept = out != 0
    # gradient is 6 where kept (1/(1-p) * 3), 0 where dropped: the backward used the forward's mask
    torch.testing.assert_close(x.grad[kept], torch.full_like(x.grad[kept], 6.0))
    assert (x.grad[~kept] == 0).all()


def test_autocast_bf16_cpu():
    lin = nn.Linear(8, 8)

    def f(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return lin(x).relu()

    x = torch.randn(4, 8)
    out = kiln.compile(f)(x)
    ref = f(x)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_against_fp64(dtype):
    def f(x, w):
        return (x @ w).tanh() * x.sum(-1, keepdim=True)

    x, w = torch.randn(8, 8), torch.randn(8, 8)
    ref = f(x.double(), w.double())
    out = kiln.compile(f)(x.to(dtype), w.to(dtype))
    assert out.dtype == dtype
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 2e-2
