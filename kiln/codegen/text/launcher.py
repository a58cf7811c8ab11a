"""A kernel module's launcher, the same for every emitter: ``call(*inputs, *sizes, *seeds, into=())`` binds
sizes from input shapes, restrides inputs, allocates outputs (or takes the wrapper's ``into``) and launches.
The header names the input dtypes, so equal text is an equal kernel for every argument.
"""
import sympy

from kiln.codegen.ir.indexing import RINDEX, XINDEX
from kiln.codegen.text.printer import py


def size_symbols(k) -> set:
    """The size symbols written kernel ``k`` takes: its index sizes, numels and stored buffers' layouts."""
    syms = set(k.sizes)
    for e in [k.xnumel, k.rnumel]:
        syms |= sympy.sympify(e).free_symbols
    for b in k.plan.stored:
        for e in b.shape + b.stride:
            syms |= sympy.sympify(e).free_symbols
    return {s for s in syms if s not in (XINDEX, RINDEX)}


def bind_sizes(kernels, inputs, buffers):
    """(Python name per size symbol, lines binding them from input shapes, symbols no input has as a
    dimension: ``call``'s extra arguments). Each kernel takes every symbol."""
    names, lines, scalars = {}, [], []
    syms = set().union(*[size_symbols(k) for k in kernels])
    for s in sorted(syms, key=str):
        name = f"ks_{s.name}"
        names[s] = name
        found = next((f"in{i}.shape[{d}]" for i, b in enumerate(inputs)
                      for d, size in enumerate(buffers[b].shape) if size == s), None)
        if found:
            lines.append(f"{name} = {found}")
        else:
            scalars.append(s)
    return names, lines, scalars


def header(inputs, buffers, what: str = "") -> str:
    """The module's first lines: what generated it and its inputs' dtypes."""
    dtypes = ", ".join(str(buffers[b].dtype).replace("torch.", "") for b in inputs)
    return f"# kiln generated kernel{what}\n# inputs: {dtypes}"


def ints(xs) -> str:
    return "(" + "".join(f"{int(x)}, " for x in xs) + ")"


def sizes(xs, names) -> str:
    """A tuple of size expressions as Python over the launcher's names."""
    return "(" + "".join(py(x, names) + ", " for x in xs) + ")"


def contiguous(shape, stride) -> bool:
    """Whether static ``stride`` is the contiguous layout of ``shape`` (dims of size 1 aside)."""
    expected = 1
    for size, st in reversed(list(zip(shape, stride))):
        if int(size) != 1 and int(st) != expected:
            return False
        expected *= int(size)
    return True


def layouts(inputs, buffers) -> tuple:
    """Per input, the static ``(shape, stride)`` its launcher checks (``restrides``), or None (no check); empty
    when no input is checked. The wrapper passes ``known=True`` where each checked input's run-time layout is
    its recorded one (``codegen.views``), and the checks are skipped."""
    out = []
    for b in inputs:
        buf = buffers[b]
        static = buf.shape and all(sympy.sympify(x).is_Integer for x in buf.shape + buf.stride)
        out.append((tuple(int(x) for x in buf.shape), tuple(int(x) for x in buf.stride)) if static else None)
    return tuple(out) if any(x is not None for x in out) else ()


def restrides(inputs, buffers, fn: str, test_contiguous: bool = False) -> list:
    """Lines restriding each input of a static layout with ``fn`` (``test_contiguous``: if not contiguous),
    unless the caller says the layouts are ``known`` (``call`` then takes that argument)."""
    out = []
    for i, layout in enumerate(layouts(inputs, buffers)):
        if layout is None:
            continue
        shape, stride = layout
        test = f"not in{i}.is_contiguous()" if test_contiguous and contiguous(shape, stride) \
            else f"in{i}.stride() != {ints(stride)}"
        out += [f"    if {test}:", f"        in{i} = {fn}(in{i}, {ints(shape)}, {ints(stride)})"]
    return ["if not known:"] + out if out else []


def reuse(stored, inputs, reusable) -> tuple:
    """``KernelSource.reuse``: per output, the positions of the inputs it may be written into (() if none)."""
    out = tuple(tuple(k for k, name in enumerate(inputs) if name in names) for names in reusable)
    return out if any(out) and len(out) == len(stored) else ()


def taking_into(i: int, alloc: str, buf, reuse, test_contiguous: bool = False) -> str:
    """Allocation line ``alloc`` of output ``i``, taking the wrapper's ``into[i]`` instead where ``reuse[i]`` (some
    input may be written) and ``into[i]`` has the layout."""
    if not (reuse and reuse[i]):
        return alloc
    lhs, rhs = alloc.split(" = ", 1)
    fits = f"into[{i}].is_contiguous()" if test_contiguous and contiguous(buf.shape, buf.stride) \
        else f"into[{i}].stride() == {ints(buf.stride)}"
    return f"{lhs} = into[{i}] if into and into[{i}] is not None and {fits} else {rhs}"


def returns(locs) -> str:
    return f"return {locs[0]}" if len(locs) == 1 else f"return ({', '.join(locs)},)"


def check_list(checks, names) -> str:
    """The bounds checks a launcher hands the runtime: ``(kind, dim, size, wraps)`` per (size, CheckInfo)."""
    return ", ".join(f"({info.kind!r}, {info.dim}, {py(size, names)}, {info.wraps})" for size, info in checks)


def call(inputs, names, scalars, seeds, body, extra=(), known=False) -> list:
    """The ``call`` function: its arguments (inputs, size scalars, seeds, ``extra``, ``known`` where ``body``
    checks layouts: ``restrides``), then ``body``."""
    args = [f"in{i}" for i in range(len(inputs))] + [names[s] for s in scalars] + list(seeds) + list(extra) + \
        ["known=False"] * known
    return ["", "", f"def call({', '.join(args)}):"] + ["    " + ln for b in body for ln in b.split("\n")]
