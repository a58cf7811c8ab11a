"""Lowerings of view ops: reshape, permute, expand, squeeze/unsqueeze, slice, select, flip.

Every view becomes index arithmetic on its input, so a kernel reads through it, even a view of a stored
tensor: no view call is left in the wrapper (GPT-2's made about 650 a step, a microsecond each). Where the
view itself must exist, ``realize`` makes it an ATen view of its stored base (``view_base``), never a copy.
``tuning.fuse_stored_views=False`` keeps views of stored tensors as ATen views (``KEEP``), for comparison.
"""
import sympy

from kiln.codegen.ir.indexing import ONE, ZERO, ModIdx, contiguous_strides, size_expr, unflatten
from kiln.codegen.ir.loops import Pointwise, Unsupported
from kiln.codegen.lower.base import KEEP, aten, broadcast, register, shape_of


def _remap(ctx, a, fn):
    """The view ``out[idx] = a[fn(idx)]`` (or KEEP when ``a`` is already materialized)."""
    if not isinstance(a, Pointwise):
        raise Unsupported("view of a non-tensor")
    buf = a.buffer
    base = buf is not None and buf.node is not None and buf.node is ctx.node.args[0]
    if base and buf.kind in ("input", "extern", "view") and not ctx.tuning.fuse_stored_views:
        return KEEP
    out = ctx.pointwise(lambda idx: a(fn(idx)), shape=shape_of(ctx.meta), dtype=a.dtype)
    if base or (buf is None and getattr(a, "view_base", None) is not None):
        out.view_base = a   # a view of a stored tensor (or of such a view): fuse through it, an ATen view if stored
    return out


def _norm_dim(d, n):
    return d + n if d < 0 else d


def reshape_index(idx, in_shape, out_shape):
    """Index into ``in_shape`` for position ``idx`` of the same data viewed as ``out_shape``."""
    in_shape = [size_expr(s) for s in in_shape]
    out_shape = [size_expr(s) for s in out_shape]
    out = []
    for ins, outs in _groups(in_shape, out_shape):
        flat = sum((idx[j] * s for j, s in zip(outs, contiguous_strides([out_shape[j] for j in outs]))), ZERO)
        out.extend(unflatten(flat, [in_shape[i] for i in ins]) if ins else [])
    return out


def _groups(a, b):
    """Pair up runs of dims of ``a`` and ``b`` with equal products (the rest as one group if the
    sizes are symbolic and do not line up)."""
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        if i < len(a) and a[i] == 1:
            groups.append(([i], []))
            i += 1
            continue
        if j < len(b) and b[j] == 1:
            groups.append(([], [j]))
            j += 1
            continue
        if i >= len(a) or j >= len(b):
            groups.append((list(range(i, len(a))), list(range(j, len(b)))))
            break
        gi, gj, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while sympy.expand(pa - pb) != 0:
            if pa.is_Integer and pb.is_Integer and pa < pb and i < len(a):
                gi.append(i)
                pa, i = pa * a[i], i + 1
            elif pa.is_Integer and pb.is_Integer and pb < pa and j < len(b):
                gj.append(j)
                pb, j = pb * b[j], j + 1
            else:
                gi.extend(range(i, len(a)))
                gj.extend(range(j, len(b)))
                i, j = len(a), len(b)
                break
        groups.append((gi, gj))
    return groups


@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.view_copy.default, view=True)
def _view(ctx, a, shape):
    out_shape = shape_of(ctx.meta)
    return _remap(ctx, a, lambda idx: reshape_index(idx, a.shape, out_shape))


@register(aten.alias.default, aten.detach.default, view=True)
def _alias(ctx, a):
    return _remap(ctx, a, lambda idx: idx)


@register(aten.permute.default, view=True)
def _permute(ctx, a, dims):
    n = len(a.shape)
    dims = [_norm_dim(d, n) for d in dims]

    def fn(idx):
        out = [None] * n
        for k, d in enumerate(dims):
            out[d] = idx[k]
        return out
    return _remap(ctx, a, fn)


