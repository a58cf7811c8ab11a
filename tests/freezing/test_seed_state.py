"""Seed 004 (test_inductor_freezing) on kiln, part 1: module state, mutation, discard, folding rules.

As in the seed, every test runs with ``freezing=True`` and ``freezing_discard_parameters=True``; CPU by
default, CUDA variants marked ``gpu``.
"""
import weakref

import pytest
import torch
from torch import nn

import kiln
from tests.freezing.helpers import DEVICES, ConvBN, compiled, cuda_ok, randomize_bn, seed_scope  # noqa: F401


@pytest.mark.parametrize("device", DEVICES)
def test_mutation(device):
    cuda_ok(device)

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
    assert kiln.counters["kiln"]["frozen_params"] == 0  # mutated: stays an input


@pytest.mark.parametrize("device", DEVICES)
def test_aliased_param_return(device):
    cuda_ok(device)

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
    cuda_ok(device)
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
    cuda_ok(device)
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
    cuda_ok(device)

    class Mod(nn.Module):  # a parameter, so that the freezing path (not the plain one) compiles it
        def __init__(self):
            super().__init__()
            self.p = nn.Parameter(torch.ones(4, 4))

        def forward(self):
            return torch.rand([4, 4], device=self.p.device) + self.p

    mod = Mod().to(device)
    foo = compiled(lambda m: m())
    bar = compiled(lambda: torch.rand([4, 4], device=device) + 1)
    with torch.no_grad():
        assert not torch.equal(foo(mod), foo(mod))
        assert not torch.equal(bar(), bar())


@pytest.mark.parametrize("device", DEVICES)
def test_symint_not_folded(device):
    cuda_ok(device)

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
    fn_opt = torch.compile(fn, backend="kiln", dynamic=True)
    mod_opt = torch.compile(lambda m, a: m(a), backend="kiln", dynamic=True)
    with torch.no_grad():
        for shape in [(2, 4, 6), (3, 5, 6)]:
            inp = torch.randn(*shape).to(device)
            torch._dynamo.mark_dynamic(inp, 0)
            torch._dynamo.mark_dynamic(inp, 1)
            torch.testing.assert_close(fn_opt(inp), fn(inp))
            expect = (inp.cos() * w, torch.zeros(shape[:2], device=device) + w.sum())
            torch.testing.assert_close(mod_opt(mod, inp), expect)
    assert kiln.counters["kiln"]["constant_folded"] >= 1  # w.sum() folded, zeros(s0, s1) not


@pytest.mark.parametrize("device", DEVICES)
def test_unfolded_bn(device):
    cuda_ok(device)
    x = torch.rand([3, 32, 15, 15]).to(device)
    mod = randomize_bn(nn.BatchNorm2d(32, eps=0.001)).eval().to(device)
    foo = compiled(lambda m, x: m(x) + 10)
    out_compiled_no_inference = foo(mod, x)
    assert kiln.counters["kiln"]["frozen_params"] == 0  # grad enabled: not frozen
    with torch.no_grad():
        out_compiled = foo(mod, x)
    assert kiln.counters["kiln"]["frozen_params"] == 4
    torch.testing.assert_close(out_compiled, out_compiled_no_inference.detach())


@pytest.mark.parametrize("device", DEVICES)
def test_dont_change_dtype_folding(device):
    cuda_ok(device)
    dtype = torch.float16 if device == "cuda" else torch.bfloat16
    mod = nn.Conv2d(3, 32, bias=None, kernel_size=3, stride=2).eval().to(device).to(dtype)
    x = torch.rand(3, 3, 32, 32).to(device).to(dtype)

    def foo(mod, x):
        return mod(x) * torch.full([1], 2.0, device=device)

    with torch.no_grad():
        out_eager = foo(mod, x)
        out = compiled(foo)(mod, x)
    assert out.dtype == out_eager.dtype == torch.float32
    # fp16 convolution: cuDNN's channels-last and NCHW algorithms may round a few outputs one fp16
    # ulp apart (seen: 4 of 21600 on an H100), which the fp32 result's default tolerance rejects
    tol = dict(atol=2e-3, rtol=1e-3) if dtype == torch.float16 else {}
    torch.testing.assert_close(out, out_eager, **tol)
    assert kiln.counters["kiln"]["binary_folded"] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_param_deallocated(device):
    cuda_ok(device)

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


@pytest.mark.parametrize("device", DEVICES)
def test_cpp_wrapper(device, capsys):
    cuda_ok(device)
    mod = randomize_bn(ConvBN(3, 32, kernel_size=3, stride=2)).eval().to(device)
    x = torch.rand(3, 3, 32, 32).to(device)
    foo = torch.compile(lambda m, x: m(x), backend="kiln", options={"cpp_wrapper": True})
    out_eager = mod(x)
    with torch.no_grad(), kiln.config.patch(debug=1):
        torch.testing.assert_close(foo(mod, x), out_eager, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(foo(mod, x), out_eager, atol=1e-4, rtol=1e-4)
    assert "cpp_wrapper=True: kiln has no C++ wrapper; running the Python wrapper" in capsys.readouterr().err
