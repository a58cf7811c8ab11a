"""FlexAttention's Triton kernel modules: the kernels' text, their tile sizes and the ``call`` launching them.

``call`` takes ``operands(call)``, allocates the outputs with the graph's layouts and returns the op's result
structure. Tile defaults follow FlexAttention's reference kernels on sm90; ``kernel_options`` override them;
a tile is a power of two from 16 (``tl.dot``'s least) within one BlockMask block (or spanning the sequence).
"""
from typing import NamedTuple

import torch
import torch.fx as fx

from kiln.codegen.flex.hop import MASK_NAMES, FlexCall, buffer_kind
from kiln.codegen.flex.translate import Unsupported
from kiln.codegen.flex.triton_kernels import backward_kernels, decode_kernels, forward_kernel
from kiln.codegen.ir.indexing import next_pow2
from kiln.codegen.text.source import PLACEHOLDER
from kiln.codegen.to_triton.ops import HELPERS

LSE = "lse = torch.empty((B, HQ, QL), dtype=torch.float32, device=q.device)"
QKV = "qkv = [*q.stride(), kb, *k.stride()[1:], vb, *v.stride()[1:]]"
SIZES = "B, HQ, QL, KL = q.shape[0], q.shape[1], q.shape[2], k.shape[2]"
KB = "kb = 0 if k.shape[0] == 1 and B > 1 else k.stride(0)"
VB = "vb = 0 if v.shape[0] == 1 and B > 1 else v.stride(0)"
MASK_PARAMS = ["kvn", "kvi", "fkvn", "fkvi", "qn", "qi", "fqn", "fqi"]   # the call's block-mask parameters

Fwd = NamedTuple("Fwd", [("block_m", int), ("block_n", int), ("warps", int), ("stages", int)])
Bwd = NamedTuple("Bwd", [("m1", int), ("n1", int), ("m2", int), ("n2", int), ("warps", int), ("stages", int)])

SM90_FWD = {(torch.float32, 64): (128, 32, 4, 3), (torch.float32, 128): (32, 64, 4, 3),
            (torch.float32, 256): (32, 32, 4, 3), (torch.bfloat16, 64): (128, 128, 4, 3),
            (torch.bfloat16, 128): (128, 64, 8, 3), (torch.bfloat16, 256): (64, 32, 4, 3)}


def fit(want: int, bs: int, length, what: str) -> int:
    """The largest power-of-two tile from 16 to ``want`` within one ``bs`` block of ``length`` (if static)."""
    length = length if isinstance(length, int) else None
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


def _fwd_opts(options, defaults, keys=("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")) -> list:
    return [_opt(options, (f"fwd_{k}", k), x) for k, x in zip(keys, defaults)]


def forward_config(call) -> Fwd:
    _, _, _, lq, lkv, d, dv, _ = call.dims()
    dt = torch.bfloat16 if call.dtype == torch.float16 else call.dtype
    hd = max(d, dv)
    key = (dt, 64 if hd <= 64 else 128 if hd <= 128 else 256)
    bm, bn, warps, stages = _fwd_opts(call.options, SM90_FWD.get(key, (64, 32, 4, 2)))
    return Fwd(fit(bm, call.q_bs, lq, "query"), fit(bn, call.kv_bs, lkv, "key/value"), warps, stages)


