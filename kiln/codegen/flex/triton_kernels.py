"""FlexAttention's Triton kernels as text: the forward, the split-KV decoding pair and the backward.

``forward_kernel``: a program per (query tile, batch x head) walks the kv blocks its BlockMask row lists
(partial blocks with mask_mod, full ones without), ``MULT`` tiles of ``BLOCK_N`` per block, with an online
softmax in base 2; GQA head ``h`` reads kv head ``h // G``. ``decode_kernels``: for a few query tokens, each
program takes a share of the blocks for ``GP`` heads sharing a kv head; a second kernel combines the shares.
``backward_kernels``: ``<name>_pre`` computes ``delta = rowsum(dO * O)`` (less ``grad_lse / ln 2``);
in ``<name>_dqkv`` the first ``cdiv(Q_LEN, BLOCK_M2)`` programs walk the forward's BlockMask rows for dq, the
others, per (kv tile, batch x kv head), the q-side BlockMask for dk and dv over the GQA group's query heads;
gradients of captured tensors are atomic adds of partial sums.
"""
import math
import re

import torch

from kiln.codegen.flex.hop import Mods, buffer_names, indices
from kiln.codegen.flex.translate import TritonDialect, Val
from kiln.codegen.ir.indexing import next_pow2
from kiln.codegen.to_triton.ops import convert

LOG2E = 1.4426950408889634
BOTH = frozenset({"q", "kv"})
QKV_STRIDES = ["sqb", "sqh", "sqm", "sqd", "skb", "skh", "skn", "skd", "svb", "svh", "svn", "svd"]
# the online softmax's state and the key/value bases of a program over query rows
START = ["kbase = K + off_b.to(tl.int64) * skb + off_hk.to(tl.int64) * skh",
         "vbase = V + off_b.to(tl.int64) * svb + off_hk.to(tl.int64) * svh",
         "m_i = tl.full([BLOCK_M], float('-inf'), tl.float32)", "l_i = tl.full([BLOCK_M], 0.0, tl.float32)",
         "acc = tl.full([BLOCK_M, DVP], 0.0, tl.float32)"]
# a tile's keys and values at start_n (the loads' masks and ")" to follow)
KV_TILE = ["k = tl.load(kbase + offs_n[:, None] * skn + offs_d[None, :] * skd",
           "v = tl.load(vbase + offs_n[:, None] * svn + offs_v[None, :] * svd"]


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
    axis crosses the sequence's end (each kernel lays its tiles out its own way)."""

    def __init__(self, call, interpret, even_m=False, even_n=False):
        _, hq, hkv, self.lq, self.lkv, d, dv, _ = call.dims()
        self.hq, self.g, self.d, self.dv = hq, hq // hkv, d, dv
        self.dp, self.dvp = max(16, next_pow2(d)), max(16, next_pow2(dv))
        self.even_m, self.even_n = even_m, even_n
        self.interpret, self.dtype = interpret, call.dtype
        self.precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
        self.has_full = call.masks["full_kv_num"] is not None
        self.dmask = ["(offs_d[None, :] < D)"] if d != self.dp else []
        self.vmask = ["(offs_v[None, :] < DV)"] if dv != self.dvp else []
        self.nmask = [] if even_n else ["(offs_n[:, None] < KV_LEN)"]

    def mods(self, call, h_rows=False) -> Mods:
        """The subgraphs' statements, their loads masked by ``mq``/``mn`` where tiles overhang."""
        masks = ({} if self.even_m else {"q": "mq"}) | ({} if self.even_n else {"kv": "mn"})
        return Mods(call, TritonDialect(masks=masks, interpret=self.interpret),
                    indices("off_b", "off_h", "q_idx", "kv_idx", h_rows))

    def to_dt(self, x: str) -> str:
        return convert(x, torch.float32, self.dtype, self.interpret) if self.dtype != torch.float32 else x

    def consts(self, call) -> list:
        return consts(HQ=self.hq, G=self.g, D=self.d, DV=self.dv, DP=self.dp, DVP=self.dvp, Q_BS=call.q_bs,
                      KV_BS=call.kv_bs)


