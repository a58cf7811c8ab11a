"""Layout hand-off for freezing: where convolution weights become channels-last constants.

Freezing calls ``convert_conv_weights`` on the ATen inference graph right after the parameters became
constants and before any folding: for each aten.convolution whose weight is a 4-D constant on a device
where ``passes.channels_last`` makes activations channels-last, it inserts
``w2 = aten.clone(w, memory_format=torch.channels_last)`` and makes the convolution read it.

Constant folding then turns each ``clone`` into a channels-last constant (and conv-BN / binary folding
keep the layout, see ``fold.like``), so the compiled graph reads prepared weights at no runtime cost.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from kiln.passes import channels_last
from kiln.passes.constant_fold import fake_mode_of, infer_val


def convert_conv_weights(gm: fx.GraphModule, opts) -> int:
    """Make 4-D constant convolution weights channels-last (in place); returns how many changed.

    Only where ``passes.channels_last`` will make the activations channels-last too (option
    ``layout_devices``: the GPU by default), so that cuDNN sees one layout and no convolution converts
    its weight per call.
    """
    if not opts.layout_optimization:
        return 0
    fake, changed, devices = fake_mode_of(gm), 0, channels_last.devices(opts)
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not torch.ops.aten.convolution.default:
            continue
        w = n.args[1]
        val = w.meta.get("val") if isinstance(w, fx.Node) else None
        if w.op != "get_attr" or val is None or val.dim() != 4 or (devices is not None and val.device.type not in devices):
            continue
        n.replace_input_with(w, channels_last.copy_before(gm, n, w, torch.channels_last, fake))
        changed += 1
    if changed:
        gm.recompile()
    return changed


# Producers whose runtime output layout is the library's choice, not the eager strides in meta['val']
# (oneDNN picks channels-last for some convolutions even on contiguous inputs).
FREE_LAYOUT = {"mkldnn._convolution_pointwise.default"}
# Ops whose output layout does not follow their inputs' layout.
RESETS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.convolution.default",
          "aten.clone.default", "aten.contiguous.default"}
STRIDED = {"aten.as_strided.default", "aten.as_strided_.default", "aten.as_strided_scatter.default"}
VIEWS = {"aten.view.default", "aten._unsafe_view.default"}


def _name(target) -> str:
    return f"{getattr(target, 'namespace', '')}.{getattr(target, '_opname', '')}.{getattr(target, '_overloadname', '')}"


def _memory_format(val):
    import torch
    if not isinstance(val, torch.Tensor):
        return None
    if val.is_contiguous():
        return torch.contiguous_format
    if val.dim() == 4 and val.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return None


def _view_breaks(node: fx.Node, val) -> bool:
    """True when ``node`` (a view) would fail on a channels-last copy of its 4-D input."""
    import torch
    if val is None or val.dim() != 4:
        return False
    shape = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args[1]]
    try:
        meta = torch.empty(list(val.shape), dtype=val.dtype, device="meta").to(memory_format=torch.channels_last)
        meta.view(shape)
    except Exception:
        return True
    return False


def pin_eager_strides(gm: fx.GraphModule, fake_mode=None) -> int:
    """Restore eager strides where a stride-sensitive consumer reads a free-layout result; in place.

    A value whose layout may differ from its ``meta['val']`` (downstream of a FREE_LAYOUT producer, through
    ops that keep their input's layout) gets ``aten.contiguous(x, memory_format=<eager>)`` (a no-op when
    the layout already matches) right before each ``as_strided``, each view that the other layout would
    break, and the graph output. Returns how many were inserted.
    """
    fake_mode = fake_mode or fake_mode_of(gm)
    free: set = set()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        name = _name(n.target)
        if name in FREE_LAYOUT or (name not in RESETS and any(a in free for a in n.all_input_nodes)):
            free.add(n)
    if not free:
        return 0
    pinned = 0
    for n in list(gm.graph.nodes):
        name = _name(n.target) if n.op == "call_function" else ""
        for a in [a for a in n.all_input_nodes if a in free]:
            val = a.meta.get("val")
            sensitive = n.op == "output" or name in STRIDED or (name in VIEWS and n.args[0] is a and
                                                                 _view_breaks(n, val))
            fmt = _memory_format(val)
            if not sensitive or fmt is None:
                continue
            with gm.graph.inserting_before(n):
                c = gm.graph.call_function(torch.ops.aten.contiguous.default, (a,), {"memory_format": fmt})
            infer_val(c, fake_mode)
            n.replace_input_with(a, c)
            pinned += 1
    if pinned:
        gm.recompile()
    return pinned
