"""The micro suite: the seed-000 activations, layer norm, T5 RMSNorm, softmax, cross-entropy and an embedding.

Each case is forward+backward of one function of leaf inputs (``FnWorkload``), in fp32 and bf16.
Sizes: ``gpu`` as in the H100 anchors (2^26 elements, layer_norm 8192x4096, RMSNorm 256x256x1024),
``cpu`` 64 times smaller for a 2-core machine, ``tiny`` for tests.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln_bench.case import DTYPES, Case, FnWorkload


# --- the functions under test (as in seed 000 and the anchors) -------------------------------------
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
    """T5's RMSNorm: no mean subtraction, variance in fp32, cast back to a half weight's dtype."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, h):
        var = h.to(torch.float32).pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(var + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            h = h.to(self.weight.dtype)
        return self.weight * h


def softmax(x):
    return torch.softmax(x, dim=-1)


def cross_entropy(logits, target):
    return F.cross_entropy(logits, target)


def embedding(weight, ids):
    return F.embedding(ids, weight)


# --- sizes -----------------------------------------------------------------------------------------
N = {"tiny": 1 << 12, "cpu": 1 << 20, "gpu": 1 << 26}
ROWS = {"tiny": (64, 64), "cpu": (1024, 1024), "gpu": (8192, 4096)}      # layer_norm
RMS = {"tiny": (2, 16, 64), "cpu": (4, 256, 1024), "gpu": (256, 256, 1024)}
SQUARE = {"tiny": (64, 64), "cpu": (1024, 1024), "gpu": (8192, 8192)}   # softmax, cross-entropy
EMBED = {"tiny": (128, 32, 64), "cpu": (8192, 256, 8192), "gpu": (50304, 768, 65536)}   # vocab, dim, tokens


def _leaves(shapes, device, dtype, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float32).to(device=device, dtype=DTYPES[dtype])
            .requires_grad_(True) for s in shapes]


def _elementwise(fn, n_args, device, dtype, size):
    return FnWorkload(fn, _leaves([(N[size],)] * n_args, device, dtype), dtype)


def _layer_norm(device, dtype, size):
    rows, cols = ROWS[size]
    return FnWorkload(layer_norm, _leaves([(rows, cols), (cols,), (cols,)], device, dtype), dtype)


def _rmsnorm(device, dtype, size):
    shape = RMS[size]
    module = T5LayerNorm(shape[-1]).to(device=device, dtype=DTYPES[dtype])
    return FnWorkload(module, _leaves([shape], device, dtype), dtype)


def _softmax(device, dtype, size):
    return FnWorkload(softmax, _leaves([SQUARE[size]], device, dtype), dtype)


def _cross_entropy(device, dtype, size):
    rows, classes = SQUARE[size]
    (logits,) = _leaves([(rows, classes)], device, dtype)
    target = torch.randint(0, classes, (rows,), generator=torch.Generator().manual_seed(2)).to(device)
    return FnWorkload(cross_entropy, [logits, target], dtype)


def _embedding(device, dtype, size):
    vocab, dim, tokens = EMBED[size]
    (weight,) = _leaves([(vocab, dim)], device, dtype)
    ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(3)).to(device)
    return FnWorkload(embedding, [weight, ids], dtype)


def _act(name, fn, n_args=1):
    return Case(name, "micro", functools.partial(_elementwise, fn, n_args), memory_bound=True,
                about=lambda size: f"{name} forward+backward on {N[size]} elements")


CASES = [
    _act("gelu_bias", gelu_bias, 2),
    _act("swish", swish),
    _act("mish", mish),
    _act("hard_sigmoid", hard_sigmoid),
    _act("hard_swish", hard_swish),
    _act("hard_mish", hard_mish),
    Case("layer_norm", "micro", _layer_norm, memory_bound=True, about="hand-written layer norm, 8192x4096 (gpu)"),
    Case("t5_rmsnorm", "micro", _rmsnorm, memory_bound=True, about="T5LayerNorm module, 256x256x1024 (gpu)"),
    Case("softmax", "micro", _softmax, memory_bound=True, about="softmax over the last dim, 8192x8192 (gpu)"),
    Case("cross_entropy", "micro", _cross_entropy, memory_bound=True,
         about="F.cross_entropy, 8192 rows x 8192 classes (gpu)"),
    Case("embedding", "micro", _embedding, memory_bound=True,
         about="F.embedding, 65536 ids into 50304 x 768 (gpu): a gather whose indices are bounds-checked"),
]
