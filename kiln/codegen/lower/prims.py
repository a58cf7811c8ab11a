"""Lowerings of ``torch.ops.prims`` that decompositions (``torch._refs``) leave in graphs.

Elementwise prims share the ATen lowerings; views are index remaps; reductions never keep dims.
"""
from __future__ import annotations

import torch
import torch._prims  # noqa: F401  (registers the prims namespace)

from kiln.codegen.ir.indexing import ZERO, size_expr
from kiln.codegen.lower.base import register
from kiln.codegen.lower.pointwise import E, _binary, _compare, _unary, elementwise, int_division
from kiln.codegen.lower.pointwise import _where as aten_where
from kiln.codegen.lower.reduce import reduce, variance
from kiln.codegen.lower.view import _remap, _view

prims = torch.ops.prims


def _ops(*names):
    """The default overloads of the prims that exist in this torch version."""
    return [getattr(prims, n).default for n in names if hasattr(prims, n)]


for _name in ("add", "sub", "mul", "maximum", "minimum", "atan2", "bitwise_and", "bitwise_or",
              "bitwise_xor", "remainder", "fmod", "pow", "hypot", "copysign"):
    if hasattr(prims, _name):
        _lowering = _binary(_name)
        register(getattr(prims, _name).default)(int_division(_lowering) if _name in ("remainder", "fmod")
                                                 else _lowering)
for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    register(getattr(prims, _name).default)(_compare(_name))
for _name in ("neg", "abs", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt",
              "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh",
              "atanh", "erf", "erfc", "floor", "ceil", "trunc", "sign", "reciprocal", "bitwise_not",
              "lgamma", "round"):
    if hasattr(prims, _name):
        register(getattr(prims, _name).default)(_unary(_name))


@register(*_ops("div"))
@int_division
def _div(ctx, a, b):
    if ctx.meta.dtype.is_floating_point:
        return elementwise(ctx, lambda x, y: E.bin("truediv", x, y), a, b)
    return elementwise(ctx, lambda x, y: E.bin("truncdiv", x, y), a, b)


@register(*_ops("where"))
def _where(ctx, cond, a, b):
    return aten_where(ctx, cond, a, b)


@register(*_ops("sum", "prod", "amax", "amin"))
def _reduce(ctx, a, dims, output_dtype=None):
    kind = {"sum": "sum", "prod": "prod", "amax": "max", "amin": "min"}[ctx.node.target._opname]
    return reduce(ctx, kind, a, list(dims), False, ctx.meta.dtype)


@register(*_ops("var"))
def _var(ctx, a, dims, correction=1, output_dtype=None):
    return variance(ctx, a, list(dims), correction, False, ctx.meta.dtype)[0]


@register(*_ops("broadcast_in_dim"))
def _broadcast_in_dim(ctx, a, shape, broadcast_dimensions):
    dims = list(broadcast_dimensions)
    return _remap(ctx, a, lambda idx: [ZERO if a.shape[k] == 1 else idx[d] for k, d in enumerate(dims)])


@register(*_ops("squeeze"))
def _squeeze(ctx, a, dims):
    n = len(a.shape)
    dims = {d % n for d in dims}

    def fn(idx):
        it = iter(idx)
        return [ZERO if i in dims else next(it) for i in range(n)]
    return _remap(ctx, a, fn)


@register(*_ops("view_of"))
def _view_of(ctx, a):
    return _remap(ctx, a, lambda idx: idx)


@register(*_ops("reshape", "collapse_view", "split_dim", "collapse"))
def _reshape(ctx, a, *args):
    return _view(ctx, a, None)


@register(*_ops("transpose"))
def _transpose(ctx, a, permutation):
    def fn(idx):
        out = [None] * len(a.shape)
        for k, d in enumerate(permutation):
            out[d] = idx[k]
        return out
    return _remap(ctx, a, fn)


@register(*_ops("slice"))
def _slice(ctx, a, start_indices, limit_indices, strides=None):
    strides = strides or [1] * len(a.shape)
    return _remap(ctx, a, lambda idx: [size_expr(s) + st * i for i, s, st in zip(idx, start_indices, strides)])


@register(*_ops("rev"))
def _rev(ctx, a, dims):
    dims = set(dims)
    return ctx.pointwise(lambda idx: a([a.shape[i] - 1 - v if i in dims else v for i, v in enumerate(idx)]))
