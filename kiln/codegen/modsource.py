"""Kernel module text: the launcher around a Triton kernel (``assemble``).

A generated module holds the ``@triton.jit`` kernel and ``call(*inputs, *scalars)``, which binds
dynamic sizes from its inputs, allocates outputs with the graph's strides and launches through
``launch.py``. Everything a launch depends on is in the text, so equal text means an equal kernel.
"""
from __future__ import annotations

import sympy
import torch

from kiln.codegen import launch
from kiln.codegen.indexing import RINDEX, XINDEX

HEADER = "# kiln generated kernel\n"


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


# A mask over a static size that the block divides is all true: written as a constant (a
# compile-time branch on the block size), Triton drops it from loads, stores and selects.
EVEN_MASKS = True


def mask_lines(var, index, numel, shape, static):
    """``var = index < numel``, or a constant-true mask when ``numel`` is static and the block
    (XBLOCK for ``xmask``, else RBLOCK) divides it."""
    plain = f"{var} = {index} < {numel}"
    if not (static and EVEN_MASKS):
        return [plain]
    block = "XBLOCK" if var == "xmask" else "RBLOCK"
    return [f"if {numel} % {block} == 0:", f"    {var} = tl.full({shape}, True, tl.int1)", "else:",
            f"    {plain}"]


def _render(lines, indent, out, static_r=False):
    for line in lines:
        if isinstance(line, tuple):
            out.append(f"{indent}for roffset in range(0, rnumel, RBLOCK):")
            out.append(f"{indent}    rindex = roffset + rbase")
            out += [f"{indent}    {ln}" for ln in mask_lines("rmask", "rindex", "rnumel", "[1, RBLOCK]", static_r)]
            _render(line[1].lines, indent + "    ", out, static_r)
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
    # integer numels are known when Triton compiles (constants, or constexpr under the interpreter)
    known_x, known_r = k.xnumel.is_Integer, k.rnumel.is_Integer
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
            body += ["rindex = rbase"] + mask_lines("rmask", "rindex", "rnumel", "[1, RBLOCK]", known_r)
    pid = "tl.program_id(0).to(tl.int64)" if k.i64 else "tl.program_id(0)"
    xshape = "[XBLOCK, 1]" if k.red else "[XBLOCK]"
    xrange = "tl.arange(0, XBLOCK)[:, None]" if k.red else "tl.arange(0, XBLOCK)"
    xmask = mask_lines("xmask", "xindex", "xnumel", xshape, known_x)
    if k.programs:   # folded column partials: each program walks its chunk of rows
        body += [f"xpid = {pid}"] + k.pre + [f"for xoffset in range(0, {k.chunk}, XBLOCK):"]
        body.append(f"    xindex = xpid * {k.chunk} + xoffset + {xrange}")
        # rows past the chunk's end belong to the next program (chunks divide the rows exactly)
        xmask = mask_lines("xmask", f"(xoffset + {xrange})", str(k.chunk), xshape, True)
        ind = "    "
    elif k.outer and not k.last_program or k.single_program:   # one program walks all rows
        body += k.pre if k.outer else []   # ... accumulating the outer reductions
        body.append("for xoffset in range(0, xnumel, XBLOCK):")
        ind = "    "
        body.append(ind + f"xindex = xoffset + {xrange}")
    else:
        body.append(f"xoffset = {pid} * XBLOCK")
        body.append(f"xindex = xoffset + {xrange}")
    body += [ind + ln for ln in xmask]
    if k.last_program:
        body += k.pre
    _render(k.top.lines, ind, body, known_r)
    if k.last_program:
        body += _last_program(k)
    elif k.outer or k.programs:
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
    from kiln.codegen.triton_ops import TL_DTYPE, combine, neutral, reduce_code
    out = []
    for var, kind, dt, acc, part in k.partials:
        out.append(f"tl.store({part} + tl.program_id(0) + tl.full([1, 1], 0, tl.int32), "
                   f"{reduce_code(kind, acc, k.interpret, axis=0)})")
    cg = past_l1(k.interpret)
    # Triton's interpreter loops only to constants: there, step over xnumel (>= n_programs, masked)
    bound = "xnumel" if k.interpret else "n_programs"
    out += last_program_if(k)
    for var, kind, dt, acc, part in k.partials:
        n = neutral(kind, dt)
        out += [f"    {acc}_all = tl.full([{PARTS_BLOCK}, 1], {n}, {TL_DTYPE[dt]})",
                f"    for p_offset in range(0, {bound}, {PARTS_BLOCK}):",
                f"        p_index = p_offset + tl.arange(0, {PARTS_BLOCK})[:, None]",
                f"        p_value = tl.load({part} + p_index, p_index < n_programs, {n}{cg})",
                f"        {acc}_all = {combine(kind, f'{acc}_all', 'p_value')}",
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


def last_program_if(k) -> list:
    """``LAST_PROGRAM_IF`` for kernel ``k`` (a kernel of folded column partials has one program per
    chunk of rows)."""
    if k.programs:
        return [LAST_PROGRAM_IF[0], f"n_programs = {k.programs}", LAST_PROGRAM_IF[2]]
    return LAST_PROGRAM_IF


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


def narrow_data(k) -> bool:
    """Whether kernel ``k`` reads or writes 2-byte elements (``launch.config``'s ``narrow``)."""
    bufs = [k.buffers[b] for b in k.inputs] + list(k.g.stored)
    return any(b.dtype.itemsize <= 2 for b in bufs)


def launch_line(k, name, args, names):
    kind = "reduction" if k.red else "pointwise"
    inner = bool(k.dims) and k.dims[-1][1]
    cfg = None
    narrow = narrow_data(k)
    if k.xnumel.is_Integer and k.rnumel.is_Integer and not k.autotune:
        cfg = launch.config(kind, int(k.xnumel), int(k.rnumel), k.persistent, inner, k.interpret, narrow)
    meta = dict(kind=kind, persistent=k.persistent, inner=inner, interpret=k.interpret, autotune=k.autotune,
                outer=k.outer and not k.last_program, narrow=narrow, programs=k.programs)
    if cfg is not None and not k.interpret and "xnumel" not in args and "rnumel" not in args:
        xb, rb, warps = cfg   # all static: grid and block sizes are constants of the module
        if int(k.xnumel) <= 0:
            return []
        grid = launch.grid_of(int(k.xnumel), xb, meta)
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
