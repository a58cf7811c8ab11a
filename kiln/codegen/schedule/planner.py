"""Planning: a fused ``Group`` -> its ``KernelPlan`` (``plan.py``): resolved expressions (``_Resolver``), how
the kernel walks its rows (persistent or looped, ``RowPass``es, online softmax pairs, ``Programs``) and the
facts emitters read. ``plan_scatter`` makes a scatter's two kernels.
"""
from dataclasses import replace

import sympy

from kiln.codegen.ir.indexing import RINDEX, XINDEX, equal, prod, simplify
from kiln.codegen.ir.loops import Buffer, Expr, Pointwise, Reduction, indirect_symbol, ops, upcast
from kiln.codegen.schedule.colpart import XPID, colpart_shape
from kiln.codegen.schedule.domain import Role, body, current, loads, place, squeeze
from kiln.codegen.schedule.fuse import Group
from kiln.codegen.schedule.plan import (Kind, KernelPlan, Level, Levels, Member, Programs, RowPass, ScatterPlan,
                                        ScatterWrite, red_ref, reds)
from kiln.options import Tuning


class _Resolver:
    """Resolution of a group's expressions (see the module docstring), memoized per kernel."""

    def __init__(self, group: Group, buffers: dict):
        self.group, self.buffers = group, buffers
        self.names = {b.name for b in group.nodes}
        self.ranges, self._memo = group.ranges, {}

    def __call__(self, e: Expr) -> Expr:
        r = self._memo.get(e)
        if r is not None:
            return r
        if e.op == "load" and e.args[0] in self.names:
            buf = self.buffers[e.args[0]]
            r = (red_ref(buf) if isinstance(buf.compute, Reduction)
                 else self(body(buf, self.group.dims, self.group.role(buf))))
            r = ops.cast(r, upcast(buf.dtype))
        elif e.op in ("load", "index"):
            # an index without rindex is hoisted out of the row loops; two spellings of an address: one load
            given = e.args[1] if e.op == "load" else e.args[0]
            binds = [(s, self(v)) for s, v in e.args[2]]
            idx = given
            if not all(v is old for (_, v), (_, old) in zip(binds, e.args[2])):
                idx = idx.xreplace({s: indirect_symbol(v) for s, v in binds})
            idx = simplify(idx, self.ranges)
            r = e if idx == given else ops.load(self.buffers[e.args[0]], idx) if e.op == "load" else \
                ops.index(idx, e.dtype)
        else:
            r = Expr(e.op, tuple(self(a) if isinstance(a, Expr) else a for a in e.args), e.dtype) if e.children() else e
        self._memo[e] = r
        return r


def numel_summary(buffers: dict) -> tuple:
    """(every buffer's numel is static, the largest one): a graph's kernels index in 32 bits by its largest tensor."""
    numels = [b.numel for b in buffers.values()]
    static = all(n.is_Integer for n in numels)
    return static, (max([int(n) for n in numels], default=0) if static else 0)


def plan_kernel(group: Group, buffers: dict, tuning: Tuning, summary: tuple) -> KernelPlan:
    """The plan of one fused group (``summary``: ``numel_summary`` of the graph's buffers)."""
    red = group.kind == "reduction"
    dims = group.dims
    xnumel, rnumel = prod(group.xs), prod(group.rs)
    levels = Levels({n for n, r in group.roles.items() if r is Role.OUTER}, red)
    resolve = _Resolver(group, buffers)
    ranges = group.ranges
    members = []
    for buf in group.nodes:
        role = group.role(buf)
        c = buf.compute
        stored = buf in group.stored
        index = simplify(current(buf, dims, role), ranges) if stored and role in (Role.ROW, Role.COLPART) else None
        is_red = isinstance(c, Reduction)
        members.append(Member(buf, role, resolve(body(buf, dims, role)), c.kind if is_red else None,
                              c.acc_dtype if is_red else None, stored, index))
    fold = [colpart_shape(m.buffer) for m in members if m.role is Role.COLPART]
    chunks = (int(fold[0][0]), int(fold[0][1])) if fold else None
    outer = any(m.role in (Role.OUTER, Role.SCALAR) for m in members)
    total = xnumel * rnumel
    last = outer and not (total.is_Integer and int(total) <= tuning.outer_max)
    # a column reduction over long columns loops so that a tile spans many columns, not one strided column
    # per program (an H100 profile of GPT-2's bias gradients: 0.78 ms per layer with one per program)
    inner = bool(dims) and dims[-1][1]
    persistent = red and rnumel.is_Integer and int(rnumel) <= (
        tuning.persistent_max if inner else tuning.outer_persistent_max)
    programs = (Programs.CHUNKS if chunks else Programs.LAST if last else Programs.ONE if outer
                else Programs.BLOCKS)
    passes, row_stores = row_passes(members, levels, tuning) if red and not persistent else ((), ())
    emitted = [m.value for m in members if m.reduce] + [m.result for m in members if m.stored]
    reads, symbols, random = _facts(emitted, ranges, [m.index for m in members if m.index is not None])
    static, largest = summary
    fits = xnumel.is_Integer and rnumel.is_Integer and static
    wide = not fits or max(int(xnumel) * int(rnumel), largest) >= 2 ** 31
    plan = KernelPlan(Kind.REDUCTION if red else Kind.POINTWISE, group.nodes[0].device, dims, xnumel, rnumel,
                      tuple(members), tuple(group.stored), buffers, persistent, programs, chunks, passes, row_stores,
                      wide, frozenset(reads), frozenset(symbols), random, (), levels)
    return replace(plan, reusable=_reusable(plan, group))


