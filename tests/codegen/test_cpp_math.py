"""The C++ emitter's math functions: a value computed in two loops (or two kernels) is the same in both;
signbit builds with g++ 12 in a vectorized loop.

glibc's vector math library (libmvec, used in ``omp simd`` loops) and its scalar functions (a loop's
remainder, a loop left scalar) differ in the last bits; a kernel in which such a result decides a
comparison, a max or a rounding calls the scalar functions in every lane (``to_cpp.emit.decides``)."""
import re

import pytest
import torch
import torch.nn.functional as F

from kiln.codegen.to_cpp import ops
from kiln.options import current
from kiln.runtime import cpp_build
from tests.codegen.test_cpp import check, fused
from tests.codegen.test_reduction import grads
from tests.codegen.util import kernels

pytestmark = pytest.mark.skipif(not cpp_build.find_compiler(current()), reason="no C++ compiler (g++, clang++, $CXX)")


def sources(gm) -> str:
    """The C++ of ``gm``'s kernels (the translation unit the build kept beside its library)."""
    names = {m for k in kernels(gm) for m in re.findall(r"function\('(kiln_cpp_\w+)'", k.source)}
    paths = {cpp_build.library(n)[:-3] + ".cpp" for n in names}
    return "\n".join(open(p).read() for p in sorted(paths))


def amax_backward(x, g):
    """max's backward by hand: the gradient goes where the (recomputed) sigmoid equals its max."""
    s = torch.sigmoid(x)
    m = s.amax(dim=-2, keepdim=True)
    return (s == m) * g


@pytest.mark.parametrize("shape", [(1, 1, 4), (2, 5, 67)])
def test_recomputed_math_equals_its_max(shape):
    """The kernel computes ``sigmoid(x)`` in the max's loop and again beside the comparison: every
    column keeps its maximum (with libmvec in one loop and glibc's scalar ``expf`` in the other, 2 of 4
    gradients of fuzz seed 10, program 287 were lost: ``aminmax(sigmoid(x), dim=-2).max`` backward)."""
    torch.manual_seed(0)
    x, g = torch.randn(shape) * 3, torch.randn(shape)
    check(amax_backward, x, g, exact=True)   # the max is exact in any order: the point is the recomputed sigmoid
    check(grads(lambda x: torch.aminmax(torch.sigmoid(x), dim=-2, keepdim=True).max, 1), x,
          torch.randn(shape[0], 1, shape[2]), atol=1e-6, rtol=1e-6)


def test_scalar_math_only_where_it_decides():
    """A kernel where exp's result reaches a comparison calls the scalar aliases; softmax (the max is over
    the inputs, exp only after it) and gelu keep the vectorizable calls."""
    x = torch.randn(8, 40)
    assert "kiln_s_expf" in sources(fused(amax_backward, x, x)[0])
    softmax = sources(fused(lambda x: torch.softmax(x, -1), x)[0])
    assert "expf(" in softmax and "kiln_s_" not in softmax.split("kiln_cpp_", 1)[1]
    gelu = sources(fused(lambda x: F.gelu(x), x)[0])
    assert "erff(" in gelu and "kiln_s_" not in gelu.split("kiln_cpp_", 1)[1]


def test_a_where_on_math_values_keeps_vector_math():
    """Only a ``where``'s condition decides: softplus's ``where(x > 20, x, log1p(exp(x)))`` keeps libmvec,
    ``where(exp(x) > 2, ...)`` does not; ``tuning.cpp_vector_math=False`` calls the scalar functions
    everywhere."""
    x = torch.randn(8, 40)
    assert "kiln_s_" not in sources(fused(F.softplus, x)[0]).split("kiln_cpp_", 1)[1]
    assert "kiln_s_expf" in sources(fused(lambda x: torch.where(x.exp() > 2, x, -x), x)[0])
    gm = check(F.softplus, x, tuning={"cpp_vector_math": False})
    assert "kiln_s_log1pf" in sources(gm) and "kiln_s_expf" in sources(gm)


def test_scalar_aliases_name_glibc_functions():
    """Every ``kiln_s_`` alias names the glibc symbol of its function (float and double)."""
    for f in ops.VECTOR_MATH:
        assert f'float kiln_s_{f}f(float) __asm__("{f}f");' in ops.PREAMBLE
        assert f'double kiln_s_{f}(double) __asm__("{f}");' in ops.PREAMBLE
    assert ops.scalar_math(ops.FLOAT_UNARY["sigmoid"]).count("kiln_s_exp{f}(") == 1
    assert ops.scalar_math(ops.FLOAT_UNARY["expm1"]) == "kiln_s_expm1{f}({0})"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_signbit_builds_and_keeps_signs(dtype):
    """signbit of 400 loaded values: g++ 12 failed to compile ``__builtin_signbit`` vectorized over bf16
    loads ('unrecognizable insn': the OpInfo sweep's signbit bf16 graph stayed ATen); the sign bit comes
    from the bits, NaN's and zero's too."""
    x = torch.randn(20, 20).to(dtype)
    x[0, :4] = torch.tensor([0.0, -0.0, float("nan"), -float("nan")], dtype=dtype)
    x[1, :2] = torch.tensor([float("inf"), -float("inf")], dtype=dtype)
    check(torch.signbit, x, n_kernels=1, exact=True)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8])
def test_float_to_int_as_eager(dtype):
    """A float converted to an integer as eager converts it on x86: NaN, infinities and values out of
    range give the lowest value (int64, int32; smaller integers through int32, truncated). The round trip
    ``x.to(int64).float()`` of a NaN gave NaN: g++ folded it into ``truncf`` (fuzz seed 15, program 544)."""
    v = [float("nan"), float("inf"), -float("inf"), 1e20, -1e20, 3.7, -3.7, 3e9, 40000.0, 300.0, 0.0, 0.5]
    x = torch.tensor(v * 3)   # (not in (-1, -0]: g++ makes (float)(int64_t)x truncf(x), -0.0 there; eager 0.0)
    check(lambda x: x.to(dtype), x, n_kernels=1, exact=True)
    check(lambda x: torch.stack([x.to(dtype).float(), x]), x, exact=True)
    check(lambda x: x.double().to(dtype), x, exact=True)
