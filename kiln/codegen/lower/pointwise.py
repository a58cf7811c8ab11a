"""Lowerings of pointwise ATen ops: arithmetic, math, comparisons, casts, where, activations.

Arithmetic happens in ``upcast(out dtype)`` (fp16/bf16 compute in fp32, rounded once at the
store); comparisons promote their operands with torch's rules.
"""
import math

import sympy
import torch

from kiln.codegen.ir.loops import Expr, Pointwise, Unsupported, ops, upcast
from kiln.codegen.lower.base import aten, register, result_dtype, shape_of, value_at


class E:
    """Expr arithmetic with Python numbers promoted to the other operand's dtype."""

    @staticmethod
    def c(v, like):
        return v if isinstance(v, Expr) else ops.const(v, like.dtype)

    @staticmethod
    def bin(op, a, b):
        if not isinstance(a, Expr):
            a = ops.const(a, b.dtype)
        b = E.c(b, a)
        return ops.binary(op, a, b)


def add(a, b): return E.bin("add", a, b)          # noqa: E704
def sub(a, b): return E.bin("sub", a, b)          # noqa: E704
def mul(a, b): return E.bin("mul", a, b)          # noqa: E704
def div(a, b): return E.bin("truediv", a, b)      # noqa: E704
def un(op, a): return ops.unary(op, a)            # noqa: E704


def elementwise(ctx, fn, *inputs, compute=None):
    """A Pointwise over the node's output shape: ``fn(*exprs)`` with tensor/scalar inputs cast to
    ``compute`` (default: upcast of the output dtype)."""
    shape = tuple(shape_of(ctx.meta))
    compute = compute or upcast(ctx.meta.dtype)

    def body(idx):
        return fn(*[value_at(v, idx, shape, compute) for v in inputs])
    return ctx.pointwise(body)


def _binary(op):
    def lower(ctx, a, b, alpha=None):
        def fn(x, y):
            if alpha is not None and alpha != 1:
                y = mul(y, alpha)
            return E.bin(op, x, y)
        return elementwise(ctx, fn, a, b)
    return lower


def int_division(lowering):
    """``lowering`` of a division or remainder, kept ATen for integers divided by a tensor: ATen raises
    on a zero divisor (on the CPU) and a kernel cannot; a nonzero number divides in the kernel."""
    def lower(ctx, a, b, *rest, **kwargs):
        number = isinstance(b, (int, float)) and not isinstance(b, bool)
        if not ctx.meta.dtype.is_floating_point and not (number and b != 0):
            raise Unsupported("integer division by a tensor (ATen raises on a zero divisor)")
        return lowering(ctx, a, b, *rest, **kwargs)
    return lower


def _fminmax(op):
    """fmax/fmin: the maximum/minimum of two numbers, the number where one is NaN (NaN if both are)."""
    def fn(x, y):
        m = E.bin(op, x, y)
        if not x.dtype.is_floating_point:
            return m
        return ops.where(un("isnan", x), y, ops.where(un("isnan", y), x, m))
    return lambda ctx, a, b: elementwise(ctx, fn, a, b)


for _name in ("add", "sub", "mul", "remainder", "fmod", "copysign"):
    _lowering = _binary(_name)
    register(getattr(aten, _name).Tensor, getattr(aten, _name).Scalar)(
        int_division(_lowering) if _name in ("remainder", "fmod") else _lowering)
for _name in ("maximum", "minimum", "atan2", "bitwise_and", "bitwise_or", "bitwise_xor", "hypot"):
    register(getattr(aten, _name))(_binary(_name))
register(aten.fmax)(_fminmax("maximum"))
register(aten.fmin)(_fminmax("minimum"))
register(aten.pow.Tensor_Tensor, aten.pow.Scalar)(_binary("pow"))
register(aten.clamp_min.default, aten.clamp_min.Tensor)(_binary("maximum"))
register(aten.clamp_max.default, aten.clamp_max.Tensor)(_binary("minimum"))
register(aten.floor_divide)(int_division(_binary("floordiv")))   # floats: eager's rounding


@register(aten.rsub.Tensor, aten.rsub.Scalar)
def _rsub(ctx, a, b, alpha=1):
    return elementwise(ctx, lambda x, y: sub(y, mul(x, alpha) if alpha != 1 else x), a, b)


@register(aten.div.Tensor, aten.div.Scalar, aten.true_divide.Tensor, aten.div.Tensor_mode, aten.div.Scalar_mode)
@int_division   # (a true division's result is a float)
def _div(ctx, a, b, rounding_mode=None):
    if rounding_mode is None:
        return elementwise(ctx, div, a, b)
    if ctx.meta.dtype.is_floating_point and rounding_mode == "trunc":
        return elementwise(ctx, lambda x, y: un("trunc", div(x, y)), a, b)
    op = "floordiv" if rounding_mode == "floor" else "truncdiv"
    return elementwise(ctx, lambda x, y: E.bin(op, x, y), a, b)