def consts(**values) -> list:
    return [f"    {k}: tl.constexpr = {v}" for k, v in values.items()]


def dot(a, b, s: Shape, acc=None):
    extra = f", {acc}" if acc else ""
    prec = f", input_precision='{s.precision}'" if s.dtype == torch.float32 and not s.interpret else ""
    return f"tl.dot({a}, {b}{extra}{prec})"


def at(ptr: str, s: str, b: str, h: str, row: str, col: str, n="m", wide=True) -> str:
    """The address of [batch b, head h, row, col] of tensor ``ptr`` with strides ``<s>b, <s>h, <s><n>, <s>d``
    (batch, and head where ``wide``, in int64)."""
    h = f"{h}.to(tl.int64)" if wide else h
    return f"{ptr} + {b}.to(tl.int64) * {s}b + {h} * {s}h + {row} * {s}{n} + {col} * {s}d"


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
    """A sum over ``axis``; the interpreter reduces with the standard combine function (``tl.sum`` is a
    function compiled for the GPU)."""
    k = ", keep_dims=True" if keep else ""
    return f"tl.reduce({x}, {axis}, tl.standard._sum_combine{k})" if interpret else f"tl.sum({x}, {axis}{k})"


def rmax(x: str, axis: int, interpret: bool) -> str:
    return f"tl.reduce({x}, {axis}, tl.standard._elementwise_max)" if interpret else f"tl.max({x}, {axis})"


def loop(var: str, lo: str, hi: str, body: list, interpret: bool) -> list:
    """``for var in range(lo, hi)``; in the interpreter (whose scalars ``range`` refuses) a ``while`` loop."""
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
    lines = ["offs_n = start_n + tl.arange(0, BLOCK_N)", "kv_idx = offs_n[None, :]"]
    if not s.even_n:
        lines.append("mn = kv_idx < KV_LEN")
    lines += [KV_TILE[0] + mask_arg(s.nmask + s.dmask) + ")", f"qk = {dot('q', 'tl.trans(k)', s)}"]
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
    return lines + [f"m_new = tl.maximum(m_i, {rmax('x', 1, s.interpret)})",
                    "m_use = tl.where(m_new == float('-inf'), 0.0, m_new)", "alpha = tl.exp2(m_i - m_use)",
                    "p = tl.exp2(x - m_use[:, None])", f"l_i = l_i * alpha + {rsum('p', 1, s.interpret)}",
                    KV_TILE[1] + mask_arg(s.nmask + s.vmask) + ")",
                    f"acc = {dot(s.to_dt('p'), 'v', s, 'acc * alpha[:, None]')}", "m_i = m_new"]


def block_loops(mods, s, scale, head: str, row: str, loops=None) -> list:
    """The walks over the listed partial blocks, then the full ones (``loops``: per kind, the range)."""
    out = []
    kinds = [("", False)] + ([("F", True)] if s.has_full else [])
    for pre, full in kinds:
        p = pre.lower()
        out += [f"nblk{pre} = tl.load({pre}KVN + off_b * {p}knb + {head} * {p}knh + {row} * {p}knm)",
                f"ibase{pre} = {pre}KVI + off_b * {p}kib + {head} * {p}kih + {row} * {p}kim"]
    for pre, full in kinds:
        lo, hi, it = (loops or {}).get(pre, ("0", f"nblk{pre} * MULT", "it"))
        body = [f"start_n = tl.load(ibase{pre} + (({it}) // MULT) * {pre.lower()}kin) * KV_BS + (({it}) % MULT) * BLOCK_N"]
        out += loop("it", lo, hi, body + tile(mods, s, full, pre.lower() or "p", scale), s.interpret)
    return out


