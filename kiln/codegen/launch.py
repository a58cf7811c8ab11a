"""Kernel modules: the launcher text around a Triton kernel, launch configurations, autotuning.

A generated module holds the ``@triton.jit`` kernel and ``call(*inputs, *scalars)``, which binds
dynamic sizes from its inputs, allocates outputs with the graph's strides and calls ``run``.
Everything a launch depends on is in the text, so equal text means an equal kernel.
"""
from __future__ import annotations

import sympy
import torch

from kiln.codegen.indexing import RINDEX, XINDEX
from kiln.compat import empty_strided_cuda_fn, triton_c_launcher_ok

HEADER = "# kiln generated kernel\n"


def next_pow2(n: int) -> int:
    n = max(int(n), 1)
    return 1 << (n - 1).bit_length()


def config(kind, xnumel, rnumel, persistent, inner, interpret):
    """(XBLOCK, RBLOCK, num_warps) from a small heuristic."""
    if kind == "pointwise":
        if interpret:
            return min(next_pow2(xnumel), 1 << 14), 1, 1
        xb = min(1024, max(next_pow2(xnumel), 16))
        return xb, 1, 8 if xb >= 1024 else (4 if xb >= 256 else 2)
    if persistent:
        rb = next_pow2(rnumel)
        budget = (1 << 14) if interpret else (4096 if inner else 2048)
        xb = max(1, min(next_pow2(xnumel), budget // rb, 1024 if interpret else 64))
        warps = 1 if interpret else max(1, min(8, (xb * rb) // 256))
        return xb, rb, warps
    if interpret:
        rb = min(next_pow2(rnumel), 1024)
        return max(1, min(next_pow2(xnumel), 4096 // rb)), rb, 1
    if inner:
        return 1, min(next_pow2(rnumel), 2048), 8
    # outer reductions: columns along the tile's first axis; autotuning on an H200 preferred
    # 16 warps for long columns (65536x512 column sum: 138 us with 4 warps, 46 us with 16)
    return min(32, next_pow2(xnumel)), min(next_pow2(rnumel), 64), 16 if rnumel >= 1024 else 4


def candidates(kind, xnumel, rnumel, persistent, inner):
    """Configurations tried under ``max_autotune``."""
    base = config(kind, xnumel, rnumel, persistent, inner, False)
    out = {base}
    xb, rb, w = base
    for f in (2, 4):
        if kind == "pointwise":
            out.add((max(16, xb // f), 1, max(1, w // 2)))
            out.add((min(4096, xb * f), 1, min(16, w * 2)))
        else:
            if xb // f >= 1:
                out.add((xb // f, rb, w))
            out.add((min(xb * f, 256), rb, w))
            if not persistent and rb // f >= 16:
                out.add((xb, rb // f, w))
    for wf in (4, 8, 16):
        out.add((xb, rb, wf))
    return sorted(out)


_TUNED: dict = {}


def run(kernel, args, xnumel, rnumel, cfg, meta):
    """Launch ``kernel`` over ``xnumel`` rows (skipped when empty)."""
    xnumel = int(xnumel)
    if xnumel <= 0:
        return
    kind = meta["kind"]
    if meta.get("autotune") and not meta.get("interpret"):
        cfg = _autotune(kernel, args, xnumel, rnumel, meta)
    elif cfg is None:
        cfg = config(kind, xnumel, rnumel, meta["persistent"], meta["inner"], meta.get("interpret"))
    xb, rb, warps = cfg
    grid = (1,) if meta.get("outer") else ((xnumel + xb - 1) // xb,)
    consts = (xb,) if kind == "pointwise" else (xb, rb)
    if meta.get("interpret"):
        _jit_launch(kernel, grid, args, consts, warps)
    else:
        _launch(kernel, grid, args, consts, warps)


def _jit_launch(kernel, grid, args, consts, warps):
    """Launch through Triton's JIT entry point (binds, specializes, compiles when new)."""
    if len(consts) == 1:
        return kernel[grid](*args, XBLOCK=consts[0], num_warps=warps)
    return kernel[grid](*args, XBLOCK=consts[0], RBLOCK=consts[1], num_warps=warps)


# -- the fast path ------------------------------------------------------------------------------
# Triton's ``kernel[grid](...)`` re-binds and re-specializes every argument on every launch (tens
# of microseconds of Python). A launch site repeats the same kernel, grid and block sizes, so kiln
# keeps the compiled kernel Triton returned and calls its C launcher directly, as long as the
# arguments specialize the same way: tensor dtypes and 16-byte alignment, integers equal to 1,
# divisible by 16, or wider than 32 bits. The site lives on the kernel object (a dict keyed by
# Triton's JITFunction would run its Python ``__hash__`` at every launch).
_COMPILED: dict = {}
_STREAM = []


def _triton_stream():
    if not _STREAM:
        from triton.runtime.driver import driver
        active = driver.active
        _STREAM.append((active.get_current_device, active.get_current_stream))
    device, stream = _STREAM[0]
    return stream(device())


# the current device and its raw stream, as Triton's driver reads them, without torch.cuda's Python
# (``current_device`` runs ``_lazy_init`` on every call); Triton's own functions where torch has no CUDA
_device = getattr(torch._C, "_cuda_getDevice", None) or (lambda: _STREAM[0][0]() if _STREAM else 0)
_stream_of = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (lambda dev: _triton_stream())


def _stream():
    return _stream_of(_device())


def _spec(args):
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() & 15 == 0))
        elif isinstance(a, bool) or not isinstance(a, int):
            key.append(type(a))
        else:
            key.append((a == 1, a & 15 == 0, -2 ** 31 <= a < 2 ** 31))
    return tuple(key)


def launch(kernel, args, grid, consts, warps):
    """A launch whose grid and block sizes were fixed when the module was generated.

    The common case costs one attribute read, one ``data_ptr`` per tensor and the C launcher: a
    site remembers the kernel compiled for 16-byte aligned tensors and integers that Triton does
    not specialize (not 1, not a multiple of 16, 32-bit: the philox seeds), on one device; any
    other arguments, another device, or an installed launch hook take the general path."""
    site = getattr(kernel, "_kiln_site", None)
    if site is not None:
        dev, fn, head, pm, nt = site
        p = 0
        for a in args[:nt]:
            p |= a.data_ptr()
        if not p & 15 and (nt == len(args) or _generic_ints(args, nt)) and _device() == dev and not _hooks_on():
            fn(grid[0], 1, 1, _stream_of(dev), *head, pm, None, None, None, *args, *consts)
            return
    ck = _launch(kernel, grid, args, consts, warps)
    nt = 0
    while nt < len(args) and isinstance(args[nt], torch.Tensor):
        nt += 1
    if ck is not None and site is None and all(isinstance(a, int) and not isinstance(a, bool) for a in args[nt:]) \
            and _generic_ints(args, nt) and all(a.data_ptr() & 15 == 0 for a in args[:nt]):
        try:
            kernel._kiln_site = (_device(), *_launcher(ck), nt)
        except AttributeError:   # an object that takes no attributes: no site, the general path
            pass


def _c_launcher_ok() -> bool:
    import triton
    return triton_c_launcher_ok(getattr(triton, "__version__", ""))


def _launcher(ck):
    """(fn, head, packed_metadata) such that ``fn(gx, 1, 1, stream, *head, pm, None, None, None, *args)``
    launches ``ck``: Triton's C launcher itself when the kernel needs no scratch memory (the
    Python ``CudaLauncher.__call__`` around it only allocates scratch), else its ``run``."""
    run = ck.run
    c_launch = getattr(run, "launch", None)
    if c_launch is not None and _c_launcher_ok() and not getattr(run, "global_scratch_size", 1) \
            and not getattr(run, "profile_scratch_size", 1) and hasattr(run, "launch_pdl"):
        return c_launch, (ck.function, run.launch_cooperative_grid, run.launch_pdl, None, None), ck.packed_metadata
    return run, (ck.function,), ck.packed_metadata


def _generic_ints(args, nt) -> bool:
    for v in args[nt:]:
        if v == 1 or not v & 15 or not -2 ** 31 <= v < 2 ** 31:
            return False
    return True


_RUNTIME: list = []


def _runtime():
    import triton
    _RUNTIME.append(getattr(getattr(triton, "knobs", None), "runtime", None))
    return _RUNTIME[0]


def _hooks_on() -> bool:
    rt = _RUNTIME[0] if _RUNTIME else _runtime()
    if rt is None:
        return True
    return _hooked(rt.launch_enter_hook) or _hooked(rt.launch_exit_hook)


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is installed (Triton 3.6 keeps an empty ``HookChain``)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _launch(kernel, grid, args, consts, warps):
    if _hooks_on():
        return _jit_launch(kernel, grid, args, consts, warps)   # launch hooks want Triton's metadata
    key = (id(kernel), _device(), grid, consts, warps, _spec(args))
    hit = _COMPILED.get(key)
    if hit is None or hit[0] is not kernel:
        ck = _jit_launch(kernel, grid, args, consts, warps)
        if ck is not None and not hasattr(ck, "result"):
            ck.run   # noqa: B018  loads the module and function handles
            _COMPILED[key] = (kernel, ck)
        return ck
    ck = hit[1]
    ck.run(grid[0], 1, 1, _stream(), ck.function, ck.packed_metadata, None, None, None, *args, *consts)
    return ck


def _autotune(kernel, args, xnumel, rnumel, meta):
    key = (id(kernel), xnumel, int(rnumel))
    best = _TUNED.get(key)
    if best is not None:
        return best
    from triton.testing import do_bench
    kind = meta["kind"]
    timings = []
    for cfg in candidates(kind, xnumel, rnumel, meta["persistent"], meta["inner"]):
        if meta["persistent"] and cfg[1] != next_pow2(rnumel):
            continue
        try:
            ms = do_bench(lambda: run(kernel, args, xnumel, rnumel, cfg, {**meta, "autotune": False}),
                          warmup=5, rep=20)
        except Exception:  # a config that does not compile (too many registers) is skipped
            continue
        timings.append((ms, cfg))
    best = min(timings)[1] if timings else config(kind, xnumel, rnumel, meta["persistent"], meta["inner"], False)
    from kiln.debug import log
    log(4, f"autotune {getattr(kernel, '__name__', kernel)} xnumel={xnumel} rnumel={rnumel}: {best}")
    _TUNED[key] = best
    return best


def restride(t: torch.Tensor, shape, stride):
    """``t`` with the strides a kernel was compiled for (a copy only when they differ)."""
    st = t.stride()
    if st == stride or all(a == b for s, a, b in zip(shape, st, stride) if s != 1):
        return t
    out = torch.empty_strided(shape, stride, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


empty_cuda = empty_strided_cuda_fn()   # (size, stride, dtype) on the current CUDA device


def cuda_here() -> torch.device:
    return torch.device("cuda", _device())


def semaphore(cache: dict, device) -> torch.Tensor:
    """A kernel's zeroed int32 counter for ``device`` and, on CUDA, the current stream (made once; the
    kernel sets it back to 0; launches on two streams at once count on two counters)."""
    key = (device, _stream_of(device.index)) if device.type == "cuda" else device
    s = cache.get(key)
    if s is None:
        s = cache[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return s


def seed() -> int:
    """A fresh philox seed from torch's default generator (repeatable under manual_seed)."""
    return int(torch.randint(0, 2 ** 31 - 1, (), dtype=torch.int64).item())


# -- module text --------------------------------------------------------------------------
def pyexpr(e, names):
    """A sympy size expression as Python over local names."""
    e = sympy.sympify(e)
    if e.is_Integer:
        return str(int(e))
    if e.is_Symbol:
        return names[e]
    from kiln.codegen.indexing import FloorDiv, ModIdx
    if isinstance(e, FloorDiv):
        return f"({pyexpr(e.args[0], names)} // {pyexpr(e.args[1], names)})"
    if isinstance(e, ModIdx):
        a, d, m = (pyexpr(x, names) for x in e.args)
        return f"(({a} // {d}) % {m})"
    if e.is_Add:
        return "(" + " + ".join(pyexpr(t, names) for t in e.args) + ")"
    if e.is_Mul:
        return "(" + "*".join(pyexpr(t, names) for t in e.args) + ")"
    if e.is_Pow and e.exp.is_Integer and e.exp > 0:
        return "(" + "*".join([pyexpr(e.base, names)] * int(e.exp)) + ")"
    raise ValueError(f"cannot print size {e}")


def _render(lines, indent, out):
    for line in lines:
        if isinstance(line, tuple):
            out.append(f"{indent}for roffset in range(0, rnumel, RBLOCK):")
            out.append(f"{indent}    rindex = roffset + rbase")
            out.append(f"{indent}    rmask = rindex < rnumel")
            _render(line[1].lines, indent + "    ", out)
        else:
            out.append(indent + line)


def _all_size_symbols(k):
    syms = set(k.sizes)
    for e in [k.xnumel, k.rnumel]:
        syms |= sympy.sympify(e).free_symbols
    for b in k.g.stored:
        for e in b.shape + b.stride:
            syms |= sympy.sympify(e).free_symbols
    return {s for s in syms if s not in (XINDEX, RINDEX)}


def bind_sizes(kernels, inputs, buffers):
    """Python names for every size symbol of ``kernels``: read from an input's shape when one
    has it as a dimension, else passed to ``call`` as an extra argument (``scalars``)."""
    names, lines, scalars = {}, [], []
    syms = set().union(*[_all_size_symbols(k) for k in kernels])
    for s in sorted(syms, key=str):
        name = f"ks_{s.name}"
        names[s] = name
        found = None
        for i, bname in enumerate(inputs):
            for d, size in enumerate(buffers[bname].shape):
                if size == s:
                    found = f"in{i}.shape[{d}]"
                    break
            if found:
                break
        if found:
            lines.append(f"{name} = {found}")
        else:
            scalars.append(s)
    for k in kernels:
        for sym in syms:
            k.sizes.setdefault(sym, names[sym])
        for sym in k.sizes:
            k.sizes[sym] = names[sym]
    return names, lines, scalars


def kernel_def(k, name):
    """The ``@triton.jit`` function text of emitted kernel ``k``."""
    static_x, static_r = _static(k)
    params = [k.inputs[b] for b in k.inputs] + [k.out_args[b.name] for b in k.g.stored]
    params += [p[4] for p in k.partials] + (["sem_ptr"] if k.last_program else []) + k.extra_params
    params += [k.sizes[s] for s in sorted(k.sizes, key=str)] + list(k.seeds.values())
    # Triton's interpreter cannot loop to a runtime int: numels are constexpr there
    ann = ": tl.constexpr" if k.interpret else ""
    if not static_x:
        params.append("xnumel" + ann)
    if k.red and not static_r:
        params.append("rnumel" + ann)
    params.append("XBLOCK: tl.constexpr")
    if k.red:
        params.append("RBLOCK: tl.constexpr")
    body = []
    if static_x:
        body.append(f"xnumel = {int(k.xnumel)}")
    if k.red and static_r:
        body.append(f"rnumel = {int(k.rnumel)}")
    ind = ""
    if k.red:
        cast = ".to(tl.int64)" if k.i64 else ""
        body.append(f"rbase = tl.arange(0, RBLOCK)[None, :]{cast}")
        if k.persistent:
            body += ["rindex = rbase", "rmask = rindex < rnumel"]
    if k.outer and not k.last_program or k.single_program:   # one program walks all rows
        body += k.pre if k.outer else []   # ... accumulating the outer reductions
        body.append("for xoffset in range(0, xnumel, XBLOCK):")
        ind = "    "
    else:
        pid = "tl.program_id(0).to(tl.int64)" if k.i64 else "tl.program_id(0)"
        body.append(f"xoffset = {pid} * XBLOCK")
    body.append(ind + ("xindex = xoffset + tl.arange(0, XBLOCK)[:, None]" if k.red else
                       "xindex = xoffset + tl.arange(0, XBLOCK)"))
    body.append(ind + "xmask = xindex < xnumel")
    if k.last_program:
        body += k.pre
    _render(k.top.lines, ind, body)
    if k.last_program:
        body += _last_program(k)
    elif k.outer:
        _render(k.post.lines, "", body)
    body += k.tail_lines
    return "\n".join(["@triton.jit", f"def {name}({', '.join(params)}):"] + ["    " + b for b in body])


PARTS_BLOCK = 1024   # partial results the last program combines per step


def _last_program(k):
    """The end of a row kernel whose outer reductions span many programs: each program stores its
    partial result of every outer reduction (``part_ptrN[pid]``) and counts itself done on ``sem_ptr``;
    the last to arrive reads all partials in program order (a fixed order: the result does not depend
    on timing), computes the scalar epilogue and sets the counter back to 0 for the next launch.
    The barrier makes the program's stores visible before its count; the partials are loaded past L1
    (``.cg``), where another SM's writes are not seen. ``sem_ptr`` is one counter per kernel module,
    device and stream (``semaphore``)."""
    from kiln.codegen.triton_ops import TL_DTYPE, neutral, reduce_code
    out = []
    for var, kind, dt, acc, part in k.partials:
        out.append(f"tl.store({part} + tl.program_id(0) + tl.full([1, 1], 0, tl.int32), "
                   f"{reduce_code(kind, acc, k.interpret, axis=0)})")
    cg = past_l1(k.interpret)
    # Triton's interpreter loops only to constants: there, step over xnumel (>= n_programs, masked)
    bound = "xnumel" if k.interpret else "n_programs"
    out += LAST_PROGRAM_IF
    for var, kind, dt, acc, part in k.partials:
        n = neutral(kind, dt)
        comb = {"sum": "{a} + {v}", "prod": "{a} * {v}", "max": "tl.maximum({a}, {v})",
                "min": "tl.minimum({a}, {v})"}[kind]
        out += [f"    {acc}_all = tl.full([{PARTS_BLOCK}, 1], {n}, {TL_DTYPE[dt]})",
                f"    for p_offset in range(0, {bound}, {PARTS_BLOCK}):",
                f"        p_index = p_offset + tl.arange(0, {PARTS_BLOCK})[:, None]",
                f"        p_value = tl.load({part} + p_index, p_index < n_programs, {n}{cg})",
                f"        {acc}_all = {comb.format(a=f'{acc}_all', v='p_value')}",
                f"    {var} = {reduce_code(kind, f'{acc}_all', k.interpret, axis=0)}"]
    _render(k.post.lines, "    ", out)
    out.append(LAST_PROGRAM_RESET)
    return out


# The gate of a kernel's last program (``_last_program``, ``chain.py``): make this program's stores
# visible, count it done, and let only the last one in; that one sets the counter back to 0 at its end.
LAST_PROGRAM_IF = ["tl.debug_barrier()",
                   "n_programs = (xnumel + XBLOCK - 1) // XBLOCK",
                   "if tl.atomic_add(sem_ptr, 1) == n_programs - 1:"]
LAST_PROGRAM_RESET = "    tl.atomic_xchg(sem_ptr, 0)"


def past_l1(interpret: bool) -> str:
    """Extra ``tl.load`` arguments for reading other programs' stores of this launch (L1 is not
    coherent across SMs); nothing under the interpreter."""
    return "" if interpret else ", cache_modifier='.cg'"


def kernel_args(k, ins, outs):
    """Launcher-side argument names for kernel ``k`` (``ins``/``outs``: buffer name -> local)."""
    args = [ins[b] for b in k.inputs] + [outs[b.name] for b in k.g.stored]
    args += [f"part{i}" for i in range(len(k.partials))] + (["sem"] if k.last_program else []) + k.extra_args
    args += [k.sizes[s] for s in sorted(k.sizes, key=str)] + list(k.seeds.values())
    static_x, static_r = _static(k)
    if not static_x:
        args.append("xnumel")
    if k.red and not static_r:
        args.append("rnumel")
    return args


def _static(k):
    """Whether xnumel/rnumel are written into the kernel (never under the interpreter)."""
    return k.xnumel.is_Integer and not k.interpret, k.rnumel.is_Integer and not k.interpret


def launch_line(k, name, args, names):
    kind = "reduction" if k.red else "pointwise"
    inner = bool(k.dims) and k.dims[-1][1]
    cfg = None
    if k.xnumel.is_Integer and k.rnumel.is_Integer and not k.autotune:
        cfg = config(kind, int(k.xnumel), int(k.rnumel), k.persistent, inner, k.interpret)
    meta = dict(kind=kind, persistent=k.persistent, inner=inner, interpret=k.interpret, autotune=k.autotune,
                outer=k.outer and not k.last_program)
    if cfg is not None and not k.interpret and "xnumel" not in args and "rnumel" not in args:
        xb, rb, warps = cfg   # all static: grid and block sizes are constants of the module
        if int(k.xnumel) <= 0:
            return []
        grid = (1,) if k.outer and not k.last_program else ((int(k.xnumel) + xb - 1) // xb,)
        consts = (xb,) if kind == "pointwise" else (xb, rb)
        return [f"launch.launch({name}, ({', '.join(args)},), {grid}, {consts}, {warps})"]
    return [f"xnumel, rnumel = {pyexpr(k.xnumel, names)}, {pyexpr(k.rnumel, names)}",
            f"launch.run({name}, ({', '.join(args)},), xnumel, rnumel, {cfg}, {meta!r})"]


def module(kernels, defs, inputs, buffers, body_fn, into=False):
    """Module text: imports, helpers, kernel ``defs`` and ``call`` (body from ``body_fn(names)``;
    ``into``: ``call`` takes an optional tensor to write its output into)."""
    names, bind_lines, scalars = bind_sizes(kernels, inputs, buffers)
    # the input dtypes are part of the text: equal text then means an equal kernel for every
    # argument, which lets a launch site reuse its compiled kernel (``launch``) without re-checking
    dtypes = ", ".join(str(buffers[b].dtype).replace("torch.", "") for b in inputs)
    lines = [HEADER + f"# inputs: {dtypes}", "import torch", "import triton", "import triton.language as tl"]
    if any(k.libdevice for k in kernels):
        lines.append("from triton.language.extra import libdevice")
    lines += ["from kiln.codegen import launch", ""]
    from kiln.codegen.triton_ops import HELPERS
    for h in sorted(set().union(*[k.helpers for k in kernels])):
        lines += ["", HELPERS[h]]
    for d in defs:
        lines += ["", d() if callable(d) else d]
    args = [f"in{i}" for i in range(len(inputs))] + [names[s] for s in scalars] + (["into=None"] if into else [])
    lines += ["", "", f"def call({', '.join(args)}):"]
    lines += ["    " + b for b in bind_lines]
    for i, b in enumerate(inputs):
        buf = buffers[b]
        if all(sympy.sympify(x).is_Integer for x in buf.shape + buf.stride) and buf.shape:
            st = _tuple(buf.stride)
            lines.append(f"    if in{i}.stride() != {st}:")
            lines.append(f"        in{i} = launch.restride(in{i}, {_tuple(buf.shape)}, {st})")
    lines += ["    " + ln for b in body_fn(names) for ln in b.split("\n")]
    return "\n".join(lines) + "\n", scalars


def alloc_line(local, buf, names, device):
    """``local = <new tensor>``; ``device`` None: the current CUDA device, through torch's C++ helper
    (``empty_cuda``: the wrapper enters the graph's device before it calls kernels)."""
    shape = "(" + "".join(pyexpr(x, names) + ", " for x in buf.shape) + ")"
    stride = "(" + "".join(pyexpr(x, names) + ", " for x in buf.stride) + ")"
    if device is None:
        return f"{local} = launch.empty_cuda({shape}, {stride}, {buf.dtype})"
    return f"{local} = torch.empty_strided({shape}, {stride}, dtype={buf.dtype}, device={device})"


def device_expr(interpret, has_inputs, device):
    """The device expression of a module's allocations: None (the current CUDA device) for compiled
    kernels, which only run on CUDA; the interpreter's kernels allocate on their inputs' device."""
    if not interpret and torch.device(device).type == "cuda":
        return None
    return "in0.device" if has_inputs else f"torch.device({str(device)!r})"


def assemble(k, name, tail=None, tail_name=None):
    """The module text for emitted kernel ``k`` (a ``triton.TritonKernel`` after planning). With ``tail``
    (``codegen/chain.py``), ``k``'s last program runs the tail's body, a ``@triton.jit`` helper named
    ``tail_name``; the tail's outputs are allocated beside ``k``'s and returned after them."""
    from kiln.codegen.triton import Source
    inputs = list(k.inputs)
    ins = {b: f"in{i}" for i, b in enumerate(inputs)}
    outs = {b.name: f"out{i}" for i, b in enumerate(k.g.stored)}
    device = device_expr(k.interpret, bool(inputs), k.g.nodes[0].device)
    tail_bufs = list(tail.g.stored) if tail is not None else []
    counter = k.last_program or tail is not None
    reuse = [] if tail is not None else reusable_inputs(k)

    def body(names):
        out = [alloc_line(outs[b.name], b, names, device) for b in k.g.stored]
        if reuse:   # the wrapper may hand over a dying input of the output's layout (``reusable_inputs``)
            st = _tuple(k.g.stored[0].stride)
            out[0] = f"if into is not None and into.stride() == {st}:\n    out0 = into\nelse:\n    {out[0]}"
        out += [alloc_line(f"tail{i}", b, names, device) for i, b in enumerate(tail_bufs)]
        for i, (_, _, dt, _, _) in enumerate(k.partials):   # one partial per program at most
            n = pyexpr(k.xnumel, names)
            out.append(f"part{i} = torch.empty(({n},), dtype={dt}, device={device or 'launch.cuda_here()'})")
        if counter:
            out.append(f"sem = launch.semaphore(SEMAPHORES, {device or 'launch.cuda_here()'})")
        out += [f"{seed} = launch.seed()" for seed in k.seeds.values()]
        out += launch_line(k, name, kernel_args(k, ins, outs), names)
        locs = [outs[b.name] for b in k.g.stored] + [f"tail{i}" for i in range(len(tail_bufs))]
        out.append(f"return {locs[0]}" if len(locs) == 1 else f"return ({', '.join(locs)},)")
        return out
    defs = [lambda: kernel_def(tail, tail_name)] if tail is not None else []
    defs += [lambda: kernel_def(k, name)] + (["SEMAPHORES = {}   # device -> this kernel's counter"] if counter else [])
    text, scalars = module([k] + ([tail] if tail is not None else []), defs, inputs, k.buffers, body,
                           into=bool(reuse))
    kind = "reduction" if k.red else "pointwise"
    src = Source(text, inputs, [b.name for b in k.g.stored + tail_bufs], scalars, kind)
    src.reuse = tuple(reuse)
    return src


def reusable_inputs(k) -> list:
    """Indices of the inputs of kernel ``k`` that its one output may be written into: a pointwise kernel
    with one stored output, an input of the output's dtype, shape and strides, read only at the element
    the kernel writes (so each program reads its elements before it stores them). The wrapper passes
    such an input as ``into`` where it dies at the call (``wrapper._Emitter._into``): its memory is
    reused instead of a new buffer of the same size living beside it."""
    from kiln.codegen.indexing import equal
    from kiln.codegen.schedule import body, current, loads
    if k.red or k.outer or len(k.g.stored) != 1:
        return []
    ob = k.g.stored[0]
    if not all(sympy.sympify(x).is_Integer for x in (*ob.shape, *ob.stride)):
        return []
    here = current(ob, k.dims)
    reads: dict = {}
    for m in k.g.nodes:
        for name, index in loads(body(m, k.dims, k.g.role(m))):
            reads.setdefault(name, []).append(index)
    out = []
    for i, name in enumerate(k.inputs):
        b = k.buffers[name]
        same = b.dtype == ob.dtype and len(b.shape) == len(ob.shape) and all(
            sympy.sympify(x) == sympy.sympify(y) for x, y in zip((*b.shape, *b.stride), (*ob.shape, *ob.stride)))
        if same and reads.get(name) and all(equal(ix, here, k.ranges) for ix in reads[name]):
            out.append(i)
    return out


def _tuple(xs):
    return "(" + "".join(f"{int(x)}, " for x in xs) + ")"
