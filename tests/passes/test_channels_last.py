"""Channels-last inference graphs for convolution nets: same values, NHWC inside, eager strides outside."""
import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import kiln.config
from kiln.passes import channels_last as C


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        h = torch.relu(self.bn(self.c1(x)))
        h = torch.relu(self.c2(h) + h)
        return self.fc(h.mean((2, 3))), h


@pytest.fixture
def any_device():
    """Option layout_devices='any' in force (CPU graphs too); the fixture's value is those options."""
    with kiln.config.patch(layout_devices="any"):
        yield kiln.config.current()


def _trace(net, x):
    """The inference graph of ``net`` with its parameters and buffers as inputs, as AOTAutograd makes it."""
    names = [k for k, _ in net.named_parameters()] + [k for k, _ in net.named_buffers()]
    state = [v.detach() for _, v in net.named_parameters()] + list(net.buffers())

    def fn(x, *vals):
        return torch.func.functional_call(net, dict(zip(names, vals)), (x,))
    with torch.no_grad():
        return make_fx(fn, tracing_mode="fake")(x, *state), state


def test_convolutions_read_channels_last_and_outputs_keep_eager_strides(any_device):
    net = Net().eval()
    x = torch.randn(2, 3, 8, 8)
    gm, state = _trace(net, x)
    with torch.no_grad():
        ref = net(x)
    # the entry and the two 3x3 weights: the second conv reads NHWC already
    assert C.to_channels_last(gm, any_device) == 3
    convs = [n for n in gm.graph.nodes if n.target is torch.ops.aten.convolution.default]
    assert all(n.args[i].meta["val"].is_contiguous(memory_format=torch.channels_last)
               for n in convs for i in (0, 1))
    # one activation copy on the way in (the second conv's input is NHWC already), one per weight
    clones = [n for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default
              and n.kwargs.get("memory_format") is torch.channels_last]
    assert sorted(tuple(c.args[0].meta["val"].shape) for c in clones) == [(2, 3, 8, 8), (8, 3, 3, 3), (8, 8, 3, 3)]
    with torch.no_grad():
        out = gm(x, *state)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5)
        assert o.stride() == r.stride()


def test_graph_without_convolutions_is_left_alone(any_device):
    gm = make_fx(lambda x: torch.relu(x) + 1, tracing_mode="fake")(torch.randn(2, 3, 4, 4))
    assert C.to_channels_last(gm, any_device) == 0


def test_cpu_graphs_are_left_alone_by_default():
    gm, _ = _trace(Net().eval(), torch.randn(2, 3, 8, 8))
    assert C.to_channels_last(gm) == 0


def test_kiln_triton_inference_matches_eager(any_device):
    net = Net().eval()
    x = torch.randn(2, 3, 8, 8)
    f = torch.compile(net, backend="kiln", options={"codegen": "triton"})
    with torch.no_grad():
        out, ref = f(x), net(x)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, atol=1e-4, rtol=1e-4)
        assert o.stride() == r.stride()


def test_frozen_inference_matches_eager_with_channels_last_weights(any_device):
    net = Net().eval()
    x = torch.randn(2, 3, 8, 8)
    f = torch.compile(net, backend="kiln", options={"codegen": "triton", "freezing": True})
    with torch.no_grad():
        out, ref = f(x), net(x)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, atol=1e-4, rtol=1e-4)
        assert o.stride() == r.stride()


def _conv_inputs_nhwc(seen):
    def hook(graph):
        seen.extend(n.args[0].meta["val"].is_contiguous(memory_format=torch.channels_last)
                    for n in graph.nodes if n.target is torch.ops.aten.convolution.default)
    return hook


@pytest.mark.parametrize("codegen,nhwc", [("cpp", True), ("triton", False)])
def test_layout_devices_auto_means_nhwc_for_cpp_kernels_on_the_cpu(codegen, nhwc):
    """By default ('auto') CPU graphs of the C++ target go channels-last (oneDNN's NHWC convolutions take about
    half the time of its NCHW ones on ResNet blocks); the Triton target keeps them for CUDA graphs only."""
    net = Net().eval()
    x = torch.randn(2, 3, 8, 8)
    seen = []
    f = torch.compile(net, backend="kiln", options={"codegen": codegen, "post_grad_custom_post_pass": _conv_inputs_nhwc(seen)})
    with torch.no_grad():
        out, ref = f(x), net(x)
    assert seen == [nhwc, nhwc]
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, atol=1e-4, rtol=1e-4)
        assert o.stride() == r.stride()