def _online_pairs(reductions, tuning: Tuning) -> dict:
    """{sum name: max member} for sums of ``exp(v - max(v))`` whose max this kernel reduces too (softmax):
    looped, each pair takes one online pass (the sum rescaled as the max grows) instead of two."""
    if not tuning.online_softmax:
        return {}
    by_name = {m.name: m for m in reductions}
    pairs, taken = {}, set()
    for m in reductions:
        e = m.value
        if m.reduce != "sum" or e.op != "exp" or e.args[0].op != "sub" or not m.acc.is_floating_point:
            continue
        v, mx = e.args[0].args
        if mx.op != "red" or mx.args[0] not in by_name or mx.args[0] in taken or reds(e) != {mx.args[0]}:
            continue
        a = by_name[mx.args[0]]
        if a.reduce == "max" and a.value is v and a.acc == m.acc == v.dtype == mx.dtype:
            pairs[m.name] = a
            taken.add(a.name)
    return pairs


def row_passes(members, levels: Levels, tuning: Tuning) -> tuple:
    """(RowPass per loop, names of the row-level stores after the loops) of a looped kernel: a reduction or
    an element's store runs in the pass after the reductions it reads."""
    reductions = [m for m in members if m.role is Role.ROW and m.reduce]
    online = _online_pairs(reductions, tuning)
    stage = {}
    for m in reductions:
        stage[m.name] = stage[online[m.name].name] if m.name in online else \
            1 + max([stage[r] for r in reds(m.value)], default=-1)
    n = 1 + max(stage.values(), default=-1)
    element_stores, row_stores = {}, []
    for m in members:
        if m.role is not Role.ROW or not m.stored:
            continue
        if levels(m.result) is Level.ELEMENT:
            s = 1 + max([stage[r] for r in reds(m.result)], default=-1)
            element_stores.setdefault(s, []).append(m)
        else:
            row_stores.append(m.name)
    n = max([n] + [k + 1 for k in element_stores])
    pairs = {a.name: s for s, a in online.items()}   # max -> sum
    passes = []
    for s in range(n):
        reduce = [m for m in reductions if stage[m.name] == s and m.name not in online]
        stores = element_stores.get(s, [])
        roots = [m.value for m in reduce] + [ops.cast(m.result, m.buffer.dtype) for m in stores]
        passes.append(RowPass(tuple(m.name for m in reduce), tuple((m.name, pairs[m.name]) for m in reduce
                                                                  if m.name in pairs),
                              tuple(m.name for m in stores), frozenset(element_reads(roots, levels))))
    return tuple(passes), tuple(row_stores)


def element_reads(roots, levels: Levels) -> set:
    """Buffers loaded per element in computing ``roots`` (a masked load at its mask's level if deeper)."""
    out, seen = set(), set()
    stack = [(e, Level.CONST) for e in roots]
    while stack:
        e, m = stack.pop()
        if (e, m) in seen or e.op == "red":
            continue
        seen.add((e, m))
        if e.op == "load" and max(levels(e), m) is Level.ELEMENT:
            out.add(e.args[0])
        if e.op == "masked":
            cond, val, other = e.args
            stack += [(cond, m), (val, max(m, levels(cond))), (other, m)]
        else:
            stack += [(c, m) for c in e.children()]
    return out


