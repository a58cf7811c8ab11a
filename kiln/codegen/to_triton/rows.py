"""How a Triton kernel's body walks its rows (``TritonKernel.write``), following the plan: straight-line
code, one loop over ``rindex`` per pass (a softmax's max and sum share one online pass), outer reductions
and column partials accumulated across row blocks, or a scatter through computed indices.
"""
import torch

from kiln.codegen.ir.indexing import RINDEX, XINDEX
from kiln.codegen.ir.loops import ops
from kiln.codegen.schedule.domain import Role
from kiln.codegen.schedule.plan import KernelPlan, Level, Programs
from kiln.codegen.to_triton.emit import ExprWriter, Flags, Scope
from kiln.codegen.to_triton.ops import TL_DTYPE, combine, convert, helpers_in, neutral, reduce_code, template


class TritonKernel(ExprWriter):
    """One ``@triton.jit`` function written from a plan; ``module.kernel_def`` renders it."""

    def __init__(self, plan: KernelPlan, flags: Flags):
        super().__init__(plan, flags)
        self.partials = []   # (result var, kind, acc dtype, accumulator, scratch arg) per outer reduction

    def write(self) -> "TritonKernel":
        """Write the kernel body (``top``, ``pre``, ``post``) from the plan."""
        plan = self.plan
        if plan.scatter is not None:
            self._scatter()
            return self
        (self._looped if plan.looped else self._straight)()
        if plan.outer:
            self._outer()
        if plan.chunks:
            self._colparts()
        return self

    def _straight(self):
        """Pointwise kernels and persistent reductions: one scope, no loops."""
        scope = self.top
        for m in self.plan.members:
            if m.role is not Role.ROW:
                continue
            if m.reduce:
                v = self._reduce_value(m, m.value, scope)
                masked = self.tmp()
                scope.lines.append(f"{masked} = tl.where(xmask & rmask, {v}, {neutral(m.reduce, m.acc)})")
                self._reduce_final(m, masked, scope, "rindex.to(tl.int64)")
            if m.stored:
                self._store(m, m.result, scope)

    def _looped(self):
        plan = self.plan
        partner = {mx: plan.member(sm) for p in plan.passes for mx, sm in p.online}   # max -> its sum
        for i, p in enumerate(plan.passes):
            self.pass_index = i
            loop = Scope(self.top)
            accs = []
            for name in p.reduce:
                m = plan.member(name)
                kind, dt = m.reduce, m.acc
                acc = f"_acc{self.count}"   # never a buffer name: equal kernels must have equal text
                self.count += 1
                self.top.lines.append(f"{acc} = tl.full([XBLOCK, RBLOCK], {neutral(kind, dt)}, {TL_DTYPE[dt]})")
                v = self._reduce_value(m, m.value, loop)
                mask = "xmask & rmask"
                if kind in ("argmax", "argmin"):
                    # per lane: the best value so far and the first rindex reaching it (a NaN beats
                    # every number, the first NaN stays: eager's index)
                    self.top.lines.append(f"{acc}_i = tl.full([XBLOCK, RBLOCK], 0, tl.int64)")
                    better = self.tmp()
                    cmp = ">" if kind == "argmax" else "<"
                    wins = f"{v} {cmp} {acc}"
                    if dt.is_floating_point:
                        wins = f"({wins}) | (({v} != {v}) & ({acc} == {acc}))"
                    loop.lines.append(f"{better} = ({mask}) & ({wins})")
                    loop.lines.append(f"{acc}_i = tl.where({better}, rindex.to(tl.int64), {acc}_i)")
                    loop.lines.append(f"{acc} = tl.where({better}, {v}, {acc})")
                    accs.append((m, (acc, f"{acc}_i")))
                    continue
                if name in partner:   # the max of an online pair: its sum updates beside it
                    acc_sum = f"_acc{self.count}"
                    self.count += 1
                    self.top.lines.append(f"{acc_sum} = tl.full([XBLOCK, RBLOCK], 0, {TL_DTYPE[dt]})")
                    self._online_step(loop, mask, v, acc, acc_sum, dt)
                    accs += [(m, acc), (partner[name], ("online", acc, acc_sum, name, dt))]
                    continue
                loop.lines.append(f"{acc} = tl.where({mask}, {combine(kind, acc, v, dt.is_floating_point)}, {acc})")
                accs.append((m, acc))
            for name in p.stores:
                m = plan.member(name)
                self._store(m, m.result, loop)
            self.top.lines.append(("loop", loop))
            self.pass_index = None
            for m, acc in accs:
                if isinstance(acc, tuple) and acc[0] == "online":
                    _, acc_max, acc_sum, max_name, dt = acc
                    self._online_final(m, acc_max, acc_sum, self.red_vars[max_name], dt)
                elif isinstance(acc, tuple):
                    self._reduce_final(m, acc[0], self.top, acc[1])
                else:
                    self._reduce_final(m, acc, self.top)
        for name in plan.row_stores:
            m = plan.member(name)
            self._store(m, m.result, self.top)

    def _online_step(self, loop, mask, v, acc_max, acc_sum, dt):
        """Loop lines of one online softmax step: the running max and the rescaled running sum."""
        exp = template("exp", dt, self.interpret, 1)
        new, safe = self.tmp(), self.tmp()
        loop.lines.append(f"{new} = tl.where({mask}, tl.maximum({acc_max}, {v}), {acc_max})")
        # a lane that has seen only -inf has no scale yet: shift by 0 (exp(-inf) = 0, never nan)
        loop.lines.append(f"{safe} = tl.where({new} == float('-inf'), 0.0, {new})")
        loop.lines.append(f"{acc_sum} = tl.where({mask}, {acc_sum} * {exp.format(f'({acc_max} - {safe})')} + "
                          f"{exp.format(f'({v} - {safe})')}, {acc_sum})")
        loop.lines.append(f"{acc_max} = {new}")

    def _online_final(self, m, acc_max, acc_sum, max_var, dt):
        """The row's sum from the lanes' partial sums rescaled to the row's max (nan for a row of -inf)."""
        exp = template("exp", dt, self.interpret, 1)
        safe, var = self.tmp(), self.tmp("red")
        scaled = f"{acc_sum} * {exp.format(f'({acc_max} - {safe})')}"
        self.top.lines += [f"{safe} = tl.where({max_var} == float('-inf'), 0.0, {max_var})",
                           f"{var} = {self.reduce('sum', scaled, dt)}",
                           f"{var} = tl.where({max_var} == float('-inf'), float('nan'), {var})"]
        self.red_vars[m.name] = var

    def _reduce_value(self, m, e, scope):
        v = self._tensor(self.emit(e, scope), e)
        return v if e.dtype == m.acc else f"{v}.to({TL_DTYPE[m.acc]})"

    def _reduce_final(self, m, acc, scope, index=None):
        """Reduce tile ``acc`` to the row result (``index``: each lane's rindex, for argmax/argmin)."""
        kind = m.reduce
        var = self.tmp("red")
        if kind in ("argmax", "argmin"):
            best = self.tmp()
            scope.lines.append(f"{best} = {self.reduce(kind[3:], acc, m.acc)}")
            big = "9223372036854775807"
            at = f"{acc} == {best}"
            if m.acc.is_floating_point:   # a NaN best: the first lane holding a NaN
                at = f"({at}) | (({acc} != {acc}) & ({best} != {best}))"
            first = self.reduce("min", f"tl.where({at}, {index}, {big})", torch.int64)
            scope.lines.append(f"{var} = {first}")
        else:
            scope.lines.append(f"{var} = {self.reduce(kind, acc, m.acc)}")
        self.red_vars[m.name] = var

    def _accumulate(self, m, e, acc, shape, mask):
        """Declare accumulator ``acc`` before the rows; fold ``m``'s element ``e`` into it per block."""
        kind, dt = m.reduce, m.acc
        self.pre.append(f"{acc} = tl.full({shape}, {neutral(kind, dt)}, {TL_DTYPE[dt]})")
        v = self._reduce_value(m, e, self.top)
        self.top.lines.append(f"{acc} = tl.where({mask}, {combine(kind, acc, v, dt.is_floating_point)}, {acc})")
        # helpers of the final reduce (``post`` or the last program's combine)
        self.helpers.update(helpers_in(reduce_code(kind, acc, self.interpret, 0, dt.is_floating_point)))

    def _outer(self):
        """Accumulate outer reductions across rows, then write the scalar results."""
        last = self.plan.programs is Programs.LAST
        n = 0
        for m in self.plan.members:
            if m.role not in (Role.OUTER, Role.SCALAR):
                continue
            if m.reduce:
                acc = f"_outer{n}"   # never a buffer name: equal kernels must have equal text
                n += 1
                self._accumulate(m, m.value, acc, "[XBLOCK, 1]", "xmask")
                var = self.tmp("red")
                if last:
                    self.partials.append((var, m.reduce, m.acc, acc, f"part_ptr{len(self.partials)}"))
                else:
                    self.post.lines.append(f"{var} = {self.reduce(m.reduce, acc, m.acc, axis=0)}")
                self.red_vars[m.name] = var
            if m.stored:
                value = ops.cast(m.result, m.buffer.dtype)
                v = self._block(self.emit(value, self.post), value, "[1, 1]")
                self.post.lines.append(f"tl.store({self.out_args[m.name]} + tl.full([1, 1], 0, tl.int32), {v})")

    def _colparts(self):
        """Folded column partials: each program's chunk of rows reduced in a tile, stored per column."""
        for m in self.plan.members:
            if m.role is not Role.COLPART:
                continue
            acc = f"_col{len(self.pre)}"
            self._accumulate(m, m.value, acc, "[XBLOCK, RBLOCK]", "xmask & rmask")
            var = self.tmp("red")
            self.post.lines.append(f"{var} = {self.reduce(m.reduce, acc, m.acc, axis=0)}")
            if m.stored:
                idx = self.pexpr(m.index)
                v = var if m.buffer.dtype == m.acc else convert(var, m.acc, m.buffer.dtype, self.interpret)
                self.helpers.update(helpers_in(v))
                self.post.lines.append(f"tl.store({self.out_args[m.name]} + ({idx}), {v}, rmask)")

    def _store(self, m, value, scope):
        value = ops.cast(value, m.buffer.dtype)
        lv = self.level(value)
        v = self.emit(value, scope)
        idx = m.index
        syms = idx.free_symbols
        ilv = Level.ELEMENT if RINDEX in syms and self.red else (Level.ROW if syms & {XINDEX, RINDEX} else Level.CONST)
        slv = max(ilv, Level.ROW)
        shape = "[XBLOCK]" if not self.red else ("[XBLOCK, 1]" if slv is Level.ROW else "[XBLOCK, RBLOCK]")
        icode = self.pexpr(idx)
        if ilv is Level.CONST:
            icode = f"{icode} + tl.full({shape}, 0, tl.int32)"
        if lv < slv:
            v = self._block(v, value, shape)
        target = scope if slv is Level.ELEMENT else self.top
        target.lines.append(f"tl.store({self.out_args[m.name]} + ({icode}), {v}, {self._mask(slv, None)})")

    def _scatter(self):
        """A scatter's kernel: each value stored (or added atomically) at its target index."""
        w = self.plan.scatter
        v = self.emit(w.value, self.top)
        t = self.index(w.target.args[0], w.target.args[2], self.top, None)
        if self.level(w.value) is Level.CONST and self.interpret and w.mode == "add":
            # a fresh block, made by a select: Triton 3.6's interpreter misreads a broadcast (stride-0)
            # value in tl.atomic_add and adds garbage (counting with ones: scatter_reduce's mean backward)
            x = self._tensor(v, w.value)
            v = f"tl.where(tl.full([XBLOCK], True, tl.int1), {x}, {x})"
        elif self.level(w.value) is Level.CONST:
            v = f"tl.broadcast_to({self._tensor(v, w.value)}, [XBLOCK])"
        if self.level(w.target) is Level.CONST:   # one target address: a block of pointers for the xmask
            t = f"({t}) + tl.full([XBLOCK], 0, tl.int32)"
        fn = "tl.atomic_add" if w.mode == "add" else "tl.store"
        self.top.lines.append(f"{fn}(out_ptr0 + ({t}), {v}, xmask)")
