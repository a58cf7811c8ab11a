"""Kernel plans: what one scheduled kernel computes, as plain data that an emitter reads once.

``plan_kernel(group, ...)`` turns a fused ``Group`` into a ``KernelPlan``. Everything a target needs
to decide is settled here, the same for every emitter:

- each member's *resolved* expression: reads of buffers the kernel computes itself become register
  values (a reduction's result, ``red(buf)``, or the producer's expression inlined), and every index is
  simplified over the kernel's ranges, so one address is one Expr;
- how the kernel walks its rows: straight-line code when a row fits (``persistent``) or one loop per
  dependency stage (``passes``: a layer norm's mean before its variance before its output), the
  programs it launches (``Programs``), 64-bit indexing where sizes need it;
- facts emitters and the chaining step read: the buffers it loads, the size symbols its indices use,
  whether it draws random numbers, which input its one output may overwrite.

A plan prints as readable text (``describe``; KILN_DEBUG=4 and KILN_DUMP show it) between the fused
graph and the kernel text. Emitters (``codegen/to_triton``) take a plan and write text in one pass.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Optional

import sympy
import torch

from kiln.codegen.ir.indexing import RINDEX, XINDEX, equal, prod, simplify
from kiln.codegen.ir.loops import Buffer, Expr, Reduction, indirect_symbol, ops, upcast
from kiln.codegen.schedule.colpart import XPID, colpart_shape
from kiln.codegen.schedule.domain import Role, body, current, domain_ranges, loads, place, squeeze
from kiln.codegen.schedule.fuse import Group
from kiln.options import Tuning


class Kind(enum.Enum):
    POINTWISE = "pointwise"
    REDUCTION = "reduction"


class Level(enum.IntEnum):
    """Where a value varies, which decides the loop depth an emitter computes it at."""
    CONST = 0     # the same for the whole kernel
    ROW = 1       # varies with xindex only
    ELEMENT = 2   # varies with rindex (inside a row loop)
    AFTER = 3     # known only after all rows (from an outer reduction)


class Programs(enum.Enum):
    """How the kernel's rows are spread over programs."""
    BLOCKS = "blocks"   # one program per block of rows
    ONE = "one"         # one program walks every row (outer reductions that fit one, a chained tail)
    CHUNKS = "chunks"   # one program per chunk of rows (folded column partials)
    LAST = "last"       # one per block of rows; the last to finish combines the outer reductions' partials


@dataclass(frozen=True, eq=False)
class Member:
    """One computed buffer of a kernel: ``value`` is the element it reduces (a reduction, ``reduce`` the
    kind, ``acc`` the accumulator dtype) or computes; ``index`` is where it is stored (None: kept in
    registers, or an outer reduction's single element)."""
    buffer: Buffer
    role: Role
    value: Expr
    reduce: Optional[str] = None
    acc: Optional[torch.dtype] = None
    stored: bool = False
    index: Optional[sympy.Expr] = None

    @property
    def name(self) -> str:
        return self.buffer.name

    @property
    def result(self) -> Expr:
        """What the kernel has for this buffer at each point: a reduction's result or the value."""
        return red_ref(self.buffer) if self.reduce else self.value


@dataclass(frozen=True)
class RowPass:
    """One loop over a row's elements (looped kernels). ``reduce``: the reductions accumulated in it,
    in member order; ``online``: (max, sum) pairs whose sum of ``exp(v - max)`` is rescaled as the max
    grows, so both take this one pass; ``stores``: element-level stores written in it; ``reads``: the
    buffers it loads per element (an emitter's cache policy: read again by a later pass or not)."""
    reduce: tuple
    online: tuple
    stores: tuple
    reads: frozenset


@dataclass(frozen=True, eq=False)
class ScatterWrite:
    """The write-through-index part of a scatter: ``value`` (resolved, in the output's dtype) is written
    (``mode`` 'set') or added atomically ('add') at flat position ``target`` (an ``index`` Expr with its
    indirect bindings) of ``buffer``."""
    buffer: Buffer
    value: Expr
    target: Expr
    mode: str


