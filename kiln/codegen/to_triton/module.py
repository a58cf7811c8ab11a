"""Kernel module text (``write_module``): the ``@triton.jit`` functions of a plan and the launcher around
them, which launches through ``kiln.runtime.launch``. Everything a launch depends on is in the text.
"""
import sympy
import torch

from kiln.codegen.ir.bounds import parts
from kiln.codegen.ir.indexing import next_pow2
from kiln.codegen.ir.loops import Unsupported
from kiln.codegen.schedule.plan import KernelPlan, Programs, ScatterPlan
from kiln.codegen.text import launcher
from kiln.codegen.text.blocks import Blocks, config, grid_of
from kiln.codegen.text.printer import py
from kiln.codegen.text.source import PLACEHOLDER, KernelSource
from kiln.codegen.to_triton.emit import Flags, past_l1
from kiln.codegen.to_triton.ops import HELPERS, TL_DTYPE, combine, neutral, reduce_code
from kiln.codegen.to_triton.rows import TritonKernel


def mask_lines(var, index, numel, shape, static, even):
    """``var = index < numel``, or with ``even`` and a static ``numel`` a compile-time branch to a
    constant-true mask when the block divides it (Triton then drops it)."""
    plain = f"{var} = {index} < {numel}"
    if not (static and even):
        return [plain]
    block = "XBLOCK" if var == "xmask" else "RBLOCK"
    return [f"if {numel} % {block} == 0:", f"    {var} = tl.full({shape}, True, tl.int1)", "else:",
            f"    {plain}"]


def _render(lines, indent, out, static_r, even):
    for line in lines:
        if isinstance(line, tuple):
            out.append(f"{indent}for roffset in range(0, rnumel, RBLOCK):")
            out.append(f"{indent}    rindex = roffset + rbase")
            rmask = mask_lines("rmask", "rindex", "rnumel", "[1, RBLOCK]", static_r, even)
            out += [f"{indent}    {ln}" for ln in rmask]
            _render(line[1].lines, indent + "    ", out, static_r, even)
        else:
            out.append(indent + line)


def _nonempty(numel) -> bool:
    return numel.is_Integer and int(numel) > 0


def _static(k):
    """Whether xnumel/rnumel are written into the kernel (never under the interpreter)."""
    return k.xnumel.is_Integer and not k.interpret, k.rnumel.is_Integer and not k.interpret


def _signature(k, names, ins=None, outs=None, extra=(), err="err") -> list:
    """(parameter, launcher argument) pairs of kernel ``k`` before its block sizes (``ins``/``outs``: buffer
    name -> launcher local; ``extra``: a chained tail's pairs; ``err``: the error buffer's local)."""
    ins, outs = ins or {}, outs or {}
    pairs = [(k.inputs[b], ins.get(b)) for b in k.inputs] + [(k.out_args[b.name], outs.get(b.name))
                                                             for b in k.plan.stored]
    pairs += [(p[4], f"part{i}") for i, p in enumerate(k.partials)]
    pairs += [("sem_ptr", "sem")] * (k.plan.programs is Programs.LAST) + list(extra)
    pairs += [(f"{s}_ptr", s) for s in k.seeds.values()]   # philox seeds: one device int64 each
    pairs += [("err_ptr", err)] * error_buffer(k) + [(names[s], names[s]) for s in sorted(names, key=str)]
    static_x, static_r = _static(k)
    ann = ": tl.constexpr" if k.interpret else ""   # the interpreter loops to constexpr numels only
    return pairs + [("xnumel" + ann, "xnumel")] * (not static_x) + [("rnumel" + ann, "rnumel")] * bool(
        k.red and not static_r)


