"""FlexAttention's forward on the CPU: one C++ function and its Python launcher (``cpp_forward``).

OpenMP threads take (batch, head, query tile) triples and walk the kv blocks of their BlockMask row ``BN``
keys at a time: ``S = Q K^T`` and ``P V`` in 4 x 16 register tiles, the mods per element in ``omp simd``
loops, the online softmax in base 2. float64 inputs compute in double.
"""
import hashlib
import math

import torch

from kiln.codegen.flex.hop import FlexCall, Mods, buffer_kind, indices
from kiln.codegen.flex.translate import CppDialect, Unsupported, Val
from kiln.codegen.flex.triton_kernels import LOG2E
from kiln.codegen.flex.triton_module import KB, MASK_PARAMS, RUNTIME, SIZES, VB, order, stats
from kiln.codegen.to_cpp.ops import MEMORY, PREAMBLE, literal
from kiln.codegen.text.source import PLACEHOLDER, Unit

ROWS = 64   # query rows of a thread's tile (a kv block's keys and values are copied once per tile)


def _load(dtype) -> str:
    return "kiln_bf16_load({})" if dtype == torch.bfloat16 else "(CT)({})"


def _store(dtype) -> str:
    return "kiln_bf16_store((float)({}))" if dtype == torch.bfloat16 else f"({MEMORY[dtype]})({{}})"


def _rows4(fmt: str, sep: str) -> str:
    """``fmt`` for the rows ``i0`` .. ``i0 + 3`` of a register tile (``{i}``: the row, ``{r}``: 0 .. 3)."""
    return sep.join(fmt.format(i="i0" if r == 0 else f"i0 + {r}", r=r) for r in range(4))


def _mma(fma: str, col: str, cols: str, init: list, red: str, ptr: str, a: str, lane: str, dst: str) -> list:
    """Rows ``i0`` .. ``i0 + 3`` x 16 columns from ``col`` of ``dst`` in registers ``c0`` .. ``c3``:
    ``init``, then over loop ``red``, ``c<r>[lane] += a<r> * ptr[lane]``."""
    p = ptr.split()[0]
    upd = [" ".join(f"c{r}[{lane}] = {fma}(a{r}, {p}[{lane}], c{r}[{lane}]);" for r in rr) for rr in ((0, 1), (2, 3))]
    return [f"    for (int64_t {col} = 0; {col} < {cols}; {col} += 16)",
            "      for (int64_t i0 = 0; i0 < mrr; i0 += 4) {"] + init + [
        f"        for ({red}) {{", f"          const CT* {ptr};",
        "          const CT " + _rows4(f"a{{r}} = {a}", ", ") + ";", "#pragma omp simd",
        f"          for (int {lane} = 0; {lane} < 16; {lane}++) {{"] + ["            " + u for u in upd] + [
        "          }", "        }", "        for (int j = 0; j < 16; j++) {",
        "          " + _rows4(f"{dst}[{{i}}][{col} + j] = c{{r}}[j];", " "), "        }", "      }"]


def _static_layout(v):
    """(shape, contiguous strides) of captured tensor ``v`` when its shape is static, else None."""
    if not all(isinstance(x, int) for x in v.shape):
        return None
    shape = [int(x) for x in v.shape]
    return shape, [math.prod(shape[j + 1:]) for j in range(len(shape))]


