"""Lowerings that index with tensors, concatenate or pad (gather, index, embedding, cat, stack, pad,
select/slice_scatter), and the scatters that write through an index (scatter_add, index_put, embedding
backward). An indirect index is an ``ind*`` symbol bound to a ``checked`` value (``ir/bounds.py``) naming
eager's error for the op; concatenation and padding read each source under a mask (``masked``).
"""
import sympy
import torch

from kiln.codegen.ir.bounds import CheckInfo, checked
from kiln.codegen.ir.indexing import ZERO, FloorDiv, contiguous_strides, flat_index
from kiln.codegen.ir.loops import (Buffer, Pointwise, Scatter, Unsupported, indirect_symbol, meta_layout, new_name, ops,
                                  upcast)
from kiln.codegen.lower.base import aten, broadcast, register, shape_of, value_at
from kiln.codegen.lower.pointwise import E


def wrap(e, size):
    """A possibly negative int64 index made non-negative (Python-style wrap)."""
    e = ops.cast(e, torch.int64)
    return ops.where(E.bin("lt", e, 0), ops.binary("add", e, _size(size)), e)


def _size(size):
    return ops.const(int(size), torch.int64) if size.is_Integer else ops.index(size)


# ops whose decompositions index (the node's ``original_aten``): their error, and whether they wrap
MADE_BY = {"nll_loss_forward": ("nll", False), "nll_loss2d_forward": ("nll", False), "embedding": ("self", False),
           "take": ("take", True), "index_copy": ("index_copy", False)}


def checker(ctx, kind: str, wraps: bool = False):
    """``sym(e, size, dim)``: the index symbol of runtime int value ``e`` into dim ``dim`` of ``size``,
    checked as eager checks op ``kind`` (``wraps``: a negative index counts from the end), or wrapped and
    unchecked under ``index_checks='never'``. Made while the lowering runs (its values are computed later)."""
    mode = ctx.opts.index_checks
    made_by = getattr(ctx.node.meta.get("original_aten"), "_opname", "") if ctx.node is not None else ""
    kind, wraps = MADE_BY.get(made_by, (kind, wraps))   # a decomposed op's error: nll_loss's gather, take's index
    if made_by == "index_add":   # its index_put: eager's index_add raises as a scatter, or (1-D) as index_select
        kind, wraps = ("self" if _rank(ctx.node.args[0]) == 1 else "scatter"), False

    def sym(e, size, dim):
        if mode == "never":
            return indirect_symbol(wrap(e, size))
        # a message without a dim: one check of a value read at two dims (a target picking a logit and a weight)
        info = CheckInfo(kind, 0 if kind in ("self", "dim1", "nll", "take") else dim, wraps, mode == "always")
        return indirect_symbol(checked(e, size, info))
    return sym


def _rank(node) -> int:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else -1


def indirect(sym, v: Pointwise, idx, dim, e):
    """``v`` at ``idx`` with position ``dim`` replaced by the runtime int value ``e`` (``checker``'s ``sym``)."""
    idx = list(idx)
    idx[dim] = sym(e, v.shape[dim], dim)
    return v(idx)


@register(aten.gather.default)
def _gather(ctx, x, dim, index, sparse_grad=False):
    d = dim % max(len(x.shape), 1)
    sym = checker(ctx, "gather")
    return ctx.pointwise(lambda idx: indirect(sym, x, idx, d, index(idx)) if len(x.shape) else x([]))


@register(aten.index_select.default)
def _index_select(ctx, x, dim, index):
    d = dim % max(len(x.shape), 1)
    sym = checker(ctx, "dim1" if d == 1 else "self")   # eager's CPU kernel for dim 1 has a message of its own
    return ctx.pointwise(lambda idx: indirect(sym, x, idx, d, index([idx[d]] if len(index.shape) else [])))


