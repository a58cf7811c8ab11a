"""C++ emitter: the expressions of a kernel plan as C++ statements, each at the loop depth its ``Level``
says and computed once per scope (the IR is hash-consed); ``rows.py`` walks the plan around them.
"""
import sympy
import torch

from kiln.codegen.ir.indexing import RINDEX, XINDEX, Ranges, simplify
from kiln.codegen.ir.loops import Expr, Unsupported, ops
from kiln.codegen.ir.scope import Scope
from kiln.codegen.schedule.colpart import XPID
from kiln.codegen.schedule.plan import KernelPlan, Level
from kiln.codegen.text import writer
from kiln.codegen.to_cpp.ops import (DISCRETE, DISCRETE_REDUCE, MEMORY, VALUE, ZERO_ROW_BYTES, calls_vector_math,
                                     literal, scalar_math, template)
from kiln.options import Tuning

XO = sympy.Symbol("xo", integer=True, nonnegative=True)   # a pointwise kernel's outer position
XI = sympy.Symbol("xi", integer=True, nonnegative=True)   # ... and its inner (vectorized) position
R0 = sympy.Symbol("r0", integer=True, nonnegative=True)   # a split row's outer position (``splits.row_split``)
R1 = sympy.Symbol("r1", integer=True, nonnegative=True)   # ... and its inner (contiguous) position


def render(lines, indent: str, out: list) -> list:
    for line in lines:
        if isinstance(line, tuple):
            header, scope, trailer = line
            out += [indent + h for h in header]
            render(scope.lines, indent + "  ", out)
            out += [indent + t for t in trailer]
        else:
            out.append(indent + line)
    return out


def decides(plan: KernelPlan) -> bool:
    """Whether the result of a ``VECTOR_MATH`` function decides something discrete in ``plan``
    (``ops.DISCRETE``, a ``where``'s condition, a max or min reduction). Such a kernel calls glibc's scalar
    functions in every lane: libmvec's differ in the last bits, so ``eq(sigmoid(x), amax(sigmoid(x)))``
    computed in two loops was false at some maxima (fuzz seed 10, program 287)."""
    members = {m.name: m for m in plan.members}
    memo: dict = {}

    def math_in(e) -> bool:
        if e not in memo:
            memo[e] = False
            memo[e] = any((n.dtype.is_floating_point and calls_vector_math(n.op)) or (
                n.op == "red" and n.args[0] in members and math_in(members[n.args[0]].value))
                for n in e.walk())
        return memo[e]

    for m in plan.members:
        if m.reduce in DISCRETE_REDUCE and math_in(m.value):
            return True
        for n in m.value.walk():
            if n.op in ("where", "masked"):   # only the condition decides (the values are continuous)
                deciding = [n.args[0]]
            elif n.op in DISCRETE or (n.op == "cast" and not n.dtype.is_floating_point):
                deciding = n.children()
            else:
                continue
            if any(math_in(c) for c in deciding):
                return True
    return False


# loads as values (2-byte floats widened) and values as memory (rounded to nearest even), where not a cast
LOADS = {torch.bfloat16: "kiln_bf16_load({})", torch.float16: "((float){})", torch.bool: "({} != 0)"}
STORES = {torch.bfloat16: "kiln_bf16_store({})", torch.float16: "((_Float16)({}))"}


def load_code(ptr: str, idx: str, dtype) -> str:
    return LOADS.get(dtype, "{}").format(f"{ptr}[{idx}]")


def store_code(value: str, dtype) -> str:
    return STORES.get(dtype, f"(({MEMORY[dtype]})({{}}))").format(value)


