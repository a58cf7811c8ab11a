"""A tiny zoo-like model with every kind of random regularization the bench turns off for its check:
``nn.Dropout``, a timm-style ``DropPath`` (``drop_prob``), a torchvision-style ``StochasticDepth`` (``p``)
and an HF-style attention whose float ``attention_dropout`` feeds functional dropout. Also a ``config``
object with a dropout float, as HF modules hold, and a BatchNorm (why eval mode is no substitute)."""
from __future__ import annotations

import types

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln_bench.case import Case, ModelWorkload


class DropPath(nn.Module):
    """timm's stochastic depth: a per-sample keep mask, ``drop_prob`` a float attribute."""

    def __init__(self, drop_prob=0.2):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1.0 - self.drop_prob
        return x * x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep) / keep


class StochasticDepth(nn.Module):
    """torchvision's: ``p`` on a module whose class name says what it is."""

    def __init__(self, p=0.2):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        keep = 1.0 - self.p
        return x * torch.empty((x.shape[0], 1, 1), dtype=x.dtype, device=x.device).bernoulli_(keep) / keep


class Attention(nn.Module):
    """HF-style: the probability is a float attribute passed to functional dropout."""

    def __init__(self, d):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.attention_dropout = 0.1

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        a = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1)
        return F.dropout(a, p=self.attention_dropout, training=self.training) @ v


class DropNet(nn.Module):
    def __init__(self, d=16, classes=10):
        super().__init__()
        self.config = types.SimpleNamespace(hidden_dropout=0.1, eps=1e-5, use_cache=False)
        self.norm = nn.LayerNorm(d)
        self.attn = Attention(d)
        self.drop = nn.Dropout(0.1)
        self.path = DropPath(0.2)
        self.depth = StochasticDepth(0.2)
        self.bn = nn.BatchNorm1d(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        x = x + self.path(self.drop(self.attn(self.norm(x))))
        x = x + self.depth(F.dropout(torch.tanh(x), p=self.config.hidden_dropout, training=self.training))
        return self.head(self.bn(x.mean(1)))


def build(device="cpu", dtype="auto", size="tiny", model=None):
    torch.manual_seed(0)
    x, y = torch.randn(4, 8, 16, device=device), torch.randint(0, 10, (4,), device=device)
    return ModelWorkload((model or DropNet()).to(device), (x, y), "fp32",
                         loss=lambda out, b: F.cross_entropy(out, b[1]),
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9), call=lambda f, b: f(b[0]))


def case(name="dropnet", model_class=DropNet) -> Case:
    return Case(name, "zoo", lambda d, dt, s: build(d, dt, s, model_class()), ("auto",), ("cpu",), True)
