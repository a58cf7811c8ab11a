"""Bounds of indirect indices: ``checked`` index values, and the ranges kiln can prove without a check.

An indirect index into a dim of ``size`` is an int64 Expr ``checked(raw, size, info)``: ``raw`` is read
from (or computed from) the index tensor, ``info`` names eager's error for the op. Its value is ``raw``
made non-negative where the op wraps (``x[-1]``); out of ``[0, size)`` an emitter records the violation
(C++: an error flag; Triton: ``tl.device_assert`` or an error buffer) and reads another element of the dim,
so no access leaves the tensor. ``proof`` says when no check is needed, from the raw value's range (loop
ranges, constants, ``remainder``, clamps, selects, argmax/argmin results); it only ever errs towards a check.
"""
from typing import NamedTuple, Optional

import sympy
import torch

from kiln.codegen.ir.indexing import ONE, ZERO, FloorDiv, ModIdx, Ranges
from kiln.codegen.ir.indexing import leq as _le
from kiln.codegen.ir.loops import Expr, Reduction, Unsupported, ops


class CheckInfo(NamedTuple):
    """What eager raises for an out-of-range index: ``kind`` names the message (``kiln.runtime.bounds``),
    ``dim`` the dim it names; ``wraps``: a negative index counts from the end; ``always``: even if proven."""
    kind: str
    dim: int
    wraps: bool
    always: bool = False


def checked(raw: Expr, size, info: CheckInfo) -> Expr:
    """The int64 index ``raw`` into a dim of ``size`` (a sympy size), checked as ``info`` says."""
    size = sympy.sympify(size)
    if size.is_Integer and int(size) <= 0:
        raise Unsupported("an indirect index into an empty dim (no element to read instead)")
    s = ops.const(int(size), torch.int64) if size.is_Integer else ops.index(size)
    return Expr("checked", (ops.cast(raw, torch.int64), s, tuple(info)), torch.int64)


def parts(e: Expr):
    """(raw Expr, size as sympy, ``CheckInfo``) of a ``checked`` Expr."""
    raw, s, info = e.args
    size = sympy.Integer(s.args[0]) if s.op == "const" else sympy.sympify(s.args[0])
    return raw, size, CheckInfo(*info)


def proof(e: Expr, ranges: Ranges, buffers: dict, memo: Optional[dict] = None) -> Optional[str]:
    """'in' when the raw value of ``checked`` Expr ``e`` provably lies in ``[0, size)``, 'wrap' when it
    lies in ``[-size, size)`` and the op wraps negative indices, else None (a check is needed)."""
    raw, size, info = parts(e)
    if info.always:
        return None
    lo, hi = value_range(raw, ranges, buffers, {} if memo is None else memo)
    if hi is None or lo is None or not _le(hi, size - 1):
        return None
    if _le(ZERO, lo):
        return "in"
    return "wrap" if info.wraps and _le(-size, lo) else None


def value_range(e: Expr, ranges: Ranges, buffers: dict, memo: dict) -> tuple:
    """(lo, hi): inclusive sympy bounds of integer Expr ``e`` over ``ranges`` (None when unknown)."""
    hit = memo.get(e)
    if hit is None:
        hit = memo[e] = _range(e, ranges, buffers, memo)
    return hit


