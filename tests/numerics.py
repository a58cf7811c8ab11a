"""Float comparisons that hold on any x86-64 host.

A product, a reduction or a norm sums in an order the host picks: the BLAS kernel MKL chooses for the CPU
(AVX2 paths on AMD, AVX-512 on most Xeons), the vector width of eager's loops (``ATEN_CPU_CAPABILITY``) and
of kiln's C++ kernels (``-march=native``), and the thread count. Two float32 results of different orders can
differ by more than ``torch.testing``'s default tolerance (rtol 1.3e-6, atol 1e-5) where the sum cancels to
a value near zero: a test that passes on the host it was written on fails on another (issue 31: 10
failures of ``test_mm_cols_any_block_width`` on an AMD EPYC).

So such a result is compared with the float64 result of the same inputs, within a bound derived from the
sizes: a sum of ``terms`` terms whose absolute values add up to ``scale`` is within ``terms * u * scale`` of
the exact sum in any order (u = eps / 2: the classical bound gamma_n = n u / (1 - n u)), and rounding the
result to its dtype adds half an ulp of it. The bound below is twice that (``eps`` for ``u``): it holds for
every order, every vector width and every thread count, and is still far below any real mistake (a wrong
column, a missing bias, a stale partial sum: errors of the values' own size).

Simulate another host on this one: ``MKL_ENABLE_INSTRUCTIONS=AVX2`` (MKL's kernels on AMD: it shows the
issue's failures), ``ONEDNN_MAX_CPU_ISA=AVX2`` (oneDNN's convolutions and eltwise kernels),
``ATEN_CPU_CAPABILITY=avx2`` (eager's 256-bit loops), ``KILN_CPP_FLAGS="-O3 -march=native -mno-avx512f ..."``,
``-mprefer-vector-width=128`` (g++'s tuning for AMD Zen 1) or ``=512`` (kiln's C++ kernels),
``OMP_NUM_THREADS=1`` or ``2``.
"""
from __future__ import annotations

import torch


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def fp64(x):
    """``x`` with every floating tensor (in tuples, lists and dicts too) detached and upcast to float64:
    the inputs of an exact reference."""
    if isinstance(x, torch.Tensor):
        return x.detach().double() if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        return type(x)(fp64(y) for y in x)
    if isinstance(x, dict):
        return {k: fp64(v) for k, v in x.items()}
    return x


def sum_bound(terms: int, scale, dtype: torch.dtype = torch.float32, exact=None):
    """The error bound of a ``dtype`` sum of ``terms`` terms whose absolute values add up to ``scale`` (a
    number or a tensor, per element), in any order; with ``exact``, plus the rounding of the result."""
    bound = terms * eps(dtype) * scale
    if exact is not None:
        bound = bound + eps(dtype) * exact.abs()
    return bound


def assert_within(got: torch.Tensor, exact: torch.Tensor, bound, msg: str = ""):
    """Every element of ``got`` within ``bound`` (a number or a tensor broadcasting to ``exact``) of
    ``exact`` (float64); NaN where ``exact`` is NaN, equal infinities. Names the worst element."""
    assert got.shape == exact.shape, (got.shape, exact.shape, msg)
    got = got.detach().double()
    exact = exact.detach().double()
    nan = exact.isnan()
    assert torch.equal(got.isnan(), nan), f"NaN where the exact result has none, or none where it has {msg}"
    inf = exact.isinf()
    assert torch.equal(got[inf], exact[inf]), f"infinities differ {msg}"
    finite = ~(nan | inf)
    err = (got - exact).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64).expand_as(exact)
    over = finite & (err > bound)
    if over.any():
        worst = ((err - bound) * over).flatten().argmax()
        idx = tuple(int(i) for i in torch.unravel_index(worst, exact.shape)) if exact.dim() else ()
        raise AssertionError(f"{int(over.sum())} of {exact.numel()} elements outside the bound {msg}; worst at "
                             f"{idx}: got {got[idx].item():.9g}, exact {exact[idx].item():.9g}, error "
                             f"{err[idx].item():.3g} > bound {bound[idx].item():.3g}")