@dataclass(frozen=True, eq=False)
class KernelPlan:
    """One kernel, as an emitter needs it (see the module docstring). ``buffers``: every buffer named
    by the kernel's expressions and stores."""
    kind: Kind
    device: torch.device
    dims: tuple
    xnumel: sympy.Expr
    rnumel: sympy.Expr
    members: tuple
    stored: tuple
    buffers: dict
    persistent: bool
    programs: Programs
    chunks: Optional[tuple]       # (programs, rows per program) of folded column partials
    passes: tuple                 # RowPass per loop of a looped kernel
    row_stores: tuple             # looped kernels: names of the row-level stores written after the loops
    wide_index: bool              # 64-bit indices
    reads: frozenset              # buffers it loads (none of them its own members)
    symbols: frozenset            # size symbols its indices use
    random: bool                  # draws random numbers
    reusable: frozenset           # inputs its one output may be written into (``_reusable``)
    levels: "Levels" = field(repr=False)
    scatter: Optional[ScatterWrite] = None
    chained: bool = False         # a tail: runs in its head's last program, reading the head's stores
    tail: Optional["KernelPlan"] = None

    @property
    def reduction(self) -> bool:
        return self.kind is Kind.REDUCTION

    @property
    def outer(self) -> bool:
        """Whether some member is known only after all rows (an outer reduction, a scalar)."""
        return any(m.role in (Role.OUTER, Role.SCALAR) for m in self.members)

    @property
    def ranges(self):
        return domain_ranges(self.dims)

    @property
    def looped(self) -> bool:
        return self.reduction and not self.persistent

    def member(self, name: str) -> Member:
        return next(m for m in self.members if m.name == name)

    def outputs(self) -> list:
        """The buffers its module returns: its stores, then its chained tail's."""
        return list(self.stored) + (list(self.tail.stored) if self.tail is not None else [])

    def describe(self, title: str = "kernel") -> str:
        return describe(self, title)


@dataclass(frozen=True, eq=False)
class ScatterPlan:
    """A scatter's module: ``copy`` writes the base into the output, then ``write`` scatters into it."""
    copy: KernelPlan
    write: KernelPlan

    def outputs(self) -> list:
        return [self.write.scatter.buffer]

    def describe(self, title: str = "scatter") -> str:
        return describe(self.copy, f"{title} (copy of the base)") + "\n" + describe(self.write, f"{title} (write)")


@dataclass(frozen=True)
class KernelSource:
    """What an emitter makes of a plan: a module's ``text`` (its kernel named by a placeholder), the
    buffers its ``call`` takes (``inputs``, in order) and returns (``outputs``), the size symbols passed
    as extra arguments (``scalars``), the kind of kernel, the inputs its output may be written into
    (``reuse``, positions), and whether it runs in Triton's interpreter."""
    text: str
    inputs: tuple
    outputs: tuple
    scalars: tuple
    kind: str
    reuse: tuple = ()
    interpret: bool = False


def red_ref(buf) -> Expr:
    """The in-register result of reduction buffer ``buf``."""
    kind = buf.compute.kind
    return Expr("red", (buf.name,), torch.int64 if kind in ("argmax", "argmin") else buf.compute.acc_dtype)


def reds(e: Expr) -> set:
    """Names of the reductions whose results ``e`` uses."""
    return {x.args[0] for x in e.walk() if x.op == "red"}


class Levels:
    """``levels(e)``: the ``Level`` of a resolved expression in one kernel (memoized)."""

    def __init__(self, outer: set, reduction: bool):
        self.outer, self.reduction, self._memo = outer, reduction, {}

    def __call__(self, e: Expr) -> Level:
        lv = self._memo.get(e)
        if lv is not None:
            return lv
        if e.op in ("load", "index", "rand"):
            index = e.args[0] if e.op == "index" else e.args[1]
            syms = index.free_symbols if isinstance(index, sympy.Basic) else set()
            lv = Level.ELEMENT if RINDEX in syms else (Level.ROW if XINDEX in syms else Level.CONST)
            if e.op != "rand":
                for _, v in e.args[2]:
                    lv = max(lv, self(v))
        elif e.op == "red":
            lv = Level.AFTER if e.args[0] in self.outer else Level.ROW
        else:
            lv = Level.CONST
            for c in e.children():
                lv = max(lv, self(c))
        if not self.reduction and lv is Level.ELEMENT:
            lv = Level.ROW
        self._memo[e] = lv
        return lv


class _Resolver:
    """Resolution of a group's expressions (see the module docstring), memoized per kernel."""

    def __init__(self, group: Group, buffers: dict):
        self.group, self.buffers = group, buffers
        self.names = {b.name for b in group.nodes}
        self.ranges = group.ranges
        self._memo = {}

    def __call__(self, e: Expr) -> Expr:
        r = self._memo.get(e)
        if r is not None:
            return r
        if e.op == "load" and e.args[0] in self.names:
            buf = self.buffers[e.args[0]]
            if isinstance(buf.compute, Reduction):
                r = red_ref(buf)
            else:
                r = self(body(buf, self.group.dims, self.group.role(buf)))
            r = ops.cast(r, upcast(buf.dtype))
        elif e.op in ("load", "index"):
            # an index that folds to one without rindex is then a per-row value (hoisted out of the row
            # loops), and two spellings of one address become one Expr (one load)
            given = e.args[1] if e.op == "load" else e.args[0]
            binds = [(s, self(v)) for s, v in e.args[2]]
            idx = given
            if not all(v is old for (_, v), (_, old) in zip(binds, e.args[2])):
                idx = idx.xreplace({s: indirect_symbol(v) for s, v in binds})
            idx = simplify(idx, self.ranges)
            if idx == given:
                r = e
            else:
                r = ops.load(self.buffers[e.args[0]], idx) if e.op == "load" else ops.index(idx, e.dtype)
        elif e.children():
            args = tuple(self(a) if isinstance(a, Expr) else a for a in e.args)
            r = Expr(e.op, args, e.dtype)
        else:
            r = e
        self._memo[e] = r
        return r


