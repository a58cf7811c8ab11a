"""Lowerings of pointwise ATen ops: arithmetic, math, comparisons, casts, where, activations.

Arithmetic happens in ``upcast(out dtype)`` (fp16/bf16 compute in fp32, rounded once at the
store); comparisons promote their operands with torch's rules.
"""
from __future__ import annotations

import math

import sympy
import torch

from kiln.codegen.ir.indexing import size_expr
from kiln.codegen.ir.loops import Expr, Pointwise, Unsupported, ops, upcast
from kiln.codegen.lower.base import aten, register, result_dtype, value_at


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
    meta = ctx.meta
    shape = tuple(ctx_shape(meta))
    compute = compute or upcast(meta.dtype)

    def body(idx):
        return fn(*[value_at(v, idx, shape, compute) for v in inputs])
    return ctx.pointwise(body)


def ctx_shape(meta):
    return [size_expr(s) for s in meta.shape]


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


register(aten.add.Tensor, aten.add.Scalar)(_binary("add"))
register(aten.sub.Tensor, aten.sub.Scalar)(_binary("sub"))
register(aten.mul.Tensor, aten.mul.Scalar)(_binary("mul"))
register(aten.maximum)(_binary("maximum"))
register(aten.minimum)(_binary("minimum"))
register(aten.fmax)(_fminmax("maximum"))
register(aten.fmin)(_fminmax("minimum"))
register(aten.atan2)(_binary("atan2"))
register(aten.bitwise_and)(_binary("bitwise_and"))
register(aten.bitwise_or)(_binary("bitwise_or"))
register(aten.bitwise_xor)(_binary("bitwise_xor"))
register(aten.remainder.Tensor, aten.remainder.Scalar)(int_division(_binary("remainder")))
register(aten.fmod.Tensor, aten.fmod.Scalar)(int_division(_binary("fmod")))
register(aten.copysign.Tensor, aten.copysign.Scalar)(_binary("copysign"))
register(aten.hypot)(_binary("hypot"))


@register(aten.rsub.Tensor, aten.rsub.Scalar)
def _rsub(ctx, a, b, alpha=1):
    return elementwise(ctx, lambda x, y: sub(y, mul(x, alpha) if alpha != 1 else x), a, b)


@register(aten.div.Tensor, aten.div.Scalar, aten.true_divide.Tensor)
def _div(ctx, a, b):
    return elementwise(ctx, div, a, b)


@register(aten.div.Tensor_mode, aten.div.Scalar_mode)
@int_division
def _div_mode(ctx, a, b, rounding_mode=None):
    meta = ctx.meta
    if rounding_mode is None:
        return elementwise(ctx, div, a, b)
    if meta.dtype.is_floating_point and rounding_mode == "trunc":
        return elementwise(ctx, lambda x, y: un("trunc", div(x, y)), a, b)
    op = "floordiv" if rounding_mode == "floor" else "truncdiv"
    return elementwise(ctx, lambda x, y: E.bin(op, x, y), a, b)


@register(aten.floor_divide)
@int_division
def _floor_divide(ctx, a, b):
    return elementwise(ctx, lambda x, y: E.bin("floordiv", x, y), a, b)   # floats: eager's rounding


def _compare(op):
    """A comparison of the operands' values in their own dtype: a 2-byte float operand computed in the same
    kernel is rounded to it first, as eager compares its stored values (max's backward ``eq(x ** 3, amin)``
    in bf16 compared the unrounded cube with the rounded minimum: no element matched, NaN gradients)."""
    def lower(ctx, a, b):
        compute = upcast(result_dtype(a, b))
        shape = tuple(ctx_shape(ctx.meta))

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
    def lower(ctx, a, b):
        return elementwise(ctx, lambda x, y: E.bin(op, x, y), a, b, compute=torch.bool)
    return lower


register(aten.logical_and)(_logical("logical_and"))
register(aten.logical_or)(_logical("logical_or"))
register(aten.logical_xor)(_logical("logical_xor"))


@register(aten.logical_not)
def _logical_not(ctx, a):
    return elementwise(ctx, lambda x: un("logical_not", x), a, compute=torch.bool)


def _unary(op, compute_from_input=False):
    def lower(ctx, a):
        compute = upcast(a.dtype) if compute_from_input else None
        return elementwise(ctx, lambda x: un(op, x), a, compute=compute)
    return lower


for _name in ("neg", "abs", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt",
              "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh",
              "atanh", "sigmoid", "erf", "erfc", "floor", "ceil", "trunc", "sign", "reciprocal",
              "bitwise_not", "lgamma"):
    register(getattr(aten, _name).default)(_unary(_name))
register(aten.round.default)(_unary("round"))
register(aten.isnan.default)(_unary("isnan", True))
register(aten.isinf.default)(_unary("isinf", True))
register(aten.signbit.default)(_unary("signbit", True))