def kernel_def(k: TritonKernel, name, names, extra=(), tail_lines=(), grouped=False):
    """The ``@triton.jit`` function of ``k`` (``extra``/``tail_lines``: a chained tail's; ``grouped``: a member
    of a grouped kernel, which takes its program's number in its range, ``xpid``)."""
    plan = k.plan
    even = k.tuning.even_masks
    static_x, static_r = _static(k)
    # integer numels are known when Triton compiles (constants, or constexpr under the interpreter); an
    # empty one must keep its real mask (all false): a constant-true mask would let loads run past it
    known_x, known_r = _nonempty(k.xnumel), _nonempty(k.rnumel)
    last = plan.programs is Programs.LAST
    params = [p for p, _ in _signature(k, names, extra=extra)] + ["xpid"] * grouped + ["XBLOCK: tl.constexpr"]
    params += ["RBLOCK: tl.constexpr"] * bool(k.red)
    body = [f"{s} = tl.load({s}_ptr)" for s in k.seeds.values()]
    body += ([f"xnumel = {int(k.xnumel)}"] if static_x else []) + (
        [f"rnumel = {int(k.rnumel)}"] if k.red and static_r else [])
    ind = ""
    if k.red:
        cast = ".to(tl.int64)" if plan.wide_index else ""
        body.append(f"rbase = tl.arange(0, RBLOCK)[None, :]{cast}")
        if k.persistent:
            body += ["rindex = rbase"] + mask_lines("rmask", "rindex", "rnumel", "[1, RBLOCK]", known_r, even)
    pid = ("xpid" if grouped else "tl.program_id(0)") + (".to(tl.int64)" if plan.wide_index else "")
    xshape = "[XBLOCK, 1]" if k.red else "[XBLOCK]"
    xrange = "tl.arange(0, XBLOCK)[:, None]" if k.red else "tl.arange(0, XBLOCK)"
    xmask = mask_lines("xmask", "xindex", "xnumel", xshape, known_x, even)
    if plan.programs is Programs.CHUNKS:   # folded column partials: each program walks its chunk of rows
        chunk = plan.chunks[1]
        body += [f"xpid = {pid}"] + k.pre + [f"for xoffset in range(0, {chunk}, XBLOCK):",
                                              f"    xindex = xpid * {chunk} + xoffset + {xrange}"]
        # rows past the chunk's end belong to the next program; the last chunk may end past the rows
        xmask = mask_lines("xmask", f"(xoffset + {xrange})", str(chunk), xshape, True, even)
        if plan.chunks[0] * chunk != plan.xnumel:
            xmask.append(f"xmask = xmask & (xindex < {plan.xnumel})")
        ind = "    "
    elif plan.programs is Programs.ONE:   # one program walks all rows
        body += k.pre if plan.outer else []   # ... accumulating the outer reductions
        body += ["for xoffset in range(0, xnumel, XBLOCK):", f"    xindex = xoffset + {xrange}"]
        ind = "    "
    else:
        body += [f"xoffset = {pid} * XBLOCK", f"xindex = xoffset + {xrange}"]
    body += [ind + ln for ln in xmask]
    if last:
        body += k.pre
    _render(k.top.lines, ind, body, known_r, even)
    if last:
        body += _last_program(k)
    elif plan.outer or plan.chunks:
        _render(k.post.lines, "", body, False, even)
    body += list(tail_lines)
    # sizes are arguments Triton must not specialize (1, multiples of 16): a new length compiles nothing
    sizes = [p for p in params if p in names.values() or p in ("xnumel", "rnumel")] if not k.interpret else []
    jit = f"@triton.jit(do_not_specialize={sizes!r})" if sizes else "@triton.jit"
    return "\n".join([jit, f"def {name}({', '.join(params)}):"] + ["    " + b for b in body])


def _last_program(k):
    """The end of a kernel whose outer reductions span many programs: each stores its partials and counts
    itself done on ``sem_ptr``; the last reads all partials in program order (past L1), computes the scalar
    epilogue and resets the counter."""
    out = []
    block = k.tuning.parts_block
    for var, kind, dt, acc, part in k.partials:
        out.append(f"tl.store({part} + tl.program_id(0) + tl.full([1, 1], 0, tl.int32), "
                   f"{reduce_code(kind, acc, k.interpret, 0, dt.is_floating_point)})")
    cg = past_l1(k.interpret)
    # Triton's interpreter loops only to constants: there, step over xnumel (>= n_programs, masked)
    bound = "xnumel" if k.interpret else "n_programs"
    out += last_program_if(k.plan)
    for var, kind, dt, acc, part in k.partials:
        n = neutral(kind, dt)
        out += [f"    {acc}_all = tl.full([{block}, 1], {n}, {TL_DTYPE[dt]})",
                f"    for p_offset in range(0, {bound}, {block}):",
                f"        p_index = p_offset + tl.arange(0, {block})[:, None]",
                f"        p_value = tl.load({part} + p_index, p_index < n_programs, {n}{cg})",
                f"        {acc}_all = {combine(kind, f'{acc}_all', 'p_value', dt.is_floating_point)}",
                f"    {var} = {reduce_code(kind, f'{acc}_all', k.interpret, 0, dt.is_floating_point)}"]
    _render(k.post.lines, "    ", out, False, k.tuning.even_masks)
    out.append(LAST_PROGRAM_RESET)
    return out


