"""Triton emitter: one ``@triton.jit`` kernel (plus a Python launcher) per fused group.

Pointwise groups use 1-D tiles over ``xindex``. Reduction groups use 2-D ``[XBLOCK, RBLOCK]``
tiles: *persistent* (the whole row in registers, straight-line code) when the row is static and
short, else *looped* over ``rindex`` with one loop per dependency stage (a layer norm needs the
mean before the variance before the output). Values that do not depend on ``rindex`` are hoisted
out of the loops; identical expressions are computed once per scope (the IR is hash-consed).
"""
from __future__ import annotations

import sympy
import torch

from kiln.codegen import modsource
from kiln.codegen.indexing import RINDEX, XINDEX, FloorDiv, ModIdx, prod, simplify
from kiln.codegen.loops import Expr, Reduction, Unsupported, ops, upcast
from kiln.codegen.fold import XPID, colpart_shape
from kiln.codegen.schedule import body, current
from kiln.codegen.triton_ops import HELPERS, TL_DTYPE, combine, neutral, reduce_code, template

PERSISTENT_MAX = 4096   # static rows up to this many elements stay in registers (an H200 profile of the
                        # 8192x4096 layer norm backward: 0.111 ms looped at 2048, 0.090 persistent)
OUTER_MAX = 1 << 18     # a row kernel with a reduction over all its rows runs as one program up to this
                        # many elements; above, each program reduces its rows and the last one to finish
                        # combines their results (``last_program``)
EVICT = "\x00"          # brackets a row loop's load pointer until ``_evictions`` writes its policy
EVICT_POLICIES = True
EVICT_SINGLE_PASS = False   # also stream (evict_first) buffers a kernel reads in one pass only
ONLINE_SOFTMAX = True   # looped rows: a softmax's max and sum in one pass (``TritonKernel._online_pairs``)
OUTER_PERSISTENT_MAX = 64   # ... and columns (reductions over a non-innermost dim) up to this many
LEVELS = {"c": 0, "x": 1, "xr": 2, "s": 3}   # constant, per row, per element, after all rows


class Source:
    """A generated kernel module: ``text``, the buffer names it reads (``inputs``, call order) and
    writes (``outputs``, return order), and ``scalars``: size symbols passed as extra call args."""

    def __init__(self, text, inputs, outputs, scalars, kind):
        self.text, self.inputs, self.outputs, self.scalars, self.kind = text, inputs, outputs, scalars, kind


class Scope:
    def __init__(self, parent=None):
        self.parent, self.lines, self.cache = parent, [], {}

    def find(self, key):
        s = self
        while s is not None:
            if key in s.cache:
                return s.cache[key]
            s = s.parent
        return None


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


class TritonKernel:
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
            idx = e.args[1] if e.op == "load" else e.args[0]
            binds = [(s, self.resolve(v)) for s, v in e.args[2]]
            if not all(v is old for (_, v), (_, old) in zip(binds, e.args[2])):
                from kiln.codegen.loops import indirect_symbol
                idx = idx.xreplace({s: indirect_symbol(v) for s, v in binds})
            idx = simplify(idx, self.ranges)
            if idx == (e.args[1] if e.op == "load" else e.args[0]):
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

    def _assemble(self, name):
        return modsource.assemble(self, name)


def red_ref(buf):
    """The in-register result of reduction buffer ``buf``."""
    kind = buf.compute.kind
    return Expr("red", (buf.name,), torch.int64 if kind in ("argmax", "argmin") else buf.compute.acc_dtype)


# kiln.bench.offline sets this to read, on a CPU-only machine, the kernels a GPU would get
EMIT_FOR_GPU = False


def emit(group, buffers, device, name="kernel", autotune=False) -> Source:
    """Generate the Triton module for one group (see ``modsource.assemble`` for the launcher)."""
    interpret = device.type != "cuda" and not EMIT_FOR_GPU
    if group.kind == "scatter":
        from kiln.codegen.triton_scatter import emit_scatter
        return emit_scatter(group, buffers, interpret, name)
    return TritonKernel(group, buffers, interpret, autotune and not interpret).generate(name)
