"""Triton emitter: one ``@triton.jit`` kernel (plus a Python launcher) per fused group.

Pointwise groups use 1-D tiles over ``xindex``. Reduction groups use 2-D ``[XBLOCK, RBLOCK]``
tiles: *persistent* (the whole row in registers, straight-line code) when the row is static and
short, else *looped* over ``rindex`` with one loop per dependency stage (a layer norm needs the
mean before the variance before the output). Values that do not depend on ``rindex`` are hoisted
out of the loops; identical expressions are computed once per scope (the IR is hash-consed).
This module resolves and writes expressions; ``triton_rows`` plans the body around them.
"""
from __future__ import annotations

import sympy
import torch

from kiln.codegen import modsource
from kiln.codegen.indexing import RINDEX, XINDEX, FloorDiv, ModIdx, prod, simplify
from kiln.codegen.loops import Expr, Reduction, Unsupported, ops, upcast
from kiln.codegen.fold import XPID, colpart_shape
from kiln.codegen.schedule import body
from kiln.codegen.triton_ops import HELPERS, TL_DTYPE, template
from kiln.codegen.triton_rows import EVICT, LEVELS, RowPlan, Scope, red_ref

PERSISTENT_MAX = 4096   # static rows up to this many elements stay in registers (an H200 profile of the
                        # 8192x4096 layer norm backward: 0.111 ms looped at 2048, 0.090 persistent)
OUTER_MAX = 1 << 18     # a row kernel with a reduction over all its rows runs as one program up to this
                        # many elements; above, each program reduces its rows and the last one to finish
                        # combines their results (``last_program``)
OUTER_PERSISTENT_MAX = 64   # ... and columns (reductions over a non-innermost dim) up to this many


class Source:
    """A generated kernel module: ``text``, the buffer names it reads (``inputs``, call order) and
    writes (``outputs``, return order), and ``scalars``: size symbols passed as extra call args."""

    def __init__(self, text, inputs, outputs, scalars, kind):
        self.text, self.inputs, self.outputs, self.scalars, self.kind = text, inputs, outputs, scalars, kind


_summary = None   # (buffer ids, the buffers, summary) of the last call, replaced as one tuple


def _numel_summary(buffers) -> tuple:
    """(every buffer's numel is static, the largest static numel) over ``buffers``; every kernel of a
    graph asks about the same buffers, so the last answer is kept (with the buffers, so the ids stay
    theirs)."""
    global _summary
    values = list(buffers.values())
    ids = tuple(map(id, values))
    last = _summary
    if last is not None and last[0] == ids:
        return last[2]
    numels = [b.numel for b in values]
    static = all(n.is_Integer for n in numels)
    summary = (static, max([int(n) for n in numels], default=0) if static else 0)
    _summary = (ids, values, summary)
    return summary


def forget_buffers() -> None:
    """Drop the buffers ``_numel_summary`` keeps (after a graph's kernels are emitted)."""
    global _summary
    _summary = None


