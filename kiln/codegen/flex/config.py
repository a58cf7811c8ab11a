"""Tile sizes, warps and pipeline stages of the FlexAttention kernels.

Defaults follow what FlexAttention's reference kernels use on sm90 (H100) per dtype and head dim;
``kernel_options`` (``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``, their ``fwd_``/``bwd_``
forms and ``BLOCK_M1``/``BLOCK_N1``/``BLOCK_M2``/``BLOCK_N2``) override them. A tile must lie within one
block of the BlockMask (the tile divides the mask's block size) unless one mask block spans the whole
sequence; tiles are powers of two from 16 (``tl.dot``'s least) and no longer than the sequence needs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.codegen.flex.translate import Unsupported
from kiln.codegen.ir.indexing import next_pow2


@dataclass(frozen=True)
class Fwd:
    block_m: int
    block_n: int
    warps: int
    stages: int


@dataclass(frozen=True)
class Bwd:
    m1: int
    n1: int
    m2: int
    n2: int
    warps: int
    stages: int


SM90_FWD = {(torch.float32, 64): (128, 32, 4, 3), (torch.float32, 128): (32, 64, 4, 3),
            (torch.float32, 256): (32, 32, 4, 3), (torch.bfloat16, 64): (128, 128, 4, 3),
            (torch.bfloat16, 128): (128, 64, 8, 3), (torch.bfloat16, 256): (64, 32, 4, 3)}


def static(n):
    return n if isinstance(n, int) else None


def fit(want: int, bs: int, length, what: str) -> int:
    """The largest power-of-two tile from 16 to ``want`` that lies within one ``bs`` block of a
    ``length``-long sequence (None: dynamic)."""
    b = next_pow2(max(16, want))
    if length is not None:
        b = min(b, max(16, next_pow2(length)))

    def ok(t):
        return bs % t == 0 or (length is not None and bs >= length)
    while b > 16 and not ok(b):
        b //= 2
    if not ok(b):
        raise Unsupported(f"flex: the BlockMask's {what} block size {bs} takes no tile of 16 or more")
    return b


def _opt(options, keys, default):
    for k in keys:
        if k in options and options[k] is not None:
            return int(options[k])
    return default


def forward_config(call, interpret: bool) -> Fwd:
    _, _, _, lq, lkv, d, dv, _ = call.dims()
    dt = torch.bfloat16 if call.dtype == torch.float16 else call.dtype
    hd = max(d, dv)
    key = (dt, 64 if hd <= 64 else 128 if hd <= 128 else 256)
    bm, bn, warps, stages = SM90_FWD.get(key, (64, 32, 4, 2))
    o = call.options
    bm = _opt(o, ("fwd_BLOCK_M", "BLOCK_M"), bm)
    bn = _opt(o, ("fwd_BLOCK_N", "BLOCK_N"), bn)
    warps = _opt(o, ("fwd_num_warps", "num_warps"), warps)
    stages = _opt(o, ("fwd_num_stages", "num_stages"), stages)
    return Fwd(fit(bm, call.q_bs, static(lq), "query"), fit(bn, call.kv_bs, static(lkv), "key/value"), warps, stages)


def backward_config(call, interpret: bool) -> Bwd:
    _, _, _, lq, lkv, d, dv, _ = call.dims()
    hd = max(d, dv)
    if call.dtype == torch.float32 or call.dtype == torch.float64:
        m1 = n1 = m2 = n2 = 32 if hd <= 128 else 16
        warps, stages = 4, 1
    elif hd < 64:
        m1, n1, m2, n2, stages, warps = 64, 64, 64, 64, 3, 4
    elif hd <= 128:
        m1, n1, m2, n2, stages, warps = 64, 128, 128, 64, 3, 8
    else:
        m1, n1, m2, n2, stages, warps = 64, 64, 64, 64, 2, 4
    o = call.options
    m1 = _opt(o, ("bwd_BLOCK_M1", "BLOCK_M1", "bwd_BLOCK_M"), m1)
    n1 = _opt(o, ("bwd_BLOCK_N1", "BLOCK_N1", "bwd_BLOCK_N"), n1)
    m2 = _opt(o, ("bwd_BLOCK_M2", "BLOCK_M2", "bwd_BLOCK_M"), m2)
    n2 = _opt(o, ("bwd_BLOCK_N2", "BLOCK_N2", "bwd_BLOCK_N"), n2)
    warps = _opt(o, ("bwd_num_warps", "num_warps"), warps)
    stages = _opt(o, ("bwd_num_stages", "num_stages"), stages)
    lq, lkv = static(lq), static(lkv)
    return Bwd(fit(m1, call.q_bs, lq, "query"), fit(n1, call.kv_bs, lkv, "key/value"),
               fit(m2, call.q_bs, lq, "query"), fit(n2, call.kv_bs, lkv, "key/value"), warps, stages)


def decode_rows(call, max_q: int):
    """(query heads per program, rows per program) of the split-KV decoding kernel for ``call``, or None
    when it does not apply: a query longer than ``max_q`` (``Tuning.flex_decode_q``) or than one mask
    block, a short key/value sequence, max_scores wanted."""
    _, hq, hkv, lq, lkv, _, _, _ = call.dims()
    lq, lkv = static(lq), static(lkv)
    if call.backward or lq is None or lkv is None or lq > max_q or 2 in call.used:
        return None
    if lq > call.q_bs or lkv < 256:
        return None
    # heads sharing a kv head ride one program when the mask is the same for all of them
    kvn = call.masks["kv_num"].meta["val"]
    g = hq // hkv if kvn.shape[1] == 1 else 1
    while g > 1 and g * lq > 128:
        g //= 2
    while g > 1 and (hq // hkv) % g:
        g -= 1
    return g, max(16, next_pow2(g * lq))


def decode_config(call, interpret: bool) -> Fwd:
    _, _, _, _, lkv, d, dv, _ = call.dims()
    bn = _opt(call.options, ("fwd_BLOCK_N", "BLOCK_N"), 64)
    warps = _opt(call.options, ("fwd_num_warps", "num_warps"), 4)
    stages = _opt(call.options, ("fwd_num_stages", "num_stages"), 2)
    return Fwd(16, fit(bn, call.kv_bs, static(lkv), "key/value"), warps, stages)


__all__ = ["Fwd", "Bwd", "fit", "forward_config", "backward_config", "decode_rows", "decode_config", "static"]
