"""Where a buffer sits in a kernel's domain: a tuple of ``(size, is_reduced)`` dims (size-1 dims dropped),
flattened into a kept part ``xindex`` and a reduced part ``rindex``. ``body`` is the expression a buffer's
kernel evaluates there, ``current`` the element it computes at (xindex, rindex), ``loads`` what it reads.
"""
import enum
import weakref

import sympy

from kiln.codegen.ir.indexing import (RINDEX, XINDEX, ZERO, Ranges, contiguous_strides, memo, prod,
                                      same_sizes, unflatten)
from kiln.codegen.ir.loops import Pointwise, Reduction, ops
from kiln.codegen.schedule.colpart import colpart_body, colpart_dims, colpart_index


class Role(enum.Enum):
    """How a buffer sits in its kernel: what ``body`` evaluates and where ``current`` places it."""
    ROW = "row"          # one element at each point (xindex, rindex) of the domain
    OUTER = "outer"      # a reduction over all rows of a row kernel (its reduced index is xindex)
    SCALAR = "scalar"    # a one-element value computed after all rows (from outer reductions)
    COLPART = "colpart"  # a folded column partial: one program per chunk of rows (``colpart.py``)


def domain_ranges(dims):
    return Ranges({XINDEX: prod([s for s, r in dims if not r]), RINDEX: prod([s for s, r in dims if r])})


def squeeze(shape):
    return [s for s in shape if s != 1]


def node_dims(buf):
    """The domain a buffer would have as a kernel of its own."""
    c = buf.compute
    if isinstance(c, Reduction) and c.fold:
        return colpart_dims(c)
    if isinstance(c, Reduction):
        return tuple((s, d in c.reduced) for d, s in enumerate(c.ranges) if s != 1)
    if isinstance(c, Pointwise):   # in memory order (channels-last: N, H, W, C), walked in address order
        order = _dense_order(buf.shape, buf.stride) or range(len(buf.shape))
        return tuple((buf.shape[d], False) for d in order if buf.shape[d] != 1)
    return None


def domain_vars(dims):
    return list(memo(("dv", dims), lambda: tuple(_domain_vars(dims))))


def _domain_vars(dims):
    xi = iter(unflatten(XINDEX, [s for s, r in dims if not r]))
    ri = iter(unflatten(RINDEX, [s for s, r in dims if r]))
    return [next(ri) if r else next(xi) for _, r in dims]


def place(shape, dims, stride=None):
    """Index (one expr per dim of ``shape``) of the element computed at (xindex, rindex), or None; another
    shape of the domain's elements is walked in memory order (a transposed copy writes in address order)."""
    hit = memo(("pl", tuple(shape), dims, None if stride is None else tuple(stride)),
               lambda: _place(shape, dims, stride))
    return None if hit is False else list(hit)


def _place(shape, dims, stride=None):   # a tuple, or False where the buffer does not fit
    sq = squeeze(shape)
    full = [s for s, _ in dims]
    xs = [s for s, r in dims if not r]
    order = _dense_order(shape, stride) if stride is not None else None
    permuted = order is not None and order != [d for d in range(len(shape)) if int(shape[d]) != 1]
    if same_sizes(sq, full) and not permuted:   # (a channels-last [16, 32, 32, 32]: memory order below)
        vs = iter(domain_vars(dims))
    elif len(xs) < len(full) and same_sizes(sq, xs):
        vs = iter(unflatten(XINDEX, xs))
    elif same_sizes([prod(sq)], [prod(full)]):   # same elements, another shape: walk both in memory order
        flat = sum((v * st for v, st in zip(domain_vars(dims), contiguous_strides(full))), ZERO)
        return tuple(memory_unflatten(flat, list(shape), stride))
    elif len(xs) < len(full) and same_sizes([prod(sq)], [prod(xs)]):
        return tuple(memory_unflatten(XINDEX, list(shape), stride))
    else:
        return False
    return tuple(ZERO if s == 1 else next(vs) for s in shape)


def memory_unflatten(flat, shape, stride=None):
    """Per-dimension indices of ``flat`` in the memory order of dense layout ``stride`` (else row-major)."""
    order = _dense_order(shape, stride)
    if order is None or order == [d for d in range(len(shape)) if int(shape[d]) != 1]:
        return unflatten(flat, shape)
    out = [ZERO] * len(shape)
    for d, v in zip(order, unflatten(flat, [shape[d] for d in order])):
        out[d] = v
    return out


def _dense_order(shape, stride):
    """The non-size-1 dims of ``shape`` by decreasing stride when ``stride`` is a dense layout, else None."""
    if stride is None or not all(sympy.sympify(x).is_Integer for x in list(shape) + list(stride)):
        return None
    dims = [d for d in range(len(shape)) if int(shape[d]) != 1]
    order = sorted(dims, key=lambda d: -int(stride[d]))
    expect = 1
    for d in reversed(order):
        if int(stride[d]) != expect:
            return None
        expect *= int(shape[d])
    return order


def body(buf, dims, role: Role = Role.ROW):
    """The Expr a buffer's kernel evaluates under ``dims`` in ``role`` (None if it does not fit)."""
    c = buf.compute
    if isinstance(c, Reduction) and c.fold:
        return colpart_body(c, dims)
    if role is Role.OUTER:
        return c.fn(unflatten(XINDEX, list(c.ranges)))
    if role is Role.SCALAR:
        return c.compute([ZERO] * len(buf.shape))
    if isinstance(c, Reduction):
        if dims_key(node_dims(buf)) != dims_key(dims):
            return None
        vs = iter(domain_vars(dims))
        return c.fn([ZERO if s == 1 else next(vs) for s in c.ranges])
    idx = place(buf.shape, dims, buf.stride)
    return None if idx is None else c.compute(idx)


def dims_key(dims) -> tuple:
    """``dims`` with sizes expanded: equal keys, equal domains."""
    return tuple((sympy.expand(s), r) for s, r in dims)


def current(buf, dims, role: Role = Role.ROW):
    """Flat index of the element of ``buf`` computed at (xindex, rindex)."""
    if role in (Role.OUTER, Role.SCALAR):
        return buf.index([ZERO] * len(buf.shape))
    if role is Role.COLPART:
        return colpart_index(buf, dims)
    return buf.index(place(buf.shape, dims, buf.stride))


_LOADS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def loads(expr):
    """[(buffer name, index)] of every load in ``expr`` (memoized: Exprs are immutable)."""
    hit = _LOADS.get(expr)
    if hit is None:
        hit = _LOADS[expr] = tuple((e.args[0], e.args[1]) for e in expr.walk() if e.op == "load")
    return list(hit)


def scatter_exprs(buf):
    """Every Expr a scatter kernel evaluates (for dependency tracking)."""
    s = buf.compute
    vs = [sympy.Symbol(f"s{i}", integer=True, nonnegative=True) for i in range(len(s.shape))]
    base_idx = [sympy.Symbol(f"b{i}", integer=True, nonnegative=True) for i in range(len(buf.shape))]
    target = s.target(vs)
    return [s.value(vs), s.base(base_idx), ops.index(target)]