# The gate of a kernel's last program: stores made visible, the program counted, only the last let in.
LAST_PROGRAM_IF = ["tl.debug_barrier()",
                   "n_programs = (xnumel + XBLOCK - 1) // XBLOCK",
                   "if tl.atomic_add(sem_ptr, 1) == n_programs - 1:"]
LAST_PROGRAM_RESET = "    tl.atomic_xchg(sem_ptr, 0)"


def last_program_if(plan: KernelPlan) -> list:
    """``LAST_PROGRAM_IF`` for ``plan`` (folded column partials: one program per chunk of rows)."""
    if plan.programs is Programs.CHUNKS:
        return [LAST_PROGRAM_IF[0], f"n_programs = {plan.chunks[0]}", LAST_PROGRAM_IF[2]]
    return LAST_PROGRAM_IF


def kernel_args(k, ins, outs, names, extra=(), err="err"):
    """Launcher-side argument names for kernel ``k`` (``ins``/``outs``: buffer name -> local)."""
    return [a for _, a in _signature(k, names, ins, outs, extra, err)]


def narrow_data(k) -> bool:
    """Whether kernel ``k`` reads or writes 2-byte elements (``config``'s ``narrow``)."""
    bufs = [k.plan.buffers[b] for b in k.inputs] + list(k.plan.stored)
    return any(b.dtype.itemsize <= 2 for b in bufs)


def launch_line(k, name, args, names):
    plan = k.plan
    kind = "reduction" if k.red else "pointwise"
    inner = plan.inner
    cfg = None
    narrow = narrow_data(k)
    blocks = Blocks.of(k.tuning)
    if k.xnumel.is_Integer and k.rnumel.is_Integer and not k.autotune:
        cfg = config(kind, int(k.xnumel), int(k.rnumel), k.persistent, inner, k.interpret, narrow, blocks)
    meta = dict(kind=kind, persistent=k.persistent, inner=inner, interpret=k.interpret, autotune=k.autotune,
                outer=plan.programs is Programs.ONE, narrow=narrow, programs=plan.chunks[0] if plan.chunks else None)
    if cfg is not None and not k.interpret and "xnumel" not in args and "rnumel" not in args:
        xb, rb, warps = cfg   # all static: grid and block sizes are constants of the module
        if int(k.xnumel) <= 0:
            return []
        grid = grid_of(int(k.xnumel), xb, meta)
        consts = (xb,) if kind == "pointwise" else (xb, rb)
        return [f"launch.launch({name}, ({', '.join(args)},), {grid}, {consts}, {warps})"]
    if cfg is None:   # chosen at each launch: the module carries the tuning the choice reads
        meta["blocks"] = tuple(blocks)
    return [f"xnumel, rnumel = {py(k.xnumel, names)}, {py(k.rnumel, names)}",
            f"launch.run({name}, ({', '.join(args)},), xnumel, rnumel, {cfg}, {meta!r})"]


def error_buffer(k) -> bool:
    """Whether kernel ``k`` takes an error buffer: an interpreted kernel with bounds checks (``emit._checked``)."""
    return bool(k.interpret and k.checks)


def checked_launch(k, launch, err, device, names) -> list:
    """``launch`` (lines), with an interpreted kernel's bounds checks: error buffer ``err``, eager's error."""
    if not error_buffer(k):
        return launch
    checks = launcher.check_list((parts(e)[1:] for e in k.checks), names)
    return [f"{err} = torch.zeros(({2 * len(k.checks)},), dtype=torch.int64, device={device})"] + launch + \
        [f"if {err}.any():", f"    _bounds.check_tensor({err}, ({checks},))"]


def assert_options(k, name) -> list:
    """Module lines making compiled kernel ``name`` with bounds checks launch with device asserts on and
    integer overflow checks off (philox multiplies modulo 2**32); read by ``launch._jit_launch``."""
    if not any(x is not None and x.checks and not x.interpret for x in k):
        return []
    return [f"{name}.kiln_options = {{'debug': True, 'sanitize_overflow': False}}"]


