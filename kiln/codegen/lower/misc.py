"""Lowerings that create values: full, arange/iota, scalar_tensor, and philox RNG (rand, randn,
bernoulli, dropout).

A random value is ``rand(kind, offset, slot)``: Triton's philox at the element's flat offset with a
seed the kernel draws from torch's generator on every call (so ``torch.manual_seed`` makes runs
repeatable, though the numbers differ from eager). A random tensor is computed in exactly one
kernel: a value holding RNG is never duplicated into two users.
"""
from __future__ import annotations

import torch

from kiln.codegen.ir.indexing import contiguous_strides, flat_index, size_expr
from kiln.codegen.ir.loops import Expr, Pointwise, Unsupported, ops, upcast
from kiln.codegen.lower.base import aten, register, value_at
from kiln.codegen.lower.pointwise import E


def _shape(meta):
    return [size_expr(s) for s in meta.shape]


def _device_ok(ctx):
    if ctx.meta.device.type not in ("cpu", "cuda"):
        raise Unsupported(f"device {ctx.meta.device}")


@register(aten.full.default, aten.full_like.default, aten.zeros_like.default, aten.ones_like.default,
          aten.scalar_tensor.default, aten.zeros.default, aten.ones.default, aten.new_zeros.default,
          aten.new_ones.default, aten.new_full.default, aten.fill.Scalar)
def _full(ctx, *args, **kwargs):
    _device_ok(ctx)
    target = ctx.node.target
    if target in (aten.zeros_like.default, aten.zeros.default, aten.new_zeros.default):
        value = 0
    elif target in (aten.ones_like.default, aten.ones.default, aten.new_ones.default):
        value = 1
    elif target in (aten.full.default, aten.new_full.default, aten.full_like.default, aten.fill.Scalar):
        value = args[1] if target != aten.new_full.default else args[2]
    else:  # scalar_tensor
        value = args[0]
    dtype = ctx.meta.dtype
    if not isinstance(value, (bool, int, float)):
        if hasattr(value, "free_symbols"):
            return ctx.pointwise(lambda idx: ops.cast(ops.index(value), upcast(dtype)))
        raise Unsupported("fill value")
    return ctx.pointwise(lambda idx: ops.const(value, upcast(dtype)))


@register(aten.arange.start_step, aten.arange.default, aten.arange.start)
def _arange(ctx, *args, **kwargs):
    _device_ok(ctx)
    nums = [a for a in args if not isinstance(a, (torch.dtype, torch.device, torch.layout))]
    if ctx.node.target == aten.arange.default:
        start, step = 0, 1
    elif ctx.node.target == aten.arange.start:
        start, step = nums[0], 1
    else:
        start, step = nums[0], (nums[2] if len(nums) > 2 else 1)
    dtype = ctx.meta.dtype
    compute = upcast(dtype)

    def fn(idx):
        i = ops.cast(ops.index(idx[0]), compute if compute.is_floating_point else torch.int64)
        v = ops.binary("mul", i, ops.const(step, i.dtype)) if step != 1 else i
        v = ops.binary("add", v, ops.const(start, i.dtype)) if start != 0 else v
        return ops.cast(v, compute)
    return ctx.pointwise(fn)


@register(torch.ops.prims.iota.default)
def _iota(ctx, length, *, start, step, dtype, device, requires_grad):
    return ctx.pointwise(lambda idx: ops.cast(ops.index(start + step * idx[0]), dtype))


def random(ctx, kind, shape, dtype):
    """A fresh random value over ``shape``: kind 'rand' (uniform in [0, 1)), 'randn' (standard normal) or
    'randint' (32 random bits as an int64 in [0, 2**32))."""
    slot = ctx.seeds.new()
    strides = contiguous_strides(shape)
    raw = torch.int64 if kind == "randint" else torch.float32
    compute = upcast(dtype)
    return ctx.pointwise(lambda idx: ops.cast(Expr("rand", (kind, flat_index(idx, strides), slot), raw), compute),
                         shape=shape, dtype=dtype)


def _plain(ctx, generator=None):
    """Refuse what a kernel cannot draw: another device, or an explicit generator (its state is the user's)."""
    _device_ok(ctx)
    if generator is not None:
        raise Unsupported("explicit generator")


@register(aten.rand.default, aten.rand_like.default, aten.randn.default, aten.randn_like.default)
def _rand(ctx, *args, **kwargs):
    _plain(ctx, kwargs.get("generator"))
    kind = "randn" if ctx.node.target in (aten.randn.default, aten.randn_like.default) else "rand"
    if not ctx.meta.dtype.is_floating_point:
        raise Unsupported("integer rand")
    return random(ctx, kind, _shape(ctx.meta), ctx.meta.dtype)