def _tile_rows(call) -> int:
    """Query rows of a thread's tile: a multiple of 4 (the register tiles' height) within one mask block."""
    lq = call.dims()[3]
    rows = ROWS if not isinstance(lq, int) else min(ROWS, max(4, -(-lq // 4) * 4))
    if isinstance(lq, int) and call.q_bs >= lq:
        return rows
    while rows > 4 and call.q_bs % rows:
        rows -= 4
    if call.q_bs % rows:
        raise Unsupported(f"flex: the BlockMask's query block size {call.q_bs} is not a multiple of 4")
    return rows


def kernel_text(call: FlexCall, name: str) -> tuple:
    """(C++ function text, number of pointer args, names of the int64 args)."""
    _, hq, hkv, _, _, d, dv, _ = call.dims()
    dt = call.dtype
    ct = torch.float64 if dt == torch.float64 else torch.float32
    dia = CppDialect(compute=ct)
    mods = Mods(call, dia, indices("ib", "ih", "q_idx", "kv_idx"))
    full = call.masks["full_kv_num"] is not None
    bm, bn = _tile_rows(call), 128   # keys a step: a 128-key block of the mask at once
    dvp = -(-dv // 16) * 16
    vdirect = dt == ct and dv == dvp
    mem = MEMORY[dt]
    ptrs = [f"const {mem}* __restrict q", f"const {mem}* __restrict k", f"const {mem}* __restrict v",
            f"{mem}* __restrict out", "float* __restrict lse", "float* __restrict mx",
            "const int32_t* kvn", "const int32_t* kvi"] + (["const int32_t* fkvn", "const int32_t* fkvi"] * full)
    ints = ["B", "QL", "KL", "sqb", "sqh", "sqm", "sqd", "skb", "skh", "skn", "skd", "svb", "svh", "svn", "svd",
            "sob", "soh", "som", "sod", "knb", "knh", "knm", "kib", "kih", "kim", "kin"]
    ints += [f"f{x}" for x in ints[-7:]] * full
    consts, prep, bargs, bsizes = [], [], [], []   # the launcher's: restrides, buffer arguments and sizes
    for i, b in enumerate(call.score_bufs + call.mask_bufs):
        if buffer_kind(b) == "tensor":
            v = b.meta["val"]
            ptrs.append(f"const {MEMORY[v.dtype]}* __restrict BUF{i}")
            bargs.append(f"buf{i}.data_ptr()")
            names = [f"BUF{i}_stride{j}" for j in range(v.dim())] + [f"BUF{i}_size{j}" for j in range(v.dim())]
            layout = _static_layout(v)
            if layout is None:
                ints += names
                bsizes += [f"*buf{i}.stride()", f"*buf{i}.shape"] if v.dim() else []
            else:   # constants: contiguous loads where a stride is 1 (the launcher restrides other layouts)
                consts += [f"{n} = {x}" for n, x in zip(names, layout[1] + layout[0])]
                prep.append(f"buf{i} = cpp_build.restride(buf{i}, {tuple(layout[0])}, {tuple(layout[1])})")
        else:
            ints.append(f"BUF{i}")
            bsizes.append(f"int(buf{i})")
    identity = mods.identity
    qscale = call.scale * LOG2E if identity else call.scale
    fma = "__builtin_fmaf" if ct == torch.float32 else "__builtin_fma"
    f = "f" if ct == torch.float32 else ""
    score_lines, post = mods.score(Val("score", ct, frozenset({"q", "kv"})), "s")
    mask_lines, keep = mods.mask("m")
    lit = lambda x: literal(x, ct)  # noqa: E731

    def walk(pre: str, partial: bool) -> list:
        p = pre.lower()
        x = "srow[j]" if identity else f"{post.code} * {lit(LOG2E)}"
        elem = [] if identity else ["const CT score = srow[j];"] + score_lines
        elem.append(f"CT x = {x};")
        if partial and keep is not None:
            elem += mask_lines + [f"x = {keep.code} ? x : -(CT)INFINITY;"]
        row = [ln for ln in elem if "kv" not in getattr(ln, "axes", "kv")]   # per query row, not per key
        elem = [ln for ln in elem if ln not in row]
        return [
            f"const int64_t nb{p} = {pre}kvn[b * {p}knb + h * {p}knh + row * {p}knm];",
            f"for (int64_t t = 0; t < nb{p}; t++) {{",
            f"  const int64_t lo = (int64_t){pre}kvi[b * {p}kib + h * {p}kih + row * {p}kim + t * {p}kin] * KV_BS;",
            "  const int64_t hi = lo + KV_BS < KL ? lo + KV_BS : KL;",
            "  for (int64_t n0 = lo; n0 < hi; n0 += BN) {",
            "    const int64_t nn = hi - n0 < BN ? hi - n0 : BN;",
            "    for (int64_t j = 0; j < nn; j++) {",
            f"      const {mem}* kr = k + kbase + (n0 + j) * skn;",
            f"      if (skd == 1) for (int64_t e = 0; e < D; e++) kt[e][j] = {_load(dt).format('kr[e]')};",
            f"      else for (int64_t e = 0; e < D; e++) kt[e][j] = {_load(dt).format('kr[e * skd]')};",
            "      if (vdirect) continue;",
            f"      const {mem}* vr = v + vbase + (n0 + j) * svn;",
            f"      if (svd == 1) for (int64_t e = 0; e < DV; e++) vt[j][e] = {_load(dt).format('vr[e]')};",
            f"      else for (int64_t e = 0; e < DV; e++) vt[j][e] = {_load(dt).format('vr[e * svd]')};",
            "    }",
            "    const int64_t nnc = (nn + 15) & ~(int64_t)15, mrr = (mr + 3) & ~(int64_t)3;   // whole register tiles",
        ] + _mma(fma, "jc", "nnc", ["        CT c0[16] = {0}, c1[16] = {0}, c2[16] = {0}, c3[16] = {0};"],
                 "int64_t e = 0; e < D; e++", "kr = &kt[e][jc]", "qt[{i}][e]", "j", "s") + [
            "    for (int64_t i = 0; i < BM; i++) {",
            "      CT* srow = s[i];",
            "      if (i >= mr) { for (int64_t j = 0; j < BN; j++) srow[j] = 0; continue; }",
            "      const int32_t q_idx = (int32_t)(m0 + i);",
        ] + ["      " + ln for ln in row] + [
            "      CT mloc = -(CT)INFINITY;",
            "#pragma omp simd reduction(max:mloc)",
            "      for (int64_t j = 0; j < nn; j++) {",
            "        const int32_t kv_idx = (int32_t)(n0 + j);",
            "        (void)kv_idx; (void)q_idx;",
        ] + ["        " + ln for ln in elem] + [
            "        srow[j] = x;",
            "        mloc = x > mloc ? x : mloc;",
            "      }",
            "      const CT mnew = mi[i] > mloc ? mi[i] : mloc;",
            "      const CT muse = mnew == -(CT)INFINITY ? 0 : mnew;",
            f"      const CT alpha = exp2{f}(mi[i] - muse);",
            "      CT sum = 0;",
            "#pragma omp simd reduction(+:sum)",
            "      for (int64_t j = 0; j < nn; j++) {",
            f"        const CT pj = exp2{f}(srow[j] - muse);",
            "        srow[j] = pj;",
            "        sum += pj;",
            "      }",
            "      for (int64_t j = nn; j < BN; j++) srow[j] = 0;",
            "      li[i] = li[i] * alpha + sum;",
            "      mi[i] = mnew;",
            "#pragma omp simd",
            "      for (int64_t e = 0; e < DVP; e++) acc[i][e] *= alpha;",
            "    }",
        ] + _mma(fma, "ec", "DVP", ["        CT c0[16], c1[16], c2[16], c3[16];",
                                    "        for (int j = 0; j < 16; j++) {",
                                    "          " + _rows4("c{r}[j] = acc[{i}][ec + j];", " "), "        }"],
                 "int64_t j = 0; j < nn; j++",
                 "vr = vdirect ? (const CT*)(v + vbase + (n0 + j) * svn) + ec : &vt[j][ec]", "s[{i}][j]", "e",
                 "acc") + [
            "  }",
            "}",
        ]

    body = [f"constexpr int64_t {', '.join(consts)};"] * bool(consts) + [
        f"constexpr int64_t HQ = {hq}, G = {hq // hkv}, D = {d}, DV = {dv}, DVP = {dvp}, BM = {bm}, BN = {bn};",
        f"constexpr int64_t Q_BS = {call.q_bs}, KV_BS = {call.kv_bs};",
        "const int64_t nmb = (QL + BM - 1) / BM;",
        "#pragma omp parallel for collapse(3) schedule(dynamic, 1)",
        "for (int64_t b = 0; b < B; b++)",
        " for (int64_t h = 0; h < HQ; h++)",
        "  for (int64_t mb = 0; mb < nmb; mb++) {",
        "    alignas(64) CT qt[BM][D], s[BM][BN], kt[D][BN], vt[BN][DVP], acc[BM][DVP];",
        "    CT mi[BM], li[BM];",
        "    const int32_t ib = (int32_t)b, ih = (int32_t)h;",
        "    (void)ib; (void)ih;",
        "    const int64_t m0 = mb * BM, mr = QL - m0 < BM ? QL - m0 : BM, row = m0 / Q_BS;",
        "    const int64_t kbase = b * skb + (h / G) * skh, vbase = b * svb + (h / G) * svh;",
        f"    const bool vdirect = {'true' if vdirect else 'false'} && svd == 1;   // float rows, read in place",
        "    for (int64_t i = 0; i < BM; i++) {",
        f"      const {mem}* qr = q + b * sqb + h * sqh + (m0 + i) * sqm;",
        f"      for (int64_t e = 0; e < D; e++) qt[i][e] = i < mr ? {_load(dt).format('qr[e * sqd]')} * {lit(qscale)} : 0;",
        "      for (int64_t e = 0; e < DVP; e++) acc[i][e] = 0;",
        "      mi[i] = -(CT)INFINITY; li[i] = 0;",
        "    }",
        "    for (int64_t j = 0; j < BN; j++) for (int64_t e = DV; e < DVP; e++) vt[j][e] = 0;",
    ]
    body += ["    " + ln for ln in walk("", True)]
    if full:
        body += ["    " + ln for ln in walk("f", False)]
    body += [
        "    for (int64_t i = 0; i < mr; i++) {",
        "      const CT l = li[i], inv = l == 0 ? 0 : 1 / l;",
        f"      {mem}* orow = out + b * sob + h * soh + (m0 + i) * som;",
        f"      for (int64_t e = 0; e < DV; e++) orow[e * sod] = {_store(dt).format('acc[i][e] * inv')};",
        f"      if (lse) lse[(b * HQ + h) * QL + m0 + i] = l == 0 ? -INFINITY : (float)(mi[i] + log2{f}(l));",
        "      if (mx) mx[(b * HQ + h) * QL + m0 + i] = (float)mi[i];",
        "    }",
        "  }",
    ]
    sig = ", ".join(ptrs + [f"int64_t {x}" for x in ints])
    ctype = "float" if ct == torch.float32 else "double"
    # g++ -O3 versions loops for unit strides: with this kernel's many strided loops that took 8 s of a 9 s build
    text = f"typedef {ctype} CT;\n#pragma GCC optimize (\"no-version-loops-for-strides\")\n#pragma GCC target (\"prefer-vector-width=512\")\nextern \"C\" void {name}({sig}) {{\n" + "\n".join("  " + b for b in body) + "\n}\n"
    return text, len(ptrs), ints, (prep, bargs, bsizes)


def cpp_forward(call: FlexCall) -> tuple:
    """(C++ ``Unit``, function name, launcher module text)."""
    text, n_ptr, ints, (prep, bargs, bsizes) = kernel_text(call, PLACEHOLDER)
    fname = "kiln_flex_cpp_" + hashlib.sha256(text.encode()).hexdigest()[:16]
    unit = Unit.of(PREAMBLE, text.replace(PLACEHOLDER, fname), (fname,))
    full = call.masks["full_kv_num"] is not None
    ptrs = ["q", "k", "v", "out", "lse", "mx", "kvn", "kvi"] + (["fkvn", "fkvi"] if full else [])
    args = [f"0 if {p} is None else {p}.data_ptr()" if p in ("lse", "mx") else f"{p}.data_ptr()" for p in ptrs]
    sizes = ["B", "QL", "KL", "*q.stride()", "kb", "*k.stride()[1:]", "vb", "*v.stride()[1:]", "*out.stride()",
             "*_mask(kvn, kvi)"] + (["*_mask(fkvn, fkvi)"] if full else [])
    params = "".join(f", buf{i}" for i in range(len(call.score_bufs + call.mask_bufs)))
    lines = ["# kiln generated kernel (FlexAttention, C++)", "import torch", "from kiln.runtime import cpp_build", "",
             f"_k = cpp_build.function({fname!r}, {n_ptr}, {len(ints)})", RUNTIME, "",
             f"def call(q, k, v, {', '.join(MASK_PARAMS)}{params}, *_unused):"]
    out = f"out = _strided((B, HQ, QL, {call.dims()[6]}), {order(call.val(call.node)[0])}, q.dtype, q.device)"
    body = [SIZES, out] + prep + stats(call)[:2] + [KB, VB, "if B * HQ * QL:",
                                                   f"    _k({', '.join(args + bargs + sizes + bsizes)})"]
    return unit, fname, "\n".join(lines + ["    " + b for b in body + stats(call)[2:]]) + "\n"
