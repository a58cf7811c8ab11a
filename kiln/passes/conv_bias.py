"""Take a convolution's bias out of cuDNN's call (a kernel of its own) on the Triton target: ``conv(x, w, b)``
becomes ``conv(x, w, None) + b.view(1, C, 1, ...)``, an add that fuses into the next pointwise kernel.
"""
import torch
import torch.fx as fx

from kiln.passes.constant_fold import call, fake_mode_of, recompiled

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
        with g.inserting_before(n):
            conv = g.call_function(aten.convolution.default, (n.args[0], n.args[1], None, *n.args[3:]))
            view = call(g, mode, aten.view.default, bias, [1, -1] + [1] * (val.dim() - 2))
            add = g.call_function(aten.add.Tensor, (conv, view))
        conv.meta = {**n.meta, "val": val}   # the layout of a convolution does not depend on its bias
        add.meta = {**n.meta, "val": val}
        n.replace_all_uses_with(add)
        g.erase_node(n)
        n_split += 1
    return recompiled(gm, n_split)