def _header(call, s: Shape, name: str, ptrs: list, scalars: list) -> list:
    strides = ["knb", "knh", "knm", "kib", "kih", "kim", "kin"]
    masks = ["KVN", "KVI", "FKVN", "FKVI"] if s.has_full else ["KVN", "KVI"]
    strides += [f"f{x}" for x in strides] if s.has_full else []
    bptrs, bints = ptr_args(call)
    blocks = ["BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr"]
    params = ptrs + masks + bptrs + scalars + strides + bints + blocks
    return ["@triton.jit", f"def {name}({', '.join(params)}):"] + s.consts(call)


def rows(pid0: str, pid1: str) -> list:
    """The indices of a program over a query tile of one (batch x head)."""
    return [f"start_m = {pid0}", f"bh = {pid1}", "off_b = bh // HQ", "off_h = bh % HQ", "off_hk = off_h // G",
            "offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)", "offs_d = tl.arange(0, DP)",
            "offs_v = tl.arange(0, DVP)", "q_idx = offs_m[:, None]"]


def forward_kernel(call, cfg, interpret: bool, name: str):
    """(kernel text, Shape, dialect) of the forward, storing the lse and max where the graph reads them."""
    s = Shape(call, interpret, grid_even(call.dims()[3], cfg.block_m),
              walk_even(call.kv_bs, call.dims()[4], cfg.block_n))
    mods = s.mods(call)
    scalars = ["Q_LEN", "KV_LEN", "MULT"] + QKV_STRIDES + ["sob", "soh", "som", "sod"]
    lines = _header(call, s, name, ["Q", "K", "V", "OUT", "LSE", "MAXS"], scalars)
    mq = [] if s.even_m else ["mq"]
    body = rows("tl.program_id(0)", "tl.program_id(1)")
    if not s.even_m:
        body.append("mq = q_idx < Q_LEN")
    body.append(f"q = tl.load({at('Q', 'sq', 'off_b', 'off_h', 'q_idx', 'offs_d[None, :]')}"
                f"{mask_arg(mq + s.dmask)})")
    body += START + ["row = (start_m * BLOCK_M) // Q_BS"] + block_loops(mods, s, call.scale, "off_h", "row")
    body += ["l_use = tl.where(l_i == 0.0, 1.0, l_i)", "acc = acc / l_use[:, None]",
             f"tl.store({at('OUT', 'so', 'off_b', 'off_h', 'q_idx', 'offs_v[None, :]')}, "
             f"{s.to_dt('acc')}{mask_arg(mq + s.vmask, False)})"]
    rmask = "" if s.even_m else ", mask=offs_m < Q_LEN"
    if 1 in call.used:
        body += ["lse = tl.where(l_i == 0.0, float('-inf'), m_i + tl.log2(l_use))",
                 f"tl.store(LSE + bh.to(tl.int64) * Q_LEN + offs_m, lse{rmask})"]
    if 2 in call.used:
        body.append(f"tl.store(MAXS + bh.to(tl.int64) * Q_LEN + offs_m, m_i{rmask})")
    return "\n".join(lines + ["    " + b for b in body]), s, mods.d


