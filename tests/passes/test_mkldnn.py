"""oneDNN conv weight prepack on hand-built FX graphs (CPU, when available)."""
import pytest
import torch
import torch.fx as fx

from kiln import debug
from kiln.passes.patterns.mkldnn import pack_conv_weights
from tests.numerics import assert_close_to_fp64

aten = torch.ops.aten
mkldnn = torch.ops.mkldnn
pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not built in")


def conv_graph(relu=True, bias=True, second_user=False):
    root = torch.nn.Module()
    root.w = torch.randn(6, 4, 3, 3)
    root.b = torch.randn(6)
    g = fx.Graph()
    x = g.placeholder("x")
    w = g.get_attr("w")
    b = g.get_attr("b") if bias else None
    c = g.call_function(aten.convolution.default, (x, w, b, [1, 1], [1, 1], [1, 1], False, [0, 0], 1))
    out = g.call_function(aten.relu.default, (c,)) if relu else c
    if second_user:
        out = g.call_function(aten.add.Tensor, (out, c))
    g.output(out)
    return fx.GraphModule(root, g)


def calls(gm, target):
    return sum(1 for n in gm.graph.nodes if n.target == target)


def exact(gm, x):
    """``conv_graph``'s module run in float64 (before its passes): oneDNN's prepacked convolution sums in
    another order than eager's, each in the one this host's ISA gives (``assert_close_to_fp64``)."""
    import copy
    return copy.deepcopy(gm).double()(x.double())


def test_pack_one_match_one_node():
    debug.counters.clear()
    gm = conv_graph()
    x = torch.randn(1, 4, 8, 8)
    expected, best = gm(x), exact(gm, x)
    assert pack_conv_weights(gm) == 1
    c = debug.counters["kiln"]
    assert (c["pattern_matcher_count"], c["pattern_matcher_nodes"]) == (1, 1)
    assert calls(gm, aten.convolution.default) == 0 and calls(gm, aten.relu.default) == 1
    (node,) = gm.graph.find_nodes(op="call_function", target=mkldnn._convolution_pointwise.default)
    assert node.args[7] == "none"
    packed = getattr(gm, node.args[1].target)
    assert packed.is_mkldnn  # prepacked once, at compile time
    assert not hasattr(gm, "w")  # the dense weight is gone
    assert_close_to_fp64(gm(x), expected, best, atol=1e-5, rtol=1.3e-6)


def test_pack_without_relu_and_without_bias():
    gm = conv_graph(relu=False, bias=False)
    x = torch.randn(2, 4, 5, 5)
    expected, best = gm(x), exact(gm, x)
    assert pack_conv_weights(gm) == 1
    (node,) = gm.graph.find_nodes(op="call_function", target=mkldnn._convolution_pointwise.default)
    assert node.args[7] == "none" and node.args[2] is None
    assert_close_to_fp64(gm(x), expected, best, atol=1e-5, rtol=1.3e-6)


def test_weight_that_is_an_input_is_not_packed():
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    c = g.call_function(aten.convolution.default, (x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1))
    g.output(c)
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert pack_conv_weights(gm) == 0
