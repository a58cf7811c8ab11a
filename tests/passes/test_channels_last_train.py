"""Channels-last training graphs: the joint graph goes NHWC before partitioning; a few SGD steps of small
conv nets match eager (outputs, gradients, BN running stats, updated inputs) with eager strides outside,
and every convolution of the forward and of the backward graph reads channels-last activations.

codegen='triton' runs the pass from kiln's pipeline (interpreted Triton kernels on the CPU);
codegen='aten' runs it from a joint_custom_post_pass hook, so the real ATen CPU convolutions and batch
norms see the NHWC tensors the fake strides promise.
"""
import copy

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import kiln.config
from kiln.passes import channels_last as C
from tests.numerics import assert_close_to_fp64

aten = torch.ops.aten
CL = torch.channels_last
CODEGENS = ["aten", "triton", "cpp"]


@pytest.fixture
def any_device():
    """Option layout_devices='any' in force (CPU graphs too); the fixture's value is those options."""
    with kiln.config.patch(layout_devices="any"):
        yield kiln.config.current()


@pytest.fixture(autouse=True)
def _no_onednn_channels_last_backward():
    """torch 2.13.0+cpu: oneDNN's backward of a strided 1x1 channels-last convolution corrupts the heap,
    in eager too (``Conv2d(4, 8, 1, 2)`` on a channels-last input, ``.sum().backward()`` a few hundred
    times: glibc aborts). Eager and kiln's ATen convolutions use the native CPU kernels here instead."""
    with torch.backends.mkldnn.flags(enabled=False):   # flags() works after torch's test utilities
        yield                                            # (OpInfo's imports) froze the global flags


class ConvBNReLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        return self.fc(h.mean((2, 3))), h


class Residual(nn.Module):
    """A torchvision-like basic block with a strided 1x1 downsample branch."""
    def __init__(self, cin=4, cout=8, stride=2):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        h = torch.relu(self.b1(self.c1(x)))
        return torch.relu(self.b2(self.c2(h)) + self.down(x))


class StridedFlatten(nn.Module):
    """Strided convolutions, then a flatten (a view a channels-last tensor cannot take) and a linear."""
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 6, 3, stride=2, padding=1)
        self.c2 = nn.Conv2d(6, 4, 3, stride=2, padding=1)
        self.fc = nn.Linear(4 * 2 * 2, 3)

    def forward(self, x):
        h = torch.relu(self.c2(torch.relu(self.c1(x))))
        return self.fc(h.flatten(1))


class MutatesInput(nn.Module):
    """Scales its (non-differentiable) input in place, then conv-BN: the updated input is a graph output."""
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3, padding=1)
        self.bn = nn.BatchNorm2d(5)

    def forward(self, x):
        x.mul_(2)
        return torch.relu(self.bn(self.conv(x)))


class ViewsOut(nn.Module):
    """Returns views of a channels-last intermediate: AOTAutograd rebuilds them from the (restored) base."""
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        h = torch.relu(self.conv(x))
        return h[:, 2:5], h.permute(0, 2, 3, 1), h


def _conv_layouts(seen):
    """A post-grad hook recording, per graph, whether each convolution's activations are NHWC."""
    def hook(graph):
        rows = []
        for n in graph.nodes:
            if n.target is aten.convolution.default:
                rows.append(("fw", [n.args[0].meta["val"].is_contiguous(memory_format=CL)]))
            elif n.target is aten.convolution_backward.default:
                rows.append(("bw", [a.meta["val"].is_contiguous(memory_format=CL) for a in n.args[:2]]))
        seen.append(rows)
    return hook


def _options(codegen, seen):
    opts = {"codegen": codegen, "post_grad_custom_post_pass": _conv_layouts(seen)}
    if codegen == "aten":   # kiln runs the pass for Triton only; run it here on the joint graph
        opts["joint_custom_post_pass"] = lambda g: C.to_channels_last(g.owning_module)
    return opts


