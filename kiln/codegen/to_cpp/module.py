"""A graph's C++ translation unit and the Python launcher of each of its kernels.

``write_unit(plans, tuning)`` writes every plan's kernel as an ``extern "C"`` function (raw pointers,
int64 sizes; named by a hash of its text, so equal kernels share a name) into one translation unit, and
for each plan a ``KernelSource`` whose text is a small Python module: its ``call`` binds sizes from
its inputs, restrides inputs whose strides differ from the graph's, allocates the outputs and calls the
function(s) through ``kiln.runtime.cpp_build`` (which built and loaded the unit). A plan the emitter
cannot write (a scatter, an op without a template) gets a source with no text: the
caller runs that kernel's ATen nodes instead, and the reason is logged.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import sympy

from kiln.codegen.ir.bounds import parts
from kiln.codegen.ir.loops import Unsupported
from kiln.codegen.schedule.plan import KernelSource, ScatterPlan
from kiln.codegen.to_cpp.ops import PREAMBLE
from kiln.codegen.to_cpp.rows import CppKernel
from kiln.codegen.to_triton.module import PLACEHOLDER, bind_sizes, pyexpr
from kiln.debug import counters, log
from kiln.options import Tuning

HEADER = "# kiln generated kernel (C++)\n"


@dataclass(frozen=True)
class CppUnit:
    """The C++ source of a graph's kernels and the names of its functions."""
    source: str
    functions: tuple


def write_unit(plans, tuning: Tuning) -> tuple:
    """(``CppUnit``, [``KernelSource`` per plan]); a declined plan's source has empty ``text``."""
    functions, sources = {}, []
    for plan in plans:
        try:
            sources.append(_write_plan(plan, tuning, functions))
        except Unsupported as e:
            counters["codegen"]["cpp_declined"] += 1
            log(1, f"codegen: cpp declines a kernel, which runs as ATen ({e})")
            sources.append(declined(plan))
    return CppUnit(PREAMBLE + "\n" + "\n\n".join(functions.values()) + "\n", tuple(functions)), sources


def declined(plan) -> KernelSource:
    """The source of a plan left to ATen: what it reads and writes, no text."""
    if isinstance(plan, ScatterPlan):
        reads, symbols = plan.copy.reads | plan.write.reads, plan.copy.symbols | plan.write.symbols
    else:
        head = {b.name for b in plan.stored}
        reads, symbols = set(plan.reads), set(plan.symbols)
        if plan.tail is not None:
            reads |= plan.tail.reads - head
            symbols |= plan.tail.symbols
    outputs = [b.name for b in plan.outputs()]
    return KernelSource("", tuple(sorted(reads)), tuple(outputs), tuple(sorted(symbols, key=str)), "aten", (), None)