class ExprWriter(writer.ExprWriter):
    """The expression half of ``rows.CppKernel``. ``checks``: Expr -> (its variable, size code, CheckInfo)."""
    LOOP_NAMES = {XINDEX: "x", RINDEX: "r", XPID: "xpid", XO: XO.name, XI: XI.name, R0: R0.name, R1: R1.name}
    DIV, WHAT = "/", "cpp index"

    def __init__(self, plan: KernelPlan, tuning: Tuning):
        super().__init__(plan, tuning)
        self.idx_t = "int64_t" if plan.wide_index else "int32_t"
        self.subst = {}
        # a reduction row's values kept for later loops over it: Expr -> (array, pass that writes it)
        self.row_cache, self.pass_no = {}, -1
        # glibc's scalar math functions in every lane (see ``decides``)
        self.scalar_math = not tuning.cpp_vector_math or decides(plan)
        # a split pointwise kernel: the scope of one outer position, before the vectorized inner loop, and
        # the variables computed there (values that do not depend on ``xi`` go there); the kernel's scope,
        # before its loops (values that depend on no index: an optimizer's bias corrections)
        self.xo_scope, self.xo_vars, self.xi_n, self._xi_free_memo = None, set(), None, {}
        self.const_scope, self.xi_tables = None, {}
        self.vary = ()   # index symbols besides ``xi`` that a value hoisted out of the inner loop must not read

    def use_split(self, outer, inner):
        """Write ``xindex`` as ``xo * inner + xi`` (or ``xi`` alone when there is one outer position)."""
        self.xi_n, one = inner, outer == 1
        self.subst = {XINDEX: XI if one else XO * inner + XI}
        self.ranges = Ranges({XI: inner} if one else {XO: outer, XI: inner})

    def _split_index(self, expr):
        """Index ``expr`` over the loop variables the kernel writes (``xo``/``xi``, ``r0``/``r1``), simplified."""
        e = simplify(expr, self.plan.ranges)
        return simplify(e.xreplace(self.subst), self.ranges) if self.subst else e

    def _xi_free(self, e: Expr, syms=(XI,)) -> bool:
        """Whether ``e`` is the same at every ``xi`` of an outer position (``syms``: every index in them; no
        indirect or random reads)."""
        hit = self._xi_free_memo.get((e, syms))
        if hit is None:
            if e.op in ("load", "index"):
                idx, binds = (e.args[1], e.args[2]) if e.op == "load" else (e.args[0], e.args[2])
                hit = not binds and not set(syms) & sympy.sympify(self._split_index(idx)).free_symbols
            else:
                hit = e.op not in ("rand", "red") and all(self._xi_free(c, syms) for c in e.children())
            self._xi_free_memo[e, syms] = hit
        return hit

    def _keep_bits(self, cond: str) -> str:
        """A 32-bit mask, all ones where ``cond`` (of the outer position) holds, for ``kiln_pick_f``."""
        key = ("keep", cond)
        hit = self.xo_scope.find(key)
        if hit is None:
            hit = self.tmp("keep")
            self.xo_scope.lines.append(f"const uint32_t {hit} = {cond} ? 0xFFFFFFFFu : 0u;")
            self.xo_scope.cache[key] = hit
        return hit

    def _row_pointer(self, buf: str, expr, cond: str):
        """For a load at ``base(xo) + s * xi`` (``s`` a positive constant) under ``cond`` (of the outer
        position): (a pointer, set per outer position, to the row read where ``cond`` holds and to zeros
        where not, ``s``), so the inner loop loads unconditionally; else None."""
        e = sympy.expand(self._split_index(expr))
        base, step = e.subs(XI, 0), e.coeff(XI, 1)
        dtype = self.plan.buffers[buf].dtype
        n = sympy.sympify(self.xi_n)
        if not (step.is_Integer and step > 0) or sympy.expand(e - base - step * XI) != 0 or not n.is_Integer \
                or int(step) * int(n) * dtype.itemsize > ZERO_ROW_BYTES or base.free_symbols & set(self.vary):
            return None
        name, mem = self.tmp("row"), MEMORY[dtype]
        self.xo_scope.lines.append(f"const {mem}* {name} = {cond} ? {self.arg_for(buf)} + ({self.pexpr(base)}) : "
                                   f"(const {mem}*)kiln_zero_bytes;")
        return name, int(step)

    def emit(self, e: Expr, scope: Scope, mask=None, row: Scope = None, post: Scope = None) -> str:
        """A variable or literal holding ``e``, its statement in ``scope``, ``row`` or ``post`` by level."""
        lv = self.level(e)
        if mask is not None:
            lv = max(lv, mask[1])
        after = lv is Level.AFTER or (post is not None and scope is post)
        target = post if after else (scope if lv is Level.ELEMENT or row is None else row)
        if target is None:
            raise Unsupported("cpp: a value known only after all rows is used inside them")
        if self.xo_scope is not None and target is scope and (mask is None or mask[0] in self.xo_vars) \
                and self._xi_free(e, (XI, *self.vary)):
            const = self.const_scope is not None and mask is None and self._xi_free(e, (XI, XO, *self.vary))
            target = self.const_scope if const else self.xo_scope
        key = (e, mask and mask[0])
        hit = target.find(key)
        if hit is not None:
            return hit
        if e.op == "red":
            return self.red_vars[e.args[0]]
        if e.op == "const":
            return literal(e.args[0], e.dtype)
        kept = self.row_cache.get(e) if mask is None and target is scope else None
        table = self._xi_table(e) if mask is None and target is scope else None   # (xi-free values: no table)
        if table is not None:
            code = f"{table}[{XI.name}]"
        elif kept is not None and self.pass_no > kept[1]:
            code = f"{kept[0]}[r]"   # computed by an earlier loop over this row
        else:
            code = self._code(e, target, mask, row if target is not post else None, post)
        var = self.tmp()
        target.lines.append(f"const {VALUE[e.dtype]} {var} = {code};")
        if target is self.xo_scope or target is self.const_scope:
            self.xo_vars.add(var)
        if kept is not None and self.pass_no == kept[1]:
            target.lines.append(f"{kept[0]}[r] = {var};")
        target.cache[key] = var
        return var

    def _xi_table(self, e: Expr):
        """The array holding ``e`` at each ``xi`` (filled once, before the loops) when ``e`` computes something
        from ``xi`` alone in a kernel of many outer positions (a channels-last batch norm's per-channel scale:
        one rsqrt per channel, not per element); else None."""
        if e in self.xi_tables:
            return self.xi_tables[e]
        n = sympy.sympify(self.xi_n)
        if self.xo_scope is None or self.const_scope is None or self.subst.get(XINDEX) == XI or not n.is_Integer \
                or int(n) > self.tuning.cpp_block or e.op in ("load", "index", "cast") \
                or not e.dtype.is_floating_point or not any(x.op == "load" for x in e.walk()) \
                or all(x.op in ("load", "index", "cast", "const") for x in e.children()) \
                or not self._xi_free(e, (XO, *self.vary)) or self._xi_free(e):
            return None
        body, saved, self.xo_scope = Scope(self.const_scope), self.xo_scope, None
        try:
            value = self.emit(e, body)
        finally:
            self.xo_scope = saved
        name = self.xi_tables[e] = self.tmp("tab")
        body.lines.append(f"{name}[{XI.name}] = {value};")
        self.const_scope.lines += [f"{VALUE[e.dtype]} {name}[{int(n)}];",
                                   ([f"for ({self.idx_t} {XI.name} = 0; {XI.name} < {int(n)}; {XI.name}++) {{"], body, ["}"])]
        return name

    def _code(self, e, scope, mask, row, post):
        op, a = e.op, e.args
        sub = lambda v, m=mask: self.emit(v, scope, m, row, post)  # noqa: E731
        if op in ("eq", "ne") and row is not None:
            narrow = self._row_index_compare(e, row)
            if narrow is not None:
                return narrow
        if op == "load":
            if mask is not None and mask[0] in self.xo_vars and scope is not self.xo_scope and not a[2]:
                row_ptr = self._row_pointer(a[0], a[1], mask[0])
                if row_ptr is not None:   # a row that does not hold reads zeros: the masked value
                    at = XI.name if row_ptr[1] == 1 else f"{row_ptr[1]}*{XI.name}"
                    return load_code(row_ptr[0], at, self.plan.buffers[a[0]].dtype)
            code = load_code(self.arg_for(a[0]), self.index(a[1], a[2], sub), self.plan.buffers[a[0]].dtype)
            return f"({mask[0]} ? {code} : ({VALUE[e.dtype]})0)" if mask is not None else code
        if op == "checked":
            return self._checked(e, scope, mask, sub)
        if op == "index":
            idx = self.index(a[0], a[2], sub)
            return f"(({idx}) != 0)" if e.dtype == torch.bool else f"(({VALUE[e.dtype]})({idx}))"
        if op == "rand":
            kind, offset, slot = a
            return f"kiln_{kind}({self.seed(slot)}, (uint32_t)({self.index(offset, (), sub)}))"
        if op == "cast":
            x = sub(a[0])
            if e.dtype.is_floating_point and _truncated(a[0]):   # g++ folds float -> int -> float into a
                w = "double" if e.dtype == torch.float64 else "float"   # trunc that keeps -0.0 (x in (-1, 0]);
                x = f"(({x}) == 0 ? ({w})0 : ({w})({x}))"            # eager's int 0 converts to +0.0
            if e.dtype == torch.bool:
                return f"({x} != 0)"
            if a[0].dtype == torch.bool and e.dtype.is_floating_point:   # a select: g++ 12 vectorizes no loop
                return f"({x} ? 1.0 : 0.0)" if e.dtype == torch.float64 else f"({x} ? 1.0f : 0.0f)"  # casting a bool
            if e.dtype == torch.bfloat16:
                return f"kiln_round_bf16((float)({x}))"
            if e.dtype == torch.float16:
                return f"kiln_round_f16((float)({x}))"
            if a[0].dtype.is_floating_point and not e.dtype.is_floating_point:   # eager's x86 conversion
                wide = "kiln_f2i64" if e.dtype == torch.int64 else "kiln_f2i32"
                return f"(({VALUE[e.dtype]}){wide}((double)({x})))"
            return f"(({VALUE[e.dtype]})({x}))"
        if op == "where":
            fused = self._nan_extremum(a, sub)
            if fused is not None:
                return fused
            c, x, y = (sub(v) for v in a)
            return f"({c} ? {x} : {y})"
        if op == "masked":
            cond = sub(a[0])
            inner = (cond if mask is None else f"({mask[0]} && {cond})", max(self.level(a[0]), mask[1] if mask
                                                                           else Level.CONST))
            val = self.emit(a[1], scope, inner, row, post)
            other = sub(a[2])
            if cond in self.xo_vars and scope is not self.xo_scope and e.dtype == torch.float32:
                return f"kiln_pick_f({self._keep_bits(cond)}, {val}, {other})"
            return f"({cond} ? {val} : {other})"
        if op in ("red", "const"):
            raise AssertionError(op)
        split = self._masked_exp(e)
        if split is not None:
            return sub(split)
        args = [sub(v) for v in a]
        dt = a[0].dtype
        t = template(op, dt, len(a))
        if self.scalar_math:
            t = scalar_math(t)
        return t.format(*args, f="f" if VALUE[dt] == "float" else "", t=VALUE[dt])

    def _checked(self, e, scope, mask, sub) -> str:
        """An indirect index: the raw value where proven in range, else the wrapped value clamped to
        ``size - 1`` as unsigned, its largest value kept in ``kiln_mK`` (a ``max`` reduction of every loop),
        which the function compares with the size after its loops (the loop still vectorizes)."""
        raw, size, info, how = self.proven(e)
        r = sub(raw)
        if how == "in":
            return r
        s = self.pexpr(size)
        w = f"({r} < 0 ? {r} + (int64_t)({s}) : {r})" if info.wraps else r
        if how == "wrap":
            return w
        m = self.checks.setdefault(e, (f"kiln_m{len(self.checks)}", s, info))[0]
        var = self.tmp("ix")
        scope.lines.append(f"const int64_t {var} = {w};")
        seen = f"(uint64_t){var}" if mask is None else f"({mask[0]} ? (uint64_t){var} : (uint64_t)0)"
        scope.lines.append(f"{m} = {m} > {seen} ? {m} : {seen};")
        last = f"((uint64_t)({s}) - 1)"   # an unsigned min: one instruction a lane (a negative index is huge)
        return f"(int64_t)((uint64_t){var} < {last} ? (uint64_t){var} : {last})"

    def _row_index_compare(self, e, row):
        """``r == t`` (or ``!=``) with ``t`` a 64-bit integer the same along the row, compared in 32 bits:
        ``t`` is narrowed once per row, to -1 when no ``r`` can equal it (16 lanes a vector, not 8)."""
        n, t = sympy.sympify(self.plan.rnumel), row_index_other(e)
        if self.idx_t != "int32_t" or not n.is_Integer or self.split is not None or t is None \
                or t.dtype not in (torch.int64, torch.int32) or self.level(t) is Level.ELEMENT:
            return None
        tv = self.emit(t, row, None, row, None)
        key = ("r32", tv)
        t32 = row.find(key)
        if t32 is None:
            t32 = self.tmp("t")
            row.lines.append(f"const int32_t {t32} = ({tv} >= 0 && {tv} < {int(n)}) ? (int32_t)({tv}) : -1;")
            row.cache[key] = t32
        return f"(r {'==' if e.op == 'eq' else '!='} {t32})"

    @staticmethod
    def _nan_extremum(a, sub):
        """``where((x > y) | isnan(x), x, y)`` (max-pool's running maximum) as ``kiln_max_nan(y, x)``, ``<``
        as ``kiln_min_nan`` (g++ vectorizes no loop with several ``|`` of bools feeding selects); or None."""
        c, x, y = a
        if c.op not in ("bitwise_or", "logical_or") or not x.dtype.is_floating_point:
            return None
        for cmp_, nan in (c.args, c.args[::-1]):
            is_nan = (nan.op == "ne" and tuple(nan.args) == (x, x)) or (nan.op == "isnan" and tuple(nan.args) == (x,))
            if cmp_.op in ("gt", "lt") and tuple(cmp_.args) == (x, y) and is_nan:
                return f"{'kiln_max_nan' if cmp_.op == 'gt' else 'kiln_min_nan'}({sub(y)}, {sub(x)})"
        return None

    def _masked_exp(self, e):
        """``exp(where(m, a, k) - c)`` with ``k`` a constant and ``c`` known per row (a masked softmax) as
        ``where(m, exp(a - c), exp(k - c))``: no vector lane sees -inf (libmvec's slow path); else None."""
        if e.op != "exp" or e.args[0].op != "sub" or self.level(e) is not Level.ELEMENT:
            return None
        w, c = e.args[0].args
        if w.op != "where" or self.level(c) >= Level.ELEMENT:
            return None
        cond, t, f = w.args
        if (t.op == "const") == (f.op == "const"):
            return None
        t, f = (ops.unary("exp", ops.binary("sub", v, c)) for v in (t, f))
        return ops.where(cond, t, f)

    def index(self, expr, binds, sub) -> str:
        """C++ for index ``expr`` (``binds``: its indirect symbols' Exprs)."""
        values = {s: f"(({self.idx_t}){sub(v)})" for s, v in binds}
        return self.pexpr(self._split_index(expr), values)

    def integer(self, n: int) -> str:
        return f"(({self.idx_t}){n}LL)" if abs(n) >= 2 ** 31 else str(n)


