"""FlexAttention's Triton kernel modules: the kernels' text and the ``call`` that launches them.

``forward_module(call, interpret, tuning)`` and ``backward_module(call, interpret)`` return a module's text
(the kernels named ``PLACEHOLDER``, which ``kiln.runtime.kernels`` names by a hash of the text). ``call``
takes the op's operands in the order ``operands(call)`` gives, allocates the outputs with the layouts the
graph's values have (their dims ordered as the graph's example strides order them), and returns the op's
result structure: ``(out, lse, max_scores)`` (the outputs the graph does not read are None), or
``(dq, dk, dv, (grads of score_mod's captured tensors,))``.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from kiln.codegen.flex import config as cfgs
from kiln.codegen.flex.hop import MASK_NAMES, FlexCall, buffer_kind
from kiln.codegen.flex.triton_bwd import backward_kernels
from kiln.codegen.flex.triton_fwd import decode_kernels, forward_kernel
from kiln.codegen.text.source import PLACEHOLDER
from kiln.codegen.to_triton.ops import HELPERS

HEADER = "# kiln generated kernel (FlexAttention)\n"

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


def _mask_strides(call, n: str, i: str, vn: str, vi: str) -> str:
    """The kernel's stride arguments of a block-mask pair (literal when its example layout is static:
    Dynamo guards the strides of graph inputs)."""
    nv, iv = call.val(call.masks[n]), call.val(call.masks[i])
    if not (_static(nv) and _static(iv)):
        return f"*_mask({vn}, {vi})"
    st = [0 if nv.shape[d] == 1 else nv.stride(d) for d in range(3)] + \
        [0 if iv.shape[d] == 1 else iv.stride(d) for d in range(3)] + [iv.stride(3)]
    return "*" + repr(tuple(int(x) for x in st))


def _dtypes(call) -> str:
    """The operands' dtypes, as a comment (two graphs whose captured tensors differ in dtype get two modules)."""
    return ", ".join(str(o.meta["val"].dtype).replace("torch.", "") for o in operands(call)
                     if hasattr(o, "meta") and isinstance(o.meta.get("val"), torch.Tensor))


def _precision() -> str:
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _prelude(call, text: str, helpers: set, libdevice: bool, interpret: bool) -> list:
    lines = [HEADER + f"# operands: {_dtypes(call)}", "import torch", "import triton", "import triton.language as tl",
             "from kiln.runtime import launch"]
    if libdevice:
        lines.append("from triton.language.extra import libdevice")
    lines += ["", f"_LOCK = launch._INTERPRETER if {interpret} else None"]
    for h in sorted(helpers):
        lines += ["", "", HELPERS[h].rstrip()]
    return lines + ["", "", text, RUNTIME]


def _buf_params(call) -> tuple:
    """(names of ``call``'s buffer parameters, the kernel's tensor arguments and int arguments they give)."""
    names, ptrs, ints = [], [], []
    for i, b in enumerate(call.score_bufs + call.mask_bufs):
        names.append(f"buf{i}")
        if buffer_kind(b) == "tensor":
            ptrs.append(f"buf{i}")
            if b.meta["val"].dim():
                ints += [f"*buf{i}.stride()", f"*buf{i}.shape"]
        else:
            ints.append(f"buf{i}")
    return names, ptrs, ints


def _launch(kernel: str, grid: str, ptrs: list, ints: list, blocks: dict, warps: int = 4, stages: int = 2) -> list:
    return [f"_run({kernel}, {grid}, {len(ptrs)}, ({', '.join(ptrs + ints)},), {blocks!r}, {warps}, {stages})"]


