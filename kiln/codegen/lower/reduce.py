"""Lowerings of reductions and the normalizations built from them.

``reduce()`` makes one ``Reduction``, always its own buffer (the scheduler decides how it splits). Softmax,
layer norm, var/std and losses are a few reductions plus pointwise epilogues, which the scheduler fuses
into one kernel per row; variance is two-pass (mean, then sum of squared deviations) within it.
"""
import sympy
import torch

from kiln.codegen.ir.indexing import ONE, ZERO, numel
from kiln.codegen.ir.loops import Pointwise, Reduction, Unsupported, ops, upcast
from kiln.codegen.lower.base import aten, register, shape_of, value_at
from kiln.codegen.lower.index import checker, indirect
from kiln.codegen.lower.pointwise import E, add, div, mul, sub, un
from kiln.codegen.lower.view import reshape_index, unsqueeze_index


def _dims(dims, n):
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(n))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({d + n if d < 0 else d for d in dims})


def out_shape(shape, dims, keepdim):
    return tuple(ONE if i in dims else s for i, s in enumerate(shape)) if keepdim else \
        tuple(s for i, s in enumerate(shape) if i not in dims)


def reduce(ctx, kind, a: Pointwise, dims, keepdim=False, dtype=None, acc=None, body=None) -> Pointwise:
    """A ``kind`` reduction of ``a`` over ``dims``; ``body(full_index)`` overrides the element."""
    dims = _dims(dims, len(a.shape))
    dtype = dtype or a.dtype
    acc = acc or upcast(dtype)
    fn = body or (lambda idx: ops.cast(a(idx), acc))
    red = Reduction(kind, a.shape, tuple(dims), fn, acc, dtype, out_shape(a.shape, dims, keepdim))
    return ctx.reduction(red, a.device)


def keep_index(idx, dims):
    """Index of a keepdim reduction result for full-space index ``idx``."""
    return [ZERO if i in dims else v for i, v in enumerate(idx)]


@register(aten.sum.dim_IntList, aten.sum.default, aten.prod.default, aten.prod.dim_int)
def _sum(ctx, a, dims=None, keepdim=False, dtype=None):
    return reduce(ctx, ctx.node.target._opname, a, dims, keepdim, ctx.meta.dtype)


@register(aten.mean.dim, aten.mean.default)
def _mean(ctx, a, dims=None, keepdim=False, dtype=None):
    meta = ctx.meta
    dims_ = _dims(dims, len(a.shape))
    total = reduce(ctx, "sum", a, dims_, keepdim, meta.dtype)
    count = numel(a.shape, dims_)
    return ctx.pointwise(lambda idx: div(total(idx), _count(count, upcast(meta.dtype))))


def _count(count, dtype):
    return ops.const(int(count), dtype) if count.is_Integer else ops.cast(ops.index(count), dtype)


@register(aten.amax, aten.amin, aten.max.default, aten.min.default)
def _amax(ctx, a, dims=(), keepdim=False):
    return reduce(ctx, ctx.node.target._opname[-3:], a, dims, keepdim)   # (a)max or (a)min


@register(aten.max.dim, aten.min.dim)
def _max_dim(ctx, a, dim, keepdim=False):
    is_max = ctx.node.target == aten.max.dim
    values = reduce(ctx, "max" if is_max else "min", a, [dim], keepdim)
    indices = reduce(ctx, "argmax" if is_max else "argmin", a, [dim], keepdim, torch.int64, upcast(a.dtype))
    return (values, indices)


@register(aten.argmax.default, aten.argmin.default)
def _argmax(ctx, a, dim=None, keepdim=False):
    if dim is None and keepdim:
        raise Unsupported("argmax keepdim without dim")
    return reduce(ctx, ctx.node.target._opname, a, dim, keepdim, torch.int64, upcast(a.dtype))


