"""The Triton text of FlexAttention's forward: the flash-attention kernel and the split-KV decoding pair.

``forward_kernel(call, cfg, target)``: one program per (query tile, batch x head) walks the key/value
blocks its BlockMask row lists (partial blocks with mask_mod, full blocks without), ``MULT`` tiles of
``BLOCK_N`` per mask block, in one flat loop (Triton pipelines its loads). Scores are ``q @ k^T`` in
fp32, ``scale``d, through score_mod, then in base 2 (``log2(e)`` folded into the scale when score_mod is
the identity); the softmax is online (running max ``m_i``, sum ``l_i``), and the log-sum-exp (base 2, as
the op returns it) is stored for the backward and ``return_lse``. GQA: query head ``h`` reads kv head
``h // G``. Head dims are padded to powers of two with masks; sequence tails are masked unless the
shapes are static and the tiles divide them.

``decode_kernels(call, cfg, rows, target)``: for a few query tokens over a long cache, program
(split, batch x head group) takes an equal share of the listed blocks, rows being the tokens of
``GP`` heads that share a kv head (``h`` then varies along rows); partial outputs (normalized) and
their log-sum-exps go to scratch buffers, and a second kernel combines them.
"""
from __future__ import annotations

import torch

from kiln.codegen.flex.mods import Mods, buffer_names, indices
from kiln.codegen.flex.translate import TritonDialect, Val
from kiln.codegen.ir.indexing import next_pow2
from kiln.codegen.to_triton.ops import convert

LOG2E = 1.4426950408889634


def grid_even(length, tile: int) -> bool:
    """Tiles laid over a static ``length`` from 0 all lie inside it."""
    return isinstance(length, int) and length % tile == 0


def walk_even(bs: int, length, tile: int) -> bool:
    """Tiles walked ``tile`` at a time through the listed ``bs`` blocks all lie inside a static ``length``."""
    if not isinstance(length, int):
        return False
    span = min(bs, length)
    return span % tile == 0 and length % span == 0


class Shape:
    """Static facts the kernel text is specialized on; ``even_m``/``even_n``: no tile of the query/kv
    axis crosses the sequence's end (set by each kernel, whose tiles are laid out differently)."""

    def __init__(self, call, interpret, precision):
        B, hq, hkv, self.lq, self.lkv, d, dv, _ = call.dims()
        self.hq, self.g, self.d, self.dv = hq, hq // hkv, d, dv
        self.dp, self.dvp = max(16, next_pow2(d)), max(16, next_pow2(dv))
        self.even_m = self.even_n = False
        self.interpret, self.dtype, self.precision = interpret, call.dtype, precision
        self.has_full = call.masks["full_kv_num"] is not None


def dot(a, b, s: Shape, acc=None):
    extra = f", {acc}" if acc else ""
    prec = f", input_precision='{s.precision}'" if s.dtype == torch.float32 and not s.interpret else ""
    return f"tl.dot({a}, {b}{extra}{prec})"


def ptr_args(call):
    """Kernel parameters of the captured operands: (tensors, then their strides and sizes or integers)."""
    ptrs, ints = [], []
    for name, b in zip(buffer_names(call), call.score_bufs + call.mask_bufs):
        v = b.meta["val"] if hasattr(b, "meta") else None
        if isinstance(v, torch.Tensor):
            ptrs.append(name)
            ints += [f"{name}_stride{d}" for d in range(v.dim())] + [f"{name}_size{d}" for d in range(v.dim())]
        else:
            ints.append(name)
    return ptrs, ints


def rsum(x: str, axis: int, interpret: bool, keep: bool = False) -> str:
    """A sum over ``axis``: Triton's ``tl.sum`` is a function compiled for the GPU, so the interpreter
    (which runs kernels built while Triton's own modules were compiled-mode) reduces with the standard
    combine function, which it runs with numpy."""
    k = ", keep_dims=True" if keep else ""
    return f"tl.reduce({x}, {axis}, tl.standard._sum_combine{k})" if interpret else f"tl.sum({x}, {axis}{k})"