@register(aten.embedding.default)
def _embedding(ctx, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    k = len(indices.shape)
    sym = checker(ctx, "self")
    return ctx.pointwise(lambda idx: indirect(sym, weight, [None, idx[k]], 0, indices(idx[:k])))


@register(aten.index.Tensor)
def _index(ctx, x, indices):
    indices = list(indices) + [None] * (len(x.shape) - len(indices))
    pos = [i for i, t in enumerate(indices) if t is not None]
    if not pos:
        raise Unsupported("index without tensors")
    if any(indices[i].dtype in (torch.bool, torch.uint8) for i in pos):
        raise Unsupported("boolean mask index (data-dependent shape)")
    bshape = _broadcast_shape([indices[i].shape for i in pos])
    adjacent = pos == list(range(pos[0], pos[-1] + 1))
    nb = len(bshape)
    sym = checker(ctx, "index", True)

    def fn(idx):
        if adjacent:
            before, bidx, after = idx[:pos[0]], idx[pos[0]:pos[0] + nb], idx[pos[0] + nb:]
            rest = list(before) + list(after)
        else:
            bidx, rest = idx[:nb], list(idx[nb:])
        full, it = [], iter(rest)
        for i in range(len(x.shape)):
            if indices[i] is None:
                full.append(next(it))
            else:
                t = indices[i]
                # eager's message counts the dims indexed by tensors (x[:, i] is its dimension 0)
                full.append(sym(t(broadcast(bidx, t.shape, bshape)), x.shape[i], pos.index(i)))
        return x(full)
    return ctx.pointwise(fn)


def _broadcast_shape(shapes):
    n = max(len(s) for s in shapes)
    out = []
    for k in range(n):
        size = sympy.Integer(1)
        for s in shapes:
            j = k - (n - len(s))
            if j >= 0 and s[j] != 1:
                size = s[j]
        out.append(size)
    return out


@register(aten.cat.default)
def _cat(ctx, tensors, dim=0):
    d = dim % len(ctx.meta.shape)
    parts = [t for t in tensors if not (len(t.shape) == 1 and t.shape[0] == 0)]
    compute = upcast(ctx.meta.dtype)

    def fn(idx):
        pieces, off = [], ZERO
        for t in parts:
            pieces.append((t, off, off + t.shape[d]))
            off = off + t.shape[d]
        out = None
        for k, (t, start, end) in enumerate(reversed(pieces)):
            sub = list(idx)
            sub[d] = idx[d] - start
            i = ops.index(idx[d])
            conds = ([ops.binary("ge", i, _size(sympy.sympify(start)))] if start != 0 else []) + \
                ([ops.binary("lt", i, _size(sympy.sympify(end)))] if k != 0 else [])
            val = ops.cast(t(sub), compute)
            if conds:
                cond = conds[0] if len(conds) == 1 else ops.binary("logical_and", *conds)
                val = ops.masked(cond, val, ops.const(0, compute))
                val = val if out is None else ops.where(cond, val, out)
            out = val
        return out
    return ctx.pointwise(fn)


@register(aten.stack.default)
def _stack(ctx, tensors, dim=0):
    shape = shape_of(ctx.meta)
    d = dim % len(shape)
    compute = upcast(ctx.meta.dtype)

    def fn(idx):
        rest = list(idx[:d]) + list(idx[d + 1:])
        out = ops.cast(tensors[-1](rest), compute)
        for k in reversed(range(len(tensors) - 1)):
            cond = ops.binary("eq", ops.index(idx[d]), ops.const(k, torch.int64))
            out = ops.where(cond, ops.masked(cond, ops.cast(tensors[k](rest), compute), ops.const(0, compute)), out)
        return out
    return ctx.pointwise(fn)


@register(aten.constant_pad_nd.default)
def _pad(ctx, x, pad, value=0):
    n = len(x.shape)
    compute = upcast(ctx.meta.dtype)
    lefts = {n - 1 - k // 2: pad[k] for k in range(0, len(pad), 2)}

    def fn(idx):
        src, cond = list(idx), None
        for d, left in lefts.items():
            src[d] = idx[d] - left
            i = ops.index(src[d])
            ok = ops.binary("logical_and", E.bin("ge", i, 0), E.bin("lt", i, _size(x.shape[d])))
            cond = ok if cond is None else ops.binary("logical_and", cond, ok)
        val = ops.cast(x(src), compute)
        return val if cond is None else ops.masked(cond, val, ops.const(value, compute))
    return ctx.pointwise(fn)


@register(aten.select_scatter.default)
def _select_scatter(ctx, base, src, dim, index):
    d = dim % len(base.shape)
    shape = shape_of(ctx.meta)
    compute = upcast(ctx.meta.dtype)
    index = sympy.sympify(index)
    if index.is_Integer and index < 0:
        index = base.shape[d] + index

    def fn(idx):
        hit = ops.binary("eq", ops.index(idx[d]), _size(sympy.sympify(index)))
        rest = list(idx[:d]) + list(idx[d + 1:])
        return ops.where(hit, ops.cast(src(rest), compute), value_at(base, idx, shape, compute))
    return ctx.pointwise(fn)


@register(aten.slice_scatter.default)
def _slice_scatter(ctx, base, src, dim=0, start=None, end=None, step=1):
    d = dim % len(base.shape)
    shape = shape_of(ctx.meta)
    compute = upcast(ctx.meta.dtype)
    size = base.shape[d]
    start = sympy.sympify(0 if start is None else start)
    if start.is_Integer and start < 0:
        start = start + size
        if start.is_Integer and start < 0:   # clamped as slice clamps it (fuzz seed 12 #4827: [-2:1:3] of 1)
            start = sympy.Integer(0)
    length = src.shape[d]

    def fn(idx):
        i = ops.index(idx[d] - start)
        cond = ops.binary("logical_and", E.bin("ge", i, 0), E.bin("lt", i, _size(sympy.sympify(length * step))))
        if step != 1:
            cond = ops.binary("logical_and", cond, E.bin("eq", E.bin("remainder", i, step), 0))
        sub = list(idx)
        sub[d] = FloorDiv(idx[d] - start, step) if step != 1 else idx[d] - start
        val = ops.masked(cond, ops.cast(src(sub), compute), ops.const(0, compute))
        return ops.where(cond, val, value_at(base, idx, shape, compute))
    return ctx.pointwise(fn)


# -- scatters: writes through an index, on top of a copy of the base --------------------------
def _scatter(ctx, base, shape, target, value, mode):
    """Write ``value(idx)`` at output index ``target(idx)`` for each ``idx`` of ``shape``."""
    meta = ctx.meta
    out_shape, out_stride = meta_layout(meta)
    if tuple(out_stride) != contiguous_strides(out_shape):
        raise Unsupported("scatter into a non-contiguous layout")
    buf = Buffer(new_name(), out_shape, out_stride, meta.dtype, meta.device, "scatter", None,
                 Scatter(base, tuple(shape), lambda idx: flat_index(target(idx), out_stride), value, mode))
    if mode == "add" and meta.dtype in (torch.bool, torch.int8, torch.uint8, torch.int16):
        raise Unsupported("atomic add on small ints")
    return ctx.add_buffer(buf)


@register(aten.scatter_add.default, aten.scatter.src, aten.scatter.value)
def _scatter_add(ctx, x, dim, index, src):
    d = dim % max(len(x.shape), 1)
    compute = upcast(ctx.meta.dtype)
    mode = "add" if ctx.node.target == aten.scatter_add.default else "set"
    sym = checker(ctx, "scatter")

    def target(idx):
        full = list(idx)
        full[d] = sym(index(idx), x.shape[d], d)
        return full
    value = (lambda idx: value_at(src, idx, index.shape, compute))
    return _scatter(ctx, x, index.shape, target, value, mode)


@register(aten.index_put.default)
def _index_put(ctx, x, indices, values, accumulate=False):
    indices = list(indices) + [None] * (len(x.shape) - len(indices))
    pos = [i for i, t in enumerate(indices) if t is not None]
    if not pos or any(indices[i].dtype in (torch.bool, torch.uint8) for i in pos):
        raise Unsupported("index_put with a boolean mask")
    if pos != list(range(len(pos))):
        raise Unsupported("index_put on non-leading dims")
    bshape = _broadcast_shape([indices[i].shape for i in pos])
    shape = list(bshape) + list(x.shape[len(pos):])
    compute = upcast(ctx.meta.dtype)
    nb = len(bshape)
    sym = checker(ctx, "index", True)

    def target(idx):
        return [sym(indices[i](broadcast(idx[:nb], indices[i].shape, bshape)), x.shape[i], i)
                for i in pos] + list(idx[nb:])
    value = (lambda idx: value_at(values, idx, shape, compute))
    return _scatter(ctx, x, shape, target, value, "add" if accumulate else "set")


@register(aten.index_add.default)
def _index_add(ctx, x, dim, index, source, alpha=1):
    d = dim % max(len(x.shape), 1)
    compute = upcast(ctx.meta.dtype)
    sym = checker(ctx, "self" if len(x.shape) == 1 else "scatter")   # eager's two messages

    def target(idx):
        full = list(idx)
        full[d] = sym(index([idx[d]]), x.shape[d], d)
        return full

    def value(idx):
        v = value_at(source, idx, source.shape, compute)
        return v if alpha == 1 else ops.binary("mul", v, ops.const(alpha, compute))
    return _scatter(ctx, x, source.shape, target, value, "add")


@register(aten.embedding_dense_backward.default)
def _embedding_backward(ctx, grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    if scale_grad_by_freq:
        raise Unsupported("scale_grad_by_freq")
    compute = upcast(ctx.meta.dtype)
    k = len(indices.shape)
    out_shape = shape_of(ctx.meta)
    zeros = Pointwise(out_shape, ctx.meta.dtype, grad.device, lambda idx: ops.const(0, compute))
    sym = checker(ctx, "self")

    def target(idx):
        return [sym(indices(idx[:k]), out_shape[0], 0), idx[k]]

    def value(idx):
        g = ops.cast(grad(idx), compute)
        if padding_idx is None or padding_idx < 0:
            return g
        return ops.where(E.bin("eq", indices(idx[:k]), padding_idx), ops.const(0, compute), g)
    return _scatter(ctx, zeros, list(indices.shape) + [out_shape[1]], target, value, "add")
