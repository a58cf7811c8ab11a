"""Helpers for codegen tests: trace a function to an ATen graph, fuse it, run it, compare."""
from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from kiln.capture.decomp import decomposition_table
from kiln.codegen.target import resolve
from kiln.options import current
from kiln.runtime.load import bind_graph
from tests.numerics import assert_close_to_fp64, fp64


def decompositions():
    return decomposition_table(fusion=True)


def fuse_graph(gm, args, opts, strict: bool = True, bind: bool = True):
    """The kernels of ``opts``' target in ``gm`` (``codegen.target.Target.fuse``, in place), with ``bind``
    built and bound so that ``gm`` runs (``Target.build``, ``runtime.load.bind_graph``; unbound, the graph
    holds ``KernelRef``s, as when the wrapper is emitted); returns the ``Fused`` value (``.kernels``,
    ``.plans``, ``.units``)."""
    target = resolve(opts, list(args))
    fused = target.fuse(gm, list(args), strict=strict)
    if bind:
        target.build(gm, fused)
        bind_graph(gm)
    return fused


def fuse(gm, args, bind: bool = True, **opts) -> int:
    """``fuse_graph`` on ``gm`` with the options in scope (``kiln.config.patch``) and ``opts``, Triton
    target, failures raised."""
    return fuse_graph(gm, args, current(codegen="triton", **opts), bind=bind).kernels


def fused(fn, *args, mode="fake", **opts):
    """(graph module with kernels, number of kernels) for ``fn`` traced on ``args``."""
    gm = make_fx(fn, decomposition_table=decompositions(), tracing_mode=mode)(*args)
    return gm, fuse(gm, args, **opts)


def kernels(gm):
    return [n.target for n in gm.graph.nodes if hasattr(n.target, "source")]


def aten_ops(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function" and not hasattr(n.target, "source")]


def _ref(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.double()
    return x


def assert_close(out, ref, atol=1e-5, rtol=1e-5, exact=None):
    """``out`` against ``ref`` (eager's, or float64 where ``ref`` is); with ``exact``, the float64 result of
    the inputs eager's ``ref`` came from, float32 results within the tolerance of ``exact`` widened by eager's
    own error (``tests.numerics.assert_close_to_fp64``: a fused kernel's sums run in another order than
    eager's, and which orders depends on the host)."""
    if exact is not None:
        assert_close_to_fp64(out, ref, exact, atol, rtol)
        return
    if isinstance(ref, (tuple, list)):
        assert len(out) == len(ref)
        for o, r in zip(out, ref):
            assert_close(o, r, atol, rtol)
        return
    if ref is None:
        assert out is None
        return
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert out.dtype == ref.dtype or ref.dtype == torch.float64, (out.dtype, ref.dtype)
    torch.testing.assert_close(out.to(ref.dtype) if ref.dtype == torch.float64 else out, ref,
                               atol=atol, rtol=rtol, equal_nan=True)


def reference(fn, args, atol, rtol):
    """(eager's result, the float64 result) of ``fn`` on ``args``; the second None where the comparison is
    exact (atol = rtol = 0: eager's values bit for bit) or ``fn`` cannot run in float64."""
    args64 = fp64(args) if atol or rtol else None   # (before eager's run, which may write its inputs)
    ref = fn(*args)
    try:
        exact = fn(*args64) if args64 is not None else None
    except Exception:   # an op without a float64 kernel, a dtype argument: eager's values alone
        exact = None
    return ref, exact


def compare(out, fn, *args, atol=1e-5, rtol=1e-5):
    """``out`` (a compiled ``fn`` run on ``args``) against eager's ``fn(*args)`` as ``check`` compares."""
    ref, exact = reference(fn, args, atol, rtol)
    assert_close(out, ref, atol, rtol, exact=exact)


def check(fn, *args, n_kernels=None, atol=1e-5, rtol=1e-5, ref_fp64=False, mode="fake"):
    """Fuse ``fn``, run it on ``args`` and compare with eager; returns the graph module. Every kernel
    must have run (a kernel that raised and fell back to ATen would give eager's values). Float32 results
    are compared with the float64 result within the tolerance widened by eager's own error (``assert_close``);
    ``ref_fp64``: with the float64 result alone, within the tolerance."""
    from kiln.debug import counters
    gm, n = fused(fn, *args, mode=mode)
    before = counters["codegen"]["runtime_fallback"]
    out = gm(*args)
    assert counters["codegen"]["runtime_fallback"] == before, "a kernel fell back to ATen (see the log)"
    if ref_fp64:
        assert_close(out, fn(*[_ref(a) for a in args]), atol, rtol)
    else:
        compare(out, fn, *args, atol=atol, rtol=rtol)
    if n_kernels is not None:
        assert n == n_kernels, f"expected {n_kernels} kernels, got {n}:\n{gm.code}"
    return gm
