"""The Triton text of FlexAttention's backward: ``backward_kernels(call, cfg, ...)``.

Two kernels: ``<name>_pre`` computes ``delta = rowsum(dO * O)`` (less the log-sum-exp's own gradient,
``grad_lse / ln 2``, when the graph has one); ``<name>_dqkv`` runs two kinds of programs in one launch (the
first ``cdiv(Q_LEN, BLOCK_M2)`` along axis 0 are dq's, the rest dk/dv's): a dq program, one per (query
tile, batch x head), walks the kv blocks of the forward's BlockMask rows and accumulates ``dq``; a dk/dv
program, one per (kv tile, batch x kv head), walks the query blocks
the q-side BlockMask lists for its kv block (for every query head of its GQA group, and every query
batch when the kv batch is broadcast) and accumulates ``dk`` and ``dv``. Both recompute the scores, the
probabilities ``p = exp2(x - lse)`` and ``ds = p * (dp - delta)``; the joint graph turns ``ds`` into the
gradient of the pre-mod score. Gradients of captured tensors (a learned bias table) are added in the dq
kernel with atomic adds into float32 buffers, each summed first over the tile axes its index does not
vary along (a per-head bias costs one atomic per tile).
"""
from __future__ import annotations

import math
import re

import torch

from kiln.codegen.flex.mods import Mods, indices
from kiln.codegen.flex.translate import TritonDialect, Val
from kiln.codegen.flex.triton_fwd import (LOG2E, QKV_STRIDES, Shape, _header_consts, dot, grid_even, loop, mask_arg, ptr_args, rsum,
                                          walk_even)
from kiln.codegen.to_triton.ops import convert

BOTH = frozenset({"q", "kv"})


def _scores(mods, s, full, tag, qk, bounds):
    """Lines computing ``score`` (pre-mod), ``x`` (post-mod, base 2, masked to -inf) and ``valid`` (None: all)."""
    lines = [f"score = {qk} * {mods.call.scale!r}"]
    code, post = mods.score(Val("score", torch.float32, BOTH), tag)
    lines += code + [f"x = {post.code} * {LOG2E!r}"]
    terms = list(bounds)
    if not full:
        code, keep = mods.mask(tag)
        if keep is not None:
            lines += code
            terms.insert(0, keep.code)
    valid = None
    if terms:
        valid = "valid"
        lines += [f"valid = {' & '.join(terms)}", "x = tl.where(valid, x, float('-inf'))"]
    return lines, valid


def _dscore(mods, tag, valid, scatter: bool, axes=("q", "kv")):
    """Lines turning ``ds`` into ``dscore`` (and, with ``scatter``, the captured tensors' atomic adds)."""
    lines, dscore, scatters = mods.joint(Val("score", torch.float32, BOTH), Val("ds", torch.float32, BOTH), tag)
    lines = list(lines) + [f"dscore = {dscore.code if dscore is not None else '0.0 * ds'}"]
    if valid and dscore is not None and dscore.code != "ds":
        lines.append(f"dscore = tl.where({valid}, dscore, 0.0)")
    if not scatter:
        return lines
    for j, sc in scatters.items():
        strides = [math.prod(sc.shape[d + 1:]) for d in range(len(sc.shape))]
        for k, (idx, val) in enumerate(sc.parts):
            sv = f"gv{j}_{k}"
            lines.append(f"{sv} = {val.code} + 0.0 * ds" if val.axes != BOTH else f"{sv} = {val.code}")
            if valid:
                lines.append(f"{sv} = tl.where({valid}, {sv}, 0.0)")
            ax = frozenset().union(*[v.axes for v in idx]) if idx else frozenset()
            for a, dim in zip(axes, (0, 1)):
                if a not in ax:
                    lines.append(f"{sv} = {rsum(sv, dim, mods.d.interpret, True)}")
            if not ax:
                lines.append(f"{sv} = {rsum(rsum(sv, 1, mods.d.interpret), 0, mods.d.interpret)}")
            terms = []
            for d, v in enumerate(idx):
                i = v.code if v.const is None else str(int(v.const))
                terms.append(f"{i} * {strides[d]}" if v.nonneg or (v.const is not None and v.const >= 0)
                             else f"tl.where({i} < 0, {i} + BUF{j}_size{d}, {i}) * {strides[d]}")
            off = " + ".join(terms) or "0"
            amask = [mods.d.masks[a] for a in sorted(ax) if a in mods.d.masks]
            lines.append(f"tl.atomic_add(GBUF{j} + {off}, {sv}{mask_arg(amask, False)})")
    return lines


