"""Seed 002 end to end: user passes at every stage of kiln's pipeline (test_custom_post_grad_passes)."""
import copy
import operator
from collections import defaultdict

import pytest
import torch
import torch.fx as fx

import kiln
import kiln.pattern_matcher as pattern_matcher
from kiln import config, debug
from kiln.pattern_matcher import Arg, CallFunction, PatternMatcherPass
from kiln.pattern_matcher import lowerings as L
from tests.numerics import assert_close_to_fp64

aten = torch.ops.aten
mkldnn = torch.ops.mkldnn


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    debug.counters.clear()
    yield
    torch._dynamo.reset()


def change_cos_pass(graph):
    for node in graph.nodes:
        if node.op == "call_function" and node.target == aten.cos.default:
            node.target = aten.sin.default


def _sins(x):
    return x.sin().sin().sin()


def _coss(x):
    return x.cos().cos().cos()


@pytest.mark.parametrize("hook", ["joint_custom_pre_pass", "joint_custom_post_pass"])
def test_custom_joint_pass(hook):
    x = torch.randn(8)
    with config.patch(**{hook: change_cos_pass}):
        torch.testing.assert_close(kiln.compile(_coss)(x), _sins(x))


@pytest.mark.parametrize("stage", ["joint_pre", "joint_post"])
def test_custom_joint_pass_registered(stage):
    x = torch.randn(8)
    with kiln.passes.register(stage, change_cos_pass):
        torch.testing.assert_close(torch.compile(_coss, backend="kiln")(x), _sins(x))
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(_coss, backend="kiln")(x), _coss(x))  # scope ended


def test_custom_joint_pass_through_torch_compile_options():
    x = torch.randn(8)
    fn = torch.compile(_coss, backend="kiln", options={"joint_custom_post_pass": change_cos_pass})
    torch.testing.assert_close(fn(x), _sins(x))


# --- post-grad pattern passes with the mkldnn conv+relu lowering (freezing, CPU) -----------------

class _CustomPass(PatternMatcherPass):
    def __init__(self):
        super().__init__()

    def __call__(self, g: torch.fx.graph.Graph):
        self.apply(g)


class _ConvReLU(torch.nn.Module):
    def __init__(self, ic, oc):
        super().__init__()
        self.conv = torch.nn.Conv2d(ic, oc, kernel_size=3, stride=1, padding=1)

    def forward(self, x):
        return self.conv(x).relu()


def _register_mkldnn_conv_relu_fusion(custom_pass_dict):
    pattern = CallFunction(aten.relu, CallFunction(mkldnn._convolution_pointwise.default,
                                                   *[Arg() for _ in range(10)], _users=1))

    @pattern_matcher.register_lowering_pattern(pattern, lambda m: True, pass_dict=custom_pass_dict)
    def fn(match, *args, **kwargs):
        computation_args = list(args)[:-3] + ["relu", [], ""]
        return L[mkldnn._convolution_pointwise.default](*computation_args)


def _test_common(mod, inputs, matcher_count, matcher_nodes, atol=1e-5, rtol=1.3e-6):
    """kiln's values against eager's and the float64 module's (a prepacked oneDNN convolution sums in another
    order than eager's, each in the one this host's ISA gives)."""
    debug.counters.clear()
    with torch.no_grad():
        clone_inputs = tuple(x.clone() for x in inputs)
        expected = mod(*inputs)
        exact = copy.deepcopy(mod).double()(*(x.double() for x in inputs))
        actual = kiln.compile(mod)(*clone_inputs)
        assert_close_to_fp64(actual, expected, exact, atol=atol, rtol=rtol)
        assert debug.counters["kiln"]["pattern_matcher_count"] == matcher_count
        assert debug.counters["kiln"]["pattern_matcher_nodes"] == matcher_nodes


needs_mkldnn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not built in")


@needs_mkldnn
@pytest.mark.parametrize("where", ["post_grad_custom_pre_pass", "post_grad_custom_post_pass"])
def test_custom_pre_and_post_pass(where):
    custom = _CustomPass()
    other = "post_grad_custom_post_pass" if where == "post_grad_custom_pre_pass" else "post_grad_custom_pre_pass"
    with config.patch(freezing=True, pattern_matcher=False, **{where: custom, other: None}):
        _register_mkldnn_conv_relu_fusion(custom)
        mod = _ConvReLU(16, 16).eval()
        x = torch.randn((1, 16, 56, 56), dtype=torch.float32)
        # 1 conv+relu match of 2 nodes, plus 1 weight-prepack match of 1 node
        _test_common(mod, (x,), 1 + 1, 2 + 1)


# --- pre-grad pass on Dynamo's torch-level graph ------------------------------------------------

def test_custom_pre_grad_pass():
    saved_graph = [None]

    def merge_mm_shared_rhs(graph: fx.Graph):
        """[mm(x, W), mm(x2, W)] => mm(cat(x, x2), W).split() (a bad proof of concept, as in the seed)."""
        saved_graph[0] = graph
        matmuls = [n for n in graph.nodes if n.target == torch.mm]
        rhs_vals = defaultdict(set)
        for m in matmuls:
            rhs_vals[m.args[1]].add(m)
        order = {n: i for i, n in enumerate(graph.nodes)}
        for rhs, mms in rhs_vals.items():
            if len(mms) == 1:
                continue
            mms = sorted(mms, key=lambda x: order[x])
            with graph.inserting_before(mms[0]):
                lhs_vals = [m.args[0] for m in mms]
                new_cat = graph.create_node("call_function", torch.cat, args=(lhs_vals, 0))
                new_mm = graph.create_node("call_function", torch.mm, args=(new_cat, rhs))
                split_vals = graph.create_node(
                    "call_function", torch.split,
                    args=(new_mm, [l.meta["example_value"].shape[0] for l in lhs_vals]))
            for idx, m in enumerate(mms):
                m.target = operator.getitem
                m.args = (split_vals, idx)

    @config.patch(pre_grad_custom_pass=merge_mm_shared_rhs)
    def inner_test():
        @kiln.compile
        def f(W, nested_seqs):
            return [torch.mm(s, W) for s in nested_seqs]

        W = torch.randn(16, 16, dtype=torch.bfloat16)
        nested_seqs = [torch.randn(n, 16, dtype=torch.bfloat16) for n in [4, 8, 5, 3]]
        out = f(W, nested_seqs)
        assert saved_graph[0] is not None
        matmuls = [n for n in saved_graph[0].nodes if n.target == torch.mm]
        assert len(matmuls) == 1
        for got, s in zip(out, nested_seqs):
            torch.testing.assert_close(got, torch.mm(s, W))

    inner_test()