def rmax(x: str, axis: int, interpret: bool) -> str:
    return f"tl.reduce({x}, {axis}, tl.standard._elementwise_max)" if interpret else f"tl.max({x}, {axis})"


def loop(var: str, lo: str, hi: str, body: list, interpret: bool) -> list:
    """``for var in range(lo, hi)`` over ``body``; in the interpreter, whose program ids and loaded scalars
    are 1-element arrays that ``range`` refuses, a ``while`` loop."""
    if not interpret:
        return [f"for {var} in range({lo}, {hi}):"] + ["    " + b for b in body]
    return [f"{var} = {lo}", f"{var}_end = {hi}", f"while {var} < {var}_end:"] + \
        ["    " + b for b in body + [f"{var} += 1"]]


def mask_arg(terms, other=True) -> str:
    """``, mask=a & b, other=0.0`` for load mask ``terms`` ('' for none)."""
    if not terms:
        return ""
    return f", mask={' & '.join(terms)}" + (", other=0.0" if other else "")


def tile(mods: Mods, s: Shape, full: bool, tag: str, scale: float) -> list:
    """Lines of one [rows, BLOCK_N] tile at ``start_n``: scores, masks, the online softmax update."""
    kmask = mask_arg(([] if s.even_n else ["(offs_n[:, None] < KV_LEN)"]) + (["(offs_d[None, :] < D)"] if s.d != s.dp else []))
    vmask = mask_arg(([] if s.even_n else ["(offs_n[:, None] < KV_LEN)"]) + (["(offs_v[None, :] < DV)"] if s.dv != s.dvp else []))
    lines = ["offs_n = start_n + tl.arange(0, BLOCK_N)", "kv_idx = offs_n[None, :]"]
    if not s.even_n:
        lines.append("mn = kv_idx < KV_LEN")
    lines += [f"k = tl.load(kbase + offs_n[:, None] * skn + offs_d[None, :] * skd{kmask})",
              f"qk = {dot('q', 'tl.trans(k)', s)}"]
    if mods.identity:
        lines.append(f"x = qk * {scale * LOG2E!r}")
    else:
        lines.append(f"score = qk * {scale!r}")
        code, post = mods.score(Val("score", torch.float32, frozenset({"q", "kv"})), tag)
        lines += code + [f"x = {post.code} * {LOG2E!r}"]
    if not full:
        code, keep = mods.mask(tag)
        if keep is not None:
            lines += code + [f"x = tl.where({keep.code}, x, float('-inf'))"]
    if not s.even_n:
        lines.append("x = tl.where(mn, x, float('-inf'))")
    p_cast = convert("p", torch.float32, s.dtype, s.interpret) if s.dtype != torch.float32 else "p"
    lines += [f"m_new = tl.maximum(m_i, {rmax('x', 1, s.interpret)})",
              "m_use = tl.where(m_new == float('-inf'), 0.0, m_new)",
              "alpha = tl.exp2(m_i - m_use)",
              "p = tl.exp2(x - m_use[:, None])",
              f"l_i = l_i * alpha + {rsum('p', 1, s.interpret)}",
              f"v = tl.load(vbase + offs_n[:, None] * svn + offs_v[None, :] * svd{vmask})",
              f"acc = {dot(p_cast, 'v', s, 'acc * alpha[:, None]')}",
              "m_i = m_new"]
    return lines


