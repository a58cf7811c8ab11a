"""How a Triton kernel's body walks its rows (``RowPlan``, a part of ``triton.TritonKernel``).

``_plan`` sorts a group's members into row reductions, stores, reductions over all rows ('outer',
'scalar') and folded column partials ('colpart'). Persistent rows are straight-line code
(``_straight``); looped rows get one loop over ``rindex`` per dependency stage (``_looped``), where
a softmax's max and sum of exponentials share one online pass and loads get L2 eviction policies
(``_evictions``); outer reductions and column partials accumulate across row blocks (``_outer``,
``_colparts``).
"""
from __future__ import annotations

import torch

from kiln.codegen.indexing import RINDEX, XINDEX, simplify
from kiln.codegen.loops import Expr, Reduction, ops
from kiln.codegen.schedule import body, current
from kiln.codegen.triton_ops import TL_DTYPE, combine, neutral, reduce_code, template

EVICT = "\x00"          # brackets a row loop's load pointer until ``_evictions`` writes its policy
EVICT_POLICIES = True
EVICT_SINGLE_PASS = False   # also stream (evict_first) buffers a kernel reads in one pass only
ONLINE_SOFTMAX = True   # looped rows: a softmax's max and sum in one pass (``RowPlan._online_pairs``)
LEVELS = {"c": 0, "x": 1, "xr": 2, "s": 3}   # constant, per row, per element, after all rows


class Scope:
    """Lines of code at one loop depth, and the values computed there (``find`` looks outwards)."""

    def __init__(self, parent=None):
        self.parent, self.lines, self.cache = parent, [], {}

    def find(self, key):
        s = self
        while s is not None:
            if key in s.cache:
                return s.cache[key]
            s = s.parent
        return None


def red_ref(buf):
    """The in-register result of reduction buffer ``buf``."""
    kind = buf.compute.kind
    return Expr("red", (buf.name,), torch.int64 if kind in ("argmax", "argmin") else buf.compute.acc_dtype)


