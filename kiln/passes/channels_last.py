"""Channels-last for convolution nets (inference graphs on the GPU): ``to_channels_last(gm)``.

cuDNN's fp16/bf16 convolutions run in NHWC; given NCHW tensors they transpose on the way in and
out. This pass makes every 4-D convolution read a channels-last input (``aten.clone(x,
memory_format=channels_last)`` where the value is not channels-last already) and re-derives every
value's fake tensor in graph order, so the pointwise work between convolutions (batch norm, ReLU,
residual adds) is planned, fused and stored in NHWC by the code generator: one conversion at the
network's entry instead of two per convolution.

What a user sees does not change: each graph output whose strides moved gets a copy back to the
eager strides, and a view that a channels-last input would break reads a contiguous copy. Weights
are left alone (the convolution converts them; under freezing the conversion is folded away).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from kiln.passes.fold import fake_mode_of, infer_val

aten = torch.ops.aten
CL = torch.channels_last
DEVICES = ("cuda",)   # where channels-last pays (tests set None: any device)
VIEWS = (aten.view.default, aten._unsafe_view.default)


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _is_cl(v) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() == 4 and v.is_contiguous(memory_format=CL) \
        and not v.is_contiguous()


def _convs(gm):
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is aten.convolution.default:
            v = _val(n.args[0])
            if isinstance(v, torch.Tensor) and v.dim() == 4 and (DEVICES is None or v.device.type in DEVICES):
                out.append(n)
    return out


def copy_before(gm, before, x, fmt, fake):
    """A new ``aten.clone(x, memory_format=fmt)`` node right before ``before``, with its fake value."""
    with gm.graph.inserting_before(before):
        c = gm.graph.call_function(aten.clone.default, (x,), {"memory_format": fmt})
    infer_val(c, fake)
    return c


def _view_breaks(node, val) -> bool:
    shape = [_val(a) if isinstance(a, fx.Node) else a for a in node.args[1]]
    try:
        torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta").view(shape)
    except RuntimeError:
        return True
    return False


def to_channels_last(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` in place as described above; returns how many convolution inputs changed."""
    convs = set(_convs(gm))
    if not convs:
        return 0
    fake = fake_mode_of(gm)
    eager = {n: _val(n) for n in gm.graph.nodes}
    changed = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        if n in convs and not _is_cl(_val(n.args[0])):
            n.replace_input_with(n.args[0], copy_before(gm, n, n.args[0], CL, fake))
            changed += 1
        if n.target in VIEWS and _is_cl(_val(n.args[0])) and _view_breaks(n, _val(n.args[0])):
            n.replace_input_with(n.args[0], copy_before(gm, n, n.args[0], torch.contiguous_format, fake))
        if n.target is operator.getitem or isinstance(n.target, torch._ops.OpOverload):
            infer_val(n, fake)
    if not changed:
        return 0
    out = next(n for n in gm.graph.nodes if n.op == "output")
    for a in list(out.all_input_nodes):
        old, new = eager.get(a), _val(a)
        if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and old.stride() != new.stride():
            fmt = CL if _is_cl(old) else torch.contiguous_format
            if old.is_contiguous(memory_format=fmt):
                out.replace_input_with(a, copy_before(gm, out, a, fmt, fake))
    gm.recompile()
    return changed