def _close(a, b, e, what, tol=1e-4):
    """kiln's ``a`` against eager's ``b`` and the float64 ``e``: NHWC and NCHW convolutions (and their weight
    gradients, sums over batch and pixels) run oneDNN's kernels for this host's ISA, in other orders."""
    assert_close_to_fp64(a, b, e, atol=tol, rtol=tol, msg=what)
    assert a.stride() == b.stride(), f"{what}: strides {a.stride()} != eager {b.stride()}"


def _train(net, x, codegen, *, steps=2, input_grad=True, **options):
    """Run ``steps`` SGD steps with kiln, with eager and with eager in float64; compare everything; return
    the hook's records."""
    ref, exact, seen = copy.deepcopy(net), copy.deepcopy(net).double(), []
    f = torch.compile(net, backend="kiln", options={**_options(codegen, seen), **options})
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (net, ref, exact)]
    for step in range(steps):
        xk, xr, xe = x.clone(), x.clone(), x.double()
        if input_grad:
            xk.requires_grad_(), xr.requires_grad_(), xe.requires_grad_()
        out, want, best = f(xk), ref(xr), exact(xe)
        out, want, best = ((o if isinstance(o, tuple) else (o,)) for o in (out, want, best))
        weights = [torch.randn_like(w) for w in want]
        for i, (o, w, e) in enumerate(zip(out, want, best)):
            _close(o, w, e, f"step {step} output {i}")
        for outs in (out, want, best):
            sum((o * g.to(o.dtype)).sum() for o, g in zip(outs, weights)).backward()
        for (name, p), q, e in zip(net.named_parameters(), ref.parameters(), exact.parameters()):
            _close(p.grad, q.grad, e.grad, f"step {step} grad of {name}")
        if input_grad:
            _close(xk.grad, xr.grad, xe.grad, f"step {step} grad of the input")
        else:
            _close(xk, xr, xe, f"step {step} updated input")
        for (name, b), c, e in zip(net.named_buffers(), ref.buffers(), exact.buffers()):
            assert_close_to_fp64(b, c, e, atol=1e-5, rtol=1e-5, msg=f"step {step} {name}")
        for o in opts:
            o.step()
            o.zero_grad()
    return seen


def _assert_all_nhwc(seen):
    rows = [r for g in seen for r in g]
    assert any(k == "fw" for k, _ in rows) and any(k == "bw" for k, _ in rows), rows
    assert all(all(flags) for _, flags in rows), rows


@pytest.mark.parametrize("codegen", CODEGENS)
@pytest.mark.parametrize("make, shape", [(ConvBNReLU, (2, 3, 6, 6)), (Residual, (2, 4, 6, 6)),
                                         (StridedFlatten, (2, 3, 8, 8)), (ViewsOut, (2, 3, 5, 5))],
                         ids=["conv_bn_relu", "residual", "strided_flatten", "views_out"])
def test_training_matches_eager_with_nhwc_convolutions(any_device, codegen, make, shape):
    seen = _train(make(), torch.randn(shape), codegen)
    _assert_all_nhwc(seen)


@pytest.mark.parametrize("codegen", CODEGENS)
def test_mutated_input_and_running_stats_match_eager(any_device, codegen):
    seen = _train(MutatesInput(), torch.randn(2, 3, 5, 5), codegen, input_grad=False)
    _assert_all_nhwc(seen)


@pytest.mark.parametrize("options", [{"partitioner": "default"}, {"activation_memory_budget": 0.3}],
                         ids=["save_all", "recompute"])
def test_partitioners_agree_with_eager(any_device, options):
    """The default partitioner saves the input's NHWC copy; under a budget the mincut partitioner saves
    the input and recomputes the copy in the backward: both see one layout per value."""
    seen = _train(Residual(), torch.randn(2, 4, 6, 6), "triton", **options)
    _assert_all_nhwc(seen)