def assert_sum_close(got, exact, *, terms: int, scale, dtype: torch.dtype = None, msg: str = ""):
    """``got`` (a tensor or a tuple/list of them) within ``sum_bound(terms, scale, dtype, exact)`` of the
    float64 ``exact``; ``dtype`` defaults to ``got``'s (pass float32 for a low-precision result accumulated
    in float32: its own rounding is added through ``exact``'s ulp of ``got.dtype``)."""
    if isinstance(exact, (tuple, list)):
        assert len(got) == len(exact), (len(got), len(exact))
        scales = scale if isinstance(scale, (tuple, list)) else [scale] * len(exact)
        for i, (g, e, s) in enumerate(zip(got, exact, scales)):
            assert_sum_close(g, e, terms=terms, scale=s, dtype=dtype, msg=f"{msg} [output {i}]")
        return
    acc = dtype or got.dtype
    bound = sum_bound(terms, scale, acc) + eps(got.dtype) * exact.detach().abs()
    assert got.dtype == exact.dtype or exact.dtype == torch.float64, (got.dtype, exact.dtype)
    assert_within(got, exact, bound, msg)


def assert_product_close(got, fn, *args, terms: int, dtype: torch.dtype = None, msg: str = ""):
    """``got`` against ``fn(*args)`` computed in float64, ``fn`` a sum of products of its tensor arguments
    (mm, addmm and bmm with positive alpha and beta, linear, matmul, einsum): each element's magnitude is
    ``fn`` of the arguments' absolute values, ``terms`` the longest sum (K, plus one for a bias)."""
    exact = fn(*fp64(args))
    scale = fn(*[a.abs() if isinstance(a, torch.Tensor) else a for a in fp64(args)])
    assert_sum_close(got, exact, terms=terms, scale=scale, dtype=dtype, msg=msg)


LOW_PRECISION = (torch.float16, torch.bfloat16)


def assert_close_to_fp64(out, ref, exact, atol: float, rtol: float, factor: float = 2.0, msg: str = ""):
    """A compiled result ``out`` against eager's ``ref`` and the float64 result ``exact`` of the same inputs
    (tensors, or tuples/lists of them), for computations whose size is not at hand (a model, a fused kernel
    of any function): each float32/float64 element within ``atol + rtol * |exact|`` of ``exact``, plus
    ``factor`` times the largest error eager's own result makes on this host (``max |ref - exact|``: the
    error the sizes, the magnitudes and this host's summation order give, measured).

    It never fails where ``|out - ref| <= atol + rtol * |ref|`` holds (the triangle inequality, factor >= 1 +
    rtol), and holds where another host's order moves eager's result or kiln's by as much as eager's
    error; a real mistake is far outside it. Where ``ref`` or ``exact`` is not finite, ``out`` must equal
    ``ref`` (NaN where eager has NaN, eager's infinities). Integer, bool, complex and 16-bit results (whose
    rounding to their dtype is the point), and ``exact=None``, are compared with ``ref`` as
    ``torch.testing.assert_close(out, ref, atol, rtol)`` does."""
    if isinstance(ref, (tuple, list)):
        assert isinstance(out, (tuple, list)) and len(out) == len(ref), (type(out), msg)
        exact = exact if exact is not None else [None] * len(ref)
        for i, (o, r, e) in enumerate(zip(out, ref, exact)):
            assert_close_to_fp64(o, r, e, atol, rtol, factor, f"{msg} [output {i}]")
        return
    if not isinstance(ref, torch.Tensor):
        assert out == ref or (ref != ref and out != out), (out, ref, msg)
        return
    assert isinstance(out, torch.Tensor), (type(out), msg)
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.shape, ref.dtype, msg)
    if (exact is None or not ref.is_floating_point() or ref.dtype in LOW_PRECISION
            or not isinstance(exact, torch.Tensor) or exact.shape != ref.shape):
        torch.testing.assert_close(out, ref, atol=atol, rtol=rtol, equal_nan=True, msg=lambda m: f"{m} {msg}")
        return
    out, ref, exact = out.detach().double(), ref.detach().double(), exact.detach().double()
    finite = ref.isfinite() & exact.isfinite()
    torch.testing.assert_close(out[~finite], ref[~finite], atol=0, rtol=0, equal_nan=True,
                               msg=lambda m: f"where eager's or the exact result is not finite: {m} {msg}")
    own = float((ref - exact)[finite].abs().max()) if finite.any() else 0.0
    bound = torch.where(finite, atol + rtol * exact.abs() + factor * own, 0.0)
    assert_within(torch.where(finite, out, exact), exact, bound,
                  f"(atol {atol:g} + rtol {rtol:g} * |exact| + {factor:g} * eager's error {own:.3g}) {msg}")