def forward_module(call: FlexCall, interpret: bool, decode_max_q: int) -> tuple:
    """(module text, kind) of a forward op: 'flex' or 'flex_decode'."""
    _, hq, _, _, _, d, dv, _ = call.dims()
    rows = cfgs.decode_rows(call, decode_max_q) if decode_max_q else None
    name = PLACEHOLDER
    full = call.masks["full_kv_num"] is not None
    bnames, bptrs, bints = _buf_params(call)
    masks = ["kvn", "kvi"] + (["fkvn", "fkvi"] if full else [])
    mstrides = [_mask_strides(call, "kv_num", "kv_idx", "kvn", "kvi")] + \
        ([_mask_strides(call, "full_kv_num", "full_kv_idx", "fkvn", "fkvi")] if full else [])
    body = ["B, HQ, QL, KL = q.shape[0], q.shape[1], q.shape[2], k.shape[2]",
            _alloc("out", call.val(call.node)[0], f"(B, HQ, QL, {dv})", "q.dtype"),
            "kb = 0 if k.shape[0] == 1 and B > 1 else k.stride(0)", "vb = 0 if v.shape[0] == 1 and B > 1 else v.stride(0)",
            "qkv = [*q.stride(), kb, *k.stride()[1:], vb, *v.stride()[1:]]"]
    ptrs = ["q", "k", "v"]
    if rows is not None:
        gp, nrows = rows
        cfg = cfgs.decode_config(call, interpret)
        text, s, dia = decode_kernels(call, cfg, gp, nrows, interpret, _precision(), name)
        body += ["lse = torch.empty((B, HQ, QL), dtype=torch.float32, device=q.device)", "mx = None",
                 f"ng = B * {hq // gp}",
                 f"splits = max(1, min(64, -(-KL // {cfg.block_n}), -(-2 * _sms(q.device) // max(ng, 1))))",
                 f"oacc = torch.empty((ng, splits, {nrows}, {s.dvp}), dtype=torch.float32, device=q.device)",
                 f"olse = torch.empty((ng, splits, {nrows}), dtype=torch.float32, device=q.device)",
                 "if ng and QL:"]
        ints = ["QL", "KL", f"_mult({call.kv_bs}, KL, {cfg.block_n})", "splits", "*qkv"] + mstrides + bints
        body += ["    " + ln for ln in _launch(name, "(splits, ng)", ptrs + ["oacc", "olse"] + masks + bptrs, ints,
                                               {"BLOCK_M": nrows, "BLOCK_N": cfg.block_n}, cfg.warps, cfg.stages)]
        body += ["    " + ln for ln in _launch(f"{name}_combine", "(ng,)", ["oacc", "olse", "out", "lse"],
                                               ["QL", "splits", "*out.stride()"], {"BLOCK_M": nrows})]
        kind = "flex_decode"
    else:
        cfg = cfgs.forward_config(call, interpret)
        text, s, dia = forward_kernel(call, cfg, interpret, _precision(), name, call.used)
        for i, var in ((1, "lse"), (2, "mx")):
            body.append(f"{var} = torch.empty((B, HQ, QL), dtype=torch.float32, device=q.device)" if i in call.used
                        else f"{var} = None")
        tensors = ptrs + ["out", "out if lse is None else lse", "out if mx is None else mx"] + masks + bptrs
        ints = ["QL", "KL", f"_mult({call.kv_bs}, KL, {cfg.block_n})", "*qkv", "*out.stride()"] + mstrides + bints
        body.append("if B * HQ * QL:")
        body += ["    " + ln for ln in _launch(name, f"(-(-QL // {cfg.block_m}), B * HQ)", tensors, ints,
                                               {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n}, cfg.warps, cfg.stages)]
        kind = "flex"
    n_out = len(call.val(call.node))
    body.append(f"return {('out', 'lse', 'mx')[:n_out]}".replace("'", ""))
    params = ["q", "k", "v", "kvn", "kvi", "fkvn", "fkvi", "qn", "qi", "fqn", "fqi"] + bnames + ["*_unused"]
    lines = _prelude(call, text, dia.helpers, dia.libdevice, interpret)
    lines += ["", "", f"def call({', '.join(params)}):"] + ["    " + b for b in body]
    return "\n".join(lines) + "\n", kind


