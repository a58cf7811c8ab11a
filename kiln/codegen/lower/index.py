"""Lowerings that index with tensors, concatenate or pad (gather, index, embedding, cat, stack, pad,
select/slice_scatter), and the scatters that write through an index (scatter_add, index_put, embedding
backward). An indirect index is an ``ind*`` symbol bound to a ``checked`` value (``ir/bounds.py``) naming
eager's error for the op; concatenation and padding read each source under a mask (``masked``).
"""
import itertools
import math

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
    return v(_put(idx, dim, sym(e, v.shape[dim], dim)))


def _put(idx, dim, e):
    return [*idx[:dim], e, *idx[dim + 1:]]


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
        bidx, rest = (idx[pos[0]:pos[0] + nb], list(idx[:pos[0]]) + list(idx[pos[0] + nb:])) if adjacent else \
            (idx[:nb], list(idx[nb:]))
        it = iter(rest)   # eager's message counts the dims indexed by tensors (x[:, i] is its dimension 0)
        return x([next(it) if t is None else sym(t(broadcast(bidx, t.shape, bshape)), x.shape[i], pos.index(i))
                  for i, t in enumerate(indices)])
    return ctx.pointwise(fn)


def _broadcast_shape(shapes):   # per dim (right-aligned), the last size other than 1
    n = max(len(s) for s in shapes)
    cols = zip(*([sympy.Integer(1)] * (n - len(s)) + list(s) for s in shapes))
    return [next((s for s in reversed(col) if s != 1), sympy.Integer(1)) for col in cols]


@register(aten.cat.default)
def _cat(ctx, tensors, dim=0):
    d = dim % len(ctx.meta.shape)
    parts = [t for t in tensors if not (len(t.shape) == 1 and t.shape[0] == 0)]
    compute = upcast(ctx.meta.dtype)

    def fn(idx):
        offs, out = list(itertools.accumulate((t.shape[d] for t in parts), initial=ZERO)), None
        for k, (t, start, end) in enumerate(reversed(list(zip(parts, offs, offs[1:])))):
            sub, i = _put(idx, d, idx[d] - start), ops.index(idx[d])
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


def _within(e, size):
    i = ops.index(e)
    return ops.binary("logical_and", E.bin("ge", i, 0), E.bin("lt", i, _size(size)))


@register(aten.constant_pad_nd.default)
def _pad(ctx, x, pad, value=0):
    n = len(x.shape)
    compute = upcast(ctx.meta.dtype)
    lefts = {n - 1 - k // 2: pad[k] for k in range(0, len(pad), 2)}

    def fn(idx):
        src, cond = list(idx), None
        for d, left in lefts.items():
            src[d] = idx[d] - left
            ok = _within(src[d], x.shape[d])
            cond = ok if cond is None else ops.binary("logical_and", cond, ok)
        val = ops.cast(x(src), compute)
        return val if cond is None else ops.masked(cond, val, ops.const(value, compute))
    return ctx.pointwise(fn)


@register(aten.max_pool2d_with_indices.default)
def _max_pool2d(ctx, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    """``capture/decomp.py``'s 2-D max pooling (running maximum, NaN wins; ATen's flat index of the first maximum;
    -inf padding), where that declines on symbolic heights or widths: its ~80 ops traced took seconds (#35)."""
    two = lambda v: [v, v] if isinstance(v, int) else list(v) * (3 - len(v))   # noqa: E731  ([k] -> [k, k])
    (kh, kw), (sh, sw), (ph, pw) = map(two, (kernel_size, stride or kernel_size, padding))
    val = ctx.meta[0]   # (ceil mode: the output's size bounds the windows)
    if len(x.shape) != 4 or not val.dtype.is_floating_point or two(dilation) != [1, 1]:
        raise Unsupported("max_pool2d_with_indices: dilated, or not of a 4-D floating-point tensor")
    (H, W), compute = x.shape[2:], upcast(val.dtype)
    low, ninf = lambda e: ops.binary("maximum", ops.index(e), ops.const(0, torch.int64)), ops.const(-math.inf, compute)

    def scan(idx):   # (maximum, index) at output position idx
        n, c, o, w = idx
        best = at = None
        for r, q in ((o * sh + i - ph, w * sw + j - pw) for i in range(kh) for j in range(kw)):
            ok = ops.binary("logical_and", _within(r, H), _within(q, W))
            v, k = ops.masked(ok, ops.cast(x([n, c, r, q]), compute), ninf), ops.index(r * W + q)
            take = best is not None and ops.binary("logical_or", E.bin("gt", v, best), ops.unary("isnan", v))
            best, at = (v, k) if best is None else (ops.where(take, v, best), ops.where(take, k, at))
        # all -inf (padding too): ATen keeps the first element inside the input (the backward writes through it)
        first = ops.binary("add", ops.binary("mul", low(o * sh - ph), _size(W)), low(w * sw - pw))
        return best, ops.where(E.bin("eq", best, ninf), first, at)
    return tuple(ctx.pointwise(lambda idx, k=k: scan(idx)[k], shape_of(val), dtype)
                 for k, dtype in enumerate((val.dtype, torch.int64)))


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
        i, cond = ops.index(idx[d] - start), _within(idx[d] - start, sympy.sympify(length * step))
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

    value = (lambda idx: value_at(src, idx, index.shape, compute))
    return _scatter(ctx, x, index.shape, lambda idx: _put(idx, d, sym(index(idx), x.shape[d], d)), value, mode)


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

    def value(idx):
        v = value_at(source, idx, source.shape, compute)
        return v if alpha == 1 else ops.binary("mul", v, ops.const(alpha, compute))
    return _scatter(ctx, x, source.shape, lambda idx: _put(idx, d, sym(index([idx[d]]), x.shape[d], d)), value, "add")


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
        return g if padding_idx is None or padding_idx < 0 else \
            ops.where(E.bin("eq", indices(idx[:k]), padding_idx), ops.const(0, compute), g)
    return _scatter(ctx, zeros, list(indices.shape) + [out_shape[1]], target, value, "add")