@register(aten.any.default, aten.any.dim, aten.any.dims, aten.all.default, aten.all.dim, aten.all.dims)
def _any(ctx, a, dim=None, keepdim=False):
    """The max (any) or min (all) of the elements as int8 0 or 1, then ``> 0``: an empty reduction leaves
    the int8 neutral, -128 or 127 (``!= 0`` made any of nothing True)."""
    kind = "max" if ctx.node.target.overloadpacket == aten.any else "min"
    body = lambda idx: ops.cast(ops.unary("logical_not", ops.unary("logical_not", ops.cast(a(idx), torch.bool))),
                                torch.int8)  # noqa: E731
    red = reduce(ctx, kind, a, dim, keepdim, torch.int8, torch.int8, body)
    return ctx.pointwise(lambda idx: E.bin("gt", red(idx), 0))


def variance(ctx, a, dims, correction, keepdim, dtype):
    """(var, mean) by two passes in one kernel: mean, then the sum of squared deviations."""
    n = len(a.shape)
    dims = _dims(dims, n)
    acc = upcast(dtype)
    count = numel(a.shape, dims)
    total = reduce(ctx, "sum", a, dims, True, dtype, acc)
    cnt = _count(count, acc)
    mean_k = lambda idx: div(total(keep_index(idx, dims)), cnt)  # noqa: E731

    def sq(idx):
        d = sub(ops.cast(a(idx), acc), mean_k(idx))
        return mul(d, d)
    m2 = reduce(ctx, "sum", a, dims, True, dtype, acc, sq)
    corr = correction if correction is not None else 1
    denom = _count(count - corr, acc) if isinstance(count, sympy.Basic) and not count.is_Integer else \
        ops.const(max(int(count) - corr, 0), acc)
    keep = (lambda idx: idx) if keepdim else (lambda idx: unsqueeze_index(idx, dims, n))
    var = Pointwise(out_shape(a.shape, dims, keepdim), dtype, a.device, lambda idx: div(m2(keep(idx)), denom))
    mean = Pointwise(out_shape(a.shape, dims, keepdim), dtype, a.device, lambda idx: mean_k(keep(idx)))
    return var, mean


@register(aten.var.correction, aten.var.dim, aten.std.correction, aten.std.dim)
def _var(ctx, a, dims=None, unbiased=None, keepdim=False, correction=None):
    if ctx.node.target in (aten.var.dim, aten.std.dim):
        correction = 1 if unbiased in (None, True) else 0
    var = variance(ctx, a, dims, correction, keepdim, ctx.meta.dtype)[0]
    return var if ctx.node.target._opname == "var" else ctx.pointwise(lambda idx: un("sqrt", var(idx)))


@register(aten.var_mean.correction)
def _var_mean(ctx, a, dims=None, correction=None, keepdim=False):
    return variance(ctx, a, dims, correction, keepdim, ctx.meta[0].dtype)


@register(aten.logsumexp.default)
def _logsumexp(ctx, a, dims, keepdim=False):
    dims = _dims(dims, len(a.shape))
    acc = upcast(ctx.meta.dtype)
    m = reduce(ctx, "max", a, dims, True, a.dtype, upcast(a.dtype))
    safe = lambda idx: (lambda v: ops.where(un("isinf", v), E.c(0, v), v))(ops.cast(m(keep_index(idx, dims)), acc))  # noqa
    s = reduce(ctx, "sum", a, dims, True, acc, acc, lambda idx: un("exp", sub(ops.cast(a(idx), acc), safe(idx))))
    keep = (lambda idx: idx) if keepdim else (lambda idx: unsqueeze_index(idx, dims, len(a.shape)))
    return ctx.pointwise(lambda idx: add(un("log", s(keep(idx))), safe(keep(idx))))


