"""Lowerings that create values: full, arange/iota, scalar_tensor, and philox RNG (rand, randn,
bernoulli, dropout). A random value is ``rand(kind, offset, slot)``: philox at the element's flat offset,
seeded from torch's generator on every call (``torch.manual_seed`` repeats runs, though not eager's numbers).
A value holding RNG is computed in exactly one kernel.
"""
import torch

from kiln.codegen.ir.indexing import contiguous_strides, flat_index
from kiln.codegen.ir.loops import Expr, Pointwise, Unsupported, ops, upcast
from kiln.codegen.lower.base import aten, register, shape_of, value_at
from kiln.codegen.lower.pointwise import E


def _device_ok(ctx):
    if ctx.meta.device.type not in ("cpu", "cuda"):
        raise Unsupported(f"device {ctx.meta.device}")


# op -> its fill value, or the position of the argument holding it
_FILLS = {aten.zeros_like.default: ("=", 0), aten.zeros.default: ("=", 0), aten.new_zeros.default: ("=", 0),
          aten.ones_like.default: ("=", 1), aten.ones.default: ("=", 1), aten.new_ones.default: ("=", 1),
          aten.full.default: ("arg", 1), aten.full_like.default: ("arg", 1), aten.fill.Scalar: ("arg", 1),
          aten.new_full.default: ("arg", 2), aten.scalar_tensor.default: ("arg", 0)}


@register(*_FILLS)
def _full(ctx, *args, **kwargs):
    _device_ok(ctx)
    how, v = _FILLS[ctx.node.target]
    value = v if how == "=" else args[v]
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
    else:   # start (start, end) or start_step (start, end, step)
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
    return random(ctx, kind, shape_of(ctx.meta), ctx.meta.dtype)


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
    bits = random(ctx, "randint", shape_of(ctx.meta), torch.int64)
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


def _drawn(kind, fn):
    def lower(ctx, *args, generator=None, **kwargs):
        _plain(ctx, generator)
        dtype = ctx.meta.dtype
        if not dtype.is_floating_point:
            raise Unsupported(f"random {ctx.node.target} of {dtype}")
        shape, compute = shape_of(ctx.meta), upcast(dtype)
        r = random(ctx, kind, shape, compute)
        operands = list(args) + list(kwargs.values())
        return ctx.pointwise(lambda idx: ops.cast(fn(r(idx), *[value_at(v, idx, shape, compute)
                                                              for v in operands]), compute))
    return lower


for _op, (_kind, _fn) in _RANDOM.items():
    register(_op)(_drawn(_kind, _fn))


@register(aten.bernoulli.p, aten.bernoulli.default, aten.bernoulli.Tensor)
def _bernoulli(ctx, x, p=None, generator=None):
    """A draw per element with probability ``p`` (a number, a tensor broadcast to ``x``, or ``x`` itself)."""
    _plain(ctx, generator)
    if isinstance(p, (int, float)) and not 0 <= p <= 1:
        raise Unsupported("bernoulli p outside [0, 1] (ATen raises)")
    shape = shape_of(ctx.meta)
    r = random(ctx, "rand", shape, torch.float32)
    prob = x if p is None else p
    dtype = upcast(ctx.meta.dtype)
    return ctx.pointwise(lambda idx: ops.cast(ops.binary("lt", r(idx), value_at(prob, idx, shape, torch.float32)),
                                              dtype))


@register(aten.native_dropout.default)
def _native_dropout(ctx, x, p, train):
    _plain(ctx)
    shape = shape_of(ctx.meta[0])
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
