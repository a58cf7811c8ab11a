"""Seed 004 (test_inductor_freezing) on kiln, part 2: conv-BN, linears, layouts.

As in the seed, every test runs with ``freezing=True`` and ``freezing_discard_parameters=True``; CPU by
default, CUDA variants marked ``gpu``.
"""
import itertools
import re

import pytest
import torch
from torch import nn

import kiln
from tests.freezing.helpers import (DEVICES, ConvBN, ConvFunctionalBN, ConvMultiBN, ConvMultiFunctionalBN, calls,
                                    compiled, cuda_ok, randomize_bn, seed_scope, wrapper_code)  # noqa: F401

aten = torch.ops.aten


@pytest.mark.parametrize("device", DEVICES)
def test_conv_multiple_uses(device):
    cuda_ok(device)

    class ToyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 1, 1)
            self.bn1 = nn.BatchNorm2d(1)
            self.bn1.weight.data.normal_()

        def forward(self, x, y):
            return self.conv1(x) + self.bn1(self.conv1(y))

    model = ToyModel().eval().to(device)
    a, b = torch.rand(8, 1, 16, 16).to(device), torch.rand(8, 1, 16, 16).to(device)
    output = model(a, b)
    with torch.no_grad():
        output2 = compiled(model)(a, b)
    torch.testing.assert_close(output2, output)
    assert kiln.counters["kiln"]["conv_bn_folded"] == 1  # the conv of y; the shared weight stays as it is


def _conv_bn_cases(device):
    for use_bias, dtype in itertools.product([True, False], [torch.float16, torch.bfloat16, torch.float32]):
        if device == "cpu" and dtype == torch.float16:
            continue
        yield use_bias, dtype


def _constants(src: str) -> list:
    """Names the wrapper binds to frozen constants (``_frozen_paramN`` or a prepacked weight)."""
    return [m.group(1) for m in re.finditer(r"^\s*(\w+) = \w+\s*(#.*)?$", src, re.M)
            if "frozen_param" in m.group(1) or "packed_weight" in m.group(1)]


@pytest.mark.parametrize("device", DEVICES)
def test_folded_conv_bn(device):
    cuda_ok(device)
    for use_bias, dtype in _conv_bn_cases(device):
        torch._dynamo.reset()
        kiln.counters.clear()
        mod = randomize_bn(ConvBN(3, 32, bias=use_bias, kernel_size=3, stride=2)).eval().to(device).to(dtype)
        x = torch.rand(3, 3, 32, 32).to(device).to(dtype)
        foo = compiled(lambda m, x: m(x))
        with torch.no_grad():
            out_eager = mod(x)
            out, code = kiln.run_and_get_code(foo, mod, x)
        torch.testing.assert_close(out, out_eager, atol=1e-2, rtol=1e-2)
        src = wrapper_code(code)
        convs = calls(src, "convolution")
        assert len(convs) == 1 and not calls(src, "batch_norm"), src
        assert kiln.counters["kiln"]["conv_bn_folded"] == 1
        consts = _constants(src)
        assert len(consts) == 2, src  # the folded weight and bias only
        if device == "cpu":
            assert all(c in convs[0] for c in consts), src
        else:  # the fusing target adds the bias in the kernel after the convolution (passes/conv_bias.py)
            weight, bias = sorted(consts, key=lambda c: c not in convs[0])
            assert weight in convs[0] and bias not in convs[0] and ", None, [" in convs[0], src
            conv_out = convs[0].split("=", 1)[0].strip()
            assert any(conv_out in ln for ln in calls(src, "kiln_")), src


@pytest.mark.parametrize("device", DEVICES)
def test_folded_conv_bn_with_module_sharing(device):
    cuda_ok(device)
    mod = ConvBN(32, 32, bias=True, kernel_size=3, stride=2).to(device).to(torch.float32)
    for _ in range(10):  # update the running statistics
        mod(torch.rand(3, 32, 32, 32).to(device))
    mod.eval()
    x = torch.rand(3, 32, 32, 32).to(device)

    def foo(mod, x):
        mod(x)
        return mod(x)

    with torch.no_grad():
        out_eager = foo(mod, x)
        out, _ = kiln.run_and_get_code(compiled(foo), mod, x)
    torch.testing.assert_close(out, out_eager, atol=1e-2, rtol=1e-2)
    assert kiln.counters["kiln"]["conv_bn_folded"] >= 1


@pytest.mark.parametrize("device", DEVICES)
def test_folded_conv_functional_bn_with_module_sharing(device):
    cuda_ok(device)
    x = torch.rand(3, 32, 32, 32).to(device)
    mod = ConvFunctionalBN(32, 32, bias=True, kernel_size=3, stride=2,
                           running_mean=torch.mean(x, dim=(0, 2, 3)), running_var=torch.var(x, dim=(0, 2, 3)),
                           weight=torch.ones(32).to(device), bn_bias=torch.zeros(32).to(device)).eval().to(device)

    def foo(mod, x):
        mod(x)
        return mod(x)

    with torch.no_grad():
        out_eager = foo(mod, x)
        out, _ = kiln.run_and_get_code(compiled(foo), mod, x)
    torch.testing.assert_close(out, out_eager, atol=1e-2, rtol=1e-2)
    assert kiln.counters["kiln"]["conv_bn_folded"] >= 1  # plain tensor attributes freeze too