def _truncated(e) -> bool:
    """Whether ``e`` is an integer made from a float (fuzz seed 21 #223: ``x.to(int32)`` stacked with floats)."""
    return e.op == "cast" and e.dtype != torch.bool and not e.dtype.is_floating_point \
        and e.args[0].dtype.is_floating_point


def row_index_other(c):
    """``t`` when ``c`` is ``r == t`` or ``r != t`` (either side; ``r`` a row's element index), else None."""
    if c.op not in ("eq", "ne"):
        return None
    for i, j in ((0, 1), (1, 0)):
        a = c.args[i]
        if a.op == "index" and not a.args[2] and sympy.sympify(a.args[0]) == RINDEX:
            return c.args[j]
    return None


_ANDS = ("logical_and", "bitwise_and")


def assume(e: Expr, facts: dict, memo=None) -> Expr:
    """``e`` with each boolean Expr of ``facts`` replaced by its value, its ``and``/``where`` simplified."""
    memo = {} if memo is None else memo
    hit = memo.get(e)
    if hit is not None:
        return hit
    if e in facts:
        out = ops.const(bool(facts[e]), torch.bool)
    else:
        sub = lambda a: assume(a, facts, memo) if isinstance(a, Expr) else a  # noqa: E731
        args = tuple(sub(a) for a in e.args)
        if e.op in ("load", "index"):
            args = args[:2] + (tuple((s, sub(x)) for s, x in e.args[2]),)
        out = e if args == e.args else Expr(e.op, args, e.dtype)
        known = lambda a, v: a.op == "const" and a.args[0] is v  # noqa: E731
        if out.op in _ANDS and out.dtype == torch.bool and any(known(a, True) for a in out.args):
            other = [a for a in out.args if not known(a, True)]
            out = other[0] if other else out.args[0]
        elif out.op in _ANDS and out.dtype == torch.bool and any(known(a, False) for a in out.args):
            out = ops.const(False, torch.bool)
        elif out.op in ("where", "masked") and known(out.args[0], True):
            out = out.args[1]
        elif out.op in ("where", "masked") and known(out.args[0], False):
            out = out.args[2]
    memo[e] = out
    return out