def block_loops(mods, s, scale, head: str, row: str, loops=None) -> list:
    """The walks over the listed partial blocks, then the full ones (``loops``: per kind, the range)."""
    out = []
    kinds = [("", False)] + ([("F", True)] if s.has_full else [])
    for pre, full in kinds:
        out += [f"nblk{pre} = tl.load({pre}KVN + off_b * {pre.lower()}knb + {head} * {pre.lower()}knh + {row} * {pre.lower()}knm)",
                f"ibase{pre} = {pre}KVI + off_b * {pre.lower()}kib + {head} * {pre.lower()}kih + {row} * {pre.lower()}kim"]
    for pre, full in kinds:
        lo, hi, it = (loops or {}).get(pre, ("0", f"nblk{pre} * MULT", "it"))
        body = [f"start_n = tl.load(ibase{pre} + (({it}) // MULT) * {pre.lower()}kin) * KV_BS + (({it}) % MULT) * BLOCK_N"]
        body += tile(mods, s, full, pre.lower() or "p", scale)
        out += loop("it", lo, hi, body, s.interpret)
    return out


def mask_params(s: Shape) -> list:
    out = ["KVN", "KVI"] + (["FKVN", "FKVI"] if s.has_full else [])
    strides = ["knb", "knh", "knm", "kib", "kih", "kim", "kin"]
    return out, strides + ([f"f{x}" for x in strides] if s.has_full else [])


def _header_consts(call, s: Shape) -> list:
    return [f"HQ: tl.constexpr = {s.hq}", f"G: tl.constexpr = {s.g}", f"D: tl.constexpr = {s.d}",
            f"DV: tl.constexpr = {s.dv}", f"DP: tl.constexpr = {s.dp}", f"DVP: tl.constexpr = {s.dvp}",
            f"Q_BS: tl.constexpr = {call.q_bs}", f"KV_BS: tl.constexpr = {call.kv_bs}"]


def _header(call, s: Shape, name: str, ptrs: list, scalars: list) -> list:
    pm, ms = mask_params(s)
    bptrs, bints = ptr_args(call)
    params = ptrs + pm + bptrs + scalars + ms + bints + ["BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr"]
    return ["@triton.jit", f"def {name}({', '.join(params)}):"] + ["    " + c for c in _header_consts(call, s)]


QKV_STRIDES = ["sqb", "sqh", "sqm", "sqd", "skb", "skh", "skn", "skd", "svb", "svh", "svn", "svd"]


def forward_kernel(call, cfg, interpret: bool, precision: str, name: str, outputs: set):
    """(kernel text, Shape) of the forward; ``outputs``: the positions the graph reads (1: lse, 2: max)."""
    s = Shape(call, interpret, precision)
    s.even_m, s.even_n = grid_even(s.lq, cfg.block_m), walk_even(call.kv_bs, s.lkv, cfg.block_n)
    d = TritonDialect(masks={} if s.even_m else {"q": "mq"}, interpret=interpret)
    if not s.even_n:
        d.masks["kv"] = "mn"
    mods = Mods(call, d, indices("off_b", "off_h", "q_idx", "kv_idx"))
    scalars = ["Q_LEN", "KV_LEN", "MULT"] + QKV_STRIDES + ["sob", "soh", "som", "sod"]
    lines = _header(call, s, name, ["Q", "K", "V", "OUT", "LSE", "MAXS"], scalars)
    qterms = ([] if s.even_m else ["mq"]) + (["(offs_d[None, :] < D)"] if s.d != s.dp else [])
    oterms = ([] if s.even_m else ["mq"]) + (["(offs_v[None, :] < DV)"] if s.dv != s.dvp else [])
    body = ["start_m = tl.program_id(0)", "bh = tl.program_id(1)", "off_b = bh // HQ", "off_h = bh % HQ",
            "off_hk = off_h // G", "offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)",
            "offs_d = tl.arange(0, DP)", "offs_v = tl.arange(0, DVP)", "q_idx = offs_m[:, None]"]
    if not s.even_m:
        body.append("mq = q_idx < Q_LEN")
    body += [f"q = tl.load(Q + off_b.to(tl.int64) * sqb + off_h.to(tl.int64) * sqh + q_idx * sqm + offs_d[None, :] * sqd"
             f"{mask_arg(qterms)})",
             "kbase = K + off_b.to(tl.int64) * skb + off_hk.to(tl.int64) * skh",
             "vbase = V + off_b.to(tl.int64) * svb + off_hk.to(tl.int64) * svh",
             "m_i = tl.full([BLOCK_M], float('-inf'), tl.float32)", "l_i = tl.full([BLOCK_M], 0.0, tl.float32)",
             "acc = tl.full([BLOCK_M, DVP], 0.0, tl.float32)", "row = (start_m * BLOCK_M) // Q_BS"]
    body += block_loops(mods, s, call.scale, "off_h", "row")
    out_v = convert("acc", torch.float32, s.dtype, interpret) if s.dtype != torch.float32 else "acc"
    body += ["l_use = tl.where(l_i == 0.0, 1.0, l_i)", "acc = acc / l_use[:, None]",
             f"tl.store(OUT + off_b.to(tl.int64) * sob + off_h.to(tl.int64) * soh + q_idx * som + offs_v[None, :] * sod, "
             f"{out_v}{mask_arg(oterms, False)})"]
    rmask = "" if s.even_m else ", mask=offs_m < Q_LEN"
    if 1 in outputs:
        body += ["lse = tl.where(l_i == 0.0, float('-inf'), m_i + tl.log2(l_use))",
                 f"tl.store(LSE + bh.to(tl.int64) * Q_LEN + offs_m, lse{rmask})"]
    if 2 in outputs:
        body.append(f"tl.store(MAXS + bh.to(tl.int64) * Q_LEN + offs_m, m_i{rmask})")
    return "\n".join(lines + ["    " + b for b in body]), s, d


