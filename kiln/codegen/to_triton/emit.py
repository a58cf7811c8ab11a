"""Triton emitter: the expressions of a kernel plan as Triton source (1-D ``[XBLOCK]`` tiles for pointwise
kernels, 2-D ``[XBLOCK, RBLOCK]`` for reductions), each at the loop depth its ``Level`` says and computed
once per scope; ``rows.py`` walks the plan around them, ``module.py`` writes the module.
"""
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
    """What a Triton kernel is written for: the CPU interpreter or a GPU, autotuned or not, its tuning."""
    interpret: bool
    autotune: bool
    tuning: Tuning


def past_l1(interpret: bool) -> str:
    """Extra ``tl.load`` arguments reading other programs' stores of this launch (L1 is not coherent)."""
    return "" if interpret else ", cache_modifier='.cg'"


class ExprWriter(writer.ExprWriter):
    """The expression half of ``rows.TritonKernel``. ``checks``: bounds-checked Expr -> its number."""
    LOOP_NAMES = {XINDEX: XINDEX.name, RINDEX: RINDEX.name, XPID: XPID.name}

    def __init__(self, plan: KernelPlan, flags: Flags):
        super().__init__(plan, flags.tuning)
        self.flags, self.interpret, self.autotune = flags, flags.interpret, flags.autotune
        self.dims, self.persistent = plan.dims, plan.persistent
        # a chained tail reads its head's stores of this launch: past L1
        self.load_suffix = past_l1(self.interpret) if plan.chained else ""
        self.helpers, self.libdevice = set(), False
        self.top, self.pre = Scope(), []
        self.post = Scope() if plan.outer or plan.chunks else None
        self.pass_index = None   # the plan's row pass being written (looped kernels)

    def emit(self, e: Expr, scope: Scope, mask=None) -> str:
        """Source for ``e`` (a variable or literal), in ``scope`` or, when the same along rindex, ``top``."""
        lv = self.level(e)
        if mask is not None:
            lv = max(lv, mask[1])
        after = lv is Level.AFTER or scope is self.post
        target = self.post if after else (scope if lv is Level.ELEMENT else self.top)
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
        """``v`` (``value``'s code) as a block of ``shape`` (a select where broadcasting would add dims)."""
        x = self._tensor(v, value)
        if shape.count(",") and self.level(value) is Level.CONST:
            return f"tl.where(tl.full({shape}, True, tl.int1), {x}, {x})"
        return f"tl.broadcast_to({x}, {shape})"

    def _mask(self, lv, mask):
        base = None if lv is Level.CONST else ("xmask & rmask" if lv is Level.ELEMENT else "xmask")
        return " & ".join(m for m in (base, mask and mask[0]) if m) or None

    def _eviction(self, name: str) -> str:
        """The L2 policy of a row loop's load of ``name``: ``evict_last`` where a later pass reads it again,
        ``evict_first`` at its last read (a softmax backward's second pass missed L2 without: 0.27 ms against
        0.18 on an H200); the default for a buffer read in one pass (unless ``tuning.evict_single_pass``)."""
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
                # a scalar address under a block mask, which Triton rejects: make the address a block
                # (tl.full, not tl.zeros: a jit function an interpreted kernel cannot call)
                shape = self._shape(lv)
                idx = f"({idx}) + tl.full({shape}, 0, tl.int32)"
            elif self.interpret and self.level(e) is Level.CONST:
                # a one-element block, not a scalar: Triton 3.6's interpreter gives a comparison of scalars
                # its operands' dtype (``cond | block_cond`` then raises)
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
        """An indirect index: the raw value where proven in range, else the wrapped value where in
        ``[0, size)`` and 0 where not. A compiled kernel asserts it (``tl.device_assert``); an interpreted
        one writes a flag and the raw index of check K to ``err_ptr[2K]``, ``err_ptr[2K + 1]``."""
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

    def reduce(self, kind, x, dtype, axis=1) -> str:
        """``reduce_code`` for a reduction over ``dtype`` values, its helpers registered."""
        code = reduce_code(kind, x, self.interpret, axis, dtype.is_floating_point)
        self.helpers.update(helpers_in(code))
        return code

    def index(self, expr, binds, scope, mask):
        sub = {s: self.emit(v, scope, mask) for s, v in binds}
        return self.pexpr(simplify(expr, self.ranges), sub)
