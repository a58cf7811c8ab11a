"""Compiled autograd over kiln: the backward graph AOTAutograd keeps for it is traced again (through the
compiled-autograd backend's own AOTAutograd), so kiln's graphs may hold ATen ops and functional prims only,
never a prim that returns a view (``prims.broadcast_in_dim``, from torch's references of keepdim
reductions: layer norm's ``var_mean``, RMS norm's ``mean``)."""
import copy

import pytest
import torch
import torch.nn as nn

import kiln
from kiln import debug
from kiln.capture.decomp import decomposition_table
from kiln.options import current
from kiln.runtime import cpp_build
from tests.numerics import assert_close_to_fp64

prims = torch.ops.prims

TARGETS = ["aten", "triton",
           pytest.param("cpp", marks=pytest.mark.skipif(not cpp_build.find_compiler(current()),
                                                        reason="no C++ compiler (g++, clang++, $CXX)"))]


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def _view_prims(gm) -> list:
    """The prims in ``gm`` whose output aliases an input (AOTAutograd cannot functionalize them)."""
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"
            and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "prims"
            and any(r.alias_info is not None for r in n.target._schema.returns)]


@pytest.mark.parametrize("codegen", TARGETS)
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_compiled_autograd_gradients_equal_eager(codegen, norm):
    d = 16
    model = nn.Sequential(nn.LayerNorm(d) if norm == "layer_norm" else RMSNorm(d), nn.Linear(d, 8), nn.GELU(),
                          nn.Linear(8, d), nn.LayerNorm(d))
    ref, exact = copy.deepcopy(model), copy.deepcopy(model).double()   # (float64: the norms sum in the
    x = torch.randn(3, 5, d)                                             # host's order)
    x_ref = x.clone().requires_grad_()
    x.requires_grad_()
    seen = []
    torch._dynamo.utils.counters.clear()
    with debug.observe(lambda event, data: seen.append(_view_prims(data["gm"])) if event == "graph" else None):
        fn = torch.compile(model, backend="kiln", options={"codegen": codegen})
        backward = torch.compile(backend="kiln", options={"codegen": codegen})
        with torch._dynamo.compiled_autograd._enable(backward):
            out = fn(x)
            out.square().sum().backward()
    ref_out = ref(x_ref)
    ref_out.square().sum().backward()
    x64 = x.detach().double().requires_grad_()
    exact_out = exact(x64)
    exact_out.square().sum().backward()
    assert torch._dynamo.utils.counters["compiled_autograd"]["captures"] == 1
    assert seen and not any(seen), seen
    assert_close_to_fp64(out, ref_out, exact_out, rtol=1e-4, atol=1e-5)
    assert_close_to_fp64(x.grad, x_ref.grad, x64.grad, rtol=1e-4, atol=1e-4)
    for (name, p), q, e in zip(model.named_parameters(), ref.parameters(), exact.parameters()):
        assert_close_to_fp64(p.grad, q.grad, e.grad, rtol=1e-4, atol=1e-4, msg=name)


@pytest.mark.parametrize("shape,dims,out", [((4,), [0], (4, 1)), ((4, 1), [0, 2], (4, 3, 5)),
                                            ((3,), [1], (2, 3)), ((), [], (2, 2)), ((2, 1, 3), [0, 1, 2], (2, 1, 3))])
def test_broadcast_in_dim_decomposes_to_aten_views(shape, dims, out):
    decompose = decomposition_table(fusion=True)[prims.broadcast_in_dim.default]
    a = torch.randn(shape)
    got = decompose(a, list(out), dims)
    assert torch.equal(got, prims.broadcast_in_dim(a, list(out), dims))
    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda a: decompose(a, list(out), dims))(a)
    assert {n.target.namespace for n in gm.graph.nodes if n.op == "call_function"} <= {"aten"}


@pytest.mark.parametrize("codegen", TARGETS)
def test_dynamic_shapes_save_no_symfloat(codegen):
    """Under dynamic shapes ``x.var(-1, keepdim=True)``'s backward needs the Bessel factor, a SymFloat:
    compiled autograd takes only SymInts from a forward, so the partitioner recomputes the factor in the
    backward from the saved size (saving it failed with 'an integer is required')."""
    def f(x):
        return x.var(-1, keepdim=True) * x
    x = torch.randn(6, 5, requires_grad=True)
    fn = torch.compile(f, backend="kiln", dynamic=True, options={"codegen": codegen})
    backward = torch.compile(backend="kiln", options={"codegen": codegen})
    with torch._dynamo.compiled_autograd._enable(backward):
        fn(x).sum().backward()
    got, x.grad = x.grad, None
    f(x).sum().backward()
    torch.testing.assert_close(got, x.grad)