def _facts(exprs, ranges, store_indices) -> tuple:
    """(buffers loaded, size symbols of the printed indices, draws random numbers) of ``exprs``."""
    reads, symbols, random = set(), set(), False
    special = {XINDEX, RINDEX, XPID}

    def add(index):
        for s in simplify(index, ranges).free_symbols:
            if s not in special and not s.name.startswith("ind"):
                symbols.add(s)
    seen = set()
    for root in exprs:
        for e in root.walk():
            if e in seen:
                continue
            seen.add(e)
            if e.op == "load":
                reads.add(e.args[0])
                add(e.args[1])
            elif e.op == "index":
                add(e.args[0])
            elif e.op == "rand":
                random = True
                add(e.args[1])
    for index in store_indices:
        add(index)
    return reads, symbols, random


def _reusable(plan: KernelPlan, group: Group) -> tuple:
    """Per stored buffer, the inputs it may be written into (the wrapper's ``into``: an input that dies at the
    call, or a mutated graph input): of its dtype and layout, read only at the element written (each program
    reads before it stores); from a pointwise kernel, or a one-output row reduction whose programs own whole
    rows and store in their last loop. With several outputs (pointwise), an input is loaded (once: Exprs are
    hash-consed, emitters cache them) by the output stored first among its readers or an earlier one, and
    never under a mask (a masked load is emitted apart), so that no store precedes a read of it."""
    if plan.outer or (plan.reduction and (len(plan.stored) != 1 or plan.programs is not Programs.BLOCKS or
                                          plan.row_stores or plan.chunks is not None or (
            not plan.persistent and plan.stored[0].name not in plan.passes[-1].stores))):
        return tuple(frozenset() for _ in plan.stored)
    indices: dict = {}
    for m in group.nodes:
        for name, index in loads(body(m, plan.dims, group.role(m))):
            indices.setdefault(name, []).append(index)
    order = [m for m in plan.members if m.stored]
    first, masked = {}, set()   # input -> the first output (in store order) loading it; those loaded under masks
    for i, m in enumerate(order):
        for e in m.result.walk():
            if e.op == "load":
                first.setdefault(e.args[0], i)
            elif e.op == "masked":
                masked.update(name for name, _ in loads(e.args[1]))

    def fits(name, ob, at):
        b, key = plan.buffers[name], (*ob.shape, *ob.stride)
        return b.dtype == ob.dtype and len(b.shape) == len(ob.shape) and all(sympy.sympify(x).is_Integer for x in key) \
            and all(sympy.sympify(x) == sympy.sympify(y) for x, y in zip((*b.shape, *b.stride), key)) \
            and (len(order) == 1 or (first.get(name, len(order)) <= at and name not in masked)) and indices.get(name) \
            and all(equal(ix, current(ob, plan.dims), plan.ranges) for ix in indices[name])
    at = {m.name: i for i, m in enumerate(order)}
    return tuple(frozenset(n for n in plan.reads if fits(n, ob, at[ob.name])) for ob in plan.stored)


def plan_scatter(group: Group, buffers: dict, tuning: Tuning, summary: tuple) -> ScatterPlan:
    """A scatter group's two kernels: a copy of the base into the output, then the write through the index."""
    buf = group.nodes[0]
    s = buf.compute
    # the copy reads the base as the scheduler saw it (a stored base is loaded, not recomputed)
    base = Pointwise(s.base.shape, s.base.dtype, s.base.device, s.base)
    copy_buf = Buffer(buf.name, buf.shape, buf.stride, buf.dtype, buf.device, "pointwise", buf.node, base)
    copy = plan_kernel(Group(tuple((x, False) for x in squeeze(buf.shape)), [copy_buf], "pointwise", [copy_buf]),
                       buffers, tuning, summary)
    write_group = Group(tuple((x, False) for x in squeeze(s.shape)), [buf], "pointwise", [buf])
    idx = place(s.shape, write_group.dims)
    value = ops.cast(_Resolver(write_group, buffers)(s.value(idx)), buf.dtype)
    target = ops.index(s.target(idx))   # carries the indirect bindings
    reads, symbols, random = _facts([value, target], write_group.ranges, [])
    static, largest = summary
    xnumel = prod(write_group.xs)
    wide = not (xnumel.is_Integer and static) or max(int(xnumel), largest) >= 2 ** 31
    write = KernelPlan(Kind.POINTWISE, buf.device, write_group.dims, xnumel, prod([]), (), (buf,), buffers, False,
                       Programs.BLOCKS, None, (), (), wide, frozenset(reads), frozenset(symbols), random, (),
                       Levels(set(), False), ScatterWrite(buf, value, target, s.mode))
    return ScatterPlan(copy, write)


def plan_group(group: Group, buffers: dict, tuning: Tuning, summary: tuple):
    """A ``KernelPlan`` (a ``ScatterPlan`` for a scatter) of one fused group."""
    return (plan_scatter if group.kind == "scatter" else plan_kernel)(group, buffers, tuning, summary)
