"""Index arithmetic for the loop IR: sympy expressions over ``xindex`` and ``rindex`` (flat positions in the
kept and reduced parts of a kernel's iteration space), size symbols and ``ind*`` symbols (indirect indexing).
Unflattening uses ``FloorDiv`` and ``ModIdx``; ``simplify`` folds them back where a load walks memory in the
kernel's order, using the variables' ranges. Every rule relies on all indices being non-negative.
"""
import functools
import math
import operator

import sympy

XINDEX = sympy.Symbol("xindex", integer=True, nonnegative=True)
RINDEX = sympy.Symbol("rindex", integer=True, nonnegative=True)
ZERO, ONE = sympy.Integer(0), sympy.Integer(1)


# Memo of pure index functions by their arguments: the same indices recur in every layer of a model
# (sympy objects compare structurally, so a hit is what the call would compute). Cleared when large.
_MEMO: dict = {}


def memo(key, make):
    """``make()``, remembered for ``key`` in the shared index memo."""
    hit = _MEMO.get(key)
    if hit is None:
        if len(_MEMO) >= 1 << 16:
            _MEMO.clear()
        hit = _MEMO[key] = make()
    return hit


class FloorDiv(sympy.Function):
    """``a // b`` for integers ``a >= 0`` and ``b > 0``."""
    is_integer = True
    is_nonnegative = True
    nargs = 2

    @classmethod
    def eval(cls, a, b):
        if b == 1:
            return a
        if a == 0:
            return ZERO
        if a.is_Integer and b.is_Integer:
            return sympy.Integer(int(a) // int(b))
        return None

    def _eval_is_positive(self):
        return (self.args[0] - self.args[1]).is_nonnegative or None


class ModIdx(sympy.Function):
    """``(a // d) % m`` for integers ``a >= 0``, ``d, m > 0``: one digit of a mixed-radix number."""
    is_integer = True
    is_nonnegative = True
    nargs = 3

    @classmethod
    def eval(cls, a, d, m):
        if m == 1 or a == 0:
            return ZERO
        if a.is_Integer and d.is_Integer and m.is_Integer:
            return sympy.Integer((int(a) // int(d)) % int(m))
        return None


def next_pow2(n: int) -> int:
    """The smallest power of two at least ``n`` (1 for n <= 1)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def size_expr(s) -> sympy.Expr:
    """An int or SymInt size as a sympy expression."""
    if isinstance(s, sympy.Expr):
        return s
    if isinstance(s, int):   # (a bool too)
        return sympy.Integer(int(s))
    node = getattr(s, "node", None)
    if node is not None and hasattr(node, "expr"):
        return own_floor_divs(sympy.sympify(node.expr))
    return sympy.Integer(int(s))


def own_floor_divs(e):
    """torch's ``FloorDiv`` of sizes (a strided conv's or pool's output size) as kiln's, which the printers
    write (both floor non-negative operands); ``n // d + c`` (c > 0) as ``(n + c*d) // d``, one atom that
    expansion keeps whole (a conv's output size squared, ``(s - 1)//2 + 1`` squared, is ``((s + 1)//2)**2``,
    not three terms that no stride or modulo matches)."""
    if e.is_Atom:
        return e
    e = e.replace(lambda a: type(a).__name__ == "FloorDiv" and not isinstance(a, FloorDiv), lambda a: FloorDiv(*a.args))
    return e.replace(lambda a: a.is_Add and any(isinstance(t, FloorDiv) for t in a.args) and a.args[0].is_Integer
                     and a.args[0] > 0, lambda a: _absorb(*a.args))


def _absorb(c, *terms):
    f = next(t for t in terms if isinstance(t, FloorDiv))
    return sympy.Add(FloorDiv(f.args[0] + c * f.args[1], f.args[1]), *[t for t in terms if t is not f])


def same_sizes(a, b) -> bool:
    """Two lists of sizes are equal element by element (symbolic sizes compared after expansion)."""
    return len(a) == len(b) and all(x == y or sympy.expand(x - y) == 0 for x, y in zip(a, b))


def prod(xs):
    return functools.reduce(operator.mul, xs, ONE)


def numel(shape, dims):
    """The number of elements over ``dims`` of ``shape``."""
    return prod([shape[d] for d in dims])


def contiguous_strides(shape):
    out, acc = [], ONE
    for s in reversed(shape):
        out.append(acc)
        acc = acc * s
    return tuple(reversed(out))


def unflatten(flat, sizes):
    """Per-dimension indices of a row-major flat position over ``sizes``."""
    return list(memo(("u", flat, tuple(sizes)), lambda: tuple(_unflatten(flat, sizes))))


def _unflatten(flat, sizes):
    out, stride = [], ONE
    for i in reversed(range(len(sizes))):
        if sizes[i] == 1:
            out.append(ZERO)
        elif i == 0 or all(s == 1 for s in sizes[:i]):
            out.append(FloorDiv(flat, stride))
        else:
            out.append(ModIdx(flat, stride, sizes[i]))
        stride = stride * sizes[i]
    return list(reversed(out))


def flat_index(index, strides, offset=ZERO):
    return memo(("f", tuple(index), tuple(strides), offset),
                lambda: offset + sum((i * s for i, s in zip(index, strides) if s != 0), ZERO))


@functools.lru_cache(maxsize=1 << 16)
def _is_multiple(term, d) -> bool:
    q = sympy.cancel(term / d)
    return q.as_numer_denom()[1] == 1 and q.is_integer is not False


def leq(a, b) -> bool:
    """Provably a <= b (False when unsure)."""
    if a is None:
        return False
    d = sympy.expand(b - a)
    return bool(d.is_nonnegative) if d.is_nonnegative is not None else (d.is_Integer and d >= 0)


class Ranges:
    """Exclusive upper bounds of the index variables (``xindex < xnumel`` ...)."""

    def __init__(self, bounds: dict):
        self.bounds = {k: sympy.sympify(v) for k, v in bounds.items()}
        self.key = frozenset(self.bounds.items())   # what simplify's results depend on

    def varies(self, e) -> bool:
        """Whether ``e`` holds an index variable or an indirect index (else it is a size)."""
        return any(s in self.bounds or s.name.startswith("ind") for s in e.free_symbols)

    def max(self, e):
        """An upper bound (inclusive) of ``e``, or None when unknown."""
        if not self.varies(e):
            return e   # a size
        if e.is_Symbol:
            b = self.bounds.get(e)
            return None if b is None else b - 1
        if isinstance(e, FloorDiv):
            m = self.max(e.args[0])
            return None if m is None else FloorDiv(m, e.args[1]) if m.is_Integer and e.args[1].is_Integer \
                else sympy.floor(m / e.args[1])
        if isinstance(e, ModIdx):
            return e.args[2] - 1
        if e.is_Add or e.is_Mul and not e.as_coeff_Mul()[0].is_negative:   # of non-negative factors
            parts = [self.max(a) for a in e.args]
            return None if any(p is None for p in parts) else e.func(*parts)
        return None


def simplify(e, ranges: Ranges):
    """Fold FloorDiv/ModIdx chains using variable ranges; the result equals ``e`` for in-range vars."""
    e = sympy.sympify(e)
    return memo(("s", e, ranges.key), lambda: _simplify(sympy.expand(e), ranges))


def _simplify(e, r):
    if not isinstance(e, sympy.Basic) or e.is_Atom:
        return e
    args = [_simplify(a, r) for a in e.args]
    if isinstance(e, FloorDiv):
        return _floordiv(args[0], args[1], r)
    if isinstance(e, ModIdx):
        return _modidx(args[0], args[1], args[2], r)
    e = e.func(*args)
    if e.is_Add:
        e = _join(e, r)
    return e


def _split(a, d):
    """a = d*q + rest with q an integer polynomial; returns (q, rest)."""
    q, rest = [], []
    for t in sympy.Add.make_args(sympy.expand(a)):
        (q if _is_multiple(t, d) else rest).append(t)
    return sympy.expand(sympy.Add(*q) / d), sympy.Add(*rest)


def _floordiv(a, b, r):
    if b == 1:
        return a
    if isinstance(a, FloorDiv):
        return _floordiv(a.args[0], a.args[1] * b, r)
    if isinstance(a, ModIdx) and _is_multiple(a.args[2], b):
        return _modidx(a.args[0], a.args[1] * b, sympy.cancel(a.args[2] / b), r)
    q, rest = _split(a, b)
    if not _neg_free(rest):
        return FloorDiv(a, b)
    if rest == 0 or leq(r.max(rest), b - 1):
        return q
    coarse = _coarsen(rest, b, r)
    if coarse is not None:   # rest = c*q2 + low, c | b, low < c: rest // b = q2 // (b / c)
        q2, c = coarse
        return q + _floordiv(q2, sympy.cancel(b / c), r)
    return q + FloorDiv(rest, b)


def _coarsen(a, d, r):
    """``(q, c)`` with ``a = c*q + low``, ``0 <= low < c``, ``c > 1`` the largest coefficient of ``a``
    dividing ``d`` (so ``a // d == q // (d / c)``: ``(128*x + r) // 16384`` is ``x // 128``, r < 128; with
    a symbolic ``d``, ``(128*x + r) // (128*s)`` is ``x // s`` and ``(s*x + r) // s**2`` is ``x // s``, r < s:
    no division per element in a dynamic kernel). The candidates: each term's factors that hold no index."""
    cands = {sympy.Mul(*[f for f in sympy.Mul.make_args(t) if not r.varies(f)]) for t in sympy.Add.make_args(a)}
    degree = lambda c: sum(k for b, k in c.as_powers_dict().items() if not b.is_Number)  # noqa: E731
    for c in sorted(cands, key=lambda c: (degree(c), c.as_coeff_Mul()[0], sympy.default_sort_key(c)), reverse=True):
        if c == 1 or not c.is_positive or not _is_multiple(d, c):
            continue
        q, low = _split(a, c)
        if q != 0 and _neg_free(q) and _neg_free(low) and (low == 0 or leq(r.max(low), c - 1)):
            return q, c
    return None


def _modidx(a, d, m, r):
    if m == 1:
        return ZERO
    if isinstance(a, FloorDiv):
        return _modidx(a.args[0], a.args[1] * d, m, r)
    if isinstance(a, ModIdx) and _is_multiple(a.args[2], d * m):
        return _modidx(a.args[0], a.args[1] * d, m, r)
    _, rest = _split(a, d * m)
    if not _neg_free(rest):
        return ModIdx(a, d, m)
    if rest == 0:
        return ZERO
    if leq(r.max(rest), d * m - 1):
        return _floordiv(rest, d, r)
    if d != 1:   # rest = c*q + low, c | d, low < c: the digit is q's (1024*xo + xi, xi < 1024: xo's)
        coarse = _coarsen(rest, d, r)
        if coarse is not None:
            q, c = coarse
            return _modidx(q, sympy.cancel(d / c), m, r)
    elif not sympy.sympify(m).is_Integer:   # (c*q + low) % (c*s) = c*(q % s) + low, c | m, low < c
        coarse = _coarsen(rest, m, r)
        if coarse is not None:
            q, c = coarse
            return c * _modidx(q, 1, sympy.cancel(m / c), r) + sympy.expand(rest - c * q)
    return ModIdx(rest, d, m)


def _neg_free(e) -> bool:
    return all(not t.as_coeff_Mul()[0].is_negative for t in sympy.Add.make_args(e))


def _join(e, r):
    """c*ModIdx(a,d,m) + c*m*ModIdx(a,d*m,n) -> c*ModIdx(a,d,m*n); likewise with FloorDiv(a,d*m)."""
    changed = True
    terms = list(sympy.Add.make_args(e))
    while changed:
        changed = False
        for i, ti in enumerate(terms):
            ci, ai = _sym_coeff(ti, ModIdx, r)
            if ai is None:
                continue
            base, d, m = ai.args
            for j, tj in enumerate(terms):
                if j == i:
                    continue
                cj, aj = _sym_coeff(tj, (ModIdx, FloorDiv), r)
                if aj is None or aj.args[0] != base or sympy.expand(cj - ci * m) != 0:
                    continue
                if isinstance(aj, ModIdx) and sympy.expand(aj.args[1] - d * m) == 0:
                    new = ci * _modidx(base, d, m * aj.args[2], r)
                elif isinstance(aj, FloorDiv) and sympy.expand(aj.args[1] - d * m) == 0:
                    new = ci * _floordiv(base, d, r)
                else:
                    continue
                terms = [t for k, t in enumerate(terms) if k not in (i, j)] + [new]
                changed = True
                break
            if changed:
                break
    return sympy.Add(*terms)


def _sym_coeff(t, kinds, r):
    """Split a term into (coefficient, atom) where atom is its one FloorDiv/ModIdx factor of an index."""
    factors = sympy.Mul.make_args(t)
    atoms = [f for f in factors if isinstance(f, kinds) and r.varies(f)]
    if len(atoms) != 1:
        return None, None
    return sympy.Mul(*[f for f in factors if f is not atoms[0]]), atoms[0]


def _evaluate(x, env):
    """Evaluate an index expression on numpy arrays bound to its symbols."""
    import numpy as np
    if x.is_Integer:
        return np.int64(int(x))
    if x.is_Symbol:
        return env[x]
    a = [_evaluate(y, env) for y in x.args]
    if isinstance(x, FloorDiv):
        return a[0] // a[1]
    if isinstance(x, ModIdx):
        return (a[0] // a[1]) % a[2]
    if x.is_Add or x.is_Mul:
        return functools.reduce(operator.add if x.is_Add else operator.mul, a)
    raise TypeError(x)


def equal(a, b, ranges: Ranges, limit: int = 1 << 20) -> bool:
    """Whether two index expressions agree at every in-range point (proved or checked exhaustively)."""
    a, b = sympy.sympify(a), sympy.sympify(b)
    return memo(("e", a, b, ranges.key, limit), lambda: _equal(a, b, ranges, limit))


def _equal(a, b, ranges: Ranges, limit: int) -> bool:
    sa, sb = simplify(a, ranges), simplify(b, ranges)
    if sa == sb or sympy.expand(sa - sb) == 0:
        return True
    syms = a.free_symbols | b.free_symbols
    if not syms <= set(ranges.bounds) or not all(ranges.bounds[s].is_Integer for s in syms):
        return False
    import numpy as np
    if math.prod(int(ranges.bounds[s]) for s in syms) > limit:
        return False
    syms = sorted(syms, key=str)
    grids = np.meshgrid(*[np.arange(int(ranges.bounds[s]), dtype=np.int64) for s in syms], indexing="ij")
    env = dict(zip(syms, grids))
    return bool(np.all(np.asarray(_evaluate(sa, env)) == np.asarray(_evaluate(sb, env))))