@register(aten.randint.low, aten.randint.default, aten.randint_like.low_dtype, aten.randint_like.default)
def _randint(ctx, *args, **kwargs):
    """``low + (bits * (high - low)) >> 32`` over 32 random bits (Lemire's multiply-shift: no division; ranges
    up to 2**31, where the product fits an int64; the bias is at most range / 2**32)."""
    _plain(ctx, kwargs.get("generator"))
    target = ctx.node.target
    nums = [a for a in args if not isinstance(a, Pointwise)][:2]
    low, high = (0, nums[0]) if target in (aten.randint.default, aten.randint_like.default) else nums
    if not all(isinstance(v, int) for v in (low, high)) or not 0 < high - low <= 2 ** 31:
        raise Unsupported("randint range (symbolic, empty or wider than 2**31)")
    dtype = ctx.meta.dtype
    bits = random(ctx, "randint", _shape(ctx.meta), torch.int64)
    span = high - low
    return ctx.pointwise(lambda idx: ops.cast(E.bin("add", E.bin("rshift", E.bin("mul", bits(idx), span), 32), low),
                                              upcast(dtype)))


def _tiny(r):
    """``r`` kept above 0 for a logarithm (a uniform can round to 1.0 in float32, so 1 - r to 0)."""
    return ops.binary("maximum", r, ops.const(1e-30, r.dtype))


_RANDOM = {
    # op: (kind, fn(r, *operands)); operands are the op's arguments after the tensor it draws the shape of
    aten.uniform.default: ("rand", lambda r, x, lo=0.0, hi=1.0: E.bin("add", E.bin("mul", r, E.bin("sub", hi, lo)), lo)),
    aten.normal_functional.default: ("randn", lambda r, x, mean=0.0, std=1.0: E.bin("add", E.bin("mul", r, std), mean)),
    aten.normal.Tensor_float: ("randn", lambda r, mean, std=1.0: E.bin("add", E.bin("mul", r, std), mean)),
    aten.normal.float_Tensor: ("randn", lambda r, mean, std: E.bin("add", E.bin("mul", r, std), mean)),
    aten.normal.Tensor_Tensor: ("randn", lambda r, mean, std: E.bin("add", E.bin("mul", r, std), mean)),
    aten.exponential.default: ("rand", lambda r, x, lambd=1.0: E.bin(
        "truediv", ops.unary("neg", ops.unary("log", _tiny(E.bin("sub", 1.0, r)))), lambd)),
    aten.log_normal.default: ("randn", lambda r, x, mean=1.0, std=2.0: ops.unary(
        "exp", E.bin("add", E.bin("mul", r, std), mean))),
    aten.cauchy.default: ("rand", lambda r, x, median=0.0, sigma=1.0: E.bin("add", E.bin("mul", ops.unary(
        "tan", E.bin("mul", E.bin("sub", r, 0.5), 3.141592653589793)), sigma), median)),
}


def _register_drawn():
    for op, (kind, fn) in _RANDOM.items():
        def lower(ctx, *args, generator=None, _kind=kind, _fn=fn, **kwargs):
            _plain(ctx, generator)
            dtype = ctx.meta.dtype
            if not dtype.is_floating_point:
                raise Unsupported(f"random {ctx.node.target} of {dtype}")
            shape = _shape(ctx.meta)
            compute = upcast(dtype)
            r = random(ctx, _kind, shape, compute)
            operands = list(args) + list(kwargs.values())
            return ctx.pointwise(lambda idx: ops.cast(_fn(r(idx), *[value_at(v, idx, shape, compute)
                                                                   for v in operands]), compute))
        register(op)(lower)


_register_drawn()


@register(aten.bernoulli.p)
def _bernoulli(ctx, x, p=0.5, generator=None):
    _plain(ctx, generator)
    if not 0 <= p <= 1:
        raise Unsupported("bernoulli p outside [0, 1] (ATen raises)")
    shape = _shape(ctx.meta)
    r = random(ctx, "rand", shape, torch.float32)
    dtype = upcast(ctx.meta.dtype)
    return ctx.pointwise(lambda idx: ops.cast(E.bin("lt", r(idx), float(p)), dtype))


@register(aten.bernoulli.default, aten.bernoulli.Tensor)
def _bernoulli_tensor(ctx, x, p=None, generator=None):
    """A draw per element with probability ``p`` (a tensor broadcast to ``x``, or ``x`` itself)."""
    _plain(ctx, generator)
    shape = _shape(ctx.meta)
    r = random(ctx, "rand", shape, torch.float32)
    prob = x if p is None else p
    dtype = upcast(ctx.meta.dtype)
    return ctx.pointwise(lambda idx: ops.cast(ops.binary("lt", r(idx), value_at(prob, idx, shape, torch.float32)),
                                              dtype))


@register(aten.native_dropout.default)
def _native_dropout(ctx, x, p, train):
    _plain(ctx)
    shape = _shape(ctx.meta[0])
    dtype = upcast(ctx.meta[0].dtype)
    if train is False or p == 0:
        raise Unsupported("eval-mode dropout")
    r = random(ctx, "rand", shape, torch.float32)
    keep = ctx.pointwise(lambda idx: E.bin("ge", r(idx), float(p)), shape=shape, dtype=torch.bool)
    ctx.realize(keep)  # one kernel draws the mask; output and mask both read it
    scale = 1.0 / (1.0 - p)
    out = ctx.pointwise(lambda idx: ops.where(keep(idx), ops.binary("mul", ops.cast(x(idx), dtype),
                                                                   ops.const(scale, dtype)),
                                              ops.const(0, dtype)), shape=shape, dtype=ctx.meta[0].dtype)
    return (out, keep)