@register(aten.transpose.int, view=True)
def _transpose(ctx, a, d0, d1):
    dims, n = list(range(len(a.shape))), len(a.shape)
    dims[_norm_dim(d0, n)], dims[_norm_dim(d1, n)] = dims[_norm_dim(d1, n)], dims[_norm_dim(d0, n)]
    return _permute(ctx, a, dims)


@register(aten.t.default, view=True)
def _t(ctx, a):
    return _remap(ctx, a, lambda idx: list(reversed(idx)))


@register(aten.expand.default, view=True)
def _expand(ctx, a, sizes, implicit=False):
    out_shape = shape_of(ctx.meta)
    return _remap(ctx, a, lambda idx: broadcast(idx, a.shape, out_shape))


@register(aten.unsqueeze.default, view=True)
def _unsqueeze(ctx, a, dim):
    d = _norm_dim(dim, len(a.shape) + 1)
    return _remap(ctx, a, lambda idx: idx[:d] + idx[d + 1:])


@register(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, view=True)
def _squeeze(ctx, a, dims=None):
    n = len(a.shape)
    if dims is None:
        dims = [i for i in range(n) if a.shape[i] == 1]
    elif isinstance(dims, int):
        dims = [dims]
    dims = {_norm_dim(d, n) for d in dims if a.shape[_norm_dim(d, n)] == 1}
    return _remap(ctx, a, lambda idx: unsqueeze_index(idx, dims, n))


def unsqueeze_index(idx, dims, n):
    """The rank-``n`` index of ``idx`` with 0 inserted at ``dims``."""
    it = iter(idx)
    return [ZERO if i in dims else next(it) for i in range(n)]


def _clamp_index(v, size):
    v = sympy.sympify(v)
    if v.is_Integer and size.is_Integer:
        v = int(v)
        if v < 0:
            v += int(size)
        return sympy.Integer(min(max(v, 0), int(size)))
    return size + v if v.is_Integer and int(v) < 0 else v


@register(aten.slice.Tensor, view=True)
def _slice(ctx, a, dim=0, start=None, end=None, step=1):
    n = len(a.shape)
    d = _norm_dim(dim, n)
    start = _clamp_index(0 if start is None else start, a.shape[d])

    def fn(idx):
        idx = list(idx)
        idx[d] = start + step * idx[d]
        return idx
    return _remap(ctx, a, fn)


@register(aten.select.int, view=True)
def _select(ctx, a, dim, index):
    n = len(a.shape)
    d = _norm_dim(dim, n)
    index = sympy.sympify(index)
    if index.is_Integer and index < 0:
        index = a.shape[d] + index
    return _remap(ctx, a, lambda idx: list(idx[:d]) + [index] + list(idx[d:]))


@register(aten.flip.default)
def _flip(ctx, a, dims):
    n = len(a.shape)
    dims = {_norm_dim(d, n) for d in dims}
    return ctx.pointwise(lambda idx: a([a.shape[i] - 1 - v if i in dims else v for i, v in enumerate(idx)]))


@register(aten.roll.default)
def _roll(ctx, a, shifts, dims=()):
    n = len(a.shape)
    if not dims:
        raise Unsupported("roll without dims")
    shifts = dict(zip([_norm_dim(d, n) for d in dims], shifts))
    for d, s in shifts.items():
        if not (sympy.sympify(s).is_Integer and a.shape[d].is_Integer):
            raise Unsupported("symbolic roll")

    def fn(idx):
        out = []
        for i, v in enumerate(idx):
            if i in shifts:
                size = int(a.shape[i])
                v = ModIdx(v + (size - int(shifts[i]) % size), ONE, a.shape[i])
            out.append(v)
        return out
    return ctx.pointwise(lambda idx: a(fn(idx)))
