"""Seed 004 (test_inductor_freezing) on kiln: every scenario, CPU by default, CUDA variants marked gpu.

As in the seed, every test runs with ``freezing=True`` and ``freezing_discard_parameters=True``.
"""
import itertools
import re
import weakref

import pytest
import torch
from torch import nn

import kiln
from tests.freezing.helpers import (ConvBN, ConvFunctionalBN, ConvMultiBN, ConvMultiFunctionalBN, calls,
                                    compiled, randomize_bn, seed_config, wrapper_code)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(autouse=True)
def _seed_config():
    kiln.counters.clear()
    with seed_config():
        yield


def _cuda_ok(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.mark.parametrize("device", DEVICES)
def test_mutation(device):
    _cuda_ok(device)

    class Mod(nn.Module):
        def __init__(self):
            super().__init__()
            self.mutated_param = nn.Parameter(torch.zeros([10, 10]))

        def forward(self):
            self.mutated_param.add_(10)
            return self.mutated_param

    with torch.no_grad():
        mod = Mod().to(device)
        out_eager, out_eager2 = mod().clone(), mod().clone()
        mod = Mod().to(device)
        foo = compiled(lambda m: m())
        out_comp, out_comp2 = foo(mod).clone(), foo(mod).clone()
    torch.testing.assert_close(out_comp, out_eager)
    torch.testing.assert_close(out_comp2, out_eager2)
    torch.testing.assert_close(mod.mutated_param.detach(), torch.full([10, 10], 20.0, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_aliased_param_return(device):
    _cuda_ok(device)

    class Mod(nn.Module):
        def __init__(self):
            super().__init__()
            self.aliased_param = nn.Parameter(torch.randn([10, 10]))

        def forward(self):
            return self.aliased_param[1:], self.aliased_param

    mod = Mod().to(device).eval()
    foo = compiled(lambda m: m())
    with torch.no_grad():
        ref = [t.clone() for t in mod()]
        out = foo(mod)
    torch.testing.assert_close(list(out), ref)
    assert out[1].data_ptr() == mod.aliased_param.data_ptr()  # still the parameter, not a copy


@pytest.mark.parametrize("device", DEVICES)
def test_autocast(device):
    _cuda_ok(device)
    dtype = torch.half if device == "cuda" else torch.bfloat16  # CPU: fp16 addmm is not always there
    mod = nn.Linear(10, 10).to(device).eval()
    inp = torch.rand([10, 10]).to(device).to(dtype)
    foo = compiled(lambda m, i: m(i))
    with torch.no_grad(), torch.autocast(device, dtype=dtype):
        out_eager = mod(inp)
        out_compiled, code = kiln.run_and_get_code(foo, mod, inp)
    assert "@triton.jit" not in code[0]
    assert out_compiled.dtype == out_eager.dtype == dtype
    torch.testing.assert_close(out_compiled, out_eager, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "no_inline"])
@pytest.mark.parametrize("device", DEVICES)
def test_error_on_eager(device, inline):
    _cuda_ok(device)
    mod = ConvBN(3, 32, kernel_size=3, stride=2).eval().to(device)
    x = torch.rand(3, 3, 32, 32).to(device)
    with torch.no_grad():
        ref = mod(x)
    foo = compiled(lambda m, x: m(x))
    with torch._dynamo.config.patch(inline_inbuilt_nn_modules=inline), torch.no_grad():
        out = foo(mod, x)
        torch.testing.assert_close(foo(mod, x), out)  # the compiled module keeps working
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(RuntimeError, match="Trying to run Pytorch Eager Module after Dynamo Freezing"):
        mod(x)


@pytest.mark.parametrize("device", DEVICES)
def test_rng_op(device):
    _cuda_ok(device)

    class Mod(nn.Module):  # a parameter so the frozen path (not the plain one) compiles it
        def __init__(self):
            super().__init__()
            self.p = nn.Parameter(torch.ones(4, 4))

        def forward(self):
            return torch.rand([4, 4], device=self.p.device) + self.p

    mod = Mod().to(device)
    foo = compiled(lambda m: m())
    bar = compiled(lambda: torch.rand([4, 4], device=device) + 1)
    with torch.no_grad():
        o1, o2 = foo(mod), foo(mod)
        assert not torch.equal(o1, o2)
        assert not torch.equal(bar(), bar())


@pytest.mark.parametrize("device", DEVICES)
def test_symint_not_folded(device):
    _cuda_ok(device)

    def fn(a):
        return a.cos(), torch.zeros(a.shape[0], a.shape[1])

    class Mod(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(6))

        def forward(self, a):  # constants next to SymInt-sized constructors
            return a.cos() * self.w, torch.zeros(a.shape[0], a.shape[1], device=a.device) + self.w.sum()

    mod = Mod().to(device)
    w = mod.w.detach().clone()  # the module's own copy is discarded by the first compile
    with torch.no_grad():
        fn_opt = torch.compile(fn, backend="kiln", dynamic=True)
        mod_opt = torch.compile(lambda m, a: m(a), backend="kiln", dynamic=True)
        for shape in [(2, 4, 6), (3, 5, 6)]:
            inp = torch.randn(*shape).to(device)
            torch._dynamo.mark_dynamic(inp, 0)
            torch._dynamo.mark_dynamic(inp, 1)
            torch.testing.assert_close(fn_opt(inp), fn(inp))
            expect = (inp.cos() * w, torch.zeros(shape[:2], device=device) + w.sum())
            got = mod_opt(mod, inp)
            torch.testing.assert_close(got, expect)


@pytest.mark.parametrize("device", DEVICES)
def test_conv_multiple_uses(device):
    _cuda_ok(device)

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
    assert kiln.counters["kiln"]["conv_bn_folded"] == 1


@pytest.mark.parametrize("device", DEVICES)
def test_unfolded_bn(device):
    _cuda_ok(device)
    x = torch.rand([3, 32, 15, 15]).to(device)
    mod = randomize_bn(nn.BatchNorm2d(32, eps=0.001)).eval().to(device)
    foo = compiled(lambda m, x: m(x) + 10)
    out_compiled_no_inference = foo(mod, x)
    assert kiln.counters["kiln"]["frozen_params"] == 0  # grad enabled: not frozen
    with torch.no_grad():
        out_compiled = foo(mod, x)
    assert kiln.counters["kiln"]["frozen_params"] == 4
    torch.testing.assert_close(out_compiled, out_compiled_no_inference.detach())


def _conv_bn_cases(device):
    for use_bias, dtype in itertools.product([True, False], [torch.float16, torch.bfloat16, torch.float32]):
        if device == "cpu" and dtype == torch.float16:
            continue
        yield use_bias, dtype


@pytest.mark.parametrize("device", DEVICES)
def test_folded_conv_bn(device):
    _cuda_ok(device)
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
        assert len(convs) == 1, src
        assert not calls(src, "batch_norm") and kiln.counters["kiln"]["conv_bn_folded"] == 1, src
        consts = [m.group(1) for m in re.finditer(r"^\s*(\w+) = \w+\s*(#.*)?$", src, re.M)
                  if "frozen_param" in m.group(1) or "packed_weight" in m.group(1)]
        assert len(consts) == 2, src  # the folded weight and bias, nothing else
        assert all(c in convs[0] for c in consts), src


@pytest.mark.parametrize("device", DEVICES)
def test_folded_conv_bn_with_module_sharing(device):
    _cuda_ok(device)
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
    _cuda_ok(device)
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
    _cuda_ok(device)
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
    _cuda_ok(device)
    x = torch.rand(3, 32, 32, 32).to(device)
    mod = ConvMultiFunctionalBN(32, 32, bias=True, kernel_size=3, stride=2,
                                running_mean=torch.mean(x, dim=(0, 2, 3)), running_var=torch.var(x, dim=(0, 2, 3)),
                                weight=torch.ones(32).to(device), bn_bias=torch.zeros(32).to(device),
                                running_mean2=torch.mean(x, dim=(0, 2, 3)) + 0.5).eval().to(device)
    with torch.no_grad():
        out_eager = mod(x)
        out, _ = kiln.run_and_get_code(compiled(lambda m, x: m(x)), mod, x)
    torch.testing.assert_close(out, out_eager, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_dont_change_dtype_folding(device):
    _cuda_ok(device)
    dtype = torch.float16 if device == "cuda" else torch.bfloat16
    mod = nn.Conv2d(3, 32, bias=None, kernel_size=3, stride=2).eval().to(device).to(dtype)
    x = torch.rand(3, 3, 32, 32).to(device).to(dtype)

    def foo(mod, x):
        return mod(x) * torch.full([1], 2.0, device=device)

    with torch.no_grad():
        out_eager = foo(mod, x)
        out = compiled(foo)(mod, x)
    assert out.dtype == out_eager.dtype == torch.float32
    torch.testing.assert_close(out, out_eager)


@pytest.mark.parametrize("device", DEVICES)
def test_param_deallocated(device):
    _cuda_ok(device)

    class Mod(nn.Module):
        def __init__(self):
            super().__init__()
            self.param = nn.Parameter(torch.zeros([10, 10]))

        def forward(self, x):
            return (self.param + 10) + x

    mod = Mod().eval().to(device)
    inp = torch.rand([10], device=device)
    with torch.no_grad():
        eager = mod(inp)
    weight_ref = weakref.ref(mod.param)
    foo = compiled(lambda m, i: m(i))
    with torch.no_grad():
        out = foo(mod, inp)
    torch.testing.assert_close(out, eager)
    assert weight_ref() is None
    with torch.no_grad():
        torch.testing.assert_close(foo(mod, inp + 1), eager + 1)  # later calls need no original


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("device", DEVICES)
def test_conv_with_as_strided(device, groups):
    _cuda_ok(device)

    class Model(nn.Module):
        def __init__(self, groups):
            super().__init__()
            self.kv = nn.Conv2d(256, 384, kernel_size=(1, 1), stride=(1, 1), bias=False, groups=groups)

        def forward(self, x):
            convolution = self.kv(x)
            constant_pad_nd = torch.ops.aten.constant_pad_nd.default(convolution, [2, 2, 2, 2], 0.0)
            as_strided = torch.ops.aten.as_strided.default(constant_pad_nd, [8, 384, 2, 20, 12],
                                                           [153600, 400, 160, 1, 20])
            as_strided_1 = torch.ops.aten.as_strided.default(as_strided, [8, 384, 2, 2, 12, 12],
                                                             [153600, 400, 160, 8, 20, 1])
            return torch.ops.aten.clone.default(as_strided_1, memory_format=torch.contiguous_format)

    foo = compiled(lambda m, i: m(i))
    with torch.no_grad():
        x = torch.randn(8, 256, 16, 16).to(device)
        mod = Model(groups).to(device).eval()
        ref = mod(x)
        torch.testing.assert_close(foo(mod, x), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_cpp_wrapper(device, capsys):
    _cuda_ok(device)
    mod = randomize_bn(ConvBN(3, 32, kernel_size=3, stride=2)).eval().to(device)
    x = torch.rand(3, 3, 32, 32).to(device)
    foo = torch.compile(lambda m, x: m(x), backend="kiln", options={"cpp_wrapper": True})
    out_eager = mod(x)
    with torch.no_grad(), kiln.config.patch(debug=1):
        torch.testing.assert_close(foo(mod, x), out_eager, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(foo(mod, x), out_eager, atol=1e-4, rtol=1e-4)
    assert "cpp_wrapper=True: kiln has no C++ wrapper; running the Python wrapper" in capsys.readouterr().err


@pytest.mark.parametrize("device", DEVICES)
def test_conv_layout_convert_with_view(device):
    _cuda_ok(device)

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
        torch.testing.assert_close(compiled(lambda m, i: m(i))(mod, x), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_conv_weight_layout_convert(device, monkeypatch):
    """The layout hand-off: weights the hook makes channels-last reach the conv as constants."""
    _cuda_ok(device)
    from kiln.passes import layout
    aten = torch.ops.aten
    seen = []

    def channels_last_hook(gm, opts):
        n = 0
        for node in list(gm.graph.nodes):
            if node.target is aten.convolution.default and node.args[1].op == "get_attr":
                with gm.graph.inserting_before(node):
                    c = gm.graph.call_function(aten.clone.default, (node.args[1],),
                                               {"memory_format": torch.channels_last})
                node.replace_input_with(node.args[1], c)
                n += 1
        gm.recompile()
        return n

    def spy(gm, fake_mode=None):
        for node in gm.graph.nodes:
            if node.target is aten.convolution.default:
                seen.append(getattr(gm, node.args[1].target))
        return 0

    monkeypatch.setattr(layout, "convert_conv_weights", channels_last_hook)
    from kiln.passes import concat_linear
    monkeypatch.setattr(concat_linear, "concat_linears", spy)  # runs after folding
    mod = nn.Conv2d(3, 128, kernel_size=3, padding=1, stride=1, bias=False).eval().to(device)
    x = torch.rand(2, 3, 5, 5).to(device)
    with torch.no_grad():
        ref = mod(x)
        out = compiled(lambda m, i: m(i))(mod, x)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert len(seen) == 1 and seen[0].is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("device", DEVICES)
def test_unequal_bias_horizontal_addmm_fusion(device):
    _cuda_ok(device)

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
    for o, e in zip(out_compiled, out_eager):
        assert o.stride() == e.stride()
    assert kiln.counters["kiln"]["concat_linear"] == 3


@pytest.mark.parametrize("device", DEVICES)
def test_redundant_clone_for_layout_convert(device):
    _cuda_ok(device)

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
        assert a.is_contiguous()