def module(kernels, defs, inputs, buffers, body_fn, into=False, seeds=()):
    """(module text, scalars): imports, helpers, kernel ``defs`` and ``call`` (body: ``body_fn(names)``)."""
    names, bind_lines, scalars = launcher.bind_sizes(kernels, inputs, buffers)
    lines = [launcher.header(inputs, buffers), "import torch", "import triton", "import triton.language as tl"]
    if any(k.libdevice for k in kernels):
        lines.append("from triton.language.extra import libdevice")
    lines += ["from kiln.runtime import launch"] + ["from kiln.runtime import bounds as _bounds"] * any(
        error_buffer(k) for k in kernels) + [""]
    for h in sorted(set().union(*[k.helpers for k in kernels])):
        lines += ["", HELPERS[h]]
    for d in defs:
        lines += ["", d(names)]
    body = bind_lines + launcher.restrides(inputs, buffers, "launch.restride") + body_fn(names)
    lines += launcher.call(inputs, names, scalars, seeds, body, ["into=()"] if into else [],
                           bool(launcher.layouts(inputs, buffers)))
    return "\n".join(lines) + "\n", scalars


def alloc_line(local, buf, names, device):
    """``local = <new tensor>``; ``device`` None: the current CUDA device (the wrapper enters it)."""
    shape, stride = launcher.sizes(buf.shape, names), launcher.sizes(buf.stride, names)
    if device is None:
        return f"{local} = launch.empty_cuda({shape}, {stride}, {buf.dtype})"
    return f"{local} = torch.empty_strided({shape}, {stride}, dtype={buf.dtype}, device={device})"


def device_expr(interpret, has_inputs, device):
    """The device of a module's allocations: None (the current CUDA device) for compiled kernels."""
    if not interpret and torch.device(device).type == "cuda":
        return None
    return "in0.device" if has_inputs else f"torch.device({str(device)!r})"