def numel_summary(buffers: dict) -> tuple:
    """(every buffer's numel is static, the largest static numel): whether a graph's kernels may index
    in 32 bits depends on the largest tensor of the graph."""
    numels = [b.numel for b in buffers.values()]
    static = all(n.is_Integer for n in numels)
    return static, (max([int(n) for n in numels], default=0) if static else 0)


def plan_kernel(group: Group, buffers: dict, tuning: Tuning, summary: tuple) -> KernelPlan:
    """The plan of one fused group (``summary``: ``numel_summary`` of the graph's buffers)."""
    red = group.kind == "reduction"
    dims = group.dims
    xnumel, rnumel = prod(group.xs), prod(group.rs)
    roles = dict(group.roles)
    outer_names = {n for n, r in roles.items() if r is Role.OUTER}
    levels = Levels(outer_names, red)
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
    # a persistent tile holds whole rows: right when rows are contiguous (inner reductions); a column
    # reduction over long columns must loop so that a tile spans many columns, else each program reads
    # one column with strided, uncoalesced loads (an H100 profile of GPT-2's bias gradients: 0.78 ms
    # per layer with one 2048-row column per program)
    inner = bool(dims) and dims[-1][1]
    persistent = red and rnumel.is_Integer and int(rnumel) <= (
        tuning.persistent_max if inner else tuning.outer_persistent_max)
    programs = (Programs.CHUNKS if chunks else Programs.LAST if last else Programs.ONE if outer
                else Programs.BLOCKS)
    passes, row_stores = ((), ())
    if red and not persistent:
        passes, row_stores = _passes(members, levels, tuning)
    emitted = [m.value for m in members if m.reduce] + [m.result for m in members if m.stored]
    reads, symbols, random = _facts(emitted, ranges, [m.index for m in members if m.index is not None])
    static, largest = summary
    fits = xnumel.is_Integer and rnumel.is_Integer and static
    wide = not fits or max(int(xnumel) * int(rnumel), largest) >= 2 ** 31
    plan = KernelPlan(Kind.REDUCTION if red else Kind.POINTWISE, group.nodes[0].device, dims, xnumel, rnumel,
                      tuple(members), tuple(group.stored), buffers, persistent, programs, chunks, passes, row_stores,
                      wide, frozenset(reads), frozenset(symbols), random, frozenset(), levels)
    return replace(plan, reusable=_reusable(plan, group))


def _online_pairs(reductions, tuning: Tuning) -> dict:
    """{sum name: max member} for sums of ``exp(v - max(v))`` over the rows whose max this kernel
    reduces too (softmax, log-softmax, cross-entropy): looped, each pair runs as one online pass that
    rescales the running sum whenever the running max grows, instead of a pass for the max and another
    for the sum (one read of each row fewer)."""
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


def _passes(members, levels: Levels, tuning: Tuning) -> tuple:
    """(RowPass per loop, names of the row-level stores after the loops) of a looped kernel: a reduction
    runs in the pass after those whose results it uses; a store of an element in the pass after the
    reductions it reads."""
    reductions = [m for m in members if m.role is Role.ROW and m.reduce]
    online = _online_pairs(reductions, tuning)
    stage = {}
    for m in reductions:
        if m.name in online:
            stage[m.name] = stage[online[m.name].name]
        else:
            stage[m.name] = 1 + max([stage[r] for r in reds(m.value)], default=-1)
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
    """Buffers loaded per element (``Level.ELEMENT``) in computing ``roots``: a load under a mask is
    made at the mask's level when that is deeper than its own (it runs where the mask is known)."""
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