def backward_config(call) -> Bwd:
    _, _, _, lq, lkv, d, dv, _ = call.dims()
    hd = max(d, dv)
    if call.dtype == torch.float32 or call.dtype == torch.float64:
        t = 32 if hd <= 128 else 16
        tiles, stages, warps = (t, t, t, t), 1, 4
    elif hd < 64:
        tiles, stages, warps = (64, 64, 64, 64), 3, 4
    else:
        tiles, stages, warps = ((64, 128, 128, 64), 3, 8) if hd <= 128 else ((64, 64, 64, 64), 2, 4)
    o = call.options
    m1, n1, m2, n2 = (_opt(o, (f"bwd_BLOCK_{k}", f"BLOCK_{k}", f"bwd_BLOCK_{k[0]}"), x)
                      for k, x in zip(("M1", "N1", "M2", "N2"), tiles))
    warps = _opt(o, ("bwd_num_warps", "num_warps"), warps)
    stages = _opt(o, ("bwd_num_stages", "num_stages"), stages)
    return Bwd(fit(m1, call.q_bs, lq, "query"), fit(n1, call.kv_bs, lkv, "key/value"),
               fit(m2, call.q_bs, lq, "query"), fit(n2, call.kv_bs, lkv, "key/value"), warps, stages)


def decode_rows(call, max_q: int):
    """(query heads per program, rows per program) of the split-KV decoding kernel, or None where it does
    not apply: a query longer than ``max_q`` or one mask block, a kv sequence under 256, max_scores read."""
    _, hq, hkv, lq, lkv, _, _, _ = call.dims()
    if call.backward or not isinstance(lq, int) or not isinstance(lkv, int) or 2 in call.used:
        return None
    if lq > max_q or lq > call.q_bs or lkv < 256:
        return None
    # heads sharing a kv head ride one program when the mask is the same for all of them
    kvn = call.masks["kv_num"].meta["val"]
    g = hq // hkv if kvn.shape[1] == 1 else 1
    while g > 1 and g * lq > 128:
        g //= 2
    while g > 1 and (hq // hkv) % g:
        g -= 1
    return g, max(16, next_pow2(g * lq))


def decode_config(call) -> Fwd:
    bn, warps, stages = _fwd_opts(call.options, (64, 4, 2), ("BLOCK_N", "num_warps", "num_stages"))
    return Fwd(16, fit(bn, call.kv_bs, call.dims()[4], "key/value"), warps, stages)


RUNTIME = '''

def _ms(t, d):   # a block mask dim of size 1 is broadcast
    return 0 if t.shape[d] == 1 else t.stride(d)


def _mask(n, i):
    return [_ms(n, 0), _ms(n, 1), _ms(n, 2), _ms(i, 0), _ms(i, 1), _ms(i, 2), i.stride(3)]


def _strided(shape, order, dtype, device):
    st, acc = [0] * len(shape), 1
    for d in order:
        st[d] = acc
        acc *= shape[d]
    return torch.empty_strided(shape, st, dtype=dtype, device=device)


def _mult(bs, n, tile):
    return -(-n // tile) if bs >= n else bs // tile


_SITES = {}


def _run(fn, grid, nt, args, blocks, warps, stages):
    """Launch ``fn`` over ``grid`` on ``args`` (``nt`` tensors, then integers): the interpreter one kernel at a time
    (it is not thread-safe); on the GPU the kernel compiled for these argument kinds is called directly after its
    first launch (``kernel[grid]`` binds and specializes every argument again, tens of microseconds), unless a
    Triton launch hook wants its own path."""
    if _LOCK is not None:
        with _LOCK:
            fn[grid](*args, **blocks, num_warps=warps, num_stages=stages)
        return
    p = 0
    for t in args[:nt]:
        p |= t.data_ptr()
    dev = torch._C._cuda_getDevice()
    key = (fn, grid, dev, p & 15 == 0, args[nt:])   # (the dtypes are the module's: see its operands comment)
    site = _SITES.get(key)
    if site is not None and not launch._hooks_on():
        c_launch, head, pm = site   # Triton's C launcher itself (kiln.runtime.launch's launch sites do the same)
        c_launch(grid[0], grid[1] if len(grid) > 1 else 1, 1, torch._C._cuda_getCurrentRawStream(dev), *head, pm,
                 None, None, None, *args, *blocks.values())
        return
    ck = fn[grid](*args, **blocks, num_warps=warps, num_stages=stages)
    if ck is not None and not hasattr(ck, "result"):
        _SITES[key] = launch.launch.__self__.launcher(ck)


_SMS = {}


def _sms(device):
    if device.type != "cuda":
        return 4
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]
'''


def operands(call: FlexCall) -> list:
    """The op's operands in the order ``call`` takes them (graph nodes, None, or ints): the kernels' own,
    then any other value the op reads (the kernels ignore those; the op's dense fallback needs them)."""
    head = [call.q, call.k, call.v] + ([call.out, call.lse, call.grad_out, call.grad_lse] if call.backward else [])
    out = head + [call.masks[n] for n in MASK_NAMES] + list(call.score_bufs + call.mask_bufs)
    listed = {o for o in out if isinstance(o, fx.Node)}
    return out + [n for n in call.node.all_input_nodes if n.op != "get_attr" and n not in listed]


def order(val) -> tuple:
    """The dims of example tensor ``val`` from the fastest-varying (stride) to the slowest."""
    st = [int(x) if isinstance(x, int) else 0 for x in val.stride()]
    return tuple(sorted(range(len(st)), key=lambda d: (st[d], d)))


def _static(val) -> bool:
    return all(isinstance(x, int) for x in list(val.shape) + list(val.stride()))


def _alloc(var: str, val, shape: str, dtype: str, device: str = "q.device") -> str:
    """A line allocating output ``var`` with example ``val``'s layout (literal when static)."""
    if _static(val):
        return f"{var} = torch.empty_strided({tuple(val.shape)}, {tuple(val.stride())}, dtype={dtype}, device={device})"
    return f"{var} = _strided({shape}, {order(val)}, {dtype}, {device})"


def _masks(call, tables: tuple) -> tuple:
    """(the block-mask tensors of ``tables`` ('kv', 'q'), partial then full, and their stride arguments:
    literal where the example layout is static, as Dynamo guards the strides of graph inputs)."""
    ptrs, strides = [], []
    for t in tables:
        for full in ("", "full_"):
            nv, iv = call.masks[f"{full}{t}_num"], call.masks[f"{full}{t}_idx"]
            if nv is None:
                continue
            vn, vi = f"{full[:1]}{t}n", f"{full[:1]}{t}i"
            nv, iv = call.val(nv), call.val(iv)
            ptrs += [vn, vi]
            st = [0 if nv.shape[d] == 1 else nv.stride(d) for d in range(3)] + \
                [0 if iv.shape[d] == 1 else iv.stride(d) for d in range(3)] + [iv.stride(3)]
            strides.append("*" + repr(tuple(int(x) for x in st)) if _static(nv) and _static(iv)
                           else f"*_mask({vn}, {vi})")
    return ptrs, strides


def _module(call, text: str, dialects, interpret: bool, params: list, body: list) -> str:
    """The module: imports, helpers, kernels, the runtime and ``def call(<params>, <buffers>, *_unused)``."""
    # the operands' dtypes, as a comment: two graphs whose captured tensors differ in dtype get two modules
    dtypes = ", ".join(str(o.meta["val"].dtype).replace("torch.", "") for o in operands(call)
                       if hasattr(o, "meta") and isinstance(o.meta.get("val"), torch.Tensor))
    lines = [f"# kiln generated kernel (FlexAttention)\n# operands: {dtypes}", "import torch",
             "import triton", "import triton.language as tl", "from kiln.runtime import launch"]
    if any(d.libdevice for d in dialects):
        lines.append("from triton.language.extra import libdevice")
    lines += ["", f"_LOCK = launch._INTERPRETER if {interpret} else None"]
    for h in sorted(set().union(*[d.helpers for d in dialects])):
        lines += ["", "", HELPERS[h].rstrip()]
    params += [f"buf{i}" for i in range(len(call.score_bufs + call.mask_bufs))] + ["*_unused"]
    lines += ["", "", text, RUNTIME, "", "", f"def call({', '.join(params)}):"] + ["    " + b for b in body]
    return "\n".join(lines) + "\n"


def _buf_params(call) -> tuple:
    """(the kernel's tensor arguments and int arguments of ``call``'s buffer parameters)."""
    ptrs, ints = [], []
    for i, b in enumerate(call.score_bufs + call.mask_bufs):
        if buffer_kind(b) == "tensor":
            ptrs.append(f"buf{i}")
            if b.meta["val"].dim():
                ints += [f"*buf{i}.stride()", f"*buf{i}.shape"]
        else:
            ints.append(f"buf{i}")
    return ptrs, ints


def stats(call) -> list:
    """The forward's lines allocating the log-sum-exp and the max the graph reads, and its return line."""
    return [LSE if 1 in call.used else "lse = None",
            LSE.replace("lse", "mx") if 2 in call.used else "mx = None",
            f"return {('out', 'lse', 'mx')[:len(call.val(call.node))]}".replace("'", "")]


def _launch(kernel: str, grid: str, ptrs: list, ints: list, blocks: dict, warps=4, stages=2) -> str:
    args = ", ".join(ptrs + ints)
    return f"    _run({kernel}, {grid}, {len(ptrs)}, ({args},), {blocks!r}, {warps}, {stages})"


def forward_module(call: FlexCall, interpret: bool, decode_max_q: int) -> tuple:
    """(module text, kind) of a forward op: 'flex' or 'flex_decode'."""
    hq, dv = call.dims()[1], call.dims()[6]
    rows = decode_rows(call, decode_max_q) if decode_max_q else None
    name = PLACEHOLDER
    bptrs, bints = _buf_params(call)
    masks, mstrides = _masks(call, ("kv",))
    body = [SIZES, _alloc("out", call.val(call.node)[0], f"(B, HQ, QL, {dv})", "q.dtype"), KB, VB, QKV]
    if rows is not None:
        gp, nrows = rows
        cfg = decode_config(call)
        text, s, dia = decode_kernels(call, cfg, gp, interpret, name)
        ints = ["QL", "KL", f"_mult({call.kv_bs}, KL, {cfg.block_n})", "splits", "*qkv"] + mstrides + bints
        body += [LSE, "mx = None", f"ng = B * {hq // gp}",
                 f"splits = max(1, min(64, -(-KL // {cfg.block_n}), -(-2 * _sms(q.device) // max(ng, 1))))",
                 f"oacc = torch.empty((ng, splits, {nrows}, {s.dvp}), dtype=torch.float32, device=q.device)",
                 f"olse = torch.empty((ng, splits, {nrows}), dtype=torch.float32, device=q.device)",
                 "if ng and QL:",
                 _launch(name, "(splits, ng)", ["q", "k", "v", "oacc", "olse"] + masks + bptrs, ints,
                         {"BLOCK_M": nrows, "BLOCK_N": cfg.block_n}, cfg.warps, cfg.stages),
                 _launch(f"{name}_combine", "(ng,)", ["oacc", "olse", "out", "lse"],
                         ["QL", "splits", "*out.stride()"], {"BLOCK_M": nrows})]
        kind = "flex_decode"
    else:
        cfg = forward_config(call)
        text, s, dia = forward_kernel(call, cfg, interpret, name)
        body += stats(call)[:2]
        tensors = ["q", "k", "v", "out", "out if lse is None else lse", "out if mx is None else mx"]
        ints = ["QL", "KL", f"_mult({call.kv_bs}, KL, {cfg.block_n})", "*qkv", "*out.stride()"] + mstrides + bints
        body += ["if B * HQ * QL:", _launch(name, f"(-(-QL // {cfg.block_m}), B * HQ)",
                                            tensors + masks + bptrs, ints, {"BLOCK_M": cfg.block_m,
                                                                            "BLOCK_N": cfg.block_n},
                                            cfg.warps, cfg.stages)]
        kind = "flex"
    body.append(stats(call)[2])
    return _module(call, text, [dia], interpret, ["q", "k", "v"] + MASK_PARAMS, body), kind


def backward_module(call: FlexCall, interpret: bool) -> tuple:
    """(module text, kind 'flex_backward') of a backward op."""
    _, hq, hkv, _, _, d, dv, _ = call.dims()
    cfg = backward_config(call)
    name = PLACEHOLDER
    text, dialects, scattered = backward_kernels(call, cfg, interpret, name, call.grad_lse is not None)
    bptrs, bints = _buf_params(call)
    masks, mstrides = _masks(call, ("kv", "q"))
    vals = call.val(call.node)
    body = ["B, HQ, QL, KL, BK = q.shape[0], q.shape[1], q.shape[2], k.shape[2], k.shape[0]",
            "dev = q.device", "if dout is None:", "    dout = torch.zeros_like(out)",
            _alloc("dq", vals[0], "tuple(q.shape)", "q.dtype", "dev"),
            _alloc("dk", vals[1], f"(BK, {hkv}, KL, {d})", "k.dtype", "dev"),
            _alloc("dv", vals[2], f"(BK, {hkv}, KL, {dv})", "v.dtype", "dev"),
            "delta = torch.empty((B * HQ * QL,), dtype=torch.float32, device=dev)",
            "kb = 0 if BK == 1 and B > 1 else k.stride(0)", "vb = 0 if BK == 1 and B > 1 else v.stride(0)",
            QKV, "lst = lse.stride()", "gst = (0, 0, 0) if dlse is None else dlse.stride()"]
    gbufs = [f"gbuf{j}" for j in scattered]
    body += [f"gbuf{j} = torch.zeros(tuple(buf{j}.shape), dtype=torch.float32, device=dev)" for j in scattered]
    ptrs = ["q", "k", "v", "dout", "lse", "delta", "dq", "dk", "dv"] + masks + bptrs + gbufs
    ints = ["QL", "KL", f"_mult({call.kv_bs}, KL, {cfg.n2})", f"_mult({call.q_bs}, QL, {cfg.m1})",
            "B if BK == 1 and B > 1 else 1", f"BK * {hkv}", "*qkv", "*dout.stride()", "*lst", "*dq.stride()",
            "*dk.stride()", "*dv.stride()"] + mstrides + bints
    blocks = {"BLOCK_M1": cfg.m1, "BLOCK_N1": cfg.n1, "BLOCK_M2": cfg.m2, "BLOCK_N2": cfg.n2}
    body += ["if B * HQ * QL and KL:",
             _launch(f"{name}_pre", f"(-(-QL // {cfg.m2}), B * HQ)",
                     ["out", "dout", "out if dlse is None else dlse", "delta"],
                     ["QL", "*out.stride()", "*dout.stride()", "*gst"], {"BLOCK_M": cfg.m2}),
             _launch(f"{name}_dqkv", f"(-(-QL // {cfg.m2}) + -(-KL // {cfg.n1}), B * HQ)", ptrs, ints, blocks,
                     cfg.warps, cfg.stages),
             "elif KL:", "    dk.zero_()", "    dv.zero_()", "if not KL:", "    dq.zero_()"]
    grads = []
    for j, b in enumerate(call.score_bufs):
        if j in scattered:
            dt = b.meta["val"].dtype
            grads.append(f"gbuf{j}" if dt == torch.float32 else f"gbuf{j}.to({dt})")
        elif (3, j) in call.used and buffer_kind(b) == "tensor":
            grads.append(f"torch.zeros_like(buf{j}, memory_format=torch.contiguous_format)")
        else:
            grads.append("None")
    body.append(f"return (dq, dk, dv, ({''.join(g + ', ' for g in grads)}))")
    params = ["q", "k", "v", "out", "lse", "dout", "dlse"] + MASK_PARAMS
    return _module(call, text, dialects, interpret, params, body), "flex_backward"