def _mask_walk(pre: str, table: str, head: str, row: str, mult: str, body: list, start: str, bs: str, tile: str,
               interpret: bool):
    p = pre.lower()
    out = [f"nblk = tl.load({pre}{table}N + off_b * {p}{table.lower()}nb + {head} * {p}{table.lower()}nh + "
           f"{row} * {p}{table.lower()}nr)",
           f"ibase = {pre}{table}I + off_b * {p}{table.lower()}ib + {head} * {p}{table.lower()}ih + "
           f"{row} * {p}{table.lower()}ir",
           ]
    first = f"{start} = tl.load(ibase + (it // {mult}) * {p}{table.lower()}ic) * {bs} + (it % {mult}) * {tile}"
    return out + loop("it", "0", f"nblk * {mult}", [first] + body, interpret)


def _mask_strides(table: str, full: bool):
    t = table.lower()
    names = [f"{t}nb", f"{t}nh", f"{t}nr", f"{t}ib", f"{t}ih", f"{t}ir", f"{t}ic"]
    return names + ([f"f{n}" for n in names] if full else [])


def backward_kernels(call, cfg, interpret: bool, precision: str, name: str, has_dlse: bool):
    """(module text of the three kernels, Shape, dialects, scattered buffer indices)."""
    _, hq, hkv, _, _, _, _, _ = call.dims()
    s2, s1 = Shape(call, interpret, precision), Shape(call, interpret, precision)
    s2.even_m, s2.even_n = grid_even(s2.lq, cfg.m2), walk_even(call.kv_bs, s2.lkv, cfg.n2)
    s1.even_m, s1.even_n = walk_even(call.q_bs, s1.lq, cfg.m1), grid_even(s1.lkv, cfg.n1)
    dt = call.dtype
    vm = ["(offs_v[None, :] < DV)"] if s2.dv != s2.dvp else []
    dmask = ["(offs_d[None, :] < D)"] if s2.d != s2.dp else []
    to_dt = (lambda x: convert(x, torch.float32, dt, interpret)) if dt != torch.float32 else (lambda x: x)
    # -- delta ------------------------------------------------------------------------------------
    pre = ["@triton.jit",
           f"def {name}_pre(OUT, DO, DLSE, DELTA, Q_LEN, sob, soh, som, sod, sdob, sdoh, sdom, sdod, sgb, sgh, sgm, "
           "BLOCK_M: tl.constexpr):"] + ["    " + c for c in _header_consts(call, s2)] + [
        "    start_m = tl.program_id(0)", "    bh = tl.program_id(1)", "    off_b = bh // HQ", "    off_h = bh % HQ",
        "    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)", "    offs_v = tl.arange(0, DVP)",
        "    mq = offs_m[:, None] < Q_LEN",
        f"    o = tl.load(OUT + off_b.to(tl.int64) * sob + off_h.to(tl.int64) * soh + offs_m[:, None] * som + "
        f"offs_v[None, :] * sod{mask_arg(['mq'] + vm)}).to(tl.float32)",
        f"    do = tl.load(DO + off_b.to(tl.int64) * sdob + off_h.to(tl.int64) * sdoh + offs_m[:, None] * sdom + "
        f"offs_v[None, :] * sdod{mask_arg(['mq'] + vm)}).to(tl.float32)",
        f"    delta = {rsum('o * do', 1, interpret)}"]
    if has_dlse:
        pre.append(f"    delta = delta - tl.load(DLSE + off_b.to(tl.int64) * sgb + off_h.to(tl.int64) * sgh + "
                   f"offs_m * sgm, mask=offs_m < Q_LEN, other=0.0) * {1 / math.log(2)!r}")
    pre.append("    tl.store(DELTA + bh.to(tl.int64) * Q_LEN + offs_m, delta, mask=offs_m < Q_LEN)")
    # -- dq ---------------------------------------------------------------------------------------
    d2 = TritonDialect(masks={} if s2.even_m else {"q": "mq"}, interpret=interpret)
    if not s2.even_n:
        d2.masks["kv"] = "mn"
    mods2 = Mods(call, d2, indices("off_b", "off_h", "q_idx", "kv_idx"))
    scattered = sorted(mods2.joint(Val("score", torch.float32, BOTH), Val("ds", torch.float32, BOTH), "x")[2])
    gbufs = [f"GBUF{j}" for j in scattered]
    full2 = call.masks["full_kv_num"] is not None
    qterms = ([] if s2.even_m else ["mq"])
    body = ["start_m = pid0", "bh = pid1", "off_b = bh // HQ", "off_h = bh % HQ",
            "off_hk = off_h // G", "offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)", "offs_d = tl.arange(0, DP)",
            "offs_v = tl.arange(0, DVP)", "q_idx = offs_m[:, None]", "mq = q_idx < Q_LEN",
            f"q = tl.load(Q + off_b.to(tl.int64) * sqb + off_h.to(tl.int64) * sqh + q_idx * sqm + offs_d[None, :] * sqd"
            f"{mask_arg(qterms + dmask)})",
            f"do = tl.load(DO + off_b.to(tl.int64) * sdob + off_h.to(tl.int64) * sdoh + q_idx * sdom + "
            f"offs_v[None, :] * sdod{mask_arg(qterms + vm)})",
            f"lse = tl.load(LSE + off_b.to(tl.int64) * slb + off_h.to(tl.int64) * slh + offs_m * slm"
            f"{mask_arg([] if s2.even_m else ['offs_m < Q_LEN'])})",
            "lse = tl.where(lse == float('-inf'), 0.0, lse)",
            f"Di = tl.load(DELTA + bh.to(tl.int64) * Q_LEN + offs_m{mask_arg([] if s2.even_m else ['offs_m < Q_LEN'])})",
            "kbase = K + off_b.to(tl.int64) * skb + off_hk.to(tl.int64) * skh",
            "vbase = V + off_b.to(tl.int64) * svb + off_hk.to(tl.int64) * svh",
            "dq = tl.full([BLOCK_M, DP], 0.0, tl.float32)", "row = (start_m * BLOCK_M) // Q_BS"]
    kterms = [] if s2.even_n else ["(offs_n[:, None] < KV_LEN)"]
    bounds2 = ([] if s2.even_m else ["mq"]) + ([] if s2.even_n else ["mn"])
    for pre_, full in [("", False)] + ([("F", True)] if full2 else []):
        sc, valid = _scores(mods2, s2, full, pre_.lower() or "p", "qk", bounds2)
        tile = ["offs_n = start_n + tl.arange(0, BLOCK_N)", "kv_idx = offs_n[None, :]", "mn = kv_idx < KV_LEN",
                f"k = tl.load(kbase + offs_n[:, None] * skn + offs_d[None, :] * skd{mask_arg(kterms + dmask)})",
                f"v = tl.load(vbase + offs_n[:, None] * svn + offs_v[None, :] * svd{mask_arg(kterms + vm)})",
                f"qk = {dot('q', 'tl.trans(k)', s2)}"] + sc + [
                "p = tl.exp2(x - lse[:, None])", f"dp = {dot('do', 'tl.trans(v)', s2)}", "ds = p * (dp - Di[:, None])"]
        tile += _dscore(mods2, pre_.lower() or "p", valid, True)
        tile.append(f"dq = {dot(to_dt('dscore'), 'k', s2, 'dq')}")
        body += _mask_walk(pre_, "KV", "off_h", "row", "MULT", tile, "start_n", "KV_BS", "BLOCK_N", interpret)
    body += ["dq = dq * " + repr(call.scale),
             f"tl.store(DQ + off_b.to(tl.int64) * sqgb + off_h.to(tl.int64) * sqgh + q_idx * sqgm + offs_d[None, :] * sqgd, "
             f"{to_dt('dq')}{mask_arg(qterms + dmask, False)})"]
    dq = _rename(body, "BLOCK_M2", "BLOCK_N2", "MULT2")
    # -- dk, dv -----------------------------------------------------------------------------------
    d1 = TritonDialect(masks={} if s1.even_m else {"q": "mq"}, interpret=interpret)
    if not s1.even_n:
        d1.masks["kv"] = "mn"
    mods1 = Mods(call, d1, indices("off_b", "off_h", "q_idx", "kv_idx"))
    full1 = call.masks["full_q_num"] is not None
    nterms = [] if s1.even_n else ["(offs_n[:, None] < KV_LEN)"]
    mterms = [] if s1.even_m else ["(offs_m[:, None] < Q_LEN)"]
    body = ["start_n = pid0 - NQT", "bk = pid1", f"off_bk = bk // {hkv}", f"off_hk = bk % {hkv}",
            "offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)", "offs_d = tl.arange(0, DP)",
            "offs_v = tl.arange(0, DVP)", "kv_idx = offs_n[:, None]", "mn = kv_idx < KV_LEN",
            f"k = tl.load(K + off_bk.to(tl.int64) * skb + off_hk.to(tl.int64) * skh + kv_idx * skn + "
            f"offs_d[None, :] * skd{mask_arg(nterms + dmask)})",
            f"v = tl.load(V + off_bk.to(tl.int64) * svb + off_hk.to(tl.int64) * svh + kv_idx * svn + "
            f"offs_v[None, :] * svd{mask_arg(nterms + vm)})",
            "dk = tl.full([BLOCK_N, DP], 0.0, tl.float32)", "dv = tl.full([BLOCK_N, DVP], 0.0, tl.float32)",
            "col = (start_n * BLOCK_N) // KV_BS"]
    bounds1 = ([] if s1.even_n else ["mn"]) + ([] if s1.even_m else ["mq"])
    inner = []
    for pre_, full in [("", False)] + ([("F", True)] if full1 else []):
        sc, valid = _scores(mods1, s1, full, pre_.lower() or "p", "qkT", bounds1)
        tile = ["offs_m = start_m + tl.arange(0, BLOCK_M)", "q_idx = offs_m[None, :]", "mq = q_idx < Q_LEN",
                f"q = tl.load(Q + off_b.to(tl.int64) * sqb + off_h.to(tl.int64) * sqh + offs_m[:, None] * sqm + "
                f"offs_d[None, :] * sqd{mask_arg(mterms + dmask)})",
                f"do = tl.load(DO + off_b.to(tl.int64) * sdob + off_h.to(tl.int64) * sdoh + offs_m[:, None] * sdom + "
                f"offs_v[None, :] * sdod{mask_arg(mterms + vm)})",
                f"lse = tl.load(LSE + off_b.to(tl.int64) * slb + off_h.to(tl.int64) * slh + offs_m * slm"
                f"{mask_arg([] if s1.even_m else ['offs_m < Q_LEN'])})",
                "lse = tl.where(lse == float('-inf'), 0.0, lse)",
                f"Di = tl.load(DELTA + bh.to(tl.int64) * Q_LEN + offs_m{mask_arg([] if s1.even_m else ['offs_m < Q_LEN'])})",
                f"qkT = {dot('k', 'tl.trans(q)', s1)}"] + sc + [
                "pT = tl.exp2(x - lse[None, :])", f"dv = {dot(to_dt('pT'), 'do', s1, 'dv')}",
                f"dpT = {dot('v', 'tl.trans(do)', s1)}", "ds = pT * (dpT - Di[None, :])"]
        tile += _dscore(mods1, pre_.lower() or "p", valid, False)
        tile.append(f"dk = {dot(to_dt('dscore'), 'q', s1, 'dk')}")
        inner += _mask_walk(pre_, "Q", "off_h", "col", "MULT", tile, "start_m", "Q_BS", "BLOCK_M", interpret)
    heads = ["off_b = off_bk + bq", "for g in range(0, G):", "    off_h = off_hk * G + g", "    bh = off_b * HQ + off_h"]
    body += loop("bq", "0", "BQ", heads + ["    " + ln for ln in inner], interpret)
    body += ["dk = dk * " + repr(call.scale),
             f"tl.store(DKO + off_bk.to(tl.int64) * skgb + off_hk.to(tl.int64) * skgh + kv_idx * skgn + "
             f"offs_d[None, :] * skgd, {to_dt('dk')}{mask_arg(nterms + dmask, False)})",
             f"tl.store(DVO + off_bk.to(tl.int64) * svgb + off_hk.to(tl.int64) * svgh + kv_idx * svgn + "
             f"offs_v[None, :] * svgd, {to_dt('dv')}{mask_arg(nterms + vm, False)})"]
    dkdv = _rename(body, "BLOCK_M1", "BLOCK_N1", "MULT1")
    ptrs, ints = ptr_args(call)
    params = ["Q", "K", "V", "DO", "LSE", "DELTA", "DQ", "DKO", "DVO", "KVN", "KVI"] + \
        (["FKVN", "FKVI"] if full2 else []) + ["QN", "QI"] + (["FQN", "FQI"] if full1 else []) + ptrs + gbufs + \
        ["Q_LEN", "KV_LEN", "MULT2", "MULT1", "BQ", "BKH"] + QKV_STRIDES + \
        ["sdob", "sdoh", "sdom", "sdod", "slb", "slh", "slm", "sqgb", "sqgh", "sqgm", "sqgd", "skgb", "skgh", "skgn",
         "skgd", "svgb", "svgh", "svgn", "svgd"] + _mask_strides("KV", full2) + _mask_strides("Q", full1) + ints + \
        [f"{b}: tl.constexpr" for b in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2")]
    both = ["@triton.jit", f"def {name}_dqkv({', '.join(params)}):"] + ["    " + c for c in _header_consts(call, s1)]
    both += ["    pid0 = tl.program_id(0)", "    pid1 = tl.program_id(1)",
             "    NQT = (Q_LEN + BLOCK_M2 - 1) // BLOCK_M2", "    if pid0 < NQT:"] + ["        " + b for b in dq] + \
        ["    elif pid1 < BKH:"] + ["        " + b for b in dkdv]
    text = "\n\n\n".join("\n".join(k) for k in (pre, both))
    return text, (s1, s2), (d1, d2), scattered


def _rename(lines, block_m: str, block_n: str, mult: str) -> list:
    """``lines`` with the tile sizes and mask multiplicity named as one half of the combined kernel names them."""
    subs = ((r"\bBLOCK_M\b", block_m), (r"\bBLOCK_N\b", block_n), (r"\bMULT\b", mult))
    out = []
    for ln in lines:
        for pat, rep in subs:
            ln = re.sub(pat, rep, ln)
        out.append(ln)
    return out


__all__ = ["backward_kernels"]
