"""Take a convolution's bias out of the library call: ``split_conv_bias(gm)`` (Triton target only:
oneDNN adds a CPU convolution's bias inside the convolution itself).

cuDNN's convolutions add a bias in a kernel of their own (ATen runs ``output.add_(bias)`` after the
convolution), one more read and write of the whole output. ``conv(x, w, b)`` becomes
``conv(x, w, None) + b.view(1, C, 1, ...)``, and the add fuses into the pointwise kernel after the
convolution (a folded BatchNorm's bias lands in the ReLU's kernel). The rounding is ATen's: the
convolution's output is rounded to its dtype before the bias is added in both. The backward graph
is not touched: its ``convolution_backward`` still computes the bias gradient.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from kiln.passes.constant_fold import fake_mode_of, infer_val

aten = torch.ops.aten


def split_conv_bias(gm: fx.GraphModule) -> int:
    """Rewrite every convolution with a bias of its output's dtype; returns how many."""
    mode, n_split = fake_mode_of(gm), 0
    g = gm.graph
    for n in list(g.nodes):
        if n.op != "call_function" or n.target is not aten.convolution.default or len(n.args) < 9:
            continue
        bias = n.args[2]
        val = n.meta.get("val")
        bval = bias.meta.get("val") if isinstance(bias, fx.Node) else None
        if not (isinstance(val, torch.Tensor) and isinstance(bval, torch.Tensor)) or val.dim() < 3 \
                or bval.dim() != 1 or bval.dtype != val.dtype or bval.shape[0] != val.shape[1]:
            continue
        with g.inserting_after(n):
            conv = g.call_function(aten.convolution.default, (n.args[0], n.args[1], None, *n.args[3:]))
        with g.inserting_after(conv):
            view = g.call_function(aten.view.default, (bias, [1, -1] + [1] * (val.dim() - 2)))
        with g.inserting_after(view):
            add = g.call_function(aten.add.Tensor, (conv, view))
        conv.meta = {**n.meta, "val": val}   # the layout of a convolution does not depend on its bias
        infer_val(view, mode)   # sets view.meta["val"]
        add.meta = {**n.meta, "val": val}
        n.replace_all_uses_with(add)
        g.erase_node(n)
        n_split += 1
    if n_split:
        gm.recompile()
    return n_split
