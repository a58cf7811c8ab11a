"""How a C++ kernel walks its rows, following the plan (``CppKernel``).

A pointwise kernel runs ``xindex`` as ``xo * inner + xi``, each block of ``xi`` an ``omp simd`` loop. A
reduction kernel gives each thread whole rows, one ``omp simd`` loop over ``rindex`` per dependency stage
(a softmax takes two loops, not the online pass: the row is still in cache). Outer reductions accumulate
per chunk of rows, combined in chunk order (independent of the thread count).
"""
import dataclasses

import sympy
import torch

from kiln.codegen.ir.indexing import RINDEX, Ranges
from kiln.codegen.ir.loops import Unsupported, ops
from kiln.codegen.schedule.domain import Role
from kiln.codegen.schedule.plan import KernelPlan, Level, reds
from kiln.codegen.schedule.planner import row_passes
from kiln.codegen.to_cpp.emit import (XI, ExprWriter, Scope, assume, load_code, render, row_index_other,
                                      store_code)
from kiln.codegen.to_cpp.ops import MEMORY, VALUE, calls_vector_math, combine, literal, neutral
from kiln.codegen.to_cpp.splits import column_split, load_order_split, pointwise_split, row_split
from kiln.options import Tuning

SIMD_REDUCE = {"sum": "+", "prod": "*", "max": "max", "min": "min"}


