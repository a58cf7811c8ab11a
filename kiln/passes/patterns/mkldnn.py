"""oneDNN convolutions on the CPU, from freezing: each 2-D ``aten.convolution`` (not transposed, float32 or
supported bfloat16) with a constant weight gets it reordered once into a new constant and becomes
``mkldnn._convolution_pointwise.default(..., "none", [], "")``.
"""
import torch
import torch.fx as fx

from kiln.passes.constant_fold import constant_value, val
from kiln.passes.match.entries import PatternMatcherPass
from kiln.passes.match.nodes import CallFunction
from kiln.passes.match.pattern import MULTIPLE, KeywordArg
from kiln.passes.match.register import register_graph_pattern
from kiln.passes.match.pattern import free_attr

aten = torch.ops.aten
mkldnn = torch.ops.mkldnn

PACK = PatternMatcherPass("mkldnn_weight_pack")
CONV = CallFunction(aten.convolution.default, *map(KeywordArg, ("x", "weight", "bias", "stride", "padding",
                    "dilation", "transposed", "output_padding", "groups")), _users=MULTIPLE)


def _can_pack(match) -> bool:
    k, gm = match.kwargs, match.graph.owning_module
    w, bias, xval = constant_value(gm, k["weight"]), k["bias"], val(k["x"])
    dtype_ok = w is not None and (w.dtype == torch.float32 or w.dtype == torch.bfloat16
                                  and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return (torch.backends.mkldnn.is_available() and dtype_ok and w.dim() == 4 and not w.is_mkldnn
            and w.device.type == "cpu" and k["transposed"] is False
            and (bias is None or constant_value(gm, bias) is not None)
            and (xval is None or (xval.device.type == "cpu" and xval.dtype == w.dtype)))


@register_graph_pattern(CONV, extra_check=_can_pack, pass_dict=PACK)
def _pack(match, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    graph, node = match.graph, match.output_node()
    gm, xval = graph.owning_module, val(x)
    input_size = list(xval.shape) if xval is not None and all(isinstance(s, int) for s in xval.shape) else None
    with torch.no_grad():
        packed = mkldnn._reorder_convolution_weight(constant_value(gm, weight).detach(), list(padding),
                                                    list(stride), list(dilation), groups, input_size)
    name = free_attr(gm, "_mkldnn_packed_weight")
    gm.register_buffer(name, packed, persistent=False)
    with graph.inserting_before(node):
        wnode = graph.get_attr(name)
        if val(weight) is not None:  # same logical shape; the packed layout is oneDNN's business
            wnode.meta["val"] = val(weight)
        new = graph.call_function(mkldnn._convolution_pointwise.default,
                                  (x, wnode, bias, list(padding), list(stride), list(dilation), groups,
                                   "none", [], ""))
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    if not weight.users:
        graph.erase_node(weight)
        if not graph.find_nodes(op="get_attr", target=weight.target) and "." not in weight.target:
            delattr(gm, weight.target)  # the dense copy is not needed any more


def pack_conv_weights(gm: fx.GraphModule) -> int:
    """Prepack constant conv weights for oneDNN (in place); returns how many."""
    n = PACK.apply(gm.graph)
    if n:
        gm.graph.lint()
        gm.recompile()
    return n