class TritonKernel(RowPlan):
    """Emit one group. ``interpret``: write for Triton's CPU interpreter (no libdevice)."""

    def __init__(self, group, buffers, interpret: bool, autotune: bool = False):
        self.g, self.buffers, self.interpret, self.autotune = group, buffers, interpret, autotune
        self.red = group.kind == "reduction"
        self.dims = group.dims
        self.xnumel, self.rnumel = prod(group.xs), prod(group.rs)
        self.ranges = group.ranges
        self.names = {b.name for b in group.nodes}
        self.roles = dict(group.roles)
        self.outer = any(r in ("outer", "scalar") for r in self.roles.values())
        # folded column partials: one program per chunk of rows (``fold.fold_split``)
        fold = [colpart_shape(b) for b in group.nodes if self.roles.get(b.name) == "colpart"]
        self.programs, self.chunk = (int(fold[0][0]), int(fold[0][1])) if fold else (None, None)
        total = self.xnumel * self.rnumel
        # many rows: every program reduces its own rows, the last to finish combines the partials
        self.last_program = self.outer and not (total.is_Integer and int(total) <= OUTER_MAX)
        self.partials = []   # (result var, kind, acc dtype, accumulator, scratch arg) per outer reduction
        self.single_program = False   # one program walks every row (a chained tail, codegen/chain.py)
        self.load_suffix = ""         # extra tl.load arguments (a tail reads its head's stores past L1)
        self.extra_params, self.extra_args, self.tail_lines = [], [], []   # a head's chained tail
        self.post = None
        self.inputs, self.sizes, self.seeds, self.helpers = {}, {}, {}, set()
        self.libdevice = False
        self.count = 0
        self._level, self._resolved, self.red_vars = {}, {}, {}
        # a persistent tile holds whole rows: right when rows are contiguous (inner reductions);
        # a column reduction over long columns must loop so that a tile spans many columns,
        # else each program reads one column with strided, uncoalesced loads (an H100 profile of
        # GPT-2's bias gradients: 0.78 ms per layer with one 2048-row column per program)
        inner = bool(self.dims) and self.dims[-1][1]
        self.persistent = self.red and self.rnumel.is_Integer and (
            int(self.rnumel) <= (PERSISTENT_MAX if inner else OUTER_PERSISTENT_MAX))
        all_static, largest = _numel_summary(buffers)
        static = self.xnumel.is_Integer and self.rnumel.is_Integer and all_static
        self.i64 = not static or max(int(self.xnumel) * int(self.rnumel), largest) >= 2 ** 31

    # -- resolution: loads of in-kernel buffers become register values -----------------------
    def resolve(self, e: Expr) -> Expr:
        r = self._resolved.get(e)
        if r is not None:
            return r
        if e.op == "load" and e.args[0] in self.names:
            buf = self.buffers[e.args[0]]
            role = self.roles.get(buf.name, "row")
            if isinstance(buf.compute, Reduction):
                r = red_ref(buf)
            else:
                r = self.resolve(body(buf, self.dims, role))
            r = ops.cast(r, upcast(buf.dtype))
        elif e.op in ("load", "index"):
            # indices are simplified over this kernel's ranges here, not only when printed: an index
            # that folds to one without rindex is then a per-row value (hoisted out of the row loops,
            # see ``level``), and two spellings of one address become one Expr (one load)
            given = e.args[1] if e.op == "load" else e.args[0]
            binds = [(s, self.resolve(v)) for s, v in e.args[2]]
            idx = given
            if not all(v is old for (_, v), (_, old) in zip(binds, e.args[2])):
                from kiln.codegen.loops import indirect_symbol
                idx = idx.xreplace({s: indirect_symbol(v) for s, v in binds})
            idx = simplify(idx, self.ranges)
            if idx == given:
                r = e
            else:
                r = ops.load(self.buffers[e.args[0]], idx) if e.op == "load" else ops.index(idx, e.dtype)
        elif e.children():
            args = tuple(self.resolve(a) if isinstance(a, Expr) else a for a in e.args)
            r = Expr(e.op, args, e.dtype)
        else:
            r = e
        self._resolved[e] = r
        return r

    def level(self, e: Expr) -> str:
        lv = self._level.get(e)
        if lv is not None:
            return lv
        if e.op in ("load", "index", "rand"):
            index = e.args[0] if e.op == "index" else e.args[1]
            syms = index.free_symbols if isinstance(index, sympy.Basic) else set()
            lv = "xr" if RINDEX in syms else ("x" if XINDEX in syms else "c")
            if e.op != "rand":
                for _, v in e.args[2]:
                    lv = max(lv, self.level(v), key=LEVELS.get)
        elif e.op == "red":
            lv = "s" if self.roles.get(e.args[0]) == "outer" else "x"
        else:
            lv = "c"
            for c in e.children():
                lv = max(lv, self.level(c), key=LEVELS.get)
        if not self.red and lv == "xr":
            lv = "x"
        self._level[e] = lv
        return lv

    def reds(self, e: Expr):
        return {x.args[0] for x in e.walk() if x.op == "red"}

    # -- expression emission ------------------------------------------------------------
    def tmp(self, prefix="tmp"):
        self.count += 1
        return f"{prefix}{self.count}"

    def emit(self, e: Expr, scope: Scope, mask=None) -> str:
        """Source for ``e`` (a variable or literal); code goes into ``scope`` or, for values
        that do not vary along rindex, into the outermost scope."""
        lv = self.level(e)
        if mask is not None:
            lv = max(lv, mask[1], key=LEVELS.get)
        if lv == "s" or scope is self.post:
            target = self.post
        else:
            target = scope if lv == "xr" else self.top
        key = (e, mask and mask[0])
        hit = target.find(key)
        if hit is not None:
            return hit
        code = self._code(e, target, mask, lv)
        if e.op == "const" or (e.op == "red"):
            return code
        var = self.tmp()
        target.lines.append(f"{var} = {code}")
        target.cache[key] = var
        return var

    def _literal(self, e):
        v, dt = e.args[0], e.dtype
        if isinstance(v, float):
            lit = repr(v) if v == v and v not in (float("inf"), float("-inf")) else f"float('{v}')"
        else:
            lit = repr(bool(v)) if dt == torch.bool else repr(int(v))
        if dt in (torch.float32, torch.int32, torch.bool) or (dt == torch.int64 and abs(int(v)) < 2 ** 31):
            return lit
        return f"tl.full([1], {lit}, {TL_DTYPE[dt]})"

    def _tensor(self, code, e):
        """Make a literal usable where a tensor is required."""
        if e.op == "const" and not code.startswith("tl."):
            return f"tl.full([1], {code}, {TL_DTYPE[e.dtype]})"
        return code

    def _mask(self, lv, mask):
        base = "xmask" if lv != "xr" else "xmask & rmask"
        if lv == "c":
            base = None
        if mask is not None:
            return mask[0] if base is None else f"{base} & {mask[0]}"
        return base

    def _code(self, e, scope, mask, lv):
        op, a = e.op, e.args
        if op == "const":
            return self._literal(e)
        if op == "red":
            return self.red_vars[a[0]]
        if op == "load":
            ptr = self.arg_for(a[0])
            idx = self.index(a[1], a[2], scope, mask)
            m = self._mask(lv, mask)
            if m and lv in ("x", "xr") and self.level(e) == "c":
                # a scalar address under a block mask (a constant-index load inside a masked
                # region): Triton rejects a block mask on a scalar pointer, so make the address a block
                # (tl.full, not tl.zeros: a jit function of Triton's standard library, which an
                # interpreted kernel cannot call unless Triton itself was imported in interpreter mode)
                shape = "[XBLOCK]" if not self.red else ("[XBLOCK, RBLOCK]" if lv == "xr" else "[XBLOCK, 1]")
                idx = f"({idx}) + tl.full({shape}, 0, tl.int32)"
            sfx = self.load_suffix
            if lv == "xr" and self.red and not self.persistent and not sfx:
                sfx = f"{EVICT}{ptr}{EVICT}"   # a row loop's load: its policy is set by ``_evictions``
            return f"tl.load({ptr} + ({idx}), {m}, other=0{sfx})" if m else f"tl.load({ptr} + ({idx}){sfx})"
        if op == "index":
            idx = self.index(a[0], a[2], scope, mask)
            return f"({idx}) + tl.full([1], 0, {TL_DTYPE[e.dtype]})" if e.dtype != torch.bool else f"(({idx}) != 0)"
        if op == "rand":
            kind, offset, slot = a
            seed = self.seeds.setdefault(slot, f"seed{len(self.seeds)}")
            if self.interpret:
                fn = "_kiln_randn" if kind == "randn" else "_kiln_rand"
                self.helpers.update([fn, "_kiln_philox", "_kiln_uniform"])
            else:
                fn = "tl.randn" if kind == "randn" else "tl.rand"
            off = self.index(offset, (), scope, mask)
            if self.level(e) == "c":
                off = f"{off} + tl.full([1], 0, tl.int32)"
            return f"{fn}({seed}, ({off}).to(tl.uint32))"
        if op == "cast":
            x = self._tensor(self.emit(a[0], scope, mask), a[0])
            if e.dtype == torch.bool:
                return f"({x} != 0)"
            return f"{x}.to({TL_DTYPE[e.dtype]})"
        if op == "where":
            c, x, y = (self.emit(v, scope, mask) for v in a)
            return f"tl.where({c}, {x}, {y})"
        if op == "masked":
            cond = self.emit(a[0], scope, mask)
            clv = self.level(a[0])
            inner = (cond if mask is None else f"({mask[0]}) & ({cond})",
                     max(clv, mask[1] if mask else "c", key=LEVELS.get))
            val = self.emit(a[1], scope, inner)
            other = self.emit(a[2], scope, mask)
            return f"tl.where({cond}, {val}, {other})"
        args = [self.emit(v, scope, mask) for v in a]
        t = template(op, a[0].dtype, self.interpret, len(a))
        if t is None:
            raise Unsupported(f"triton: no template for {op} on {a[0].dtype}")
        if "libdevice." in t:
            self.libdevice = True
        self.helpers.update(h for h in HELPERS if h in t)
        if t.startswith(("tl.", "libdevice.", "_kiln")):
            args = [self._tensor(x, v) for x, v in zip(args, a)]
        elif all(v.op == "const" for v in a):
            args[0] = self._tensor(args[0], a[0])
        return t.format(*args, d=TL_DTYPE.get(e.dtype, ""))

    # -- indices --------------------------------------------------------------------------
    def arg_for(self, name):
        if name not in self.inputs:
            self.inputs[name] = f"in_ptr{len(self.inputs)}"
        return self.inputs[name]

    def index(self, expr, binds, scope, mask):
        sub = {s: self.emit(v, scope, mask) for s, v in binds}
        return self.pexpr(simplify(expr, self.ranges), sub)

    def size_arg(self, sym):
        if sym not in self.sizes:
            self.sizes[sym] = f"ks_{sym.name}"
        return self.sizes[sym]

    def pexpr(self, e, sub=None):
        """Print an index expression as Triton source."""
        sub = sub or {}
        p = lambda x: self.pexpr(x, sub)  # noqa: E731
        if e.is_Integer:
            return str(int(e))
        if e.is_Symbol:
            if e in (XINDEX, RINDEX, XPID):
                return e.name
            if e in sub:
                return sub[e]
            return self.size_arg(e)
        # a right operand of // or % that is a product needs parentheses: ``a // 32*s`` is (a // 32)*s
        q = lambda x: f"({p(x)})" if x.is_Mul or x.is_Pow else p(x)  # noqa: E731
        if isinstance(e, FloorDiv):
            return f"({p(e.args[0])} // {q(e.args[1])})"
        if isinstance(e, ModIdx):
            a, d, m = e.args
            return f"({p(a)} % {q(m)})" if d == 1 else f"(({p(a)} // {q(d)}) % {q(m)})"
        if e.is_Add:
            return "(" + " + ".join(p(t) for t in e.args) + ")"
        if e.is_Mul:
            return "*".join(p(t) for t in e.args)
        if e.is_Pow and e.exp.is_Integer and e.exp > 0:
            return "(" + "*".join([p(e.base)] * int(e.exp)) + ")"
        raise Unsupported(f"cannot print index {e}")

    # -- kernel body ----------------------------------------------------------------------
    def generate(self, name):
        self.prepare()
        return self._assemble(name)

    def prepare(self):
        """Plan and write the kernel body (``top``, ``post``); ``modsource.kernel_def`` renders it."""
        self.top = Scope()
        if self.outer or self.programs:
            self.post, self.pre = Scope(), []
        plan = self._plan()
        if self.red and not self.persistent:
            self._looped(plan)
        else:
            self._straight(plan)
        if self.outer:
            self._outer(plan)
        if self.programs:
            self._colparts(plan[3])
        self._evictions()
        return self

    def _assemble(self, name):
        return modsource.assemble(self, name)


# kiln.bench.offline sets this to read, on a CPU-only machine, the kernels a GPU would get
EMIT_FOR_GPU = False


def emit(group, buffers, device, name="kernel", autotune=False) -> Source:
    """Generate the Triton module for one group (see ``modsource.assemble`` for the launcher)."""
    interpret = device.type != "cuda" and not EMIT_FOR_GPU
    if group.kind == "scatter":
        from kiln.codegen.triton_scatter import emit_scatter
        return emit_scatter(group, buffers, interpret, name)
    return TritonKernel(group, buffers, interpret, autotune and not interpret).generate(name)
