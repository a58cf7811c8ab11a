"""Triton emitter: the expressions of a kernel plan as Triton source.

``TritonKernel(plan, flags)`` writes the body of one ``@triton.jit`` function from a ``KernelPlan``.
Pointwise kernels use 1-D tiles over ``xindex``. Reduction kernels use 2-D ``[XBLOCK, RBLOCK]``
tiles: straight-line code when the plan's rows are persistent, else one loop over ``rindex`` per
pass of the plan. A value goes to the loop depth its ``Level`` says (values that do not vary along
``rindex`` are hoisted out of the loops); identical expressions are computed once per scope (the IR
is hash-consed). This module writes expressions; ``rows.py`` walks the plan around them and
``module.py`` writes the module (the launcher) around the function.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kiln.codegen.ir.indexing import RINDEX, XINDEX, simplify
from kiln.codegen.ir.loops import Expr, Unsupported
from kiln.codegen.ir.scope import Scope
from kiln.codegen.schedule.colpart import XPID
from kiln.codegen.schedule.plan import KernelPlan, Level
from kiln.codegen.text import writer
from kiln.codegen.to_triton.ops import TL_DTYPE, convert, helpers_in, reduce_code, template
from kiln.options import Tuning


@dataclass(frozen=True)
class Flags:
    """What a Triton kernel is written for: Triton's CPU interpreter (no libdevice) or a GPU, with or
    without autotuned launches, under ``tuning`` (``codegen.target.TritonTarget.flags`` decides)."""
    interpret: bool
    autotune: bool
    tuning: Tuning


def past_l1(interpret: bool) -> str:
    """Extra ``tl.load`` arguments for reading other programs' stores of this launch (L1 is not
    coherent across SMs); nothing under the interpreter."""
    return "" if interpret else ", cache_modifier='.cg'"


class ExprWriter(writer.ExprWriter):
    """The expression half of ``rows.TritonKernel``: its state and how one Expr is written. ``checks``:
    bounds-checked Expr -> its number (``_checked``)."""
    LOOP_NAMES = {XINDEX: XINDEX.name, RINDEX: RINDEX.name, XPID: XPID.name}

    def __init__(self, plan: KernelPlan, flags: Flags):
        super().__init__(plan, flags.tuning)
        self.flags, self.interpret, self.autotune = flags, flags.interpret, flags.autotune
        self.dims, self.xnumel, self.rnumel, self.ranges = plan.dims, plan.xnumel, plan.rnumel, plan.ranges
        self.persistent = plan.persistent
        # a chained tail reads its head's stores of this launch: past L1
        self.load_suffix = past_l1(self.interpret) if plan.chained else ""
        self.helpers, self.libdevice = set(), False
        self.top = Scope()
        self.post = Scope() if plan.outer or plan.chunks else None
        self.pre = []
        self.pass_index = None   # the plan's row pass being written (looped kernels)

    # -- expression emission ------------------------------------------------------------
    def emit(self, e: Expr, scope: Scope, mask=None) -> str:
        """Source for ``e`` (a variable or literal); code goes into ``scope`` or, for values
        that do not vary along rindex, into the outermost scope."""
        lv = self.level(e)
        if mask is not None:
            lv = max(lv, mask[1])
        if lv is Level.AFTER or scope is self.post:
            target = self.post
        else:
            target = scope if lv is Level.ELEMENT else self.top
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
        if self.interpret and dt == torch.bfloat16:   # the interpreter builds no bf16 constant: an exact fp32 one
            f = float(torch.tensor(float(v), dtype=dt))
            lit = repr(f) if math.isfinite(f) else f"float('{f}')"
            one = f"tl.full([1], {lit}, tl.float32)" if math.copysign(1.0, f) > 0 or f != 0 else \
                "(tl.full([1], 0.0, tl.float32) * -1.0)"
            return f"{one}.to(tl.bfloat16)"
        if self.interpret and isinstance(v, float) and v == 0 and math.copysign(1.0, v) < 0:
            return f"(tl.full([1], 0.0, {TL_DTYPE[dt]}) * -1.0)"   # the interpreter drops a literal's sign
        if isinstance(v, float):
            lit = repr(v) if v == v and v not in (float("inf"), float("-inf")) else f"float('{v}')"
        else:
            lit = repr(bool(v)) if dt == torch.bool else repr(int(v))
        if dt in (torch.float32, torch.int32, torch.bool) or (dt == torch.int64 and abs(int(v)) < 2 ** 31):
            return lit
        return f"tl.full([1], {lit}, {TL_DTYPE[dt]})"

    def _tensor(self, code, e):
        """Make a literal usable where a tensor is required."""
        if e.op == "const" and not code.lstrip("(").startswith("tl."):
            return f"tl.full([1], {code}, {TL_DTYPE[e.dtype]})"
        return code

    def _shape(self, lv) -> str:
        """The block shape of a value at level ``lv`` in this kernel."""
        if lv is Level.CONST:
            return "[1]"
        if not self.red:
            return "[XBLOCK]"
        return "[XBLOCK, RBLOCK]" if lv is Level.ELEMENT else "[XBLOCK, 1]"

    def _block(self, v, value, shape: str) -> str:
        """``v`` (the code of ``value``) as a block of ``shape``: broadcast when its rank is the
        block's, else (a literal, a one-element value in a 2-D kernel) filled in by a select, since
        ``tl.broadcast_to`` does not add dimensions."""
        x = self._tensor(v, value)
        if shape.count(",") and self.level(value) is Level.CONST:
            return f"tl.where(tl.full({shape}, True, tl.int1), {x}, {x})"
        return f"tl.broadcast_to({x}, {shape})"

    def _mask(self, lv, mask):
        base = "xmask" if lv is not Level.ELEMENT else "xmask & rmask"
        if lv is Level.CONST:
            base = None
        if mask is not None:
            return mask[0] if base is None else f"{base} & {mask[0]}"
        return base

    def _eviction(self, name: str) -> str:
        """The L2 policy of a row loop's load of ``name``: a buffer that a later pass reads again is
        loaded ``evict_last`` (its rows stay in L2 for that pass), and its last read ``evict_first``
        (streamed through without pushing the others out). Without them, a softmax backward's second
        pass over 8192-element fp32 rows missed L2 (an H200 profile: 0.27 ms against 0.18 for
        inductor's). A buffer read in one pass only keeps the default policy: the next kernel may read
        it from L2 (``tuning.evict_single_pass`` marks those evict_first too)."""
        i = self.pass_index
        if not self.tuning.evict_policies or i is None:
            return ""
        passes = self.plan.passes
        if any(name in p.reads for p in passes[i + 1:]):
            return ", eviction_policy='evict_last'"
        if any(name in p.reads for p in passes[:i]) or self.tuning.evict_single_pass:
            return ", eviction_policy='evict_first'"
        return ""

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
            if m and self.level(e) is Level.CONST:
                # a scalar address under a block mask (a constant-index load inside a masked region,
                # even one whose condition is a one-element block): Triton rejects a block mask on a
                # scalar pointer, so make the address a block (tl.full, not tl.zeros: a jit function of
                # Triton's standard library, which an interpreted kernel cannot call unless Triton itself
                # was imported in interpreter mode)
                shape = self._shape(lv)
                idx = f"({idx}) + tl.full({shape}, 0, tl.int32)"
            elif self.interpret and self.level(e) is Level.CONST:
                # a one-element block, not a scalar: Triton 3.6's interpreter gives a comparison of scalars
                # its operands' dtype, so a scalar condition broadcast into a block holds floats (and
                # ``cond | block_cond`` raises)
                idx = f"({idx}) + tl.full([1], 0, tl.int32)"
            sfx = self.load_suffix
            if lv is Level.ELEMENT and self.red and not self.persistent and not sfx:
                sfx = self._eviction(a[0])
            return f"tl.load({ptr} + ({idx}), {m}, other=0{sfx})" if m else f"tl.load({ptr} + ({idx}){sfx})"
        if op == "checked":
            return self._checked(e, scope, mask, lv)
        if op == "index":
            idx = self.index(a[0], a[2], scope, mask)
            return f"({idx}) + tl.full([1], 0, {TL_DTYPE[e.dtype]})" if e.dtype != torch.bool else f"(({idx}) != 0)"
        if op == "rand":
            kind, offset, slot = a
            seed = self.seed(slot)
            if self.interpret:
                fn = f"_kiln_{kind}"
                self.helpers.update([fn, "_kiln_philox", "_kiln_uniform"])
            else:
                fn = f"tl.{kind}"
            off = self.index(offset, (), scope, mask)
            if self.level(e) is Level.CONST:
                off = f"{off} + tl.full([1], 0, tl.int32)"
            code = f"{fn}({seed}, ({off}).to(tl.uint32))"
            return f"{code}.to(tl.int64)" if kind == "randint" else code   # 32 random bits, zero-extended
        if op == "cast":
            x = self._tensor(self.emit(a[0], scope, mask), a[0])
            if e.dtype == torch.bool:
                return f"({x} != 0)"
            code = convert(x, a[0].dtype, e.dtype, self.interpret)
            self.helpers.update(helpers_in(code))
            return code
        if op == "where":
            c, x, y = (self.emit(v, scope, mask) for v in a)
            return f"tl.where({c}, {x}, {y})"
        if op == "masked":
            cond = self.emit(a[0], scope, mask)
            clv = self.level(a[0])
            inner = (cond if mask is None else f"({mask[0]}) & ({cond})", max(clv, mask[1] if mask else Level.CONST))
            val = self.emit(a[1], scope, inner)
            other = self.emit(a[2], scope, mask)
            return f"tl.where({cond}, {val}, {other})"
        args = [self.emit(v, scope, mask) for v in a]
        t = template(op, a[0].dtype, self.interpret, len(a))
        if t is None:
            raise Unsupported(f"triton: no template for {op} on {a[0].dtype}")
        if "libdevice." in t:
            self.libdevice = True
        self.helpers.update(helpers_in(t))
        if t.startswith(("tl.", "libdevice.", "_kiln")):
            args = [self._tensor(x, v) for x, v in zip(args, a)]
        elif all(v.op == "const" for v in a):
            args[0] = self._tensor(args[0], a[0])
        return t.format(*args, d=TL_DTYPE.get(e.dtype, ""))

    def _checked(self, e, scope, mask, lv) -> str:
        """An indirect index (``ir.bounds.checked``): the raw value where it is proven in range, else the
        wrapped value where it is in ``[0, size)`` and 0 where not (no access leaves the tensor). A compiled
        kernel asserts it in range (``tl.device_assert``: the module launches it with ``debug``, as eager's
        CUDA kernels assert); an interpreted one, whose asserts Triton 3.6 drops, writes a flag and the raw
        index of check K to ``err_ptr[2K]`` and ``err_ptr[2K + 1]``, which its launcher reads
        (``kiln.runtime.bounds.check_tensor``)."""
        raw, size, info, how = self.proven(e)
        r = self._tensor(self.emit(raw, scope, mask), raw)
        if how == "in":
            return r
        s = self.pexpr(size)
        w = f"tl.where({r} < 0, {r} + {s}, {r})" if info.wraps else r
        if how == "wrap":
            return w
        k = self.checks.setdefault(e, len(self.checks))
        wv, ok = self.tmp("ix"), self.tmp("ok")
        scope.lines += [f"{wv} = {w}", f"{ok} = ({wv} >= 0) & ({wv} < {s})"]
        m = self._mask(lv, mask)
        if self.interpret:
            bad = self.tmp("bad")
            scope.lines.append(f"{bad} = ({ok} == 0)" + (f" & ({m})" if m else ""))
            at = f"err_ptr + {bad}.to(tl.int32) * 0"
            scope.lines += [f"tl.store({at} + {2 * k}, {bad}.to(tl.int64), mask={bad})",
                            f"tl.store({at} + {2 * k + 1}, {r} + {bad}.to(tl.int64) * 0, mask={bad})"]
        else:
            cond = ok if not m else f"{ok} | (({m}) == 0)"
            scope.lines.append(f"tl.device_assert({cond}, 'index out of bounds: 0 <= index < {size}')")
        return f"tl.where({ok}, {wv}, 0)"

    # -- reductions ---------------------------------------------------------------------
    def reduce(self, kind, x, dtype, axis=1) -> str:
        """``reduce_code`` for a reduction over ``dtype`` values, its helpers registered."""
        code = reduce_code(kind, x, self.interpret, axis, dtype.is_floating_point)
        self.helpers.update(helpers_in(code))
        return code

    # -- indices --------------------------------------------------------------------------
    def index(self, expr, binds, scope, mask):
        sub = {s: self.emit(v, scope, mask) for s, v in binds}
        return self.pexpr(simplify(expr, self.ranges), sub)