def backward_module(call: FlexCall, interpret: bool) -> tuple:
    """(module text, kind 'flex_backward') of a backward op."""
    _, hq, hkv, _, _, d, dv, _ = call.dims()
    cfg = cfgs.backward_config(call, interpret)
    name = PLACEHOLDER
    text, _, (d1, d2), scattered = backward_kernels(call, cfg, interpret, _precision(), name,
                                                    call.grad_lse is not None)
    bnames, bptrs, bints = _buf_params(call)
    fullkv, fullq = call.masks["full_kv_num"] is not None, call.masks["full_q_num"] is not None
    vals = call.val(call.node)
    body = ["B, HQ, QL, KL, BK = q.shape[0], q.shape[1], q.shape[2], k.shape[2], k.shape[0]",
            "dev = q.device",
            "if dout is None:", "    dout = torch.zeros_like(out)",
            _alloc("dq", vals[0], "tuple(q.shape)", "q.dtype", "dev"),
            _alloc("dk", vals[1], f"(BK, {hkv}, KL, {d})", "k.dtype", "dev"),
            _alloc("dv", vals[2], f"(BK, {hkv}, KL, {dv})", "v.dtype", "dev"),
            "delta = torch.empty((B * HQ * QL,), dtype=torch.float32, device=dev)",
            "kb = 0 if BK == 1 and B > 1 else k.stride(0)", "vb = 0 if BK == 1 and B > 1 else v.stride(0)",
            "qkv = [*q.stride(), kb, *k.stride()[1:], vb, *v.stride()[1:]]",
            "lst = lse.stride()",
            "gst = (0, 0, 0) if dlse is None else dlse.stride()"]
    for j in scattered:
        body.append(f"gbuf{j} = torch.zeros(tuple(buf{j}.shape), dtype=torch.float32, device=dev)")
    pre = _launch(f"{name}_pre", f"(-(-QL // {cfg.m2}), B * HQ)", ["out", "dout", "out if dlse is None else dlse", "delta"],
                  ["QL", "*out.stride()", "*dout.stride()", "*gst"], {"BLOCK_M": cfg.m2})
    ptrs = ["q", "k", "v", "dout", "lse", "delta", "dq", "dk", "dv", "kvn", "kvi"] + \
        (["fkvn", "fkvi"] if fullkv else []) + ["qn", "qi"] + (["fqn", "fqi"] if fullq else []) + bptrs + \
        [f"gbuf{j}" for j in scattered]
    ints = ["QL", "KL", f"_mult({call.kv_bs}, KL, {cfg.n2})", f"_mult({call.q_bs}, QL, {cfg.m1})",
            "B if BK == 1 and B > 1 else 1", f"BK * {hkv}", "*qkv", "*dout.stride()", "*lst", "*dq.stride()",
            "*dk.stride()", "*dv.stride()", _mask_strides(call, "kv_num", "kv_idx", "kvn", "kvi")] + \
        ([_mask_strides(call, "full_kv_num", "full_kv_idx", "fkvn", "fkvi")] if fullkv else []) + \
        [_mask_strides(call, "q_num", "q_idx", "qn", "qi")] + \
        ([_mask_strides(call, "full_q_num", "full_q_idx", "fqn", "fqi")] if fullq else []) + bints
    blocks = {"BLOCK_M1": cfg.m1, "BLOCK_N1": cfg.n1, "BLOCK_M2": cfg.m2, "BLOCK_N2": cfg.n2}
    grads = _launch(f"{name}_dqkv", f"(-(-QL // {cfg.m2}) + -(-KL // {cfg.n1}), B * HQ)", ptrs, ints, blocks, cfg.warps,
                 cfg.stages)
    body.append("if B * HQ * QL and KL:")
    body += ["    " + ln for ln in pre + grads]
    body.append("elif KL:")
    body += ["    dk.zero_()", "    dv.zero_()"]
    body.append("if not KL:")
    body.append("    dq.zero_()")
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
    params = ["q", "k", "v", "out", "lse", "dout", "dlse", "kvn", "kvi", "fkvn", "fkvi", "qn", "qi", "fqn", "fqi"] + \
        bnames + ["*_unused"]
    lines = _prelude(call, text, d1.helpers | d2.helpers, d1.libdevice or d2.libdevice, interpret)
    lines += ["", "", f"def call({', '.join(params)}):"] + ["    " + b for b in body]
    return "\n".join(lines) + "\n", "flex_backward"


__all__ = ["forward_module", "backward_module", "operands", "order"]