def test_dynamic_shapes_stay_nchw(any_device):
    seen = []
    f = torch.compile(ConvBNReLU(), backend="kiln", dynamic=True,
                      options={"codegen": "triton", "post_grad_custom_post_pass": _conv_layouts(seen)})
    out, h = f(torch.randn(2, 3, 6, 6))
    (out.sum() + h.sum()).backward()
    rows = [r for g in seen for r in g]
    assert rows and not any(any(flags) for _, flags in rows)


def test_channels_last_input_keeps_its_gradient_layout(any_device):
    x = torch.randn(2, 4, 6, 6).to(memory_format=CL)
    seen = _train(Residual(), x, "aten", steps=1)
    _assert_all_nhwc(seen)


def _conversions(seen):
    """A post-grad hook counting layout copies per graph: [{'nhwc': n, 'nchw': n, 'view': n}, ...]."""
    def hook(graph):
        c = {"nhwc": 0, "nchw": 0, "view": 0}
        for n in graph.nodes:
            if n.target is aten.clone.default and "memory_format" in n.kwargs:
                c["nhwc" if n.kwargs["memory_format"] is CL else "nchw"] += 1
            c["view"] += n.target is aten.as_strided.default
        seen.append(c)
    return hook


def test_residual_block_converts_once_on_the_way_in(any_device):
    """Forward: the block's input and its two 3x3 weights go NHWC once (the 1x1 weight is both layouts),
    its output back once. Backward: nothing goes NHWC (it reuses the forward's copies); the input's
    gradient and the 3x3 weights' gradients go back to eager strides, the 1x1 weight's gradient only
    differs in size-1 strides and gets a view."""
    seen = []
    f = torch.compile(Residual(), backend="kiln", options={"codegen": "triton",
                                                          "post_grad_custom_pre_pass": _conversions(seen)})
    x = torch.randn(2, 4, 6, 6, requires_grad=True)
    f(x).sum().backward()
    assert seen == [{"nhwc": 3, "nchw": 1, "view": 0}, {"nhwc": 0, "nchw": 3, "view": 1}]


def _joint(net, x):
    """AOTAutograd-like joint graph of ``net``'s forward and backward (params as inputs, out.sum() loss)."""
    names = [k for k, _ in net.named_parameters()]
    params = [p.detach() for p in net.parameters()]

    def fn(x, *ps):
        ps = [p.requires_grad_() for p in ps]
        out = torch.func.functional_call(net, dict(zip(names, ps)), (x,))
        return [out] + list(torch.autograd.grad(out.sum(), ps))
    return make_fx(fn, tracing_mode="fake")(x, *params)


def _clones(gm):
    return [n for n in gm.graph.nodes if n.target is aten.clone.default and "memory_format" in n.kwargs]


def test_joint_graph_shares_the_input_copy_and_restores_gradient_strides(any_device):
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)).eval()
    gm = _joint(net, torch.randn(2, 3, 6, 6))
    before = {n.name: n.meta["val"].stride() for n in gm.graph.nodes if n.op == "output" for n in n.all_input_nodes}
    convs = C.to_channels_last(gm, any_device)
    # forward: conv(x) (relu(conv) is NHWC already); backward of conv 2: its expanded grad_output;
    # backward of conv 1: x again (its grad_output, relu's backward, is NHWC already); the two weights
    # in the forward and again in the backward
    assert convs == 7
    into = [c for c in _clones(gm) if c.kwargs["memory_format"] is CL]
    converted = [c.args[0].name for c in into if c.args[0].op == "placeholder"]
    assert len(converted) == 3 == len(set(converted))   # x and both weights, once each, shared with the backward
    out = next(n for n in gm.graph.nodes if n.op == "output")
    for a in out.all_input_nodes:
        name = a.args[0].name if a.target in (aten.clone.default, aten.as_strided.default) else a.name
        assert a.meta["val"].stride() == before[name]