def _chain(head: TritonKernel, tail: TritonKernel):
    """(head's extra (parameter, argument) pairs, its last program's call of the tail, the tail's name): the
    last program of ``head`` runs ``tail`` as a ``@triton.jit`` helper."""
    plan = tail.plan
    kind = "reduction" if tail.red else "pointwise"
    inner = plan.inner
    xb, rb, _ = config(kind, int(tail.xnumel), int(tail.rnumel), tail.persistent, inner, tail.interpret, False,
                       Blocks.of(tail.tuning))
    if tail.red and tail.persistent and not tail.interpret:
        # one program does the whole tail: a tile of tuning.tail_tile elements per step (a [64, S] tile took
        # 48 dependent steps for a 3072-column bias gradient)
        xb = max(xb, min(next_pow2(int(tail.xnumel)), max(1, tail.tuning.tail_tile // rb)))
    static_x, static_r = _static(tail)
    call = [head.out_args[b] for b in tail.inputs] + [f"tail_ptr{i}" for i in range(len(plan.stored))]
    call += [] if static_x else [str(int(tail.xnumel))]
    call += [] if static_r or not tail.red else [str(int(tail.rnumel))]
    call += [str(xb)] + ([str(rb)] if tail.red else [])
    extra = [(f"tail_ptr{i}", f"tail{i}") for i in range(len(plan.stored))] + [("sem_ptr", "sem")]
    name = PLACEHOLDER + "_tail"
    lines = last_program_if(head.plan) + [f"    {name}({', '.join(call)})", LAST_PROGRAM_RESET]
    return extra, lines, name


def write_module(plan, flags: Flags) -> KernelSource:
    """The Triton module of ``plan`` (a ``KernelPlan``, with its chained tail if any, or a ``ScatterPlan``)."""
    if isinstance(plan, ScatterPlan):
        return _scatter_module(plan, flags)
    k = TritonKernel(plan, flags).write()
    tail = None
    if plan.tail is not None:
        tail = TritonKernel(plan.tail, Flags(flags.interpret, False, flags.tuning)).write()
        if error_buffer(tail):
            raise Unsupported("triton: bounds checks in an interpreted chained tail")
    name = PLACEHOLDER
    inputs = list(k.inputs)
    ins = {b: f"in{i}" for i, b in enumerate(inputs)}
    outs = {b.name: f"out{i}" for i, b in enumerate(plan.stored)}
    device = device_expr(k.interpret, bool(inputs), plan.device)
    tail_bufs = list(plan.tail.stored) if tail is not None else []
    counter = plan.programs is Programs.LAST or tail is not None
    reuse = launcher.reuse(plan.stored, inputs, plan.reusable) if tail is None else ()
    extra, tail_lines, tail_name = _chain(k, tail) if tail is not None else ((), (), None)

    def body(names):
        # each output a new tensor, or the input the wrapper hands over (``into``, ``KernelPlan.reusable``)
        out = [launcher.taking_into(i, alloc_line(outs[b.name], b, names, device), b, reuse)
               for i, b in enumerate(plan.stored)]
        out += [alloc_line(f"tail{i}", b, names, device) for i, b in enumerate(tail_bufs)]
        for i, (_, _, dt, _, _) in enumerate(k.partials):   # one partial per program at most
            n = py(k.xnumel, names)
            out.append(f"part{i} = torch.empty(({n},), dtype={dt}, device={device or 'launch.cuda_here()'})")
        if counter:
            out.append(f"sem = launch.semaphore(SEMAPHORES, {device or 'launch.cuda_here()'})")
        out += checked_launch(k, launch_line(k, name, kernel_args(k, ins, outs, names, extra), names), "err",
                              device, names)
        out.append(launcher.returns([outs[b.name] for b in plan.stored] + [f"tail{i}" for i in range(len(tail_bufs))]))
        return out
    defs = [lambda names: kernel_def(tail, tail_name, names)] if tail is not None else []
    defs += [lambda names: kernel_def(k, name, names, extra, tail_lines)]
    asserts = assert_options([k, tail], name)
    defs += [lambda names: "\n".join(asserts)] * bool(asserts)
    defs += [lambda names: "SEMAPHORES = {}   # device -> this kernel's counter"] if counter else []
    text, scalars = module([k] + ([tail] if tail is not None else []), defs, inputs, plan.buffers, body,
                           into=bool(reuse), seeds=k.seeds.values())
    kind = "reduction" if k.red else "pointwise"
    return KernelSource(text, tuple(inputs), tuple(b.name for b in plan.stored + tuple(tail_bufs)), tuple(scalars),
                        kind, tuple(reuse), flags.interpret, len(k.seeds), launcher.layouts(inputs, plan.buffers))


def _scatter_module(plan: ScatterPlan, flags: Flags) -> KernelSource:
    """One module, two kernels: the base copied into the output, then each value stored (or added)."""
    flags = Flags(flags.interpret, False, flags.tuning)   # scatters are never autotuned
    copy = TritonKernel(plan.copy, flags).write()
    scatter = TritonKernel(plan.write, flags).write()
    buf = plan.write.scatter.buffer
    name = PLACEHOLDER
    inputs = list(dict.fromkeys(list(copy.inputs) + list(scatter.inputs)))
    ins = {b: f"in{i}" for i, b in enumerate(inputs)}
    outs = {buf.name: "out0"}
    device = device_expr(flags.interpret, bool(inputs), buf.device)

    def body(names):
        out = [alloc_line("out0", buf, names, device)]
        out += checked_launch(copy, launch_line(copy, f"{name}_copy", kernel_args(copy, ins, outs, names, (),
                                                                                   "err_copy"), names),
                              "err_copy", device, names)
        writes = checked_launch(scatter, launch_line(scatter, name, kernel_args(scatter, ins, outs, names), names),
                                "err", device, names)
        numel = sympy.Mul(*buf.shape)
        if not numel.is_Integer:   # an empty output takes no write (its indices may point anywhere)
            writes = ["if out0.numel():"] + ["    " + ln for ln in writes]
        out += writes if numel != 0 else []
        out.append("return out0")
        return out
    defs = [lambda names: kernel_def(copy, f"{name}_copy", names), lambda names: kernel_def(scatter, name, names)]
    asserts = assert_options([copy], f"{name}_copy") + assert_options([scatter], name)
    defs += [lambda names: "\n".join(asserts)] * bool(asserts)
    text, scalars = module([copy, scatter], defs, inputs, plan.write.buffers, body, seeds=scatter.seeds.values())
    return KernelSource(text, tuple(inputs), (buf.name,), tuple(scalars), "scatter", (), flags.interpret,
                        len(scatter.seeds), launcher.layouts(inputs, plan.write.buffers))