class CppKernel(ExprWriter):
    """One ``extern "C"`` function written from a plan: ``write()`` walks it, ``define`` renders it."""

    def __init__(self, plan: KernelPlan, tuning: Tuning):
        super().__init__(plan, tuning)
        self.body = []   # the function's lines after the size bindings (strings and blocks)
        self.split = None   # K when a row runs as r = r0 * K + r1 (``row_split``)

    def write(self) -> "CppKernel":
        plan = self.plan
        if plan.scatter is not None:
            self._scatter()
        elif plan.reduction:
            self._reduction()
        else:
            if plan.outer or plan.chunks or any(m.role is not Role.ROW for m in plan.members):
                raise Unsupported("cpp: a pointwise kernel with outer members")
            self._pointwise()
        return self

    def _scatter(self):
        """A scatter's values stored (or added) at their targets in order, on one thread (targets repeat)."""
        w, t = self.plan.scatter, self.idx_t
        if w.mode == "add" and w.buffer.dtype == torch.bool:
            raise Unsupported("cpp: an accumulating scatter of bools")
        self.use_split(sympy.Integer(1), self.plan.xnumel)
        scope = Scope()
        v = self.emit(w.value, scope)
        at, idx = self.tmp("at"), self.index(w.target.args[0], w.target.args[2], lambda e: self.emit(e, scope))
        scope.lines.append(f"const int64_t {at} = {idx};")
        ptr = self.out_args[w.buffer.name]
        new = f"({load_code(ptr, at, w.buffer.dtype)} + {v})" if w.mode == "add" else v
        scope.lines.append(f"{ptr}[{at}] = {store_code(new, w.buffer.dtype)};")
        self.body.append(([f"for ({t} xi = 0; xi < xnumel; xi++) {{"], scope, ["}"]))

    def _parallel(self, extra: str = "") -> str:
        """The loop's OpenMP pragma; none below ``cpp_parallel_min`` elements read (entering a region costs about
        2 us; a CNN's fused max-pool reads 4 per element, its global average pool 16 x 4: 60 us on one thread)."""
        static = sympy.sympify(self.plan.xnumel * self.plan.rnumel)
        if static.is_Integer:
            reads = len({n for m in self.plan.members for n in m.value.walk()
                         if n.op == "load" and self.level(n) is Level.ELEMENT})
            if int(static) * max(1, reads) < self.tuning.cpp_parallel_min:
                return f"// one thread: {int(static)} elements"
            return f"#pragma omp parallel for{extra} schedule(static)"
        work = f"(int64_t)({self.pexpr(self.plan.xnumel)}) * (int64_t)({self.pexpr(self.plan.rnumel)})"
        return f"#pragma omp parallel for{extra} schedule(static) if({work} >= {self.tuning.cpp_parallel_min})"

    def _pointwise(self):
        plan = self.plan
        outer, inner = pointwise_split(plan, self.tuning.cpp_min_inner)
        walk = load_order_split(plan, self.tuning.cpp_min_inner) if outer == 1 else None
        if walk is not None:   # a short innermost dim (an image's 3 channels): walk a read's memory order
            outer, inner = walk[:2]
        self.use_split(outer, inner)
        self.subst = walk[2] if walk is not None else self.subst
        n = sympy.sympify(plan.xnumel)   # once, before the loops: values that vary with no index (not when empty)
        self.const_scope = Scope() if n.is_Integer and int(n) > 0 else None
        position = Scope(self.const_scope)   # per outer position: values that do not vary along xi (masks...)
        scope = Scope(position)
        self.xo_scope = position
        stored = [m for m in plan.members if m.stored]
        for m in stored:
            self._store(m, m.result, scope, None, None)
        interior = self._interior(stored)
        if interior is not None:   # the same body where the xi bounds checks hold, with them taken as true
            lo, hi, holds = interior
            inside, facts, memo = Scope(position), dict.fromkeys(holds, True), {}
            for m in stored:
                self._store(m, assume(m.result, facts, memo), inside, None, None)
        self.xo_scope = None
        self.body += [self.const_scope] if self.const_scope is not None else []
        b, t = self.tuning.cpp_block, self.idx_t
        head = [f"const {t} xo_n = {self.pexpr(outer)}, xi_n = {self.pexpr(inner)};",
                f"const {t} nb = (xi_n + {b - 1}) / {b};",
                self._parallel(" collapse(2)"),
                f"for ({t} xo = 0; xo < xo_n; xo++)",
                f"for ({t} xb = 0; xb < nb; xb++) {{",
                f"  const {t} xe = xb * {b} + {b} < xi_n ? xb * {b} + {b} : xi_n;"]
        if interior is None:
            position.lines.append((["#pragma omp simd", f"for ({t} xi = xb * {b}; xi < xe; xi++) {{"], scope, ["}"]))
        else:
            x0 = f"xb * {b}"
            for start, end, body in ((x0, f"(xe < {lo} ? xe : {lo})", scope),
                                     (f"({x0} > {lo} ? {x0} : {lo})", f"(xe < {hi} ? xe : {hi})", inside),
                                     (f"({x0} > {hi} ? {x0} : {hi})", "xe", scope)):
                position.lines.append((["#pragma omp simd", f"for ({t} xi = {start}; xi < {end}; xi++) {{"],
                                       body, ["}"]))
        self.body.append((head, position, ["}"]))

    def _interior(self, stored):
        """(lo, hi, checks): the xi range where every check ``a * xi + b >= k`` (or <, >, <=) of a stored
        value holds, when that is most of the row but not all of it (a max-pool's edges); else None."""
        n, least = sympy.sympify(self.xi_n), self.tuning.cpp_interior_min
        if not least or not n.is_Integer or int(n) < 2 * least:
            return None
        lo, hi, checks = 0, int(n), set()
        for m in stored:
            for e in m.result.walk():
                bound = self._xi_bound(e) if e not in checks else None
                if bound is not None:
                    checks.add(e)
                    lo, hi = max(lo, bound[0]), min(hi, bound[1])
        if not checks or hi - lo < least or (lo, hi) == (0, int(n)):
            return None
        return lo, hi, checks

    def _xi_bound(self, e):
        """``[lo, hi)`` of the xi where comparison ``e`` of an affine index in xi with a constant holds."""
        if e.op not in ("ge", "gt", "le", "lt") or e.args[0].op != "index" or e.args[0].args[2] \
                or e.args[1].op != "const" or not isinstance(e.args[1].args[0], int) \
                or isinstance(e.args[1].args[0], bool):
            return None
        idx = sympy.expand(self._split_index(e.args[0].args[0]))
        if idx.free_symbols != {XI}:
            return None
        a, b = idx.coeff(XI, 1), idx.subs(XI, 0)
        if not (a.is_Integer and b.is_Integer) or a == 0 or sympy.expand(idx - a * XI - b) != 0:
            return None
        a, b, k = int(a), int(b), e.args[1].args[0]
        # a * xi + b >= k' with k' an integer: ge k, gt k + 1; <= k'': le k, lt k - 1
        if e.op in ("ge", "gt"):
            k2 = k if e.op == "ge" else k + 1
            return (-((b - k2) // a), 1 << 62) if a > 0 else (0, (k2 - b) // a + 1)
        k2 = k if e.op == "le" else k - 1
        return (0, (k2 - b) // a + 1) if a > 0 else (-((b - k2) // a), 1 << 62)

    def _reduction(self):
        plan = self.plan
        t = self.idx_t
        online_off = dataclasses.replace(self.tuning, online_softmax=False)
        passes, row_stores = row_passes(plan.members, plan.levels, online_off)
        stage = {name: i for i, p in enumerate(passes) for name in p.reduce}
        cols = [m for m in plan.members if m.role is Role.COLPART]
        outers = [m for m in plan.members if m.role in (Role.OUTER, Role.SCALAR)]
        col_pass = {m.name: 1 + max([stage[r] for r in reds(m.value)], default=-1) for m in cols}
        n_pass = max([len(passes)] + [s + 1 for s in col_pass.values()])
        if plan.dims and not plan.dims[-1][1] and not cols and not outers:
            self._columns(passes, row_stores)
            return
        row = Scope()
        post = Scope() if outers else None
        self.row, self.post = row, post
        if not cols and not outers:
            self._use_row_split()
            self._keep_row_values(passes, row)
        for i in range(n_pass):
            p = passes[i] if i < len(passes) else None
            self.pass_no = i
            self._pass(p, [m for m in cols if col_pass[m.name] == i])
        self.pass_no = n_pass
        for name in row_stores:
            m = plan.member(name)
            self._store(m, m.result, row, row, None)
        if plan.chunks:
            if outers:
                raise Unsupported("cpp: folded column partials beside outer reductions")
            self._colpart_rows(cols, row)
        elif outers:
            self._outer_rows(outers, row, post)
        else:
            self.body.append(([self._parallel(), f"for ({t} x = 0; x < xnumel; x++) {{"], row, ["}"]))

    def _pass(self, p, cols):
        """One loop over a row's elements: its reductions, element stores and folded column partials."""
        plan, row = self.plan, self.row
        loop = Scope(row)
        clauses, finals, simd = [], [], True
        for name in (p.reduce if p is not None else ()):
            m = plan.member(name)
            kind, acc_t = m.reduce, m.acc
            onehot = self._one_hot(m) if kind == "sum" and acc_t.is_floating_point else None
            if onehot is not None:   # no loop: the row's one matching element, and the rest
                finals.append((m, onehot))
                continue
            ct = VALUE[acc_t]
            acc = self.tmp("acc")
            v = self._reduce_value(m, loop)
            row.lines.append(f"{ct} {acc} = {neutral(kind.replace('arg', ''), acc_t)};")
            if kind in ("argmax", "argmin"):
                simd = False
                row.lines.append(f"int64_t {acc}_i = 0;")
                wins = f"{v} {'>' if kind == 'argmax' else '<'} {acc}"
                if acc_t.is_floating_point:   # a NaN beats every number; the first NaN stays
                    wins = f"({wins}) || ({v} != {v} && {acc} == {acc})"
                loop.lines.append(f"if ({wins}) {{ {acc} = {v}; {acc}_i = r; }}")
                finals.append((m, f"{acc}_i"))
                continue
            if kind not in SIMD_REDUCE or VALUE[acc_t] == "bool":
                raise Unsupported(f"cpp: reduction {kind} over {acc_t}")
            clauses.append(f"reduction({SIMD_REDUCE[kind]}:{acc})")
            if kind in ("max", "min"):
                cmp = ">" if kind == "max" else "<"
                loop.lines.append(f"{acc} = {v} {cmp} {acc} ? {v} : {acc};")
                if acc_t.is_floating_point:   # NaN propagates: kept apart so the lanes' max stays plain
                    row.lines.append(f"int {acc}_nan = 0;")
                    clauses.append(f"reduction(|:{acc}_nan)")
                    loop.lines.append(f"{acc}_nan |= ({v} != {v});")
                    finals.append((m, f"({acc}_nan ? {literal(float('nan'), acc_t)} : {acc})"))
                    continue
            else:
                loop.lines.append(f"{acc} = {combine(kind, acc, v, False)};")
            finals.append((m, acc))
        for name in (p.stores if p is not None else ()):
            m = plan.member(name)
            self._store(m, m.result, loop, row, None)
        for m in cols:
            v = self._reduce_value(m, loop)
            loop.lines.append(f"{m.name}_col[r] = {combine(m.reduce, f'{m.name}_col[r]', v, m.acc.is_floating_point)};")
        if loop.lines:
            head, tail = self._r_loop(("#pragma omp simd " + " ".join(clauses)) if simd else None)
            row.lines.append((head, loop, tail))
        for m, code in finals:
            var = self.tmp("red")
            row.lines.append(f"const {VALUE[m.acc] if not m.reduce.startswith('arg') else 'int64_t'} {var} = {code};")
            self.red_vars[m.name] = var

    def _columns(self, passes, row_stores):
        """A reduction over a non-innermost dim (a bias gradient, a channels-last average pool): blocks of
        columns, simd along them, the columns as ``xo * inner + xi`` (``column_split``: no division in the inner
        loop, a channel's BatchNorm scale in a table, not a rsqrt per element)."""
        plan, t, xb, x = self.plan, self.idx_t, self.tuning.cpp_col_block, XI.name
        self.row = None   # every value is computed in the inner loop over columns
        split = column_split(plan, self.tuning.cpp_min_inner)
        self.use_split(*split)
        self.ranges, self.vary = Ranges({**self.ranges.bounds, RINDEX: plan.rnumel}), (RINDEX,)
        n = sympy.sympify(plan.xnumel * plan.rnumel)   # values that vary with no index: before the loops
        self.const_scope = Scope() if n.is_Integer and int(n) > 0 else None
        body = self.xo_scope = Scope(self.const_scope)
        for p in passes:
            outer = Scope(body)
            inner = Scope(outer)
            for name in p.reduce:
                m = plan.member(name)
                kind, acc_t, fl = m.reduce, m.acc, m.acc.is_floating_point
                acc, at = self.tmp("acc"), f"[{x} - x0]"
                # a float sum of 1024 rows made a channels-last BatchNorm backward 100x less accurate than eager's
                double = self.tuning.cpp_double_columns and kind == "sum" and VALUE[acc_t] == "float"
                body.lines.append(f"{'double' if double else VALUE[acc_t]} {acc}[{xb}];")
                body.lines.append(f"for ({t} i = 0; i < {xb}; i++) {acc}[i] = {neutral(kind.replace('arg', ''), acc_t)};")
                v = self._reduce_value(m, inner)
                if kind in ("argmax", "argmin"):
                    body.lines.append(f"int64_t {acc}_i[{xb}];")
                    body.lines.append(f"for ({t} i = 0; i < {xb}; i++) {acc}_i[i] = 0;")
                    wins = f"{v} {'>' if kind == 'argmax' else '<'} {acc}{at}"
                    if fl:
                        wins = f"({wins}) || ({v} != {v} && {acc}{at} == {acc}{at})"
                    w = self.tmp("win")
                    inner.lines += [f"const bool {w} = {wins};", f"{acc}_i{at} = {w} ? (int64_t)r : {acc}_i{at};",
                                    f"{acc}{at} = {w} ? {v} : {acc}{at};"]
                    self.red_vars[name] = f"{acc}_i{at}"
                    continue
                inner.lines.append(f"{acc}{at} = {combine(kind, acc + at, v, fl)};")
                self.red_vars[name] = acc + at
            for name in p.stores:
                m = plan.member(name)
                self._store(m, m.result, inner, None, None)
            outer.lines.append((["#pragma omp simd", f"for ({t} {x} = x0; {x} < xe; {x}++) {{"], inner, ["}"]))
            body.lines.append(([f"for ({t} r = 0; r < rnumel; r++) {{"], outer, ["}"]))
        last, rows = Scope(body), Scope(body)
        spread = Scope(rows)
        for name in row_stores:   # a column's value stored once, or (``spread``) at every row of it
            m = plan.member(name)
            along = m.index is not None and RINDEX in m.index.free_symbols
            self._store(m, m.result, spread if along else last, None, None)
        columns = ["#pragma omp simd", f"for ({t} {x} = x0; {x} < xe; {x}++) {{"]
        if last.lines:
            body.lines.append((columns, last, ["}"]))
        if spread.lines:
            rows.lines.append((columns, spread, ["}"]))
            body.lines.append(([f"for ({t} r = 0; r < rnumel; r++) {{"], rows, ["}"]))
        self.xo_scope = None
        self.body += [self.const_scope] if self.const_scope is not None else []
        head = [f"const {t} xo_n = {self.pexpr(split[0])}, xi_n = {self.pexpr(split[1])};",
                self._parallel(" collapse(2)"), f"for ({t} xo = 0; xo < xo_n; xo++)",
                f"for ({t} xb = 0; xb < (xi_n + {xb - 1}) / {xb}; xb++) {{",
                f"  const {t} x0 = xb * {xb}, xe = x0 + {xb} < xi_n ? x0 + {xb} : xi_n;"]
        self.body.append((head, body, ["}"]))

    def _one_hot(self, m):
        """A float sum over a row whose elements differ only by ``r == t`` (``t`` the same along the row:
        cross-entropy's one-hot gradient) without a loop: ``0 + hit + miss * (n - hits)``; else None."""
        out, n = None, sympy.sympify(self.plan.rnumel)
        if self.split is None and n.is_Integer:
            for c in m.value.walk():
                t = row_index_other(c) if c.op == "eq" else None
                if t is None or self.level(t) is Level.ELEMENT:
                    continue
                hit, miss = assume(m.value, {c: True}), assume(m.value, {c: False})
                if Level.ELEMENT in (self.level(hit), self.level(miss)):
                    continue
                tv, hv, mv = (self.emit(v, self.row, None, self.row, None) for v in (t, hit, miss))
                ct = VALUE[m.acc]
                k = self.tmp("hits")
                self.row.lines.append(f"const int {k} = ({tv} >= 0 && {tv} < {int(n)}) ? 1 : 0;")
                out = (f"(({ct})0 + ({k} ? ({ct}){hv} : ({ct})0) + "
                       f"(({int(n)} - {k}) > 0 ? ({ct}){mv} * ({ct})({int(n)} - {k}) : ({ct})0))")
                break
        return out

    def _reduce_value(self, m, scope):
        v = self.emit(m.value, scope, None, self.row, None)
        return v if m.value.dtype == m.acc else f"(({VALUE[m.acc]}){v})"

    def _colpart_rows(self, cols, row):
        """Folded column partials: one task per chunk of rows, storing its partial at (program, column)."""
        plan, t = self.plan, self.idx_t
        if not plan.rnumel.is_Integer:
            raise Unsupported("cpp: folded column partials over a dynamic row length")
        programs, chunk = plan.chunks
        start, end = [], []
        for m in cols:
            ct = VALUE[m.acc]
            start.append(f"{ct} {m.name}_col[{int(plan.rnumel)}];")
            start.append(f"for ({t} r = 0; r < rnumel; r++) {m.name}_col[r] = {neutral(m.reduce, m.acc)};")
            dt = m.buffer.dtype
            end.append(f"for ({t} r = 0; r < rnumel; r++) {self.out_args[m.name]}[{self.pexpr(m.index)}] = "
                       f"{store_code(f'{m.name}_col[r]', dt)};")
        short = "" if programs * chunk == int(plan.xnumel) else f" && xpid * {chunk} + xo < xnumel"   # the last chunk
        rows = ([f"for ({t} xo = 0; xo < {chunk}{short}; xo++) {{", f"  const {t} x = xpid * {chunk} + xo;"], row, ["}"])
        self.body.append(([self._parallel(), f"for ({t} xpid = 0; xpid < {programs}; xpid++) {{"],
                          Scope(lines=start + [rows] + end), ["}"]))

    def _outer_rows(self, outers, row, post):
        """Reductions over all rows: a partial per chunk of rows, combined in chunk order, then ``post``."""
        t, n = self.idx_t, self.tuning.cpp_outer_chunks
        start, end, combine_lines, final = [], [], [], []
        for m in outers:
            if not m.reduce:
                continue
            if m.reduce not in SIMD_REDUCE:
                raise Unsupported(f"cpp: outer reduction {m.reduce}")
            ct, fl = VALUE[m.acc], m.acc.is_floating_point
            acc = self.tmp("oacc")
            row.lines.append(f"{acc} = {combine(m.reduce, acc, self._reduce_value(m, row), fl)};")
            start.append(f"{ct} {acc} = {neutral(m.reduce, m.acc)};")
            end.append(f"{acc}_part[c] = {acc};")
            var = self.tmp("red")
            combine_lines += [f"{ct} {acc}_part[{n}];"]
            self.red_vars[m.name] = var
            final += [f"{ct} {var} = {neutral(m.reduce, m.acc)};",
                      f"for ({t} c = 0; c < nch; c++) {var} = {combine(m.reduce, var, f'{acc}_part[c]', fl)};"]
        for m in outers:
            if m.stored:
                self._store(m, m.result, post, None, post)
        rows = ([f"const {t} x0 = ({t})((int64_t)c * xnumel / nch), x1 = ({t})((int64_t)(c + 1) * xnumel / nch);",
                 f"for ({t} x = x0; x < x1; x++) {{"], row, ["}"])
        body = Scope(lines=start + [rows] + end)
        # nch is opaque: with xnumel <= n each chunk is one row, and g++ 12, proving the row loop runs once,
        # left the row's exp loop scalar (cross-entropy's forward over 64 rows: 94 us, eager's 18)
        self.body += [f"{t} nch = xnumel < {n} ? xnumel : {n};", "KILN_OPAQUE(nch);"] + combine_lines
        self.body.append(([self._parallel(), f"for ({t} c = 0; c < nch; c++) {{"], body, ["}"]))
        self.body += final + [post]

    def _keep_row_values(self, passes, row):
        """Costly values (vector math, float division) that two loops over a static row of at most
        ``tuning.cpp_row_cache`` elements compute: the first keeps them in an array, later ones read it."""
        n = sympy.sympify(self.plan.rnumel)
        if not n.is_Integer or int(n) > self.tuning.cpp_row_cache:
            return
        first: dict = {}   # Expr -> the first pass computing it
        again: set = set()
        for i, p in enumerate(passes):
            roots = [self.plan.member(name).value for name in p.reduce]
            roots += [self.plan.member(name).result for name in p.stores]
            seen = set()
            for root in roots:
                for e in root.walk():
                    if e in seen or self.level(e) is not Level.ELEMENT or not _costly(e):
                        continue
                    seen.add(e)
                    if e in first:
                        again.add(e)
                    else:
                        first[e] = i
        inner = {c for e in again for c in e.walk() if c is not e}   # kept inside a kept value: not kept
        for e in sorted((e for e in again if e not in inner), key=lambda e: first[e]):
            arr = self.tmp("kept")
            row.lines.append(f"{VALUE[e.dtype]} {arr}[{int(n)}];")
            self.row_cache[e] = (arr, first[e])

    def _use_row_split(self):
        """Index the row's elements as ``r = r0 * K + r1`` where ``row_split`` finds a K."""
        found = row_split(self.plan, self.tuning.cpp_row_split)
        if found is not None:
            self.split, self.subst, self.ranges = found

    def _r_loop(self, pragma):
        """(head lines, tail lines) of a loop over a row: ``r``, or ``r0`` around a vectorized ``r1``."""
        t = self.idx_t
        if self.split is None:
            return ([pragma] if pragma else []) + [f"for ({t} r = 0; r < rnumel; r++) {{"], ["}"]
        k = self.pexpr(self.split)
        n = k if self.split.is_Atom else f"({k})"   # a product of sizes divides as one: rnumel / (h*w)
        return ([f"for ({t} r0 = 0; r0 < rnumel / {n}; r0++) {{"] + ([pragma] if pragma else []) +
                [f"for ({t} r1 = 0; r1 < {k}; r1++) {{", f"const {t} r = r0 * {k} + r1; (void)r;"], ["}", "}"])

    def _store(self, m, value, scope, row, post):
        """Store ``value`` at ``m``'s index (a per-row value stored along its row gets a loop of its own)."""
        value = ops.cast(value, m.buffer.dtype)
        v = self.emit(value, scope, None, row, post)
        idx = m.index if m.index is not None else sympy.Integer(0)
        code = f"{self.out_args[m.name]}[{self.index(idx, (), None)}] = {store_code(v, m.buffer.dtype)};"
        if self.plan.reduction and RINDEX in idx.free_symbols and scope is row:
            head, tail = self._r_loop("#pragma omp simd")
            scope.lines.append((head, Scope(lines=[code]), tail))
        else:
            scope.lines.append(code)

    def params(self, names) -> list:
        shared = set().union(*self.plan.reusable)   # inputs an output may be written into: no __restrict__
        ins = [f"const {MEMORY[self.plan.buffers[b].dtype]}*{' __restrict__' * (b not in shared)} {p}"
               for b, p in self.inputs.items()]
        outs = [f"{MEMORY[b.dtype]}*{' __restrict__' * (not r)} {self.out_args[b.name]}"
                for b, r in zip(self.plan.stored, self.plan.reusable or [()] * len(self.plan.stored))]
        seeds = [f"const int64_t* __restrict__ {v}_ptr" for v in self.seeds.values()]   # philox seeds
        sizes = [f"int64_t {names[s]}" for s in sorted(names, key=str)]
        return ins + outs + seeds + sizes + ["int64_t* kiln_err"] * bool(self.checks)

    def define(self, name: str, names) -> str:
        """The function's text; with bounds checks it returns K + 1 when check K fails (see ``kiln_err``)."""
        t = self.idx_t
        checks = list(self.checks.values())
        lines = [f'extern "C" {"int" if checks else "void"} {name}({", ".join(self.params(names))}) {{',
                 f"  const {t} xnumel = {self.pexpr(self.plan.xnumel)};",
                 f"  const {t} rnumel = {self.pexpr(self.plan.rnumel)};",
                 "  (void)xnumel; (void)rnumel;"]
        lines += [f"  const int64_t {v} = {v}_ptr[0];" for v in self.seeds.values()]
        body = [ln for line in self.body for ln in (line.lines if isinstance(line, Scope) else [line])]
        if checks:   # the loops that update the checks' variables reduce them (per thread, per vector lane)
            lines.append("  uint64_t " + ", ".join(f"{m} = 0" for m, _, _ in checks) + ";")
            body = _reducing(body, " reduction(max:" + ",".join(m for m, _, _ in checks) + ")")[0]
        render(body, "  ", lines)
        if checks:
            for k, (m, s, _) in enumerate(checks):
                lines.append(f"  if ({m} >= (uint64_t)({s})) {{ kiln_err[0] = (int64_t){m}; return {k + 1}; }}")
            lines.append("  return 0;")
        return "\n".join(lines + ["}"])


def _reducing(lines, clause: str) -> tuple:
    """(``lines``, ``clause`` added to the pragma of every loop updating a ``kiln_mK``, whether any does)."""
    out, hit = [], False
    for ln in lines:
        if isinstance(ln, tuple):
            header, scope, trailer = ln
            inner, updates = _reducing(scope.lines, clause)
            if updates:
                header = [h + clause if h.lstrip().startswith(("#pragma omp parallel for", "#pragma omp simd"))
                          else h for h in header]
            out.append((header, Scope(lines=inner), trailer))
            hit |= updates
        else:
            out.append(ln)
            hit |= ln.startswith("kiln_m")
    return out, hit


def _costly(e) -> bool:
    """Whether element value ``e`` costs more to compute again than to read back from a kept row."""
    return calls_vector_math(e.op) or (e.op == "truediv" and e.dtype.is_floating_point)
