"""Seed 000's TestMemoryEfficientOpAuthoring scenarios, written for kiln.memory_efficient_fusion."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln


def gelu_bias(bias, y):
    x = bias + y
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def swish(x):
    return x * torch.sigmoid(x)


def mish(x):
    return x.mul(torch.tanh(F.softplus(x)))


def hard_sigmoid(x):
    return (x + 3.0).clamp(min=0.0, max=6.0).div(6.0)


def hard_swish(x):
    return x * (x + 3.0).clamp(min=0.0, max=6.0).div(6.0)


def hard_mish(x):
    return 0.5 * x * (x + 2.0).clamp(min=0.0, max=2.0)


def layer_norm(x, weight, bias):
    mean = torch.mean(x, -1, keepdim=True)
    centered = x - mean
    var = torch.sum(centered * centered, -1, keepdim=True) / x.size(-1)
    rvar = 1.0 / torch.sqrt(var + 1e-5)
    return (x - mean) * rvar * weight + bias


class T5LayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


CASES = {
    "gelu_bias": (gelu_bias, [(1024,), (1024,)]),
    "mish": (mish, [(1024,)]),
    "swish": (swish, [(1024,)]),
    "hard_sigmoid": (hard_sigmoid, [(1024,)]),
    "hard_swish": (hard_swish, [(1024,)]),
    "hard_mish": (hard_mish, [(1024,)]),
    "layer_norm": (layer_norm, [(10, 16), (16,), (16,)]),
    "t5_rmsnorm": (None, [(256, 256, 1024)]),
}


def run_and_compare(fn, shapes, device, **options):
    if isinstance(fn, nn.Module):
        fn = fn.to(device)
    ref_args = [torch.randn(s, device=device, requires_grad=True) for s in shapes]
    res_args = [a.detach().clone().requires_grad_(True) for a in ref_args]
    ref = fn(*ref_args)
    ref.sum().backward()
    compiled = kiln.memory_efficient_fusion(fn, **options)
    for _ in range(5):
        for a in res_args:
            a.grad = None
        res = compiled(*res_args)
        res.sum().backward()
    torch.testing.assert_close(res, ref)
    for a, b in zip(ref_args, res_args):
        torch.testing.assert_close(b.grad, a.grad)


def _fn(name):
    fn, shapes = CASES[name]
    return (T5LayerNorm(1024) if fn is None else fn), shapes


@pytest.mark.parametrize("name", sorted(CASES))
def test_memory_efficient_fusion_cpu(name):
    fn, shapes = _fn(name)
    if name == "t5_rmsnorm":  # the seed's 256x256x1024 takes ~100 s on 2 cores: see the slow test
        shapes = [(8, 64, 1024)]
    run_and_compare(fn, shapes, "cpu")


@pytest.mark.slow
def test_memory_efficient_fusion_cpu_t5_seed_shape():
    fn, shapes = _fn("t5_rmsnorm")
    run_and_compare(fn, shapes, "cpu")


@pytest.mark.parametrize("name", ["gelu_bias", "layer_norm"])
def test_memory_efficient_fusion_triton_interpreter(name):
    fn, shapes = _fn(name)
    run_and_compare(fn, shapes, "cpu", codegen="triton")


def test_recompiles_for_a_new_shape():
    compiled = kiln.memory_efficient_fusion(swish)
    for n in (8, 16):
        x = torch.randn(n)
        torch.testing.assert_close(compiled(x), swish(x))


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_memory_efficient_fusion_cuda(name):
    fn, shapes = _fn(name)
    run_and_compare(fn, shapes, "cuda")