def decode_kernels(call, cfg, gp: int, interpret: bool, name: str):
    """(text of the split kernel ``<name>`` and its combining kernel ``<name>_combine``, Shape, dialect)."""
    lq = call.dims()[3]
    s = Shape(call, interpret, even_n=walk_even(call.kv_bs, call.dims()[4], cfg.block_n))
    mods = s.mods(call, h_rows=gp > 1)
    lines = _header(call, s, name, ["Q", "K", "V", "OACC", "OLSE"], ["Q_LEN", "KV_LEN", "MULT", "SPLITS"] + QKV_STRIDES)
    lines += consts(GP=gp, QL=lq)
    heads = "(hg * GP + r // QL)[:, None]" if gp > 1 else "hg"
    body = ["sp = tl.program_id(0)", "bg = tl.program_id(1)", "off_b = bg // (HQ // GP)", "hg = bg % (HQ // GP)",
            "r = tl.arange(0, BLOCK_M)", f"off_h = {heads}", "off_hk = (hg * GP) // G", "q_idx = (r % QL)[:, None]",
            "mq = (r < GP * QL)[:, None]", "offs_d = tl.arange(0, DP)", "offs_v = tl.arange(0, DVP)",
            f"q = tl.load({at('Q', 'sq', 'off_b', 'off_h', 'q_idx', 'offs_d[None, :]', wide=False)}"
            f"{mask_arg(['mq'] + s.dmask)})"] + START + ["mhead = hg * GP"]
    loops = {"": ("lo", "tl.minimum(hi, npart)", "it"), "F": ("tl.maximum(lo, npart)", "hi", "it - npart")}
    walk = block_loops(mods, s, call.scale, "mhead", "0", loops)
    n_decl = 4 if s.has_full else 2
    total = "(nblk + nblkF) * MULT" if s.has_full else "nblk * MULT"
    body += walk[:n_decl] + ["npart = nblk * MULT", f"total = {total}",
                             "per = (total + SPLITS - 1) // SPLITS", "lo = sp * per",
                             "hi = tl.minimum(lo + per, total)"] + walk[n_decl:]
    body += ["l_use = tl.where(l_i == 0.0, 1.0, l_i)", "slot = (bg.to(tl.int64) * SPLITS + sp) * BLOCK_M + r",
             "tl.store(OACC + slot[:, None] * DVP + offs_v[None, :], acc / l_use[:, None])",
             "tl.store(OLSE + slot, tl.where(l_i == 0.0, float('-inf'), m_i + tl.log2(l_use)))"]
    kernel = "\n".join(lines + ["    " + b for b in body])
    combine = [
        "bg = tl.program_id(0)", "off_b = bg // (HQ // GP)", "hg = bg % (HQ // GP)",
        "r = tl.arange(0, BLOCK_M)", "offs_v = tl.arange(0, DVP)", "ok = r < GP * QL",
        "g = tl.full([BLOCK_M], float('-inf'), tl.float32)",
    ] + loop("sp", "0", "SPLITS", [
        "g = tl.maximum(g, tl.load(OLSE + (bg.to(tl.int64) * SPLITS + sp) * BLOCK_M + r))"], interpret) + [
        "g_use = tl.where(g == float('-inf'), 0.0, g)",
        "tot = tl.full([BLOCK_M], 0.0, tl.float32)", "o = tl.full([BLOCK_M, DVP], 0.0, tl.float32)",
    ] + loop("sp", "0", "SPLITS", [
        "slot = (bg.to(tl.int64) * SPLITS + sp) * BLOCK_M + r", "w = tl.exp2(tl.load(OLSE + slot) - g_use)",
        "tot = tot + w", "o = o + w[:, None] * tl.load(OACC + slot[:, None] * DVP + offs_v[None, :])"],
        interpret) + [
        "t_use = tl.where(tot == 0.0, 1.0, tot)", "o = o / t_use[:, None]", "h = hg * GP + r // QL",
        "m = r % QL",
        f"tl.store({at('OUT', 'so', 'off_b', 'h[:, None]', 'm[:, None]', 'offs_v[None, :]', wide=False)}, "
        f"{s.to_dt('o')}{mask_arg(['ok[:, None]'] + s.vmask, False)})",
        "tl.store(LSE + (off_b.to(tl.int64) * HQ + h) * QL + m, "
        "tl.where(tot == 0.0, float('-inf'), g_use + tl.log2(t_use)), mask=ok)",
    ]
    combine = ["@triton.jit", f"def {name}_combine(OACC, OLSE, OUT, LSE, Q_LEN, SPLITS, sob, soh, som, sod, "
               "BLOCK_M: tl.constexpr):"] + consts(HQ=s.hq, GP=gp, QL=lq, DV=s.dv, DVP=s.dvp) + \
        ["    " + c for c in combine]
    return kernel + "\n\n\n" + "\n".join(combine), s, mods.d



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