@register(aten.relu.default)
def _relu(ctx, a):
    return elementwise(ctx, lambda x: E.bin("maximum", x, 0), a)


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


@register(aten.pow.Tensor_Tensor, aten.pow.Scalar)
def _pow(ctx, a, b):
    return elementwise(ctx, lambda x, y: E.bin("pow", x, y), a, b)


@register(aten.clamp.default, aten.clamp.Tensor)
def _clamp(ctx, a, min=None, max=None):
    def fn(x, lo, hi):
        if lo is not None:
            x = E.bin("maximum", x, lo)
        if hi is not None:
            x = E.bin("minimum", x, hi)
        return x
    lo = min if min is not None else None
    hi = max if max is not None else None
    args = [a] + [v for v in (lo, hi) if v is not None]

    def call(x, *rest):
        rest = list(rest)
        return fn(x, rest.pop(0) if lo is not None else None, rest.pop(0) if hi is not None else None)
    return elementwise(ctx, call, *args)


@register(aten.clamp_min.default, aten.clamp_min.Tensor)
def _clamp_min(ctx, a, lo):
    return elementwise(ctx, lambda x, y: E.bin("maximum", x, y), a, lo)


@register(aten.clamp_max.default, aten.clamp_max.Tensor)
def _clamp_max(ctx, a, hi):
    return elementwise(ctx, lambda x, y: E.bin("minimum", x, y), a, hi)


@register(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def _where(ctx, cond, a, b):
    shape = ctx_shape(ctx.meta)
    compute = upcast(ctx.meta.dtype)
    return ctx.pointwise(lambda idx: ops.where(value_at(cond, idx, shape, torch.bool),
                                               value_at(a, idx, shape, compute), value_at(b, idx, shape, compute)))


@register(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def _masked_fill(ctx, a, mask, value):
    shape = ctx_shape(ctx.meta)
    compute = upcast(ctx.meta.dtype)
    return ctx.pointwise(lambda idx: ops.where(value_at(mask, idx, shape, torch.bool),
                                               value_at(value, idx, shape, compute), value_at(a, idx, shape, compute)))


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
    shape = ctx_shape(meta)
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


@register(aten.silu.default)
def _silu(ctx, a):
    return elementwise(ctx, lambda x: mul(x, un("sigmoid", x)), a)


@register(aten.silu_backward.default)
def _silu_backward(ctx, grad, a):
    def fn(g, x):
        s = un("sigmoid", x)
        return mul(g, mul(s, add(1, mul(x, sub(1, s)))))
    return elementwise(ctx, fn, grad, a)


@register(aten.sigmoid_backward.default)
def _sigmoid_backward(ctx, grad, y):
    return elementwise(ctx, lambda g, s: mul(g, mul(s, sub(1, s))), grad, y)


@register(aten.tanh_backward.default)
def _tanh_backward(ctx, grad, y):
    return elementwise(ctx, lambda g, t: mul(g, sub(1, mul(t, t))), grad, y)


@register(aten.threshold_backward.default)
def _threshold_backward(ctx, grad, a, threshold):
    return elementwise(ctx, lambda g, x: ops.where(E.bin("le", x, threshold), E.c(0, g), g), grad, a)


@register(aten.hardtanh.default)
def _hardtanh(ctx, a, lo=-1.0, hi=1.0):
    return elementwise(ctx, lambda x: E.bin("minimum", E.bin("maximum", x, lo), hi), a)


@register(aten.leaky_relu.default)
def _leaky_relu(ctx, a, slope=0.01):
    return elementwise(ctx, lambda x: ops.where(E.bin("gt", x, 0), x, mul(x, slope)), a)


@register(aten.softplus.default)
def _softplus(ctx, a, beta=1, threshold=20):
    def fn(x):
        bx = mul(x, beta)
        return ops.where(E.bin("gt", bx, threshold), x, div(un("log1p", un("exp", bx)), beta))
    return elementwise(ctx, fn, a)


@register(aten.hardsigmoid.default)
def _hardsigmoid(ctx, a):
    return elementwise(ctx, lambda x: div(E.bin("minimum", E.bin("maximum", add(x, 3), 0), 6), 6), a)


@register(aten.hardswish.default)
def _hardswish(ctx, a):
    return elementwise(ctx, lambda x: mul(x, div(E.bin("minimum", E.bin("maximum", add(x, 3), 0), 6), 6)), a)


@register(aten.mish.default)
def _mish(ctx, a):
    def fn(x):
        sp = ops.where(E.bin("gt", x, 20), x, un("log1p", un("exp", x)))
        return mul(x, un("tanh", sp))
    return elementwise(ctx, fn, a)


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