def decode_kernels(call, cfg, gp: int, rows: int, interpret: bool, precision: str, name: str):
    """(text of the split kernel ``<name>`` and its combining kernel ``<name>_combine``, Shape, dialect)."""
    _, _, _, lq, _, _, _, _ = call.dims()
    s = Shape(call, interpret, precision)
    s.even_n = walk_even(call.kv_bs, s.lkv, cfg.block_n)
    d = TritonDialect(masks={"q": "mq"}, interpret=interpret)
    if not s.even_n:
        d.masks["kv"] = "mn"
    mods = Mods(call, d, indices("off_b", "off_h", "q_idx", "kv_idx", h_rows=gp > 1))
    scalars = ["Q_LEN", "KV_LEN", "MULT", "SPLITS"] + QKV_STRIDES
    lines = _header(call, s, name, ["Q", "K", "V", "OACC", "OLSE"], scalars)
    lines += [f"    GP: tl.constexpr = {gp}", f"    QL: tl.constexpr = {lq}"]
    dm = " & (offs_d[None, :] < D)" if s.d != s.dp else ""
    heads = "(hg * GP + r // QL)[:, None]" if gp > 1 else "hg"
    body = ["sp = tl.program_id(0)", "bg = tl.program_id(1)", "off_b = bg // (HQ // GP)", "hg = bg % (HQ // GP)",
            "r = tl.arange(0, BLOCK_M)", f"off_h = {heads}", "off_hk = (hg * GP) // G", "q_idx = (r % QL)[:, None]",
            "mq = (r < GP * QL)[:, None]", "offs_d = tl.arange(0, DP)", "offs_v = tl.arange(0, DVP)",
            f"q = tl.load(Q + off_b.to(tl.int64) * sqb + off_h * sqh + q_idx * sqm + offs_d[None, :] * sqd, "
            f"mask=mq{dm}, other=0.0)",
            "kbase = K + off_b.to(tl.int64) * skb + off_hk.to(tl.int64) * skh",
            "vbase = V + off_b.to(tl.int64) * svb + off_hk.to(tl.int64) * svh",
            "m_i = tl.full([BLOCK_M], float('-inf'), tl.float32)", "l_i = tl.full([BLOCK_M], 0.0, tl.float32)",
            "acc = tl.full([BLOCK_M, DVP], 0.0, tl.float32)", "mhead = hg * GP"]
    loops = {"": ("lo", "tl.minimum(hi, npart)", "it"), "F": ("tl.maximum(lo, npart)", "hi", "it - npart")}
    walk = block_loops(mods, s, call.scale, "mhead", "0", loops)
    n_decl = 4 if s.has_full else 2
    body += walk[:n_decl]
    total = "(nblk + nblkF) * MULT" if s.has_full else "nblk * MULT"
    body += ["npart = nblk * MULT", f"total = {total}", "per = (total + SPLITS - 1) // SPLITS", "lo = sp * per",
             "hi = tl.minimum(lo + per, total)"] + walk[n_decl:]
    body += ["l_use = tl.where(l_i == 0.0, 1.0, l_i)", "slot = (bg.to(tl.int64) * SPLITS + sp) * BLOCK_M + r",
             "tl.store(OACC + slot[:, None] * DVP + offs_v[None, :], acc / l_use[:, None])",
             "tl.store(OLSE + slot, tl.where(l_i == 0.0, float('-inf'), m_i + tl.log2(l_use)))"]
    kernel = "\n".join(lines + ["    " + b for b in body])
    vm = " & (offs_v[None, :] < DV)" if s.dv != s.dvp else ""
    out_v = convert("o", torch.float32, s.dtype, interpret) if s.dtype != torch.float32 else "o"
    combine = [
        "@triton.jit",
        f"def {name}_combine(OACC, OLSE, OUT, LSE, Q_LEN, SPLITS, sob, soh, som, sod, BLOCK_M: tl.constexpr):",
        f"    HQ: tl.constexpr = {s.hq}", f"    GP: tl.constexpr = {gp}", f"    QL: tl.constexpr = {lq}",
        f"    DV: tl.constexpr = {s.dv}", f"    DVP: tl.constexpr = {s.dvp}",
        "    bg = tl.program_id(0)", "    off_b = bg // (HQ // GP)", "    hg = bg % (HQ // GP)",
        "    r = tl.arange(0, BLOCK_M)", "    offs_v = tl.arange(0, DVP)", "    ok = r < GP * QL",
        "    g = tl.full([BLOCK_M], float('-inf'), tl.float32)",
    ] + ["    " + ln for ln in loop("sp", "0", "SPLITS", [
        "g = tl.maximum(g, tl.load(OLSE + (bg.to(tl.int64) * SPLITS + sp) * BLOCK_M + r))"], interpret)] + [
        "    g_use = tl.where(g == float('-inf'), 0.0, g)",
        "    tot = tl.full([BLOCK_M], 0.0, tl.float32)", "    o = tl.full([BLOCK_M, DVP], 0.0, tl.float32)",
    ] + ["    " + ln for ln in loop("sp", "0", "SPLITS", [
        "slot = (bg.to(tl.int64) * SPLITS + sp) * BLOCK_M + r",
        "w = tl.exp2(tl.load(OLSE + slot) - g_use)",
        "tot = tot + w",
        "o = o + w[:, None] * tl.load(OACC + slot[:, None] * DVP + offs_v[None, :])"], interpret)] + [
        "    t_use = tl.where(tot == 0.0, 1.0, tot)", "    o = o / t_use[:, None]",
        "    h = hg * GP + r // QL", "    m = r % QL",
        f"    tl.store(OUT + off_b.to(tl.int64) * sob + h[:, None] * soh + m[:, None] * som + offs_v[None, :] * sod, "
        f"{out_v}, mask=ok[:, None]{vm})",
        "    tl.store(LSE + (off_b.to(tl.int64) * HQ + h) * QL + m, "
        "tl.where(tot == 0.0, float('-inf'), g_use + tl.log2(t_use)), mask=ok)",
    ]
    return kernel + "\n\n\n" + "\n".join(combine), s, d


__all__ = ["forward_kernel", "decode_kernels", "Shape", "rsum", "rmax", "grid_even", "walk_even", "mask_arg", "loop", "_header_consts", "tile", "dot", "ptr_args", "mask_params", "QKV_STRIDES",
           "LOG2E"]
