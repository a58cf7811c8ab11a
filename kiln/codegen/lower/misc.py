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
from kiln.codegen.ir.loops import Expr, Unsupported, ops, upcast
from kiln.codegen.lower.base import aten, register
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
    """A fresh random value (kind 'rand' or 'randn') over ``shape``."""
    slot = ctx.seeds.new()
    strides = contiguous_strides(shape)
    compute = upcast(dtype)
    return ctx.pointwise(lambda idx: ops.cast(Expr("rand", (kind, flat_index(idx, strides), slot), torch.float32),
                                              compute), shape=shape, dtype=dtype)


@register(aten.rand.default, aten.rand_like.default, aten.randn.default, aten.randn_like.default)
def _rand(ctx, *args, **kwargs):
    _device_ok(ctx)
    if kwargs.get("generator") is not None:
        raise Unsupported("explicit generator")
    kind = "randn" if ctx.node.target in (aten.randn.default, aten.randn_like.default) else "rand"
    if not ctx.meta.dtype.is_floating_point:
        raise Unsupported("integer rand")
    return random(ctx, kind, _shape(ctx.meta), ctx.meta.dtype)


@register(aten.bernoulli.p)
def _bernoulli(ctx, x, p=0.5, generator=None):
    _device_ok(ctx)
    if generator is not None:
        raise Unsupported("explicit generator")
    shape = _shape(ctx.meta)
    r = random(ctx, "rand", shape, torch.float32)
    dtype = upcast(ctx.meta.dtype)
    return ctx.pointwise(lambda idx: ops.cast(E.bin("lt", r(idx), float(p)), dtype))


@register(aten.native_dropout.default)
def _native_dropout(ctx, x, p, train):
    _device_ok(ctx)
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