@pytest.mark.parametrize("device", DEVICES)
def test_conv_bn_with_multi_bn_share_conv(device):
    cuda_ok(device)
    mod = ConvMultiBN(32, 32, bias=True, kernel_size=3, stride=2).to(device)
    for _ in range(10):
        mod(torch.rand(3, 32, 32, 32).to(device))
    mod.eval()
    x = torch.rand(3, 32, 32, 32).to(device)
    with torch.no_grad():
        out_eager = mod(x)
        out, _ = kiln.run_and_get_code(compiled(lambda m, x: m(x)), mod, x)
    torch.testing.assert_close(out, out_eager, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_conv_functional_bn_with_multi_bn_share_conv(device):
    cuda_ok(device)
    x = torch.rand(3, 32, 32, 32).to(device)
    mod = ConvMultiFunctionalBN(32, 32, bias=True, kernel_size=3, stride=2,
                                running_mean=torch.mean(x, dim=(0, 2, 3)), running_var=torch.var(x, dim=(0, 2, 3)),
                                weight=torch.ones(32).to(device), bn_bias=torch.zeros(32).to(device),
                                running_mean2=torch.mean(x, dim=(0, 2, 3)) + 0.5).eval().to(device)
    with torch.no_grad():
        out_eager = mod(x)
        out, _ = kiln.run_and_get_code(compiled(lambda m, x: m(x)), mod, x)
    torch.testing.assert_close(out, out_eager, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("device", DEVICES)
def test_conv_with_as_strided(device, groups):
    cuda_ok(device)

    class Model(nn.Module):
        def __init__(self, groups):
            super().__init__()
            self.kv = nn.Conv2d(256, 384, kernel_size=(1, 1), stride=(1, 1), bias=False, groups=groups)

        def forward(self, x):
            convolution = self.kv(x)
            constant_pad_nd = aten.constant_pad_nd.default(convolution, [2, 2, 2, 2], 0.0)
            as_strided = aten.as_strided.default(constant_pad_nd, [8, 384, 2, 20, 12], [153600, 400, 160, 1, 20])
            as_strided_1 = aten.as_strided.default(as_strided, [8, 384, 2, 2, 12, 12],
                                                   [153600, 400, 160, 8, 20, 1])
            return aten.clone.default(as_strided_1, memory_format=torch.contiguous_format)

    foo = compiled(lambda m, i: m(i))
    with torch.no_grad():
        x = torch.randn(8, 256, 16, 16).to(device)
        mod = Model(groups).to(device).eval()
        ref = mod(x)
        torch.testing.assert_close(foo(mod, x), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_conv_layout_convert_with_view(device):
    cuda_ok(device)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 128, kernel_size=3, padding=1, stride=1, bias=False)
            self.bn = nn.BatchNorm2d(3)

        def forward(self, x):
            return torch.flatten(self.conv(self.bn(x)), 1)

    mod = randomize_bn(Model()).to(device).eval()
    with torch.no_grad():
        x = torch.rand(2, 3, 5, 5).to(device)
        ref = mod(x)
        out = compiled(lambda m, i: m(i))(mod, x)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert out.stride() == ref.stride()


@pytest.mark.parametrize("device", DEVICES)
def test_conv_weight_layout_convert(device):
    """The layout hand-off: freezing's layout pass (``layout_devices='any'``: on the CPU too) makes the
    conv weight channels-last, and it reaches the convolution as a channels-last constant. The Triton
    target keeps ``aten.convolution`` on the CPU (the ATen target prepacks the weight for oneDNN, an
    opaque layout)."""
    cuda_ok(device)
    seen = []

    def spy(graph):  # post_grad_pre: after freezing and its folding
        gm = graph.owning_module
        seen.extend(getattr(gm, n.args[1].target) for n in graph.nodes
                    if n.target is aten.convolution.default and n.args[1].op == "get_attr")

    mod = nn.Conv2d(3, 128, kernel_size=3, padding=1, stride=1, bias=False).eval().to(device)
    x = torch.rand(2, 3, 5, 5).to(device)
    with torch.no_grad(), kiln.passes.register("post_grad_pre", spy):
        ref = mod(x)
        out = compiled(lambda m, i: m(i), codegen="triton", layout_devices="any")(mod, x)
    tol = 1e-4 if device == "cpu" else 2e-3  # cuDNN may pick another (TF32) algorithm for channels-last
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    assert len(seen) == 1 and seen[0].is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("device", DEVICES)
def test_unequal_bias_horizontal_addmm_fusion(device):
    cuda_ok(device)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], device=device)
            self.b1 = torch.zeros(3, device=device)
            self.w2 = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0], [0.0, 0.0, 1.0]], device=device)
            self.b2 = torch.tensor([[-1.0, -1.0, -1.0]], device=device)
            self.w3 = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]], device=device)
            self.b3 = torch.tensor([1.0, 2.0, 3.0], device=device)

        def forward(self, x):
            F = torch.nn.functional
            return F.linear(x, self.w1, self.b1), F.linear(x, self.w2, self.b2), F.linear(x, self.w3, self.b3)

    func = Model().to(device).eval()
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], device=device)
    with torch.no_grad():
        out_eager = func(x.clone())
        out_compiled = compiled(func)(x.clone())
    torch.testing.assert_close(out_compiled, out_eager)
    assert [o.stride() for o in out_compiled] == [e.stride() for e in out_eager]
    assert kiln.counters["kiln"]["concat_linear"] == 3


@pytest.mark.parametrize("device", DEVICES)
def test_redundant_clone_for_layout_convert(device):
    cuda_ok(device)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 128, kernel_size=3, padding=1, stride=1, bias=False)

        def forward(self, x):
            return self.conv(x), x + 1

    mod = Model().eval().to(device)
    inp = torch.rand(2, 3, 5, 5).to(device)
    with torch.no_grad():
        expected = mod(inp)
        actual = compiled(mod)(inp)
    assert len(actual) == 2
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)
        assert a.is_contiguous()  # outputs keep eager strides