def _reusable(plan: KernelPlan, group: Group) -> frozenset:
    """Inputs that the kernel's one output may be written into: a pointwise kernel with one stored
    output, an input of the output's dtype, shape and strides, read only at the element the kernel
    writes (so each program reads its elements before it stores them). The wrapper passes such an input
    as ``into`` where it dies at the call (``wrapper._Emitter._into``): its memory is reused instead of a
    new buffer of the same size living beside it."""
    if plan.reduction or plan.outer or len(plan.stored) != 1:
        return frozenset()
    ob = plan.stored[0]
    if not all(sympy.sympify(x).is_Integer for x in (*ob.shape, *ob.stride)):
        return frozenset()
    here = current(ob, plan.dims)
    indices: dict = {}
    for m in group.nodes:
        for name, index in loads(body(m, plan.dims, group.role(m))):
            indices.setdefault(name, []).append(index)
    out = set()
    for name in plan.reads:
        b = plan.buffers[name]
        same = b.dtype == ob.dtype and len(b.shape) == len(ob.shape) and all(
            sympy.sympify(x) == sympy.sympify(y) for x, y in zip((*b.shape, *b.stride), (*ob.shape, *ob.stride)))
        if same and indices.get(name) and all(equal(ix, here, plan.ranges) for ix in indices[name]):
            out.add(name)
    return frozenset(out)


def plan_scatter(group: Group, buffers: dict, tuning: Tuning, summary: tuple) -> ScatterPlan:
    """A scatter group's two kernels: a pointwise copy of the base into the output, then the write of
    each value at its computed target index."""
    buf = group.nodes[0]
    s = buf.compute
    copy_buf = Buffer(buf.name, buf.shape, buf.stride, buf.dtype, buf.device, "pointwise", buf.node, s.base)
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
                       Programs.BLOCKS, None, (), (), wide, frozenset(reads), frozenset(symbols), random, frozenset(),
                       Levels(set(), False), ScatterWrite(buf, value, target, s.mode))
    return ScatterPlan(copy, write)


def plan_group(group: Group, buffers: dict, tuning: Tuning, summary: tuple):
    """A ``KernelPlan`` (a ``ScatterPlan`` for a scatter) of one fused group."""
    if group.kind == "scatter":
        return plan_scatter(group, buffers, tuning, summary)
    return plan_kernel(group, buffers, tuning, summary)


# -- printing ------------------------------------------------------------------------------------------------
def describe(plan: KernelPlan, title: str = "kernel") -> str:
    """A readable account of ``plan``: domain, how rows are walked, each member's role and expression."""
    shape = " x ".join(f"{s}{'r' if r else ''}" for s, r in plan.dims) or "scalar"
    walk = ("pointwise" if not plan.reduction else "persistent rows" if plan.persistent
            else f"looped rows, {len(plan.passes)} pass(es)")
    head = (f"{title}: {plan.kind.value} over [{shape}] ({plan.xnumel} rows x {plan.rnumel}), {walk}, "
            f"programs {plan.programs.value}" + (f" {plan.chunks}" if plan.chunks else "")
            + (", 64-bit indices" if plan.wide_index else "") + (", chained tail" if plan.chained else ""))
    lines = [head, f"  reads: {', '.join(sorted(plan.reads)) or '-'}"]
    for m in plan.members:
        what = f"{m.reduce}[{str(m.acc).replace('torch.', '')}]" if m.reduce else "value"
        where = f" -> stored at {m.index}" if m.index is not None else (" -> stored" if m.stored else "")
        role = "" if m.role is Role.ROW else f" ({m.role.value})"
        lines.append(f"  {m.name}{role} = {what} {_short(m.value)}{where}")
    for i, p in enumerate(plan.passes):
        online = "".join(f", online {mx}+{sm}" for mx, sm in p.online)
        lines.append(f"  pass {i}: reduce {', '.join(p.reduce) or '-'}{online}; store {', '.join(p.stores) or '-'}; "
                     f"reads {', '.join(sorted(p.reads)) or '-'}")
    if plan.row_stores:
        lines.append(f"  after the passes: store {', '.join(plan.row_stores)}")
    if plan.scatter is not None:
        w = plan.scatter
        lines.append(f"  {w.buffer.name}[{_short(w.target)}] {'+=' if w.mode == 'add' else '='} {_short(w.value)}")
    if plan.reusable:
        lines.append(f"  output may overwrite: {', '.join(sorted(plan.reusable))}")
    if plan.tail is not None:
        lines.append("  " + describe(plan.tail, "then, in the last program").replace("\n", "\n  "))
    return "\n".join(lines)


def _short(e, limit: int = 160) -> str:
    text = repr(e)
    return text if len(text) <= limit else text[:limit - 3] + "..."


__all__ = ["Kind", "Level", "Programs", "Member", "RowPass", "ScatterWrite", "KernelPlan", "ScatterPlan",
           "KernelSource", "Levels", "plan_group", "plan_kernel", "plan_scatter", "numel_summary", "red_ref", "reds",
           "element_reads", "describe"]