def _dscore(mods, tag, valid, scatter: bool):
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
            for a, dim in (("q", 0), ("kv", 1)):
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


def _mask_walk(pre: str, table: str, row: str, body: list, interpret: bool) -> list:
    """The walk over the blocks a row of BlockMask ``table`` ('KV' or 'Q') lists (``pre`` 'F': full ones)."""
    t = pre.lower() + table.lower()
    start, bs, tile = ("start_n", "KV_BS", "BLOCK_N") if table == "KV" else ("start_m", "Q_BS", "BLOCK_M")
    first = f"{start} = tl.load(ibase + (it // MULT) * {t}ic) * {bs} + (it % MULT) * {tile}"
    return [f"nblk = tl.load({pre}{table}N + off_b * {t}nb + off_h * {t}nh + {row} * {t}nr)",
            f"ibase = {pre}{table}I + off_b * {t}ib + off_h * {t}ih + {row} * {t}ir"] + \
        loop("it", "0", "nblk * MULT", [first] + body, interpret)


def _mask_strides(table: str, full: bool):
    t = table.lower()
    names = [f"{t}nb", f"{t}nh", f"{t}nr", f"{t}ib", f"{t}ih", f"{t}ir", f"{t}ic"]
    return names + ([f"f{n}" for n in names] if full else [])


def _q_rows(s: Shape, row: str, terms: list) -> list:
    """Loads of q, dO, the log-sum-exp and delta at query rows ``row`` (``terms``: their row mask)."""
    rm = mask_arg([] if s.even_m else ["offs_m < Q_LEN"])
    return [f"q = tl.load({at('Q', 'sq', 'off_b', 'off_h', row, 'offs_d[None, :]')}"
            f"{mask_arg(terms + s.dmask)})",
            f"do = tl.load({at('DO', 'sdo', 'off_b', 'off_h', row, 'offs_v[None, :]')}"
            f"{mask_arg(terms + s.vmask)})",
            f"lse = tl.load(LSE + off_b.to(tl.int64) * slb + off_h.to(tl.int64) * slh + offs_m * slm{rm})",
            "lse = tl.where(lse == float('-inf'), 0.0, lse)",
            f"Di = tl.load(DELTA + bh.to(tl.int64) * Q_LEN + offs_m{rm})"]


