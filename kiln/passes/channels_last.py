"""Channels-last for convolution nets on the GPU: ``to_channels_last(gm, opts)``.

cuDNN's fp16/bf16 convolutions run in NHWC; given NCHW tensors they transpose on the way in and
out. This pass makes every 4-D convolution read a channels-last input (``aten.clone(x,
memory_format=channels_last)`` where the value is not channels-last already) and re-derives every
value's fake tensor in graph order, so the pointwise work between convolutions (batch norm, ReLU,
residual adds) is planned, fused and stored in NHWC by the code generator: one conversion at the
network's entry instead of two per convolution.

It runs on inference graphs and on AOTAutograd's joint training graph before partitioning. In a joint
graph ``aten.convolution_backward`` reads its ``grad_output`` and its ``input`` channels-last too (the
input reuses the forward's copy), so the forward, the saved activations and the backward agree on one
layout and the partitioner cuts a graph whose fake strides are consistent across the fw/bw boundary.

What a user sees does not change: each graph output whose strides moved gets a copy back to the
eager strides (user outputs, updated inputs, and in a joint graph the gradients: a weight's gradient
comes back with the weight's strides; AOTAutograd's tangents keep eager strides since the outputs do),
or an ``as_strided`` view where only size-1 dimensions' strides moved (a 1x1 weight's gradient). A
view that a channels-last input would break reads a contiguous copy, and ``as_strided`` reads a copy
with the eager strides. Graphs with symbolic shapes are left alone (as inductor does). Fake values
are re-derived only where an input's value changed.

Which devices: option ``layout_devices``, 'cuda' (where channels-last pays) or 'any' (CPU graphs too,
e.g. to test the pass); ``devices(opts)`` reads it.

A KxK weight goes channels-last in the graph too, once, shared by the convolution and its backward.
Given an NCHW weight, cuDNN copies it to NHWC inside every call (an ATen ``contiguous``: about 20 us
of host time and a kernel, in the forward and again in the backward). Under autocast the weight's
cast to bf16 then writes NHWC itself (the clone fuses into it); a weight that is a graph input gets
one kiln copy kernel. Frozen weights (``get_attr``) are left to freezing, which stores them NHWC.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from kiln.options import active
from kiln.passes.constant_fold import fake_mode_of, infer_val

aten = torch.ops.aten
CL = torch.channels_last
LAYOUT_DEVICES = {"cuda": ("cuda",), "any": None}   # option layout_devices -> device types (None: any)
VIEWS = (aten.view.default, aten._unsafe_view.default)
STRIDED = (aten.as_strided.default,)   # reads storage through explicit strides
# convolution op -> (index of the activation whose device decides, indices that should be NHWC)
CONVS = {aten.convolution.default: (0, (0, 1)),
         aten.convolution_backward.default: (1, (0, 1, 2))}   # (grad_output, input, weight, ...)
WEIGHT = {aten.convolution.default: 1, aten.convolution_backward.default: 2}   # which of those is the weight


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _is_cl(v) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() == 4 and v.is_contiguous(memory_format=CL) \
        and not v.is_contiguous()


def _weight_to_convert(w) -> bool:
    """A computed or input 4-D weight that is not NHWC already (a 1x1 weight is both layouts at once)."""
    v = _val(w)
    return isinstance(w, fx.Node) and w.op != "get_attr" and isinstance(v, torch.Tensor) and v.dim() == 4 \
        and not v.is_contiguous(memory_format=CL)


def _symbolic(v) -> bool:
    return any(isinstance(s, torch.SymInt) for s in (*v.shape, *v.stride()))


def devices(opts=None):
    """Device types where the layout passes act (None: any), from option ``layout_devices``; without
    ``opts``, the options of the compile in progress (``kiln.options.active()``)."""
    return LAYOUT_DEVICES[(opts if opts is not None else active()).layout_devices]


def _convs(gm, on) -> dict:
    """{convolution node: argument indices to make channels-last} for the 4-D convolutions on ``on``."""
    out = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in CONVS:
            at, idx = CONVS[n.target]
            v = _val(n.args[at])
            if isinstance(v, torch.Tensor) and v.dim() == 4 and (on is None or v.device.type in on):
                out[n] = idx
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
    except (RuntimeError, ValueError):   # torch 2.13 raises ValueError on the meta device
        return True
    return False


def _eager_format(old, new):
    """The memory format that gives ``new`` back ``old``'s strides, or None (unchanged, or not dense)."""
    if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)) or old.stride() == new.stride():
        return None
    fmt = CL if _is_cl(old) else torch.contiguous_format
    return fmt if old.is_contiguous(memory_format=fmt) else None


def _same_but_size_one(old, new) -> bool:
    """Strides differ only where a dimension has size 1 (the same memory order: a view fixes them)."""
    return old.shape == new.shape and old.stride() != new.stride() and \
        all(a == b for n, a, b in zip(old.shape, old.stride(), new.stride()) if n != 1)


def restore_before(gm, before, x, old, fake):
    """Give ``before`` the value ``x`` with the strides ``old`` had (eager's): an ``as_strided`` view where
    only size-1 dimensions differ (a 1x1 weight's gradient), else a copy; returns the new node or None."""
    new = _val(x)
    if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)):
        return None
    if _same_but_size_one(old, new):
        with gm.graph.inserting_before(before):
            c = gm.graph.call_function(aten.as_strided.default,
                                       (x, list(old.shape), list(old.stride()), new.storage_offset()))
        infer_val(c, fake)
    else:
        fmt = _eager_format(old, new)
        c = copy_before(gm, before, x, fmt, fake) if fmt is not None else None
    if c is not None:
        before.replace_input_with(x, c)
    return c


