"""Built-in models for ``kiln bench`` and ``kiln demo``: a small GPT and a small CNN, plain PyTorch.

No extra dependencies and no downloads: weights are random (seeded). Attention is written out
(matmul, causal mask, softmax) rather than through ``scaled_dot_product_attention`` so that the
partitioner sees the activations a memory budget trades against recompute; pass ``sdpa=True`` for
the fused kernel. Sizes come from ``GPT_SIZES`` / ``CNN_SIZES`` keyed by ``tiny``, ``cpu``, ``gpu``.

>>> model, batch = build_gpt("tiny")
>>> loss = gpt_loss(model(*batch), batch[1])
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the built-in GPT; ``batch`` and ``seq`` describe the example batch."""
    vocab: int = 1024
    seq: int = 128
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    batch: int = 4
    sdpa: bool = False


GPT_SIZES = {
    "tiny": GPTConfig(vocab=256, seq=32, n_layer=1, n_head=2, n_embd=32, batch=2),
    "cpu": GPTConfig(vocab=1024, seq=128, n_layer=2, n_head=4, n_embd=64, batch=4),
    "gpu": GPTConfig(vocab=16384, seq=1024, n_layer=6, n_head=12, n_embd=768, batch=8),
}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with explicit softmax (or SDPA when ``cfg.sdpa``)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.sdpa = cfg.n_head, cfg.sdpa
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.register_buffer("mask", torch.ones(cfg.seq, cfg.seq, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(~self.mask[:T, :T], float("-inf"))
            y = torch.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)) with tanh-GELU."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.n_embd), nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """A GPT-2-shaped language model; ``forward(ids, targets)`` returns the mean cross-entropy loss."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.n_embd)
        self.pos = nn.Embedding(cfg.seq, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab, bias=False)

    def forward(self, ids, targets=None):
        T = ids.shape[1]
        x = self.tok(ids) + self.pos(torch.arange(T, device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def gpt_loss(out, targets=None):
    """The loss of a GPT forward: it already is the loss when targets were passed."""
    return out


def build_gpt(size: str = "cpu", device="cpu", seed: int = 0, **overrides):
    """A seeded GPT and its example batch ``(ids, targets)`` for ``size`` in GPT_SIZES."""
    cfg = GPT_SIZES[size]
    if overrides:
        cfg = GPTConfig(**{**cfg.__dict__, **overrides})
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), device=device)
    return model, (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


@dataclass(frozen=True)
class CNNConfig:
    """Shape of the built-in CNN: ``widths`` per stage, ``blocks`` residual blocks per stage."""
    widths: tuple = (32, 64, 128)
    blocks: int = 2
    classes: int = 10
    image: int = 32
    batch: int = 16


CNN_SIZES = {
    "tiny": CNNConfig(widths=(8, 16), blocks=1, image=16, batch=2),
    "cpu": CNNConfig(widths=(32, 64, 128), blocks=1, image=32, batch=16),
    "gpu": CNNConfig(widths=(64, 128, 256, 512), blocks=2, image=64, batch=128),
}


class ResBlock(nn.Module):
    """conv-bn-relu-conv-bn plus a (strided 1x1 conv-bn) shortcut, then relu."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Identity()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.short(x))


class CNN(nn.Module):
    """A small ResNet: stem, one stage per width (stride 2 after the first), pool, linear."""

    def __init__(self, cfg: CNNConfig):
        super().__init__()
        self.cfg = cfg
        self.stem = nn.Sequential(nn.Conv2d(3, cfg.widths[0], 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(cfg.widths[0]), nn.ReLU())
        layers, cin = [], cfg.widths[0]
        for i, w in enumerate(cfg.widths):
            for j in range(cfg.blocks):
                layers.append(ResBlock(cin, w, 2 if (i > 0 and j == 0) else 1))
                cin = w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, cfg.classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_cnn(size: str = "cpu", device="cpu", seed: int = 0, **overrides):
    """A seeded CNN and its example batch ``(images, labels)`` for ``size`` in CNN_SIZES."""
    cfg = CNN_SIZES[size]
    if overrides:
        cfg = CNNConfig(**{**cfg.__dict__, **overrides})
    torch.manual_seed(seed)
    model = CNN(cfg).to(device)
    x = torch.randn(cfg.batch, 3, cfg.image, cfg.image, device=device)
    y = torch.randint(0, cfg.classes, (cfg.batch,), device=device)
    return model, (x, y)


class ResNet18(nn.Module):
    """torchvision's ResNet-18 (same layers, shapes and parameter count), for machines without torchvision:
    a 7x7/2 stem with a 3x3/2 max-pool, four stages of two basic blocks (64-512 channels), pool, linear."""

    def __init__(self, classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        layers, cin = [], 64
        for i, w in enumerate((64, 128, 256, 512)):
            for j in range(2):
                layers.append(ResBlock(cin, w, 2 if (i > 0 and j == 0) else 1))
                cin = w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
