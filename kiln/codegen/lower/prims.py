"""Lowerings of ``torch.ops.prims`` that decompositions (``torch._refs``) leave in graphs.

Elementwise prims share the ATen lowerings; views are index remaps; reductions never keep dims.
"""
import torch
import torch._prims  # noqa: F401  (registers the prims namespace)

from kiln.codegen.ir.indexing import ZERO, size_expr
from kiln.codegen.lower.base import register
from kiln.codegen.lower.pointwise import UNARY, _binary, _compare, _unary, int_division
from kiln.codegen.lower.pointwise import _where as aten_where
from kiln.codegen.lower import view
from kiln.codegen.lower.reduce import reduce, variance
from kiln.codegen.lower.view import _remap, _view

prims = torch.ops.prims


def _ops(*names):
    """The default overloads of the prims that exist in this torch version."""
    return [getattr(prims, n).default for n in names if hasattr(prims, n)]


for _name in ("add", "sub", "mul", "maximum", "minimum", "atan2", "bitwise_and", "bitwise_or",
              "bitwise_xor", "remainder", "fmod", "pow", "hypot", "copysign"):
    register(*_ops(_name))(int_division(_binary(_name)) if _name in ("remainder", "fmod") else _binary(_name))
for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    register(*_ops(_name))(_compare(_name))
for _name in UNARY:
    register(*_ops(_name))(_unary(_name))
register(*_ops("where"))(aten_where)


@register(*_ops("div"))
@int_division
def _div(ctx, a, b):
    return _binary("truediv" if ctx.meta.dtype.is_floating_point else "truncdiv")(ctx, a, b)


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


@register(*_ops("reshape", "collapse_view", "split_dim", "collapse"))
def _reshape(ctx, a, *args):
    return _view(ctx, a, None)


@register(*_ops("slice"))
def _slice(ctx, a, start_indices, limit_indices, strides=None):
    strides = strides or [1] * len(a.shape)
    return _remap(ctx, a, lambda idx: [size_expr(s) + st * i for i, s, st in zip(idx, start_indices, strides)])


# the same index maps as ATen's (prims' dims are never negative; squeeze's are size 1)
register(*_ops("squeeze"))(view._squeeze)
register(*_ops("view_of"))(view._alias)
register(*_ops("transpose"))(view._permute)
register(*_ops("rev"))(view._flip)
