"""A graph's C++ translation unit (an ``extern "C"`` function per kernel, named by a hash of its text) and
each kernel's Python launcher, which calls it through ``kiln.runtime.cpp_build``. A plan the emitter cannot
write gets a source with no text (its ATen nodes run; the reason logged).
"""
import hashlib

from kiln.codegen.ir.bounds import parts
from kiln.codegen.ir.loops import Unsupported
from kiln.codegen.schedule.plan import ScatterPlan
from kiln.codegen.text import launcher
from kiln.codegen.text.source import PLACEHOLDER, KernelSource, Unit, declined
from kiln.codegen.to_cpp.ops import PREAMBLE
from kiln.codegen.to_cpp.rows import CppKernel
from kiln.debug import counters, log
from kiln.options import Tuning


def write_unit(plans, tuning: Tuning) -> tuple:
    """(``Unit``, [``KernelSource`` per plan]); a declined plan's source has empty ``text``."""
    functions, sources = {}, []
    for plan in plans:
        try:
            sources.append(_write_plan(plan, tuning, functions))
        except Unsupported as e:
            counters["codegen"]["cpp_declined"] += 1
            log(1, f"codegen: cpp declines a kernel, which runs as ATen ({e})")
            sources.append(declined(plan))
    return Unit.of(PREAMBLE, "\n\n".join(functions.values()) + "\n", tuple(functions)), sources


def _write_plan(plan, tuning: Tuning, functions: dict) -> KernelSource:
    scatter = isinstance(plan, ScatterPlan)   # the base copied into the output, then the values written
    parts = (plan.copy, plan.write) if scatter else (plan, plan.tail)
    kernels = [CppKernel(p, tuning).write() for p in parts if p is not None]
    tail = kernels[1] if len(kernels) > 1 else None
    inputs = list(dict.fromkeys(b for k in kernels[:1 + scatter] for b in k.inputs))
    buffers, device = (plan.write.buffers, plan.write.device) if scatter else (plan.buffers, plan.device)
    names, bind_lines, scalars = launcher.bind_sizes(kernels, inputs, buffers)
    fnames = []
    for k in kernels:
        text = k.define(PLACEHOLDER, names)
        fname = "kiln_cpp_" + hashlib.sha256(text.encode()).hexdigest()[:16]
        functions.setdefault(fname, text.replace(PLACEHOLDER, fname))
        fnames.append(fname)
    ins = {b: f"in{i}" for i, b in enumerate(inputs)}
    outs = {b.name: f"out{i}" for i, b in enumerate(plan.outputs())}
    # the launcher runs once per kernel call: torch's functions, the device and the C functions are
    # module globals, and the checks are the cheapest that decide (``is_contiguous`` where it does)
    lines = [launcher.header(inputs, buffers, " (C++)"), "import torch", "from kiln.runtime import cpp_build"] + \
        ["from kiln.runtime import bounds as _bounds", "_cell, _cell_at = _bounds.error_cell()"] * any(
            k.checks for k in kernels) + \
        ["", "_empty = cpp_build.empty_cpu"]
    for i, (k, fname) in enumerate(zip(kernels, fnames)):
        n_ptr = len(k.inputs) + len(k.plan.stored) + len(k.seeds)
        lines.append(f"_k{i} = cpp_build.function({fname!r}, {n_ptr}, {len(names)}"
                     f"{', checked=True' if k.checks else ''})")
    # the philox seeds: one-element int64 tensors the graph draws once per call (``codegen.rewrite``)
    seeds = [f"seed{j}" for j in range(sum(len(k.seeds) for k in kernels))]
    body = bind_lines + launcher.restrides(inputs, buffers, "cpp_build.restride", test_contiguous=True)
    reuse = launcher.reuse(plan.stored, inputs, plan.reusable) if tail is None else ()
    for i, b in enumerate(plan.outputs()):
        line = f"{outs[b.name]} = _empty({launcher.sizes(b.shape, names)}, {launcher.sizes(b.stride, names)}, " \
               f"{b.dtype})"
        body.append(launcher.taking_into(i, line, b, reuse, True))
    sizes = [names[s] for s in sorted(names, key=str)]
    taken = 0
    for i, k in enumerate(kernels):
        local = {**ins, **outs}
        ptrs = [f"{local[b]}.data_ptr()" for b in k.inputs] + [f"{outs[b.name]}.data_ptr()" for b in k.plan.stored]
        ptrs += [f"{s}.data_ptr()" for s in seeds[taken:taken + len(k.seeds)]]
        taken += len(k.seeds)
        body += _checked(f"_k{i}({', '.join(ptrs + sizes)})", k, names)
    body.append(launcher.returns([outs[b.name] for b in plan.outputs()]))
    lines += launcher.call(inputs, names, scalars, seeds, body, ["into=()"] if reuse else [],
                           bool(launcher.layouts(inputs, buffers)))
    kind = "scatter" if scatter else "reduction" if plan.reduction else "pointwise"
    return KernelSource("\n".join(lines) + "\n", tuple(inputs), tuple(outs), tuple(scalars), kind, reuse, None,
                        len(seeds), launcher.layouts(inputs, buffers))


def _checked(call: str, k, names) -> list:
    """The launcher lines of ``call`` (with bounds checks: the error cell passed, eager's error raised)."""
    if not k.checks:
        return [call]
    checks = launcher.check_list(((parts(e)[1], info) for e, (_, _, info) in k.checks.items()), names)
    return [f"_c = {call[:-1]}, _cell_at)", "if _c:", f"    _bounds.fail(_c, _cell, ({checks},))"]
