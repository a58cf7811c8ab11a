"""How a C++ kernel's flat indices split into loops (``rows.CppKernel`` walks them): a pointwise kernel's
``xindex = xo * inner + xi`` (or a read's memory order), a column reduction's channels, a row read at
``r // K`` and ``r % K``. Each split leaves no division by the vectorized loop's variable.
"""
import sympy

from kiln.codegen.ir.indexing import (RINDEX, XINDEX, FloorDiv, ModIdx, Ranges, contiguous_strides, prod, simplify,
                                      unflatten)
from kiln.codegen.to_cpp.emit import R0, R1, XI, XO


def _divides(exprs, subst, ranges, inner) -> bool:
    """Whether an index of ``exprs`` still divides loop variable ``inner`` once ``subst`` is applied."""
    return any(inner in a.free_symbols for e in exprs
               for a in simplify(e.xreplace(subst), ranges).atoms(FloorDiv, ModIdx))


def _index_exprs(plan) -> list:
    """Every load, index and store expression of ``plan``'s row members, simplified in its ranges."""
    out = [n.args[1] if n.op == "load" else n.args[0] for m in plan.members for n in m.value.walk()
           if n.op in ("load", "index")]
    return [simplify(e, plan.ranges) for e in out + [m.index for m in plan.members if m.index is not None]]


def pointwise_split(plan, min_inner: int):
    """``(outer, inner)`` of ``xindex = xo * inner + xi``: ``inner`` the longest run of trailing dims every
    index reads without a division, else the innermost dim; the whole domain below ``min_inner``."""
    xs = [s for s, _ in plan.dims]
    if len(xs) < 2:
        return sympy.Integer(1), plan.xnumel
    exprs = _index_exprs(plan)
    for k in range(1, len(xs) - 1):
        outer, inner = prod(xs[:k]), prod(xs[k:])
        if inner.is_Integer and int(inner) < min_inner:
            break
        if not _divides(exprs, {XINDEX: XO * inner + XI}, Ranges({XO: outer, XI: inner}), XI):
            return outer, inner
    inner = xs[-1]
    if inner.is_Integer and int(inner) < min_inner:
        return sympy.Integer(1), plan.xnumel
    return prod(xs[:-1]), inner


def load_order_split(plan, min_inner: int):
    """``(outer, inner, {xindex: its value in xo, xi})`` walking a pointwise kernel's static domain in the memory
    order of a read that is affine in the domain's dims and contiguous over at least ``min_inner`` elements of
    dims adjacent in the domain (NCHW to channels-last: xo over N, C and xi over H * W, stores 3 apart), when
    the domain's innermost dim is shorter than that and the walk reads and writes along ``xi`` more plainly
    (``_walk_score``) than one loop over the whole domain; else None."""
    sizes = [sympy.sympify(s) for s, _ in plan.dims]
    if len(sizes) < 2 or not all(s.is_Integer for s in sizes) or int(sizes[-1]) >= min_inner:
        return None
    vs = sympy.symbols(f"kiln_d0:{len(sizes)}", integer=True, nonnegative=True)
    strides = contiguous_strides(sizes)
    flat, ranges, exprs = sum(v * st for v, st in zip(vs, strides)), Ranges(dict(zip(vs, sizes))), _index_exprs(plan)
    best = _walk_score(exprs, {XINDEX: XI}, Ranges({XI: plan.xnumel}))
    for idx in [n.args[1] for m in plan.members for n in m.value.walk() if n.op == "load" and not n.args[2]]:
        e = sympy.expand(simplify(simplify(idx, plan.ranges).xreplace({XINDEX: flat}), ranges))
        coef = [e.coeff(v, 1) for v in vs]
        if not all(c.is_Integer for c in coef) or (e - sum(c * v for c, v in zip(coef, vs))).free_symbols & set(vs):
            continue
        order = sorted(range(len(vs)), key=lambda d: -int(coef[d]))
        run, step = [], 1   # trailing dims the read walks contiguously, adjacent in the domain (stores stay affine)
        for d in reversed(order):
            if int(coef[d]) != step or run and d != run[0] - 1:
                break
            run.insert(0, d)
            step *= int(sizes[d])
        rest = [d for d in order if d not in run]
        at = dict(zip(rest, unflatten(XO, [sizes[d] for d in rest])))
        at.update(zip(run, unflatten(XI, [sizes[d] for d in run])))
        walk = (prod([sizes[d] for d in rest]), sympy.Integer(step), {XINDEX: sum(at[d] * st for d, st in enumerate(strides))})
        if step >= min_inner and _walk_score(exprs, walk[2], Ranges({XO: walk[0], XI: walk[1]})) > best:
            return walk
    return None


def _walk_score(exprs, subst, ranges) -> int:
    """How plainly the loop over ``xi`` reads and writes ``exprs``: 2 per index the same along it or contiguous,
    1 per other affine index, 0 where it divides ``xi``."""
    score = 0
    for e in exprs:
        e = simplify(e.xreplace(subst), ranges)
        if XI not in e.free_symbols:
            score += 2
        elif not any(XI in a.free_symbols for a in e.atoms(FloorDiv, ModIdx)):
            score += 2 if sympy.expand(e).coeff(XI, 1) == 1 else 1
    return score


def column_split(plan, min_inner: int):
    """``(outer, inner)`` of a column reduction's ``xindex = xo * inner + xi``: ``inner`` its innermost dim (a
    channels-last tensor's channels) when that is static, at least ``min_inner`` and divided by no index, else
    all of ``xindex``."""
    xs = [sympy.sympify(s) for s, r in plan.dims if not r]
    inner, outer = xs[-1], prod(xs[:-1])
    subst, ranges = {XINDEX: XO * inner + XI}, Ranges({XO: outer, XI: inner, RINDEX: plan.rnumel})
    if len(xs) < 2 or not inner.is_Integer or int(inner) < min_inner or _divides(_index_exprs(plan), subst, ranges, XI):
        return sympy.Integer(1), plan.xnumel
    return outer, inner


def row_split(plan, minimum: int):
    """``(K, substitution, ranges)`` when every index reads ``rindex`` only through ``r // K`` and ``r % K``
    (K >= ``minimum`` dividing the row, a symbolic row too: 1024 * s), so ``r = r0 * K + r1`` leaves no division;
    else None."""
    n = sympy.sympify(plan.rnumel)
    if minimum <= 0:
        return None
    exprs = _index_exprs(plan)
    ks = set()
    for e in exprs:
        for a in e.atoms(FloorDiv, ModIdx):
            if RINDEX not in a.free_symbols:
                continue
            if a.args[0] != RINDEX or (isinstance(a, ModIdx) and a.args[1] != 1):
                return None
            ks.add(a.args[-1])
    if len(ks) != 1:
        return None
    k = ks.pop()
    rows = n / k   # K symbolic too (the spatial size of a fully dynamic CNN), in whole rows
    if rows.is_integer is not True or k.is_Integer and (int(k) < minimum or n.is_Integer and k >= n) \
            or k.free_symbols & {RINDEX, XINDEX}:
        return None
    bounds = {s: b for s, b in plan.ranges.bounds.items() if s != RINDEX}
    ranges = Ranges({**bounds, R0: rows, R1: k})
    subst = {RINDEX: R0 * k + R1}
    return None if _divides(exprs, subst, ranges, R1) else (k, subst, ranges)