def backward_kernels(call, cfg, interpret: bool, name: str, has_dlse: bool):
    """(module text of the kernels, their dialects, scattered buffer indices)."""
    hkv = call.dims()[2]
    lq, lkv = call.dims()[3:5]
    s2 = Shape(call, interpret, grid_even(lq, cfg.m2), walk_even(call.kv_bs, lkv, cfg.n2))
    s1 = Shape(call, interpret, walk_even(call.q_bs, lq, cfg.m1), grid_even(lkv, cfg.n1))
    vm, dmask = s2.vmask, s2.dmask
    # -- delta ------------------------------------------------------------------------------------
    pre = ["start_m = tl.program_id(0)", "bh = tl.program_id(1)", "off_b = bh // HQ", "off_h = bh % HQ",
           "offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)", "offs_v = tl.arange(0, DVP)",
           "mq = offs_m[:, None] < Q_LEN"]
    for var, t, s in (("o", "OUT", "so"), ("do", "DO", "sdo")):
        pre.append(f"{var} = tl.load({at(t, s, 'off_b', 'off_h', 'offs_m[:, None]', 'offs_v[None, :]')}"
                   f"{mask_arg(['mq'] + vm)}).to(tl.float32)")
    pre.append(f"delta = {rsum('o * do', 1, interpret)}")
    if has_dlse:
        pre.append(f"delta = delta - tl.load(DLSE + off_b.to(tl.int64) * sgb + off_h.to(tl.int64) * sgh + "
                   f"offs_m * sgm, mask=offs_m < Q_LEN, other=0.0) * {1 / math.log(2)!r}")
    pre.append("tl.store(DELTA + bh.to(tl.int64) * Q_LEN + offs_m, delta, mask=offs_m < Q_LEN)")
    pre = ["@triton.jit", f"def {name}_pre(OUT, DO, DLSE, DELTA, Q_LEN, sob, soh, som, sod, sdob, sdoh, "
           "sdom, sdod, sgb, sgh, sgm, BLOCK_M: tl.constexpr):"] + s2.consts(call) + \
        ["    " + ln for ln in pre]
    # -- dq ---------------------------------------------------------------------------------------
    mods2 = s2.mods(call)
    scattered = sorted(mods2.joint(Val("score", torch.float32, BOTH), Val("ds", torch.float32, BOTH), "x")[2])
    full2 = call.masks["full_kv_num"] is not None
    qterms = [] if s2.even_m else ["mq"]
    body = rows("pid0", "pid1") + ["mq = q_idx < Q_LEN"] + _q_rows(s2, "q_idx", qterms) + START[:2] + \
        ["dq = tl.full([BLOCK_M, DP], 0.0, tl.float32)", "row = (start_m * BLOCK_M) // Q_BS"]
    bounds2 = qterms + ([] if s2.even_n else ["mn"])
    for pre_, full in [("", False)] + ([("F", True)] if full2 else []):
        sc, valid = _scores(mods2, s2, full, pre_.lower() or "p", "qk", bounds2)
        tile = ["offs_n = start_n + tl.arange(0, BLOCK_N)", "kv_idx = offs_n[None, :]", "mn = kv_idx < KV_LEN",
                KV_TILE[0] + mask_arg(s2.nmask + dmask) + ")", KV_TILE[1] + mask_arg(s2.nmask + vm) + ")",
                f"qk = {dot('q', 'tl.trans(k)', s2)}"] + sc + [
                "p = tl.exp2(x - lse[:, None])", f"dp = {dot('do', 'tl.trans(v)', s2)}", "ds = p * (dp - Di[:, None])"]
        tile += _dscore(mods2, pre_.lower() or "p", valid, True)
        tile.append(f"dq = {dot(s2.to_dt('dscore'), 'k', s2, 'dq')}")
        body += _mask_walk(pre_, "KV", "row", tile, interpret)
    body += ["dq = dq * " + repr(call.scale),
             f"tl.store({at('DQ', 'sqg', 'off_b', 'off_h', 'q_idx', 'offs_d[None, :]')}, "
             f"{s2.to_dt('dq')}{mask_arg(qterms + dmask, False)})"]
    dq = _rename(body, "BLOCK_M2", "BLOCK_N2", "MULT2")
    # -- dk, dv -----------------------------------------------------------------------------------
    mods1 = s1.mods(call)
    full1 = call.masks["full_q_num"] is not None
    nterms = s1.nmask
    body = ["start_n = pid0 - NQT", "bk = pid1", f"off_bk = bk // {hkv}", f"off_hk = bk % {hkv}",
            "offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)", "offs_d = tl.arange(0, DP)",
            "offs_v = tl.arange(0, DVP)", "kv_idx = offs_n[:, None]", "mn = kv_idx < KV_LEN",
            f"k = tl.load({at('K', 'sk', 'off_bk', 'off_hk', 'kv_idx', 'offs_d[None, :]', 'n')}"
            f"{mask_arg(nterms + dmask)})",
            f"v = tl.load({at('V', 'sv', 'off_bk', 'off_hk', 'kv_idx', 'offs_v[None, :]', 'n')}"
            f"{mask_arg(nterms + vm)})",
            "dk = tl.full([BLOCK_N, DP], 0.0, tl.float32)", "dv = tl.full([BLOCK_N, DVP], 0.0, tl.float32)",
            "col = (start_n * BLOCK_N) // KV_BS"]
    bounds1 = ([] if s1.even_n else ["mn"]) + ([] if s1.even_m else ["mq"])
    inner = []
    for pre_, full in [("", False)] + ([("F", True)] if full1 else []):
        sc, valid = _scores(mods1, s1, full, pre_.lower() or "p", "qkT", bounds1)
        tile = ["offs_m = start_m + tl.arange(0, BLOCK_M)", "q_idx = offs_m[None, :]", "mq = q_idx < Q_LEN"]
        tile += _q_rows(s1, "offs_m[:, None]", [] if s1.even_m else ["(offs_m[:, None] < Q_LEN)"]) + \
            [f"qkT = {dot('k', 'tl.trans(q)', s1)}"] + sc + [
                "pT = tl.exp2(x - lse[None, :])", f"dv = {dot(s1.to_dt('pT'), 'do', s1, 'dv')}",
                f"dpT = {dot('v', 'tl.trans(do)', s1)}", "ds = pT * (dpT - Di[None, :])"]
        tile += _dscore(mods1, pre_.lower() or "p", valid, False)
        tile.append(f"dk = {dot(s1.to_dt('dscore'), 'q', s1, 'dk')}")
        inner += _mask_walk(pre_, "Q", "col", tile, interpret)
    heads = ["off_b = off_bk + bq", "for g in range(0, G):", "    off_h = off_hk * G + g", "    bh = off_b * HQ + off_h"]
    body += loop("bq", "0", "BQ", heads + ["    " + ln for ln in inner], interpret)
    body += ["dk = dk * " + repr(call.scale),
             f"tl.store({at('DKO', 'skg', 'off_bk', 'off_hk', 'kv_idx', 'offs_d[None, :]', 'n')}, "
             f"{s1.to_dt('dk')}{mask_arg(nterms + dmask, False)})",
             f"tl.store({at('DVO', 'svg', 'off_bk', 'off_hk', 'kv_idx', 'offs_v[None, :]', 'n')}, "
             f"{s1.to_dt('dv')}{mask_arg(nterms + vm, False)})"]
    dkdv = _rename(body, "BLOCK_M1", "BLOCK_N1", "MULT1")
    ptrs, ints = ptr_args(call)
    params = ["Q", "K", "V", "DO", "LSE", "DELTA", "DQ", "DKO", "DVO", "KVN", "KVI"] + \
        (["FKVN", "FKVI"] if full2 else []) + ["QN", "QI"] + (["FQN", "FQI"] if full1 else []) + ptrs + \
        [f"GBUF{j}" for j in scattered] + ["Q_LEN", "KV_LEN", "MULT2", "MULT1", "BQ", "BKH"] + QKV_STRIDES + \
        ["sdob", "sdoh", "sdom", "sdod", "slb", "slh", "slm", "sqgb", "sqgh", "sqgm", "sqgd", "skgb", "skgh", "skgn",
         "skgd", "svgb", "svgh", "svgn", "svgd"] + _mask_strides("KV", full2) + _mask_strides("Q", full1) + ints + \
        [f"{b}: tl.constexpr" for b in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2")]
    both = ["@triton.jit", f"def {name}_dqkv({', '.join(params)}):"] + s1.consts(call)
    both += ["    pid0 = tl.program_id(0)", "    pid1 = tl.program_id(1)",
             "    NQT = (Q_LEN + BLOCK_M2 - 1) // BLOCK_M2", "    if pid0 < NQT:"] + ["        " + b for b in dq] + \
        ["    elif pid1 < BKH:"] + ["        " + b for b in dkdv]
    return "\n\n\n".join("\n".join(k) for k in (pre, both)), (mods1.d, mods2.d), scattered


def _rename(lines, block_m: str, block_n: str, mult: str) -> list:
    """``lines`` with the tile sizes and mask multiplicity named as one half of the combined kernel names them."""
    names = {"BLOCK_M": block_m, "BLOCK_N": block_n, "MULT": mult}
    return [re.sub(r"\b(BLOCK_M|BLOCK_N|MULT)\b", lambda m: names[m.group(1)], ln) for ln in lines]
