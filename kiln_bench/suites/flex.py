"""The flex suite: FlexAttention (``torch.nn.attention.flex_attention``) in training, long-context and
decoding shapes, and on the CPU.

* ``flex_doc_causal``: issue #34's case: Linear -> flex_attention -> Linear, B 4, H 16, S 2048, D 64,
  fp32 weights under bf16 autocast, causal attention within documents of 300 tokens (a BlockMask from
  ``create_block_mask``), forward + backward.
* ``flex_sliding_8k``: the same block at S 8192 (B 1) with a causal sliding window of 1024 tokens.
* ``flex_decode``: one new token over an 8k key/value cache (B 8, 32 query heads over 8 kv heads, D 128,
  bf16), each sequence masked to its own cache length; inference.
* ``flex_doc_causal_cpu``: the CPU forward of the issue (B 4, H 8, S 1024, D 64, document + causal, fp32,
  no_grad).

Sizes: ``gpu``/``cpu`` as above, ``tiny`` for tests (S 128).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from kiln_bench.case import Case, FnWorkload, ModelWorkload


def _doc_causal(S: int, doc_len: int, device):
    doc = torch.arange(S, device=device) // doc_len

    def mask(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)
    return mask


def _sliding(window: int):
    def mask(b, h, q, kv):
        return (q >= kv) & (q - kv < window)
    return mask


class FlexBlock(nn.Module):
    """Linear (qkv) -> flex_attention -> Linear (out) over [B, S, H * D] activations."""

    def __init__(self, heads: int, head_dim: int, block_mask):
        super().__init__()
        dim = heads * head_dim
        self.heads, self.head_dim, self.block_mask = heads, head_dim, block_mask
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        from torch.nn.attention.flex_attention import flex_attention
        B, S, _ = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        o = flex_attention(q, k, v, block_mask=self.block_mask)
        return self.out(o.transpose(1, 2).reshape(B, S, self.heads * self.head_dim))


def _sum_loss(out, batch):
    return out.float().sum()


def _block(device, B, H, S, D, mask):
    from torch.nn.attention.flex_attention import create_block_mask
    torch.manual_seed(0)
    bm = create_block_mask(mask, None, None, S, S, device=device)
    model = FlexBlock(H, D, bm).to(device)
    x = torch.randn(B, S, H * D, device=device)
    autocast = torch.bfloat16 if device == "cuda" else None
    return ModelWorkload(model, (x,), "amp_bf16" if autocast else "fp32", loss=_sum_loss, autocast=autocast,
                         train=True)


def _doc_causal_train(device, dtype, size):
    B, H, S, D = (4, 16, 2048, 64) if size == "gpu" else (1, 2, 128, 16)
    return _block(device, B, H, S, D, _doc_causal(S, 300 if size == "gpu" else 50, device))


def _sliding_train(device, dtype, size):
    B, H, S, D = (1, 16, 8192, 64) if size == "gpu" else (1, 2, 128, 16)
    return _block(device, B, H, S, D, _sliding(1024 if size == "gpu" else 32))


def _decode(device, dtype, size):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    B, HQ, HKV, S, D = (8, 32, 8, 8192, 128) if size == "gpu" else (2, 4, 2, 256, 16)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(0)
    lens = torch.randint(S // 2, S + 1, (B,), generator=gen).to(device)

    def mask(b, h, q, kv):
        return kv < lens[b]
    bm = create_block_mask(mask, B, None, 1, S, device=device)
    q = torch.randn(B, HQ, 1, D, generator=gen).to(device=device, dtype=dt)
    k, v = (torch.randn(B, HKV, S, D, generator=gen).to(device=device, dtype=dt) for _ in range(2))

    def step(q, k, v):
        return flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    return FnWorkload(step, (q, k, v), "bf16" if dt == torch.bfloat16 else "fp32", train=False)


def _doc_causal_cpu(device, dtype, size):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    B, H, S, D = (4, 8, 1024, 64) if size != "tiny" else (1, 2, 128, 16)
    bm = create_block_mask(_doc_causal(S, 300 if size != "tiny" else 50, device), None, None, S, S, device=device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=gen).to(device) for _ in range(3))

    def step(q, k, v):
        return flex_attention(q, k, v, block_mask=bm)
    return FnWorkload(step, (q, k, v), "fp32", train=False)


CASES = [
    Case("flex_doc_causal", "flex", _doc_causal_train, ("auto",), ("cuda",), True, needs=(),
         about="Linear + flex_attention + Linear, B 4 H 16 S 2048 D 64, bf16 autocast, causal within 300-token "
               "documents, forward+backward (issue #34)"),
    Case("flex_sliding_8k", "flex", _sliding_train, ("auto",), ("cuda",), True,
         about="the same block at S 8192 (B 1), causal sliding window of 1024, forward+backward"),
    Case("flex_decode", "flex", _decode, ("auto",), ("cuda",), False,
         about="decoding: 1 token over an 8k kv cache, B 8, 32/8 GQA heads, D 128, bf16, per-sequence lengths"),
    Case("flex_doc_causal_cpu", "flex", _doc_causal_cpu, ("auto",), ("cpu",), False,
         about="CPU forward (no_grad): B 4 H 8 S 1024 D 64, causal within 300-token documents, fp32"),
]
