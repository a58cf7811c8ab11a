"""oneDNN (mkldnn) convolution on CPU: prepack constant weights, fuse the following relu.

Run after freezing, when conv weights are ``get_attr`` constants:

* ``pack_conv_weights(gm)``: each ``aten.convolution`` (2-D, not transposed, float32 or supported
  bfloat16, CPU) with a constant weight gets its weight reordered once with
  ``mkldnn._reorder_convolution_weight`` into a new constant, and becomes
  ``mkldnn._convolution_pointwise.default(x, w_packed, b, padding, stride, dilation, groups, "none", [], "")``.
  One match of one node per convolution.
* ``fuse_conv_relu(gm)``: ``relu(_convolution_pointwise(..., "none", [], ""))`` becomes the same call
  with ``attr="relu"`` (a lowering pattern, two nodes per match).

``optimize_conv(gm)`` runs both and returns the number of matches.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from kiln.passes.match.entries import PatternMatcherPass
from kiln.passes.match.fx_lowerings import lowerings as L
from kiln.passes.match.nodes import CallFunction
from kiln.passes.match.pattern import MULTIPLE, Arg, KeywordArg
from kiln.passes.match.register import register_graph_pattern, register_lowering_pattern

aten = torch.ops.aten
mkldnn = torch.ops.mkldnn

PACK = PatternMatcherPass("mkldnn_weight_pack")
FUSE = PatternMatcherPass("mkldnn_conv_relu")

CONV = CallFunction(aten.convolution.default, KeywordArg("x"), KeywordArg("weight"), KeywordArg("bias"),
                    KeywordArg("stride"), KeywordArg("padding"), KeywordArg("dilation"),
                    KeywordArg("transposed"), KeywordArg("output_padding"), KeywordArg("groups"),
                    _users=MULTIPLE)
CONV_RELU = CallFunction(aten.relu, CallFunction(mkldnn._convolution_pointwise.default,
                                                 *[Arg() for _ in range(7)], "none", [], "", _users=1))


def _val(node):
    return node.meta.get("val", node.meta.get("example_value")) if isinstance(node, fx.Node) else None


def _constant(gm, node):
    """The tensor behind a get_attr node (None for anything else)."""
    if not (isinstance(node, fx.Node) and node.op == "get_attr") or gm is None:
        return None
    obj = gm
    for part in node.target.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, torch.Tensor) else None


def _dtype_ok(dtype) -> bool:
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _can_pack(match) -> bool:
    k = match.kwargs
    gm = match.graph.owning_module
    w = _constant(gm, k["weight"])
    bias = k["bias"]
    xval = _val(k["x"])
    return (torch.backends.mkldnn.is_available() and w is not None and w.dim() == 4 and not w.is_mkldnn
            and w.device.type == "cpu" and _dtype_ok(w.dtype) and k["transposed"] is False
            and (bias is None or _constant(gm, bias) is not None)
            and (xval is None or (xval.device.type == "cpu" and xval.dtype == w.dtype)))


def _free_name(gm, prefix):
    i = 0
    while hasattr(gm, f"{prefix}{i}"):
        i += 1
    return f"{prefix}{i}"


@register_graph_pattern(CONV, extra_check=_can_pack, pass_dict=PACK)
def _pack(match, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    graph = match.graph
    gm = graph.owning_module
    node = match.output_node()
    xval = _val(x)
    input_size = list(xval.shape) if xval is not None and all(isinstance(s, int) for s in xval.shape) else None
    with torch.no_grad():
        packed = mkldnn._reorder_convolution_weight(_constant(gm, weight).detach(), list(padding), list(stride),
                                                    list(dilation), groups, input_size)
    name = _free_name(gm, "_mkldnn_packed_weight")
    gm.register_buffer(name, packed, persistent=False)
    with graph.inserting_before(node):
        wnode = graph.get_attr(name)
        if _val(weight) is not None:  # same logical shape; the packed layout is oneDNN's business
            wnode.meta["val"] = _val(weight)
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


@register_lowering_pattern(CONV_RELU, pass_dict=FUSE)
def _fuse_relu(match, *args):
    return L[mkldnn._convolution_pointwise.default](*args, "relu", [], "")


def pack_conv_weights(gm: fx.GraphModule) -> int:
    """Prepack constant conv weights for oneDNN and call ``_convolution_pointwise``; edits ``gm``."""
    n = PACK.apply(gm.graph)
    if n:
        gm.graph.lint()
        gm.recompile()
    return n


def fuse_conv_relu(gm: fx.GraphModule) -> int:
    """Fold ``relu`` into the preceding ``_convolution_pointwise``; edits ``gm`` in place."""
    n = FUSE.apply(gm.graph)
    if n:
        gm.recompile()
    return n


def optimize_conv(gm: fx.GraphModule) -> int:
    """``pack_conv_weights`` then ``fuse_conv_relu``; returns the total number of matches."""
    return pack_conv_weights(gm) + fuse_conv_relu(gm)


# the entry point kiln's freezing stage looks up (weight prepack only: conv+relu fusion is left to
# later pattern passes, user ones included)
prepack_convolutions = pack_conv_weights