def _compare(op):
    """A comparison of the operands' values in their own dtype: a 2-byte float operand computed in the same
    kernel is rounded to it first, as eager compares its stored values (max's backward ``eq(x ** 3, amin)``
    in bf16 compared the unrounded cube with the rounded minimum: no element matched, NaN gradients)."""
    def lower(ctx, a, b):
        compute = upcast(result_dtype(a, b))
        shape = tuple(shape_of(ctx.meta))

        def at(v, idx):
            x = value_at(v, idx, shape, compute)
            if isinstance(v, Pointwise) and v.dtype in (torch.bfloat16, torch.float16) and compute != v.dtype:
                return ops.cast(ops.cast(x, v.dtype), compute)   # (a reduction's result too: in fp32 here)
            return x
        return ctx.pointwise(lambda idx: E.bin(op, at(a, idx), at(b, idx)))
    return lower


for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    register(getattr(aten, _name).Tensor, getattr(aten, _name).Scalar)(_compare(_name))


def _logical(op):
    fn = (lambda x: un(op, x)) if op == "logical_not" else (lambda x, y: E.bin(op, x, y))
    return lambda ctx, *args: elementwise(ctx, fn, *args, compute=torch.bool)


for _name in ("logical_and", "logical_or", "logical_xor", "logical_not"):
    register(getattr(aten, _name))(_logical(_name))


def _unary(op, compute_from_input=False):
    def lower(ctx, a):
        compute = upcast(a.dtype) if compute_from_input else None
        return elementwise(ctx, lambda x: un(op, x), a, compute=compute)
    return lower


# the unary ops of ATen and prims alike (``prims.py``)
UNARY = ("neg", "abs", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "sin", "cos",
         "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "sigmoid", "erf",
         "erfc", "floor", "ceil", "trunc", "sign", "reciprocal", "bitwise_not", "lgamma", "round")
for _name in UNARY:
    register(getattr(aten, _name).default)(_unary(_name))
for _name in ("isnan", "isinf", "signbit"):
    register(getattr(aten, _name).default)(_unary(_name, True))


@register(aten.pow.Tensor_Scalar)
def _pow_scalar(ctx, a, exponent):
    if isinstance(exponent, sympy.Expr):
        raise Unsupported("symbolic exponent")
    special = {0: lambda x: E.c(1, x), 1: lambda x: x, 2: lambda x: mul(x, x), 3: lambda x: mul(mul(x, x), x),
               0.5: lambda x: un("sqrt", x), -0.5: lambda x: un("rsqrt", x), -1: lambda x: div(1, x),
               -2: lambda x: div(1, mul(x, x))}
    if exponent in special and (ctx.meta.dtype.is_floating_point or exponent >= 0):
        return elementwise(ctx, special[exponent], a)
    return elementwise(ctx, lambda x: E.bin("pow", x, exponent), a)


@register(aten.clamp.default, aten.clamp.Tensor)
def _clamp(ctx, a, min=None, max=None):
    bounds = [(op, v) for op, v in (("maximum", min), ("minimum", max)) if v is not None]

    def fn(x, *vs):
        for (op, _), v in zip(bounds, vs):
            x = E.bin(op, x, v)
        return x
    return elementwise(ctx, fn, a, *[v for _, v in bounds])


