"""Kernel plans: what one scheduled kernel computes, as plain data that an emitter reads once.

A ``KernelPlan`` (``planner.plan_group``) settles what every target shares: each member's resolved
expression (reads of the kernel's own buffers become register values, indices are simplified, so one
address is one Expr), how the kernel walks its rows (``persistent``, or one loop per dependency stage:
``passes``), its ``Programs``, 64-bit indexing, and the facts emitters read. ``describe`` prints it
(KILN_DEBUG=4, KILN_DUMP).
"""
import enum
from dataclasses import dataclass, field
from typing import Optional

import sympy
import torch

from kiln.codegen.ir.indexing import RINDEX, XINDEX
from kiln.codegen.ir.loops import Buffer, Expr
from kiln.codegen.schedule.domain import Role, domain_ranges


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
    """One computed buffer of a kernel: ``value`` is the element it reduces (``reduce``: the kind) or
    computes; ``index`` is where it is stored (None: in registers, or an outer reduction's one element)."""
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
    """One loop over a row's elements (looped kernels): the reductions accumulated in it, ``online``
    (max, sum) pairs whose sum of ``exp(v - max)`` is rescaled as the max grows, the element-level stores
    written in it, and the buffers it loads per element (for an emitter's cache policy)."""
    reduce: tuple
    online: tuple
    stores: tuple
    reads: frozenset


@dataclass(frozen=True, eq=False)
class ScatterWrite:
    """A scatter's write: ``value`` set or atomically added (``mode``) at flat position ``target`` (an
    ``index`` Expr with its indirect bindings) of ``buffer``."""
    buffer: Buffer
    value: Expr
    target: Expr
    mode: str


@dataclass(frozen=True, eq=False)
class KernelPlan:
    """One kernel, as an emitter needs it; ``buffers``: every buffer its expressions and stores name."""
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
    reusable: tuple               # per stored buffer: the inputs it may be written into (``_reusable``)
    levels: "Levels" = field(repr=False)
    scatter: Optional[ScatterWrite] = None
    chained: bool = False         # a tail: runs in its head's last program, reading the head's stores
    tail: Optional["KernelPlan"] = None

    @property
    def inner(self) -> bool:
        """Whether a tile runs along rows (the last dim reduced)."""
        return bool(self.dims) and self.dims[-1][1]

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
                lv = max([lv] + [self(v) for _, v in e.args[2]])
        elif e.op == "red":
            lv = Level.AFTER if e.args[0] in self.outer else Level.ROW
        else:
            lv = max((self(c) for c in e.children()), default=Level.CONST)
        if not self.reduction and lv is Level.ELEMENT:
            lv = Level.ROW
        self._memo[e] = lv
        return lv


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
    for b, names in zip(plan.stored, plan.reusable):
        if names:
            lines.append(f"  {b.name} may overwrite: {', '.join(sorted(names))}")
    if plan.tail is not None:
        lines.append("  " + describe(plan.tail, "then, in the last program").replace("\n", "\n  "))
    return "\n".join(lines)


def _short(e, limit: int = 160) -> str:
    text = repr(e)
    return text if len(text) <= limit else text[:limit - 3] + "..."
