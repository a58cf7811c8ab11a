"""The Triton module of a grouped kernel (``schedule.group.GroupPlan``): one ``@triton.jit`` kernel whose
programs are split in ranges, one per member, in order; each member's body is a ``@triton.jit`` function of
its own (``kernel_def(grouped=True)``) called with its program's number in its range. One block size for all
members, fixed when the module is written (members have static sizes); one launch.
"""
from kiln.codegen.ir.loops import Unsupported
from kiln.codegen.text import launcher
from kiln.codegen.text.blocks import Blocks, config
from kiln.codegen.text.source import PLACEHOLDER, KernelSource
from kiln.codegen.to_triton.emit import Flags
from kiln.codegen.to_triton.module import (alloc_line, device_expr, error_buffer, kernel_args, kernel_def, module,
                                           narrow_data)
from kiln.codegen.to_triton.rows import TritonKernel


def write_group(plan, flags: Flags) -> KernelSource:
    """The module of ``plan`` (a ``GroupPlan``): ``call`` returns every member's outputs, in order."""
    flags = Flags(flags.interpret, False, flags.tuning)   # one configuration, chosen here: never autotuned
    ks = [TritonKernel(p, flags).write() for p in plan.plans]
    if any(error_buffer(k) for k in ks):
        raise Unsupported("triton: bounds checks in a grouped kernel")
    inputs = list(dict.fromkeys(b for k in ks for b in k.inputs))
    buffers = {n: b for p in plan.plans for n, b in p.buffers.items()}
    stored = plan.stored
    ins = {b: f"in{i}" for i, b in enumerate(inputs)}
    outs = {b.name: f"out{i}" for i, b in enumerate(stored)}
    xb, _, warps = config("pointwise", max(int(k.xnumel) for k in ks), 1, False, False, flags.interpret,
                          any(narrow_data(k) for k in ks), Blocks.of(flags.tuning))
    ends, total = [], 0
    for k in ks:
        total += -(-int(k.xnumel) // xb)
        ends.append(total)
    device = device_expr(flags.interpret, bool(inputs), plan.device)
    reuse = launcher.reuse(stored, inputs, _reusable(plan))
    params = list(ins.values()) + list(outs.values())
    name = PLACEHOLDER

    def defs(names):
        # members of equal text (a weight cast per layer) share one function
        texts = [kernel_def(k, f"{name}_member", names, grouped=True) for k in ks]
        fns = {t: f"{name}_{j}" for j, t in enumerate(dict.fromkeys(texts))}
        lines = ["pid = tl.program_id(0)"]
        for i, k in enumerate(ks):
            # a member's arguments; an interpreted one takes its static xnumel (a constexpr there)
            args = [str(int(k.xnumel)) if a == "xnumel" else a for a in kernel_args(k, ins, outs, names)]
            local = f"pid - {ends[i - 1]}" if i else "pid"
            test = "else:" if i == len(ks) - 1 else f"{'elif' if i else 'if'} pid < {ends[i]}:"
            lines += [test, f"    {fns[texts[i]]}({', '.join(args + [local])}, XBLOCK)"]
        kernel = "\n".join(["@triton.jit", f"def {name}({', '.join(params)}, XBLOCK: tl.constexpr):"] +
                           ["    " + ln for ln in lines])
        return "\n\n\n".join([t.replace(f"def {name}_member(", f"def {f}(") for t, f in fns.items()] + [kernel])

    def body(names):
        out = [launcher.taking_into(i, alloc_line(outs[b.name], b, names, device), b, reuse)
               for i, b in enumerate(stored)]
        if flags.interpret:
            meta = {"kind": "pointwise", "interpret": True}
            out.append(f"launch.run({name}, ({', '.join(params)},), {total * xb}, 1, ({xb}, 1, {warps}), {meta!r})")
        else:
            out.append(f"launch.launch({name}, ({', '.join(params)},), ({total},), ({xb},), {warps})")
        out.append(launcher.returns(list(outs.values())))
        return out
    text, scalars = module(ks, [defs], inputs, buffers, body, into=bool(reuse))
    return KernelSource(text, tuple(inputs), tuple(outs), tuple(scalars), "group", tuple(reuse), flags.interpret, 0,
                        launcher.layouts(inputs, buffers))


def _reusable(plan) -> list:
    """Per output, the inputs it may be written into (its member's ``KernelPlan.reusable``): none that another
    member reads, which the launch may still be reading."""
    out = []
    for p in plan.plans:
        others = frozenset().union(*[q.reads for q in plan.plans if q is not p])
        out += [tuple(n for n in names if n not in others) for names in p.reusable]
    return out