def _range(e, ranges, buffers, memo):
    op, a = e.op, e.args
    rng = lambda x: value_range(x, ranges, buffers, memo)  # noqa: E731
    if e.dtype.is_floating_point or e.dtype.is_complex:
        return None, None
    if op == "const":
        v = sympy.Integer(int(a[0]))
        return v, v
    if op == "index":
        if a[2]:   # an index of loaded values
            return None, None
        x = sympy.sympify(a[0])
        return _lo(x, ranges), ranges.max(x)
    if op == "cast":   # exact from bool or a narrower integer into a wider one (or int64)
        src = a[0].dtype
        if src == torch.bool:
            return ZERO, ONE
        wider = e.dtype == torch.int64 or e.dtype.itemsize > src.itemsize
        if src.is_floating_point or e.dtype == torch.bool or not wider:
            return None, None
        return rng(a[0])
    if op == "checked":   # an index already checked (or proven) into its dim
        return ZERO, parts(e)[1] - 1
    if op in ("where", "masked"):
        (l1, h1), (l2, h2) = rng(a[1]), rng(a[2])
        return _either(l1, l2, min), _either(h1, h2, max)
    if op in ("add", "sub"):
        (l1, h1), (l2, h2) = rng(a[0]), rng(a[1])
        if op == "sub":
            l2, h2 = (None if h2 is None else -h2), (None if l2 is None else -l2)
        return (None if l1 is None or l2 is None else l1 + l2), (None if h1 is None or h2 is None else h1 + h2)
    if op == "neg":
        lo, hi = rng(a[0])
        return (None if hi is None else -hi), (None if lo is None else -lo)
    if op == "mul":
        return _mul(rng(a[0]), rng(a[1]))
    if op in ("maximum", "minimum"):
        (l1, h1), (l2, h2) = rng(a[0]), rng(a[1])
        if op == "maximum":   # max(x, y) >= each one's lower bound
            return _known(l1, l2, max), _either(h1, h2, max)
        return _either(l1, l2, min), _known(h1, h2, min)
    if op in ("remainder", "fmod"):
        (l1, _), (l2, h2) = rng(a[0]), rng(a[1])
        if l2 is None or h2 is None or not _le(ONE, l2):
            return None, None
        if op == "remainder" or (l1 is not None and _le(ZERO, l1)):
            return ZERO, h2 - 1   # a positive divisor: remainder's result takes its sign
        return None, None
    if op in ("red", "load"):
        return _arg_range(buffers.get(a[0]))
    return None, None


def _arg_range(buf) -> tuple:
    """[0, n - 1] for the buffer of an argmax/argmin over n elements, else unknown."""
    red = getattr(buf, "compute", None)
    if not isinstance(red, Reduction) or red.kind not in ("argmax", "argmin") or red.split or red.fold:
        return None, None
    n = ONE
    for d in red.reduced:
        n = n * sympy.sympify(red.ranges[d])
    return ZERO, n - 1


def _either(x, y, pick):
    return None if x is None or y is None else _pick(x, y, pick)


def _known(x, y, pick):
    """``pick`` of the bounds that are known (a bound of max's lower end, or of min's upper end)."""
    if x is None or y is None:
        return y if x is None else x
    return _pick(x, y, pick)


def _pick(x, y, pick):
    if x.is_Integer and y.is_Integer:
        return pick(x, y)
    if _le(x, y):
        return y if pick is max else x
    if _le(y, x):
        return x if pick is max else y
    return sympy.Max(x, y) if pick is max else sympy.Min(x, y)


def _mul(r1, r2):
    (l1, h1), (l2, h2) = r1, r2
    if None in (l1, h1, l2, h2):
        return None, None
    if all(v.is_Integer for v in (l1, h1, l2, h2)):
        corners = [l1 * l2, l1 * h2, h1 * l2, h1 * h2]
        return min(corners), max(corners)
    if _le(ZERO, l1) and _le(ZERO, l2):
        return l1 * l2, h1 * h2
    return None, None


def _lo(x, ranges: Ranges):
    """A lower bound of index expression ``x`` over ``ranges`` (loop variables and sizes are >= 0)."""
    if x.is_Integer:
        return x
    if x.is_Symbol:
        return ZERO if x.is_nonnegative or x in ranges.bounds else None
    if isinstance(x, (FloorDiv, ModIdx)):
        inner = _lo(x.args[0], ranges)
        return ZERO if inner is not None and _le(ZERO, inner) else None
    if x.is_Add:
        parts_ = [_lo(t, ranges) for t in x.args]
        return None if any(p is None for p in parts_) else sympy.Add(*parts_)
    if x.is_Mul:
        coeff, rest = x.as_coeff_Mul()
        if coeff.is_negative:
            hi = ranges.max(-x)
            return None if hi is None else -hi
        inner = [_lo(t, ranges) for t in sympy.Mul.make_args(rest)]
        if all(p is not None and _le(ZERO, p) for p in inner):
            return ZERO
    return None