def test_cpu_training_graphs_are_left_alone_by_default():
    seen = []
    f = torch.compile(ConvBNReLU(), backend="kiln", options={"codegen": "triton",
                                                            "post_grad_custom_post_pass": _conv_layouts(seen)})
    out, h = f(torch.randn(2, 3, 6, 6))
    (out.sum() + h.sum()).backward()
    rows = [r for g in seen for r in g]
    assert rows and not any(any(flags) for _, flags in rows)


def test_layout_optimization_off_leaves_training_graphs_alone(any_device):
    seen = []
    f = torch.compile(ConvBNReLU(), backend="kiln", options={
        "codegen": "triton", "layout_optimization": False, "post_grad_custom_post_pass": _conv_layouts(seen)})
    out, h = f(torch.randn(2, 3, 6, 6))
    (out.sum() + h.sum()).backward()
    rows = [r for g in seen for r in g]
    assert rows and not any(any(flags) for _, flags in rows)


def _nchw_row_reductions(seen):
    """A post-grad hook recording, per graph, reductions that still walk a channels-last tensor row by
    row in NCHW order (reduced dims include W but not C: the uncoalesced form nhwc_reductions rewrites)
    and reductions of an NHWC view."""
    def hook(graph):
        bad = good = 0
        for n in graph.nodes:
            if n.op != "call_function" or n.target not in C.REDUCTIONS:
                continue
            x = n.args[0]
            dims = {d % 4 for d in C._dims_keepdim(n)[0] or ()}
            bad += C._is_cl(x.meta.get("val")) and 3 in dims and 1 not in dims
            good += x.target is aten.permute.default and list(x.args[1]) == C.TO_NHWC
        seen.append((bad, good > 0))
    return hook


def test_batch_norm_statistics_reduce_through_the_nhwc_view(any_device):
    """BN's mean/var (forward) and its gradient sums (backward) reduce the NHWC view over its leading
    dims, and a training step still matches eager (the _train comparisons)."""
    seen = []
    _train(Residual(), torch.randn(2, 4, 6, 6), "triton", steps=1,
           post_grad_custom_pre_pass=_nchw_row_reductions(seen))
    assert seen == [(0, True), (0, True)]


class MixedConvs(nn.Module):
    """Dilated depthwise, transposed (plain and grouped) and 1x1 convolutions."""
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(),
                                 nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=8),
                                 nn.ConvTranspose2d(8, 6, 3, stride=2, padding=1, output_padding=1), nn.ReLU(),
                                 nn.Conv2d(6, 4, 1), nn.ConvTranspose2d(4, 2, 4, stride=2, groups=2))

    def forward(self, x):
        return self.net(x)


def _weight_layouts(seen):
    """A post-grad hook recording whether each convolution's weight is NHWC (forward and backward)."""
    def hook(graph):
        for n in graph.nodes:
            if n.target in (aten.convolution.default, aten.convolution_backward.default):
                w = n.args[1 if n.target is aten.convolution.default else 2].meta["val"]
                seen.append((n.target is aten.convolution.default, w.shape[-1],
                             w.is_contiguous(memory_format=CL)))
    return hook


@pytest.mark.parametrize("codegen", CODEGENS)
def test_weights_go_nhwc_for_every_kind_of_convolution(any_device, codegen):
    """KxK weights of plain, depthwise-dilated and transposed convolutions are NHWC in the forward and the
    backward (cuDNN would copy them in each call), the 1x1 weight is both layouts, and training matches."""
    _train(MixedConvs(), torch.randn(2, 4, 9, 9), codegen)
    seen = []
    opts = {**_options(codegen, []), "post_grad_custom_post_pass": _weight_layouts(seen)}
    f = torch.compile(MixedConvs(), backend="kiln", options=opts)
    f(torch.randn(2, 4, 9, 9, requires_grad=True)).sum().backward()
    assert {fw for fw, _, _ in seen} == {True, False} and all(cl for _, _, cl in seen), seen