def _write_plan(plan, tuning: Tuning, functions: dict) -> KernelSource:
    if isinstance(plan, ScatterPlan):
        raise Unsupported("cpp: scatter kernels run as ATen")
    head = CppKernel(plan, tuning).write()
    tail = CppKernel(plan.tail, tuning).write() if plan.tail is not None else None
    kernels = [head] + ([tail] if tail is not None else [])
    inputs = list(head.inputs)
    names, bind_lines, scalars = bind_sizes(kernels, inputs, plan.buffers)
    fnames = []
    for k in kernels:
        text = k.define(PLACEHOLDER, names)
        fname = "kiln_cpp_" + hashlib.sha256(text.encode()).hexdigest()[:16]
        functions.setdefault(fname, text.replace(PLACEHOLDER, fname))
        fnames.append(fname)
    ins = {b: f"in{i}" for i, b in enumerate(inputs)}
    outs = {b.name: f"out{i}" for i, b in enumerate(plan.outputs())}
    dtypes = ", ".join(str(plan.buffers[b].dtype).replace("torch.", "") for b in inputs)
    # the launcher runs once per kernel call: torch's functions, the device and the C functions are
    # module globals, and the checks are the cheapest that decide (``is_contiguous`` where it does)
    lines = [HEADER + f"# inputs: {dtypes}", "import torch", "from kiln.runtime import cpp_build"] + \
        ["from kiln.runtime import bounds as _bounds", "_cell, _cell_at = _bounds.error_cell()"] * any(
            k.checks for k in kernels) + \
        ["", "_empty = torch.empty_strided", f"_device = torch.device({str(plan.device)!r})"]
    for i, (k, fname) in enumerate(zip(kernels, fnames)):
        n_ptr = len(k.inputs) + len(k.plan.stored) + len(k.seeds)
        lines.append(f"_k{i} = cpp_build.function({fname!r}, {n_ptr}, {len(names)}"
                     f"{', checked=True' if k.checks else ''})")
    # the philox seeds: one-element int64 tensors the graph draws once per call (``fuse_graph.seed_nodes``)
    seeds = [f"seed{j}" for j in range(sum(len(k.seeds) for k in kernels))]
    args = [f"in{i}" for i in range(len(inputs))] + [names[s] for s in scalars] + seeds
    lines += ["", "", f"def call({', '.join(args)}):"]
    body = list(bind_lines)
    for i, b in enumerate(inputs):
        buf = plan.buffers[b]
        if buf.shape and all(sympy.sympify(x).is_Integer for x in buf.shape + buf.stride):
            st, shape = _tuple(buf.stride), _tuple(buf.shape)
            test = f"not in{i}.is_contiguous()" if _contiguous(buf.shape, buf.stride) else f"in{i}.stride() != {st}"
            body += [f"if {test}:", f"    in{i} = cpp_build.restride(in{i}, {shape}, {st})"]
    for b in plan.outputs():
        shape = "(" + "".join(pyexpr(x, names) + ", " for x in b.shape) + ")"
        stride = "(" + "".join(pyexpr(x, names) + ", " for x in b.stride) + ")"
        body.append(f"{outs[b.name]} = _empty({shape}, {stride}, dtype={b.dtype}, device=_device)")
    sizes = [names[s] for s in sorted(names, key=str)]
    taken = 0
    for i, k in enumerate(kernels):
        local = {**ins, **outs}
        ptrs = [f"{local[b]}.data_ptr()" for b in k.inputs] + [f"{outs[b.name]}.data_ptr()" for b in k.plan.stored]
        ptrs += [f"{s}.data_ptr()" for s in seeds[taken:taken + len(k.seeds)]]
        taken += len(k.seeds)
        body += _checked(f"_k{i}({', '.join(ptrs + sizes)})", k, names)
    locs = [outs[b.name] for b in plan.outputs()]
    body.append(f"return {locs[0]}" if len(locs) == 1 else f"return ({', '.join(locs)},)")
    lines += ["    " + ln for b in body for ln in b.split("\n")]
    kind = "reduction" if plan.reduction else "pointwise"
    return KernelSource("\n".join(lines) + "\n", tuple(inputs), tuple(outs), tuple(scalars), kind, (), None,
                        len(seeds))


def _checked(call: str, k, names) -> list:
    """The launcher lines of kernel call ``call``: with bounds checks, the call passes the error cell and
    a failed check raises eager's error (``kiln.runtime.bounds``)."""
    if not k.checks:
        return [call]
    checks = ", ".join(f"({info.kind!r}, {info.dim}, {pyexpr(parts(e)[1], names)}, {info.wraps})"
                       for e, (_, _, info) in k.checks.items())
    return [f"_c = {call[:-1]}, _cell_at)", "if _c:", f"    _bounds.fail(_c, _cell, ({checks},))"]


def _tuple(xs):
    return "(" + "".join(f"{int(x)}, " for x in xs) + ")"


def _contiguous(shape, stride) -> bool:
    """Whether static ``stride`` is the contiguous layout of ``shape`` (dims of size 1 aside, as
    ``Tensor.is_contiguous`` and ``cpp_build.restride`` both ignore them)."""
    expected = 1
    for size, st in reversed(list(zip(shape, stride))):
        if int(size) != 1 and int(st) != expected:
            return False
        expected *= int(size)
    return True


__all__ = ["CppUnit", "write_unit", "declined"]