@register(aten._softmax.default, aten._log_softmax.default)
def _softmax(ctx, a, dim, half_to_float=False):
    dims = _dims(dim, len(a.shape))
    acc = upcast(ctx.meta.dtype)
    m = reduce(ctx, "max", a, dims, True, a.dtype, upcast(a.dtype))
    shifted = lambda idx: sub(ops.cast(a(idx), acc), ops.cast(m(keep_index(idx, dims)), acc))  # noqa: E731
    s = reduce(ctx, "sum", a, dims, True, acc, acc, lambda idx: un("exp", shifted(idx)))
    if ctx.node.target is aten._softmax.default:
        return ctx.pointwise(lambda idx: div(un("exp", shifted(idx)), s(keep_index(idx, dims))))
    return ctx.pointwise(lambda idx: sub(shifted(idx), un("log", s(keep_index(idx, dims)))))


@register(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def _softmax_backward(ctx, grad, out, dim, input_dtype):
    dims = _dims(dim, len(out.shape))
    acc = upcast(ctx.meta.dtype)
    g = lambda idx: ops.cast(grad(idx), acc)  # noqa: E731
    y = lambda idx: ops.cast(out(idx), acc)  # noqa: E731
    if ctx.node.target is aten._softmax_backward_data.default:
        s = reduce(ctx, "sum", out, dims, True, acc, acc, lambda idx: mul(g(idx), y(idx)))
        return ctx.pointwise(lambda idx: mul(y(idx), sub(g(idx), s(keep_index(idx, dims)))))
    s = reduce(ctx, "sum", grad, dims, True, acc, acc, g)   # log-softmax's
    return ctx.pointwise(lambda idx: sub(g(idx), mul(un("exp", y(idx)), s(keep_index(idx, dims)))))


@register(aten.native_layer_norm.default)
def _layer_norm(ctx, x, normalized_shape, weight, bias, eps):
    n = len(x.shape)
    dims = list(range(n - len(normalized_shape), n))
    out_meta = ctx.meta[0]
    acc = upcast(out_meta.dtype)
    var, mean = variance(ctx, x, dims, 0, True, acc)
    rstd = Pointwise(var.shape, acc, x.device, lambda idx: un("rsqrt", add(var(idx), float(eps))))
    shape = x.shape

    def out(idx):
        k = keep_index(idx, dims)
        y = mul(sub(ops.cast(x(idx), acc), mean(k)), rstd(k))
        if weight is not None:
            y = mul(y, value_at(weight, idx, shape, acc))
        if bias is not None:
            y = add(y, value_at(bias, idx, shape, acc))
        return y
    mean_out = _reshaped(mean, ctx.meta[1])
    rstd_out = _reshaped(rstd, ctx.meta[2])
    return (Pointwise(shape, out_meta.dtype, x.device, out), mean_out, rstd_out)


def _reshaped(v, meta):
    """``v`` (keepdim shape) presented with ``meta``'s shape (same numel, 1s dropped or kept)."""
    shape = tuple(shape_of(meta))
    if shape == v.shape:
        return Pointwise(shape, meta.dtype, v.device, v)
    return Pointwise(shape, meta.dtype, v.device, lambda idx: v(reshape_index(idx, v.shape, shape)))


@register(aten.native_layer_norm_backward.default)
def _layer_norm_backward(ctx, grad, x, normalized_shape, mean, rstd, weight, bias, mask):
    n = len(x.shape)
    k = len(normalized_shape)
    dims, outer = list(range(n - k, n)), list(range(n - k))
    acc = upcast(ctx.meta[0].dtype if ctx.meta[0] is not None else x.dtype)
    shape = x.shape
    count = numel(shape, dims)
    g = lambda idx: ops.cast(grad(idx), acc)  # noqa: E731
    mu = lambda idx: value_at(mean, keep_index(idx, dims), shape, acc)  # noqa: E731
    rs = lambda idx: value_at(rstd, keep_index(idx, dims), shape, acc)  # noqa: E731
    xhat = lambda idx: mul(sub(ops.cast(x(idx), acc), mu(idx)), rs(idx))  # noqa: E731
    w = (lambda idx: value_at(weight, idx, shape, acc)) if weight is not None else (lambda idx: ops.const(1, acc))
    gw = lambda idx: mul(g(idx), w(idx))  # noqa: E731
    outs = [None, None, None]
    if mask[0]:
        s1 = reduce(ctx, "sum", x, dims, True, acc, acc, gw)
        s2 = reduce(ctx, "sum", x, dims, True, acc, acc, lambda idx: mul(gw(idx), xhat(idx)))

        def gx(idx):
            kk = keep_index(idx, dims)
            inner = sub(sub(mul(gw(idx), _count(count, acc)), s1(kk)), mul(xhat(idx), s2(kk)))
            return mul(div(rs(idx), _count(count, acc)), inner)
        outs[0] = Pointwise(shape, ctx.meta[0].dtype, x.device, gx)
    if mask[1] and weight is not None:
        s = reduce(ctx, "sum", x, outer, False, ctx.meta[1].dtype, acc, lambda idx: mul(g(idx), xhat(idx)))
        outs[1] = _reshaped(s, ctx.meta[1])
    if mask[2] and bias is not None:
        s = reduce(ctx, "sum", x, outer, False, ctx.meta[2].dtype, acc, g)
        outs[2] = _reshaped(s, ctx.meta[2])
    return tuple(outs)


def _nll_parts(ctx, x, target, weight, ignore_index):
    """Per-sample (loss, weight) value functions for nll_loss over class dim 1 (or 0 for 1-D)."""
    cdim = 1 if len(x.shape) >= 2 else 0
    acc = upcast(x.dtype)
    sym = checker(ctx, "nll")

    def pick(idx):
        t = target(idx)
        valid = E.bin("ne", t, ignore_index)
        safe = ops.where(valid, t, E.c(0, t))
        full = list(idx[:cdim]) + [None] + list(idx[cdim:])
        xv = indirect(sym, x, full, cdim, safe)
        wv = indirect(sym, weight, [None], 0, safe) if weight is not None else ops.const(1, acc)
        wv = ops.where(valid, ops.cast(wv, acc), ops.const(0, acc))
        return ops.cast(xv, acc), wv
    return pick, acc


@register(aten.nll_loss_forward.default)
def _nll_loss_forward(ctx, x, target, weight, reduction, ignore_index):
    pick, acc = _nll_parts(ctx, x, target, weight, ignore_index)
    dtype = ctx.meta[0].dtype
    loss = lambda idx: (lambda xv, wv: ops.unary("neg", mul(xv, wv)))(*pick(idx))  # noqa: E731
    tshape = target.shape
    per = Pointwise(tshape, dtype, x.device, loss)
    wsum = Pointwise(tshape, acc, x.device, lambda idx: pick(idx)[1])
    total_w = reduce(ctx, "sum", wsum, None, False, acc, acc)
    if reduction == 0:  # none
        return (per, _reshaped(total_w, ctx.meta[1]))
    s = reduce(ctx, "sum", per, None, False, dtype, acc)
    if reduction == 2:  # sum
        return (s, _reshaped(total_w, ctx.meta[1]))
    return (Pointwise((), dtype, x.device, lambda idx: div(s(idx), total_w(idx))), _reshaped(total_w, ctx.meta[1]))


@register(aten.nll_loss_backward.default)
def _nll_loss_backward(ctx, grad, x, target, weight, reduction, ignore_index, total_weight):
    cdim = 1 if len(x.shape) >= 2 else 0
    acc = upcast(ctx.meta.dtype)

    def fn(idx):
        tidx = list(idx[:cdim]) + list(idx[cdim + 1:])
        t = target(tidx)
        c = ops.index(idx[cdim])
        valid = E.bin("ne", t, ignore_index)
        hit = ops.binary("logical_and", E.bin("eq", t, c), valid)
        w = ops.cast(weight([idx[cdim]]), acc) if weight is not None else ops.const(1, acc)
        g = value_at(grad, tidx, grad.shape, acc) if reduction == 0 else ops.cast(grad([]), acc)
        if reduction == 1:
            g = div(g, ops.cast(total_weight([]), acc))
        return ops.where(hit, ops.unary("neg", mul(w, g)), ops.const(0, acc))
    return ctx.pointwise(fn)
