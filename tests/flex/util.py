"""FlexAttention test helpers: a family of score_mod/mask_mod cases, an fp64 dense reference written
from scratch (materialized scores, the mods called on broadcast index tensors), and the compiled calls
(the public ``flex_attention`` for the forward; the higher-order op itself where the backward is wanted,
since torch refuses FlexAttention's backward on CPU tensors in its public function)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.nn.attention.flex_attention import _apply_kernel_options, create_block_mask, flex_attention
from torch._higher_order_ops.flex_attention import flex_attention as flex_hop

import kiln
from kiln.debug import counters

torch.nn.attention.flex_attention._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True   # no warnings of eager's calls


@dataclass
class Case:
    """A mod family member: ``score(p)``/``mask(p)`` build the mods over the captured tensors ``p``
    (a dict; the reference passes fp64 copies). ``grad``: names in ``p`` that require grad."""
    name: str
    score: object = None
    mask: object = None
    params: dict = field(default_factory=dict)
    grad: tuple = ()
    hkv: int = 0   # GQA: kv heads (0: as many as query heads)


def cases(S: int, H: int, device="cpu") -> dict:
    """The family at sequence length ``S`` with ``H`` query heads."""
    doc = (torch.arange(S, device=device) * 3) // max(S, 1) + (torch.arange(S, device=device) % 17 == 5)
    doc = torch.cummax(doc, 0).values
    prefix = torch.tensor([S // 3, S // 5, S // 2, 7], device=device, dtype=torch.int32)
    slopes = torch.exp2(-torch.arange(1, H + 1, device=device, dtype=torch.float32) * (8.0 / H))
    rel = torch.randn(H, 2 * S - 1, device=device) * 0.5
    causal = lambda p: lambda b, h, q, kv: q >= kv  # noqa: E731
    out = [
        Case("none"),
        Case("causal", mask=causal),
        Case("sliding", mask=lambda p: lambda b, h, q, kv: (q >= kv) & (q - kv < 24)),
        Case("document", mask=lambda p: lambda b, h, q, kv: (p["doc"][q] == p["doc"][kv]) & (q >= kv),
             params={"doc": doc}),
        Case("prefix_lm", mask=lambda p: lambda b, h, q, kv: (kv < p["prefix"][b]) | (q >= kv),
             params={"prefix": prefix}),
        Case("alibi", score=lambda p: lambda s, b, h, q, kv: s + p["slopes"][h] * (kv - q), mask=causal,
             params={"slopes": slopes}),
        Case("softcap", score=lambda p: lambda s, b, h, q, kv: 20.0 * torch.tanh(s / 20.0)),
        Case("relbias", score=lambda p: lambda s, b, h, q, kv: s + p["rel"][h, q - kv + S - 1], mask=causal,
             params={"rel": rel}, grad=("rel",)),
        Case("gqa", mask=causal, hkv=max(1, H // 2)),
    ]
    return {c.name: c for c in out}


def inputs(B, H, S, D, hkv=0, dtype=torch.float32, device="cpu", grad=False):
    hk = hkv or H
    q = torch.randn(B, H, S, D, dtype=dtype, device=device)
    k = torch.randn(B, hk, S, D, dtype=dtype, device=device)
    v = torch.randn(B, hk, S, D, dtype=dtype, device=device)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def params_of(case: Case, dtype=None, grad=True):
    """The case's captured tensors (fp64 copies with ``dtype``), the learned ones requiring grad."""
    out = {}
    for k, v in case.params.items():
        t = v.detach().clone()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[k] = t.requires_grad_(grad and k in case.grad)
    return out


def block_mask(case: Case, p, B, H, S, bs, device="cpu"):
    if case.mask is None:
        return None
    return create_block_mask(case.mask(p), B, H, S, S, device=device, BLOCK_SIZE=bs)


def dense(q, k, v, case: Case, p, scale=None):
    """(out, lse) in q's dtype from materialized scores; fully masked rows give 0 and -inf."""
    B, H, M, D = q.shape
    G = H // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    scale = 1 / math.sqrt(D) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    dev = q.device
    b = torch.arange(B, device=dev).view(B, 1, 1, 1)
    h = torch.arange(H, device=dev).view(1, H, 1, 1)
    qi = torch.arange(M, device=dev).view(1, 1, M, 1)
    ki = torch.arange(k.shape[2], device=dev).view(1, 1, 1, -1)
    if case.score is not None:
        s = case.score(p)(s, b, h, qi, ki)
    if case.mask is not None:
        keep = case.mask(p)(b, h, qi, ki).expand_as(s)
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    dead = torch.isinf(lse) & (lse < 0)
    pr = torch.exp(s - torch.where(dead, 0.0, lse).unsqueeze(-1))
    return pr @ v, lse


def compiled_forward(case, p, bm, return_lse=False, gqa=False, kernel_options=None):
    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=case.score(p) if case.score else None, block_mask=bm,
                              enable_gqa=gqa, return_lse=return_lse, kernel_options=kernel_options)
    return torch.compile(fn, backend="kiln", fullgraph=True)


def compiled_hop(case, p, bm, q, k, v, scale=None):
    """A compiled call of the higher-order op itself (torch's public function refuses the backward on
    CPU tensors): returns (out, natural-log lse)."""
    from torch.nn.attention.flex_attention import _create_empty_block_mask, _identity
    score = case.score(p) if case.score else _identity
    mask = bm if bm is not None else _create_empty_block_mask(q, k)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale

    def fn(q, k, v):
        ko = _apply_kernel_options(q, k, v, True, None)
        out, lse, *_ = flex_hop(q, k, v, score, mask.as_tuple(), scale, ko)
        return out, lse * math.log(2)
    return torch.compile(fn, backend="kiln", fullgraph=True)


class Count:
    """Counts of FlexAttention kernels and dense fallbacks made inside the ``with`` block."""

    def __enter__(self):
        self.flex = dict(counters["flex"])
        self.fallback = {k: v for k, v in counters["fallback"].items() if k.startswith("flex")}
        return self

    def __exit__(self, *exc):
        now = counters["flex"]
        self.kernels = {k: now[k] - self.flex.get(k, 0) for k in now if now[k] != self.flex.get(k, 0)}
        fb = {k: v for k, v in counters["fallback"].items() if k.startswith("flex")}
        self.fallbacks = {k: fb[k] - self.fallback.get(k, 0) for k in fb if fb[k] != self.fallback.get(k, 0)}
        return False


def tol(S: int, D: int, dtype=torch.float32) -> float:
    """Absolute tolerance of a kernel's value against the fp64 reference: the float's eps grown with the
    length of the sums behind one output (S scores of D products)."""
    return 20 * torch.finfo(dtype).eps * math.sqrt(S * D)


def close(out, ref, atol):
    torch.testing.assert_close(out.double(), ref.double(), atol=atol, rtol=atol)


__all__ = ["Case", "cases", "inputs", "params_of", "block_mask", "dense", "compiled_forward", "compiled_hop",
           "Count", "tol", "close", "kiln"]