@register(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def _where(ctx, cond, a, b):
    shape = shape_of(ctx.meta)
    compute = upcast(ctx.meta.dtype)
    return ctx.pointwise(lambda idx: ops.where(value_at(cond, idx, shape, torch.bool),
                                               value_at(a, idx, shape, compute), value_at(b, idx, shape, compute)))


register(aten.masked_fill.Scalar, aten.masked_fill.Tensor)(lambda ctx, a, mask, v: _where(ctx, mask, v, a))


# -- casts and copies ---------------------------------------------------------------------
@register(aten._to_copy.default, aten.clone.default, aten.lift_fresh_copy.default,
          torch.ops.prims.convert_element_type.default, aten.alias_copy.default)
def _to_copy(ctx, a, *args, **kwargs):
    meta = ctx.meta
    if not isinstance(a, Pointwise):
        raise Unsupported("copy of a non-tensor")
    if a.device != meta.device:
        raise Unsupported("device copy")
    if a.dtype == meta.dtype:
        return ctx.pointwise(lambda idx: a(idx))
    # an explicit cast rounds to the target dtype (kept as that dtype, upcast by consumers)
    return ctx.pointwise(lambda idx: ops.cast(ops.cast(a(idx), a.dtype), meta.dtype))


@register(aten.copy.default)
def _copy(ctx, dst, src, non_blocking=False):
    meta = ctx.meta
    if not isinstance(src, Pointwise) or src.device != meta.device:
        raise Unsupported("device copy")
    shape = shape_of(meta)
    return ctx.pointwise(lambda idx: ops.cast(value_at(src, idx, shape, src.dtype), meta.dtype))


# -- activations ----------------------------------------------------------------------------
SQRT1_2 = 1 / math.sqrt(2)


@register(aten.gelu.default)
def _gelu(ctx, a, approximate="none"):
    def fn(x):
        if approximate == "tanh":
            inner = mul(math.sqrt(2 / math.pi), add(x, mul(0.044715, mul(x, mul(x, x)))))
            return mul(mul(0.5, x), add(1, un("tanh", inner)))
        return mul(mul(0.5, x), add(1, un("erf", mul(x, SQRT1_2))))
    return elementwise(ctx, fn, a)


@register(aten.gelu_backward.default)
def _gelu_backward(ctx, grad, a, approximate="none"):
    def fn(g, x):
        if approximate == "tanh":
            k, c = math.sqrt(2 / math.pi), 0.044715
            inner = mul(k, add(x, mul(c, mul(x, mul(x, x)))))
            t = un("tanh", inner)
            left = mul(0.5, add(1, t))
            dinner = mul(k, add(1, mul(3 * c, mul(x, x))))
            right = mul(mul(mul(0.5, x), sub(1, mul(t, t))), dinner)
            return mul(g, add(left, right))
        cdf = mul(0.5, add(1, un("erf", mul(x, SQRT1_2))))
        pdf = mul(1 / math.sqrt(2 * math.pi), un("exp", mul(-0.5, mul(x, x))))
        return mul(g, add(cdf, mul(x, pdf)))
    return elementwise(ctx, fn, grad, a)


def _hardsigmoid(x):
    return div(E.bin("minimum", E.bin("maximum", add(x, 3), 0), 6), 6)


def _softplus(x, beta=1, threshold=20):
    return ops.where(E.bin("gt", mul(x, beta), threshold), x, div(un("log1p", un("exp", mul(x, beta))), beta))


# op -> fn(*operand exprs): its tensor operands, then its Python numbers (the defaults where omitted)
_ELEMENTWISE = {
    aten.relu.default: lambda x: E.bin("maximum", x, 0),
    aten.silu.default: lambda x: mul(x, un("sigmoid", x)),
    aten.silu_backward.default: lambda g, x: mul(g, mul(un("sigmoid", x),
                                                        add(1, mul(x, sub(1, un("sigmoid", x)))))),
    aten.sigmoid_backward.default: lambda g, s: mul(g, mul(s, sub(1, s))),
    aten.tanh_backward.default: lambda g, t: mul(g, sub(1, mul(t, t))),
    aten.threshold_backward.default: lambda g, x, t: ops.where(E.bin("le", x, t), E.c(0, g), g),
    aten.hardtanh.default: lambda x, lo=-1.0, hi=1.0: E.bin("minimum", E.bin("maximum", x, lo), hi),
    aten.leaky_relu.default: lambda x, slope=0.01: ops.where(E.bin("gt", x, 0), x, mul(x, slope)),
    aten.hardsigmoid.default: _hardsigmoid,
    aten.hardswish.default: lambda x: mul(x, _hardsigmoid(x)),
    aten.softplus.default: _softplus,
    aten.mish.default: lambda x: mul(x, un("tanh", _softplus(x))),
}
for _op, _fn in _ELEMENTWISE.items():
    register(_op)(lambda ctx, *args, _fn=_fn: elementwise(ctx, _fn, *args))


@register(aten.elu.default)
def _elu(ctx, a, alpha=1, scale=1, input_scale=1):
    return elementwise(ctx, lambda x: ops.where(E.bin("gt", x, 0), mul(x, scale),
                                                mul(un("expm1", mul(x, input_scale)), alpha * scale)), a)


@register(aten.nan_to_num.default)
def _nan_to_num(ctx, a, nan=0.0, posinf=None, neginf=None):
    info = torch.finfo(ctx.meta.dtype) if ctx.meta.dtype.is_floating_point else None
    if info is None:
        return elementwise(ctx, lambda x: x, a)
    posinf = info.max if posinf is None else posinf
    neginf = info.min if neginf is None else neginf

    def fn(x):
        x = ops.where(un("isnan", x), E.c(nan, x), x)
        x = ops.where(E.bin("eq", x, math.inf), E.c(posinf, x), x)
        return ops.where(E.bin("eq", x, -math.inf), E.c(neginf, x), x)
    return elementwise(ctx, fn, a)
