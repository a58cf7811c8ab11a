"""Triton emitter for scatters (scatter_add, index_put, index_add, embedding backward).

One module, two kernels: a pointwise copy of the base into the output, then a kernel over the
source positions that writes (``tl.store``) or accumulates (``tl.atomic_add``) each value at its
computed target index.
"""
from __future__ import annotations

from kiln.codegen import modsource
from kiln.codegen.loops import Buffer, ops
from kiln.codegen.schedule import Group, place, squeeze
from kiln.codegen.triton import Scope, Source, TritonKernel


class ScatterKernel(TritonKernel):
    """The write-through-index kernel of a scatter buffer."""

    def __init__(self, buf, buffers, interpret):
        s = buf.compute
        dims = tuple((x, False) for x in squeeze(s.shape))
        super().__init__(Group(dims, [buf], "pointwise", [buf]), buffers, interpret)
        self.buf = buf

    def generate_body(self):
        self.top = Scope()
        s, buf = self.buf.compute, self.buf
        idx = place(s.shape, self.dims)
        value = ops.cast(self.resolve(s.value(idx)), buf.dtype)
        target = ops.index(s.target(idx))   # carries the indirect bindings
        self.out_args = {buf.name: "out_ptr0"}
        v = self.emit(value, self.top)
        t = self.index(target.args[0], target.args[2], self.top, None)
        if self.level(value) == "c":
            v = f"tl.broadcast_to({self._tensor(v, value)}, [XBLOCK])"
        if self.level(target) == "c":   # one target address: a block of pointers for the xmask
            t = f"({t}) + tl.full([XBLOCK], 0, tl.int32)"
        fn = "tl.atomic_add" if s.mode == "add" else "tl.store"
        self.top.lines.append(f"{fn}(out_ptr0 + ({t}), {v}, xmask)")


def emit_scatter(group, buffers, interpret, name) -> Source:
    buf = group.nodes[0]
    s = buf.compute
    copy_buf = Buffer(buf.name, buf.shape, buf.stride, buf.dtype, buf.device, "pointwise", buf.node, s.base)
    copy = TritonKernel(Group(tuple((x, False) for x in squeeze(buf.shape)), [copy_buf], "pointwise",
                              [copy_buf]), buffers, interpret)
    copy.top = Scope()
    copy._straight(copy._plan())
    scatter = ScatterKernel(buf, buffers, interpret)
    scatter.generate_body()
    # the scatter kernel reads the output it writes: pass it as its out_ptr0 only
    inputs = list(dict.fromkeys(list(copy.inputs) + list(scatter.inputs)))
    ins = {b: f"in{i}" for i, b in enumerate(inputs)}
    outs = {buf.name: "out0"}
    device = modsource.device_expr(interpret, bool(inputs), buf.device)

    def body(names):
        out = [modsource.alloc_line("out0", buf, names, device)]
        out += modsource.launch_line(copy, f"{name}_copy", modsource.kernel_args(copy, ins, outs), names)
        out += [f"{seed} = launch.seed()" for seed in scatter.seeds.values()]
        out += modsource.launch_line(scatter, name, modsource.kernel_args(scatter, ins, outs), names)
        out.append("return out0")
        return out
    defs = [lambda: modsource.kernel_def(copy, f"{name}_copy"), lambda: modsource.kernel_def(scatter, name)]
    text, scalars = modsource.module([copy, scatter], defs, inputs, buffers, body)
    return Source(text, inputs, [buf.name], scalars, "scatter")