class RowPlan:
    """The body-planning half of ``triton.TritonKernel`` (it provides ``emit``, ``resolve``,
    ``level``, ``pexpr`` and the kernel's state)."""

    def _plan(self):
        """(reductions, stores, later): resolved row reductions and stored values in topological
        order, and the outer reductions and scalar stores that follow the loop over rows."""
        reductions, stores, later, colparts = [], [], [], []
        for buf in self.g.nodes:
            role = self.roles.get(buf.name, "row")
            e = self.resolve(body(buf, self.dims, role))
            is_red = isinstance(buf.compute, Reduction)
            value = red_ref(buf) if is_red else e
            if role == "colpart":
                colparts.append((buf, e))
            elif role == "row":
                if is_red:
                    reductions.append((buf, e))
                if buf in self.g.stored:
                    stores.append((buf, value))
            else:
                later.append((buf, e if is_red else None, value if buf in self.g.stored else None))
        self.out_args = {b.name: f"out_ptr{i}" for i, b in enumerate(self.g.stored)}
        return reductions, stores, later, colparts

    def _outer(self, plan):
        """Accumulate outer reductions across rows, then write the scalar results."""
        for buf, e, value in plan[2]:
            if e is not None:
                kind, dt = buf.compute.kind, buf.compute.acc_dtype
                acc = f"_outer_{buf.name}"
                self._accumulate(buf, e, acc, "[XBLOCK, 1]", "xmask")
                var = self.tmp("red")
                if self.last_program:
                    self.partials.append((var, kind, dt, acc, f"part_ptr{len(self.partials)}"))
                else:
                    self.post.lines.append(f"{var} = {reduce_code(kind, acc, self.interpret, axis=0)}")
                self.red_vars[buf.name] = var
            if value is not None:
                value = ops.cast(value, buf.dtype)
                v = self._tensor(self.emit(value, self.post), value)
                self.post.lines.append(f"tl.store({self.out_args[buf.name]} + tl.full([1, 1], 0, tl.int32), "
                                       f"tl.broadcast_to({v}, [1, 1]))")

    def _accumulate(self, buf, e, acc, shape, mask):
        """Declare accumulator ``acc`` of ``shape`` before the rows (``pre``) and fold reduction
        ``buf``'s element ``e`` into it at each row block (``top``) where ``mask`` holds."""
        kind, dt = buf.compute.kind, buf.compute.acc_dtype
        self.pre.append(f"{acc} = tl.full({shape}, {neutral(kind, dt)}, {TL_DTYPE[dt]})")
        v = self._reduce_value(buf, e, self.top)
        self.top.lines.append(f"{acc} = tl.where({mask}, {combine(kind, acc, v)}, {acc})")
        if kind == "prod":
            self.helpers.add("_kiln_prod")

    def _colparts(self, colparts):
        """Folded column partials: each program accumulates its chunk's rows column by column in an
        [XBLOCK, RBLOCK] tile (one step per block of rows), then reduces the tile's rows and stores
        the chunk's partial result at (program, column)."""
        for buf, e in colparts:
            kind, dt = buf.compute.kind, buf.compute.acc_dtype
            acc = f"_col{len(self.pre)}"
            self._accumulate(buf, e, acc, "[XBLOCK, RBLOCK]", "xmask & rmask")
            var = self.tmp("red")
            self.post.lines.append(f"{var} = {reduce_code(kind, acc, self.interpret, axis=0)}")
            if buf in self.g.stored:
                idx = self.pexpr(simplify(current(buf, self.dims, "colpart"), self.ranges))
                v = var if buf.dtype == dt else f"{var}.to({TL_DTYPE[buf.dtype]})"
                self.post.lines.append(f"tl.store({self.out_args[buf.name]} + ({idx}), {v}, rmask)")

    def _reduce_final(self, buf, acc, scope, index=None):
        """Reduce the [XBLOCK, RBLOCK] tile ``acc`` to the row result (``index``: the rindex of
        each lane's value, for argmax/argmin)."""
        kind = buf.compute.kind
        var = self.tmp("red")
        if kind in ("argmax", "argmin"):
            best = self.tmp()
            scope.lines.append(f"{best} = {reduce_code(kind[3:], acc, self.interpret)}")
            big = "9223372036854775807"
            scope.lines.append(f"{var} = {reduce_code('min', f'tl.where({acc} == {best}, {index}, {big})', self.interpret)}")
        else:
            if kind == "prod":
                self.helpers.add("_kiln_prod")
            scope.lines.append(f"{var} = {reduce_code(kind, acc, self.interpret)}")
        self.red_vars[buf.name] = var

    def _reduce_value(self, buf, e, scope):
        v = self._tensor(self.emit(e, scope), e)
        dt = buf.compute.acc_dtype
        if e.dtype != dt:
            v = f"{v}.to({TL_DTYPE[dt]})"
        return v

    def _straight(self, plan):
        """Pointwise kernels and persistent reductions: one scope, no loops."""
        reductions, stores = plan[:2]
        scope = self.top
        red_of = {b.name: (b, e) for b, e in reductions}
        order = [(b, red_of.get(b.name)) for b in self.g.nodes]
        store_of = dict((b.name, v) for b, v in stores)
        for buf, red in order:
            if red is not None:
                kind, dt = buf.compute.kind, buf.compute.acc_dtype
                v = self._reduce_value(buf, red[1], scope)
                n = neutral(kind, dt)
                masked = self.tmp()
                scope.lines.append(f"{masked} = tl.where(xmask & rmask, {v}, {n})")
                self._reduce_final(buf, masked, scope, "rindex.to(tl.int64)")
            if buf.name in store_of:
                self._store(buf, store_of[buf.name], scope)

    def _online_pairs(self, reductions) -> dict:
        """{sum buffer: max buffer} for sums of ``exp(v - max(v))`` over the rows whose max this
        kernel reduces too (softmax, log-softmax, cross-entropy): looped, each pair runs as one
        online pass that rescales the running sum whenever the running max grows, instead of a pass
        for the max and another for the sum (one read of each row fewer)."""
        by_name = {b.name: (b, e) for b, e in reductions}
        pairs, taken = {}, set()
        for b, e in reductions:
            c = b.compute
            if c.kind != "sum" or e.op != "exp" or e.args[0].op != "sub" or not c.acc_dtype.is_floating_point:
                continue
            v, m = e.args[0].args
            if m.op != "red" or m.args[0] not in by_name or m.args[0] in taken or self.reds(e) != {m.args[0]}:
                continue
            a, ea = by_name[m.args[0]]
            if a.compute.kind == "max" and ea is v and a.compute.acc_dtype == c.acc_dtype == v.dtype == m.dtype:
                pairs[b.name] = a
                taken.add(a.name)
        return pairs

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

    def _online_final(self, buf, acc_max, acc_sum, max_var, dt):
        """The row's sum from the lanes' partial sums, each rescaled to the row's max. A row of
        -inf gives nan, as ``sum(exp(v - max))`` does."""
        exp = template("exp", dt, self.interpret, 1)
        safe, var = self.tmp(), self.tmp("red")
        self.top.lines.append(f"{safe} = tl.where({max_var} == float('-inf'), 0.0, {max_var})")
        scaled = f"{acc_sum} * {exp.format(f'({acc_max} - {safe})')}"
        self.top.lines.append(f"{var} = {reduce_code('sum', scaled, self.interpret)}")
        self.top.lines.append(f"{var} = tl.where({max_var} == float('-inf'), float('nan'), {var})")
        self.red_vars[buf.name] = var

    def _looped(self, plan):
        reductions, stores = plan[:2]
        online = self._online_pairs(reductions) if ONLINE_SOFTMAX else {}
        partner = {a.name: b for b, a in ((self.buffers[n], a) for n, a in online.items())}
        stage = {}
        for buf, e in reductions:
            if buf.name in online:
                stage[buf.name] = stage[online[buf.name].name]
            else:
                stage[buf.name] = 1 + max([stage[r] for r in self.reds(e)], default=-1)
        nstages = 1 + max(stage.values())
        xr_stores, x_stores = {}, []
        for buf, v in stores:
            if self.level(v) == "xr":
                s = 1 + max([stage[r] for r in self.reds(v)], default=-1)
                xr_stores.setdefault(s, []).append((buf, v))
            else:
                x_stores.append((buf, v))
        for s in range(max([nstages] + [k + 1 for k in xr_stores])):
            loop = Scope(self.top)
            accs = []
            for buf, e in reductions:
                if stage[buf.name] != s or buf.name in online:   # a paired sum runs with its max
                    continue
                kind, dt = buf.compute.kind, buf.compute.acc_dtype
                acc = f"_acc{self.count}"   # never a buffer name: equal kernels must have equal text
                self.count += 1
                n = neutral(kind, dt)
                self.top.lines.append(f"{acc} = tl.full([XBLOCK, RBLOCK], {n}, {TL_DTYPE[dt]})")
                v = self._reduce_value(buf, e, loop)
                m = "xmask & rmask"
                if kind in ("argmax", "argmin"):
                    # per lane: the best value so far and the first rindex reaching it
                    self.top.lines.append(f"{acc}_i = tl.full([XBLOCK, RBLOCK], 0, tl.int64)")
                    better = self.tmp()
                    cmp = ">" if kind == "argmax" else "<"
                    loop.lines.append(f"{better} = ({m}) & ({v} {cmp} {acc})")
                    loop.lines.append(f"{acc}_i = tl.where({better}, rindex.to(tl.int64), {acc}_i)")
                    loop.lines.append(f"{acc} = tl.where({better}, {v}, {acc})")
                    accs.append((buf, (acc, f"{acc}_i")))
                    continue
                if buf.name in partner:   # the max of an online pair: its sum updates beside it
                    acc_sum = f"_acc{self.count}"
                    self.count += 1
                    self.top.lines.append(f"{acc_sum} = tl.full([XBLOCK, RBLOCK], 0, {TL_DTYPE[dt]})")
                    self._online_step(loop, m, v, acc, acc_sum, dt)
                    accs.append((buf, acc))
                    accs.append((partner[buf.name], ("online", acc, acc_sum, buf.name, dt)))
                    continue
                loop.lines.append(f"{acc} = tl.where({m}, {combine(kind, acc, v)}, {acc})")
                accs.append((buf, acc))
            for buf, v in xr_stores.get(s, []):
                self._store(buf, v, loop)
            self.top.lines.append(("loop", loop))
            for buf, acc in accs:
                if isinstance(acc, tuple) and acc[0] == "online":
                    _, acc_max, acc_sum, max_name, dt = acc
                    self._online_final(buf, acc_max, acc_sum, self.red_vars[max_name], dt)
                elif isinstance(acc, tuple):
                    self._reduce_final(buf, acc[0], self.top, acc[1])
                else:
                    self._reduce_final(buf, acc, self.top)
        for buf, v in x_stores:
            self._store(buf, v, self.top)

    def _evictions(self):
        """L2 eviction policies of the row loops' loads: a buffer that a later loop reads again is
        loaded ``evict_last`` (its rows stay in L2 for that pass), and its last read ``evict_first``
        (streamed through without pushing the others out). Without them, a softmax backward's second
        pass over 8192-element fp32 rows missed L2 (an H200 profile: 0.27 ms against 0.18 for
        inductor's). A buffer read in one pass only keeps the default policy: the next kernel may
        read it from L2 (``EVICT_SINGLE_PASS`` marks those evict_first too)."""
        import re
        loops = [ln[1] for ln in self.top.lines if isinstance(ln, tuple)]
        pattern = re.compile(f"{EVICT}(\\w+){EVICT}")
        loaded = [{m for ln in lp.lines for m in pattern.findall(ln)} for lp in loops]
        for i, lp in enumerate(loops):
            later, earlier = set().union(*loaded[i + 1:]), set().union(*loaded[:i])

            def policy(m, later=later, earlier=earlier):
                if not EVICT_POLICIES:
                    return ""
                if m.group(1) in later:
                    return ", eviction_policy='evict_last'"
                if m.group(1) in earlier or EVICT_SINGLE_PASS:
                    return ", eviction_policy='evict_first'"
                return ""
            lp.lines = [pattern.sub(policy, ln) for ln in lp.lines]

    def _store(self, buf, value, scope):
        value = ops.cast(value, buf.dtype)
        lv = self.level(value)
        v = self.emit(value, scope)
        idx = simplify(current(buf, self.dims, self.roles.get(buf.name, "row")), self.ranges)
        syms = idx.free_symbols
        ilv = "xr" if RINDEX in syms and self.red else ("x" if syms & {XINDEX, RINDEX} else "c")
        slv = max(ilv, "x", key=LEVELS.get)
        shape = "[XBLOCK]" if not self.red else ("[XBLOCK, 1]" if slv == "x" else "[XBLOCK, RBLOCK]")
        icode = self.pexpr(idx)
        if ilv == "c":
            icode = f"{icode} + tl.full({shape}, 0, tl.int32)"
        if LEVELS[lv] < LEVELS[slv]:
            v = f"tl.broadcast_to({self._tensor(v, value)}, {shape})"
        target = scope if slv == "xr" else self.top
        target.lines.append(f"tl.store({self.out_args[buf.name]} + ({icode}), {v}, {self._mask(slv, None)})")