def _same_layout(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype \
            and a.storage_offset() == b.storage_offset()
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_layout(x, y) for x, y in zip(a, b))
    return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor)


def to_channels_last(gm: fx.GraphModule, opts=None) -> int:
    """Rewrite ``gm`` in place as described above; returns how many convolution inputs changed.

    ``opts`` (an ``Options``; default: those of the compile in progress, else of the current scope)
    decides the devices through ``layout_devices``."""
    convs = _convs(gm, devices(opts))
    if not convs or any(_symbolic(_val(n.args[CONVS[n.target][0]])) for n in convs):
        return 0
    fake = fake_mode_of(gm)
    eager = {n: _val(n) for n in gm.graph.nodes}
    nhwc = {}   # value -> its channels-last copy (a convolution's input is shared with its backward)
    changed = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        for i in convs.get(n, ()):
            a = n.args[i]
            convert = _weight_to_convert(a) if i == WEIGHT[n.target] else \
                isinstance(a, fx.Node) and not _is_cl(_val(a))
            if convert:
                if a not in nhwc:
                    nhwc[a] = copy_before(gm, n, a, CL, fake)
                n.update_arg(i, nhwc[a])
                changed += 1
        if n.target in VIEWS and _is_cl(_val(n.args[0])) and _view_breaks(n, _val(n.args[0])):
            n.replace_input_with(n.args[0], copy_before(gm, n, n.args[0], torch.contiguous_format, fake))
        if n.target in STRIDED and isinstance(n.args[0], fx.Node):
            a = n.args[0]
            fmt = _eager_format(eager.get(a), _val(a))
            if fmt is not None and not _same_but_size_one(eager[a], _val(a)):
                n.replace_input_with(a, copy_before(gm, n, a, fmt, fake))
        if (n.target is operator.getitem or isinstance(n.target, torch._ops.OpOverload)) \
                and any(_val(a) is not eager.get(a) for a in n.all_input_nodes):
            if _same_layout(infer_val(n, fake), eager[n]):
                n.meta["val"] = eager[n]   # unchanged: later nodes need no new fake value either
    if not changed:
        return 0
    nhwc_reductions(gm, fake)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    for a in list(out.all_input_nodes):
        restore_before(gm, out, a, eager.get(a), fake)
    gm.recompile()
    return changed


# -- reductions over N, H, W of a channels-last tensor (batch norm's statistics and its backward) --------
prims = torch.ops.prims
PRIM_REDUCTIONS = {prims.sum.default, prims.var.default, prims.amax.default, prims.amin.default}  # no keepdim
REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
              aten.var_mean.correction, aten.var.correction} | PRIM_REDUCTIONS
TO_NHWC, TO_NCHW = [0, 2, 3, 1], [0, 3, 1, 2]
NHWC_POS = {0: 0, 2: 1, 3: 2, 1: 3}   # NCHW dim -> its position in the NHWC view


def _dims_keepdim(n):
    dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", n.kwargs.get("dims"))
    if n.target in PRIM_REDUCTIONS:
        return dims, False
    positional = n.target not in (aten.var_mean.correction, aten.var.correction)
    keep = n.args[2] if positional and len(n.args) > 2 else n.kwargs.get("keepdim", False)
    return dims, bool(keep)


def nhwc_reductions(gm: fx.GraphModule, fake) -> int:
    """Reduce channels-last tensors through their NHWC view; returns the count of rewritten reductions.

    Logically ``sum(x, [0, 2, 3])`` reduces rows that end in the innermost dim W, so the code generator
    plans one row per channel; in channels-last memory those rows are strided by C and every load is
    uncoalesced (ResNet-50's batch-norm statistics ran 3x slower than NCHW). Through
    ``permute(x, [0, 2, 3, 1])``, a dense view, the same reduction keeps the innermost dim C and is a
    column reduction, which the code generator splits over many programs and loads contiguously."""
    done = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in REDUCTIONS or not _is_cl(_val(n.args[0])):
            continue
        dims, keep = _dims_keepdim(n)
        if dims is None:
            continue
        dims = sorted(d % 4 for d in dims)
        kept = [d for d in range(4) if d not in dims]
        if 1 in dims or 3 not in dims or (not keep and kept != [d for d in TO_NHWC if d in kept]):
            continue
        new_dims = sorted(NHWC_POS[d] for d in dims)
        g = gm.graph
        with g.inserting_before(n):
            view = g.call_function(aten.permute.default, (n.args[0], TO_NHWC))
            infer_val(view, fake)
            args, kwargs = list(n.args), dict(n.kwargs)
            args[0] = view
            if len(args) > 1:
                args[1] = new_dims
            else:
                kwargs["dims" if "dims" in kwargs else "dim"] = new_dims
            red = g.call_function(n.target, tuple(args), kwargs)
            infer_val(red, fake)

            def back(v):
                if not keep:
                    return v
                b = g.call_function(aten.permute.default, (v, TO_NCHW))
                infer_val(b, fake)
                return b
            if isinstance(_val(n), (tuple, list)):
                for u in list(n.users):
                    if u.target is not operator.getitem:
                        break
                    with g.inserting_before(u):
                        item = g.call_function(operator.getitem, (red, u.args[1]))
                        infer_val(item, fake)
                        u.replace_all_uses_with(back(item))
                    g.erase_node(u)
                if n.users:   # a user other than getitem: leave it (both forms compute the same)
                    continue
            else:
                n.replace_all_uses_with(back(red))
        g.erase_node(n)
        done += 1
    return done
