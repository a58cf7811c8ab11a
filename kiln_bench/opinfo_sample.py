"""One OpInfo sample through one backend, judged against eager: ``run(op, sample, dtype, backend)``.

Eager runs the sample's op on copies of its inputs; then, after ``torch._dynamo.reset()``, the op is
compiled with ``torch.compile(fn, backend=..., options=...)`` and run on fresh copies. Values are
compared with the op's tolerances (``opinfo_cases.tolerance``); where the sample has float inputs that
require grad, gradients of the float outputs (``output_process_fn_grad``, seeded random cotangents) are
compared too. Low-precision runs (bf16, fp16) are also judged against an fp64 run of eager (the
arbiter): a result passes when, element by element, it is within tolerance of that reference or no more
than twice as far from it as eager's own result. An fp32 mismatch records whether the arbiter would
have passed it (``fp64_ok``), to tell reordering noise from wrong values.

The outcome is a plain dict (``status``: pass, mismatch, error, skip; the worker pool adds crash and
timeout) with the counts that matter for kiln: Dynamo graphs and graph breaks, graphs that stayed ATen
(``counters['codegen']['fallback']``: on the C++ target also a unit g++ could not build), kernels that
fell back to ATen at run time (``counters['codegen']['runtime_fallback']``), kernels the C++ emitter
declined, whose ATen nodes run (``declined``: scatters, random ops, ops without a template) and the
reasons kiln logged.
"""
from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import time
import traceback

import torch
from torch.utils import _pytree as pytree

from kiln import config
from kiln_bench import opinfo_cases as cases

# backend name -> (torch.compile backend, options)
BACKENDS = {
    "kiln-aten": ("kiln", {"codegen": "aten", "cache": False}),   # (no compile cache: the sweep tests compiles)
    "kiln-triton": ("kiln", {"codegen": "triton", "compile_workers": 0, "cache": False}),
    # C++ kernels: built with the system compiler (no precompile workers: those are for Triton on CUDA)
    "kiln-cpp": ("kiln", {"codegen": "cpp", "cache": False}),
    "inductor": ("inductor", None),
    "aot_eager": ("aot_eager", None),
    "eager": ("eager", None),
}
COTANGENT_SEED = 1234


class UnknownBackend(ValueError):
    """``--backends`` named a backend the sweep does not know: use the names of ``BACKENDS``
    (kiln-aten, kiln-triton, kiln-cpp, inductor, aot_eager, eager)."""


def error_text(e: BaseException) -> str:
    """``Type: first line`` of the innermost cause (Dynamo wraps backend failures)."""
    seen = set()
    while id(e) not in seen:
        seen.add(id(e))
        inner = getattr(e, "inner_exception", None) or e.__cause__
        if inner is None:
            break
        e = inner
    first = next((ln for ln in str(e).strip().splitlines() if ln.strip()), "")
    return f"{type(e).__name__}: {first[:300]}"


def kiln_frame(e: BaseException) -> str | None:
    """``path:line`` of the innermost traceback frame inside kiln, following causes."""
    found = None
    while e is not None:
        for fs in traceback.extract_tb(e.__traceback__):
            if f"{os.sep}kiln{os.sep}" in fs.filename and f"{os.sep}bench{os.sep}" not in fs.filename:
                found = f"kiln{fs.filename.split(f'{os.sep}kiln', 1)[1]}:{fs.lineno}"
        e = getattr(e, "inner_exception", None) or e.__cause__
    return found


# -- inputs ------------------------------------------------------------------------------------
def _copy(x, dtype=None, grad=True):
    """A fresh leaf with ``x``'s values, strides where possible, and requires_grad (when ``grad``); float
    tensors cast to ``dtype``'s precision when given (complex keeps complex)."""
    if not isinstance(x, torch.Tensor):
        return x
    to = x.dtype
    if dtype is not None and x.is_floating_point():
        to = dtype
    elif dtype is not None and x.is_complex():
        to = torch.complex128 if dtype == torch.float64 else x.dtype
    with torch.no_grad():
        try:
            y = torch.empty_strided(x.shape, x.stride(), dtype=to, device=x.device)
            y.copy_(x)
        except RuntimeError:   # overlapping strides (expanded), odd layouts
            y = x.detach().clone().to(to)
    return y.requires_grad_(grad and x.requires_grad and (y.is_floating_point() or y.is_complex()))


def copy_sample(sample, dtype=None, grad=True):
    """(args, kwargs, the leaves that require grad) for a fresh run of ``sample``."""
    args, kwargs = pytree.tree_map(lambda t: _copy(t, dtype, grad), ((sample.input,) + tuple(sample.args),
                                                                     dict(sample.kwargs)))
    leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
    return args, kwargs, leaves


def _grad_outputs(out, sample):
    picked = sample.output_process_fn_grad(out)
    return [t for t in pytree.tree_leaves(picked)
            if isinstance(t, torch.Tensor) and t.requires_grad and (t.is_floating_point() or t.is_complex())]


def cotangents(outs) -> list:
    """Seeded random cotangents shaped like ``outs``."""
    g = torch.Generator().manual_seed(COTANGENT_SEED)
    res = []
    for o in outs:
        c = torch.randn(o.shape, generator=g, dtype=torch.float64)
        if o.is_complex():
            c = torch.complex(c, torch.randn(o.shape, generator=g, dtype=torch.float64))
        res.append(c.to(o.dtype))
    return res


def execute(fn, sample, dtype=None, cots=None, rec=None):
    """(outputs, grads or None) of ``fn`` on fresh copies of the sample; grads when ``cots`` is given.
    Without ``cots`` no input requires grad (an inference graph). ``rec["where"]`` follows the stage."""
    args, kwargs, leaves = copy_sample(sample, dtype, grad=cots is not None)
    if rec is not None:
        rec["where"] = "forward"
    out = fn(*args, **kwargs)
    if cots is None:
        return out, None
    if rec is not None:
        rec["where"] = "backward"
    outs = _grad_outputs(out, sample)
    cots = [c.to(o.dtype) for c, o in zip(cots, outs)]
    grads = torch.autograd.grad(outs, leaves, cots, allow_unused=True)
    return out, [g.detach() if g is not None else torch.zeros_like(x) for g, x in zip(grads, leaves)]


# -- comparison --------------------------------------------------------------------------------
def _leaves(x):
    return pytree.tree_leaves(x)


def compare(actual, expected, atol, rtol, ref64=None) -> tuple[bool, float, str]:
    """(ok, max abs error, what differs) of two outputs with the same structure. ``ref64``, an fp64
    eager result, lets an element pass that is no more than twice as far from it as eager's."""
    a_l, e_l = _leaves(actual), _leaves(expected)
    r_l = _leaves(ref64) if ref64 is not None else [None] * len(e_l)
    if len(a_l) != len(e_l):
        return False, math.inf, f"{len(a_l)} outputs, eager has {len(e_l)}"
    worst, ok, why = 0.0, True, ""
    for i, (a, e, r) in enumerate(zip(a_l, e_l, r_l)):
        if not isinstance(e, torch.Tensor):
            good = a == e if not isinstance(e, float) else math.isclose(a, e, rel_tol=rtol, abs_tol=atol) \
                or (math.isnan(a) and math.isnan(e))
            if not good:
                ok, why = False, why or f"output {i}: {a!r} != {e!r}"
            continue
        if not isinstance(a, torch.Tensor):
            ok, why = False, why or f"output {i}: {type(a).__name__}, eager gives a tensor"
            continue
        if a.shape != e.shape or a.dtype != e.dtype:
            ok, why = False, why or f"output {i}: {a.dtype}{list(a.shape)}, eager {e.dtype}{list(e.shape)}"
            continue
        good, err = _close(a.detach(), e.detach(), atol, rtol, r)
        worst = max(worst, err)
        if not good:
            ok, why = False, why or f"output {i}: max abs error {err:.3g} (atol {atol:g}, rtol {rtol:g})"
    return ok, worst, why


def _close(a, e, atol, rtol, r):
    if a.layout != torch.strided:
        a, e = a.to_dense(), e.to_dense()
    if not (e.is_floating_point() or e.is_complex()):
        bad = a != e
        return not bool(bad.any()), float(bad.sum())
    ac, ec = a.to(torch.complex128 if e.is_complex() else torch.float64), e.to(
        torch.complex128 if e.is_complex() else torch.float64)
    same = (ac == ec) | (torch.isnan(ac) & torch.isnan(ec))   # equal infinities and both-NaN pass
    diff = (ac - ec).abs()
    diff = torch.where(same, torch.zeros_like(diff), diff)
    good = same | (diff <= atol + rtol * ec.abs())
    if r is not None and not bool(good.all()):
        rc = r.detach().to(ac.dtype)
        good = good | ((ac - rc).abs() <= 2 * (ec - rc).abs() + atol + rtol * rc.abs())
    finite = diff[torch.isfinite(diff)]
    err = float(finite.max()) if finite.numel() else (0.0 if bool(good.all()) else math.inf)
    if bool((~torch.isfinite(diff) & ~same).any()):
        err = math.inf
    return bool(good.all()), err


# -- one run -----------------------------------------------------------------------------------
def modes(sample) -> list:
    """The checks a sample gets: forward (no input requires grad: an inference graph) and, when it has
    float inputs requiring grad, backward (a training graph: values and gradients)."""
    return ["forward", "backward"] if _needs_grad(sample) else ["forward"]


def _needs_grad(sample) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad
               for t in pytree.tree_leaves((sample.input, sample.args, sample.kwargs)))


def _counts():
    from torch._dynamo.utils import counters as dyn
    from kiln import counters
    return (sum(dyn["graph_break"].values()), dyn["stats"]["unique_graphs"],
            counters["codegen"]["fallback"], counters["codegen"]["runtime_fallback"],
            counters["codegen"]["cpp_declined"])


def run(op, sample, dtype: torch.dtype, backend: str, index: int = 0, mode: str = "forward",
        spec=None) -> dict:
    """Run one sample of ``op`` in ``dtype`` through ``backend`` in ``mode`` and judge it; the record.
    ``spec``, a (torch.compile backend, options) pair, compiles instead of ``BACKENDS[backend]``."""
    if spec is None and backend not in BACKENDS:
        raise UnknownBackend(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    device = _device(sample)
    atol, rtol, tol_from = cases.tolerance(op, dtype, device)
    rec = dict(op=cases.full_name(op), dtype=cases.dtype_name(dtype), backend=backend, sample=index,
               mode=mode, status="pass", where=None, error=None, max_err=None,
               atol=atol, rtol=rtol, tol=tol_from, desc=_describe(sample))
    t0 = time.perf_counter()
    try:
        _run(op, sample, dtype, spec or BACKENDS[backend], rec, mode == "backward")
    finally:
        rec["seconds"] = round(time.perf_counter() - t0, 3)
    return rec


def _device(sample) -> str:
    found = [t.device.type for t in pytree.tree_leaves((sample.input, sample.args, sample.kwargs))
             if isinstance(t, torch.Tensor)]
    return found[0] if found else "cpu"


def _describe(sample) -> str:
    try:
        return sample.summary()[:300]
    except Exception:
        return ""


def _skip(rec, why):
    rec.update(status="skip", error=why)


def _run(op, sample, dtype, spec, rec, train):
    if op.has_nondeterministic_output or op.skip_correctness_check_compile_vs_eager:
        return _skip(rec, "op: output not comparable with eager (uninitialized or random)")
    func = op.get_op()

    def fn(*args, **kwargs):
        return func(*args, **kwargs)

    cots = ref_grads = None
    try:   # eager; a sample eager cannot run is no test of the compiler
        torch.manual_seed(0)
        if not train:
            ref, _ = execute(fn, sample)
        else:
            args, kwargs, _ = copy_sample(sample)
            outs = _grad_outputs(fn(*args, **kwargs), sample)
            if not outs:
                return _skip(rec, "backward: no float output requires grad")
            cots = cotangents(outs)
            torch.manual_seed(0)
            ref, ref_grads = execute(fn, sample, cots=cots)
    except Exception as e:
        return _skip(rec, f"eager: {error_text(e)}")
    out, grads = _compiled(fn, sample, spec, cots, rec)
    if rec["status"] == "error":
        return
    low = dtype in cases.LOW_PRECISION
    ref64, grads64 = _fp64(fn, sample, cots) if low else (None, None)
    ok, err, why = compare(out, ref, rec["atol"], rec["rtol"], ref64)
    rec["where"] = None if ok else "forward"
    if ok and train:
        ok, err_g, why = compare(grads, ref_grads, rec["atol"], rec["rtol"], grads64)
        err = max(err, err_g)
        rec["where"] = None if ok else "backward"
    rec["max_err"] = err or None
    if ok:
        return
    rec.update(status="mismatch", error=why)
    if not low:   # would the fp64 arbiter have passed it? (reordering noise against wrong values)
        ref64, grads64 = _fp64(fn, sample, cots)
        if ref64 is not None:
            a, e, r = (out, ref, ref64) if rec["where"] == "forward" else (grads, ref_grads, grads64)
            rec["fp64_ok"] = compare(a, e, rec["atol"], rec["rtol"], r)[0]


def _compiled(fn, sample, spec, cots, rec):
    """(outputs, grads) of ``fn`` compiled as ``spec`` says; on failure sets the record's error."""
    name, opts = spec
    log = io.StringIO()
    before = _counts()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=name, options=dict(opts) if opts else None)
    out = grads = None
    caught = _BackendExceptions()
    dynamo_log = logging.getLogger("torch._dynamo.exc")
    dynamo_log.addHandler(caught)
    # kiln logs why a graph stays ATen or a kernel falls back (debug level 1, at compile and at run time)
    logging_scope = config.patch(debug=1) if name == "kiln" else contextlib.nullcontext()
    try:
        with contextlib.redirect_stderr(log), logging_scope:
            torch.manual_seed(0)
            out, grads = execute(compiled, sample, cots=cots, rec=rec)
    except Exception as e:
        rec.update(status="error", error=error_text(e), kiln_frame=kiln_frame(e))
    finally:
        dynamo_log.removeHandler(caught)
        if caught.found:
            rec["backend_exception"] = caught.found[0]
        after = _counts()
        rec.update(graphs=after[1] - before[1], graph_breaks=after[0] - before[0],
                   fallback=after[2] - before[2], runtime_fallback=after[3] - before[3],
                   declined=after[4] - before[4])
        reasons = [ln.split("[kiln] ", 1)[1] for ln in log.getvalue().splitlines() if "[kiln] codegen:" in ln]
        if reasons:
            rec["reasons"] = reasons[:4]
        torch._dynamo.reset()
    return out, grads


class _BackendExceptions(logging.Handler):
    """Collects Dynamo's warnings that a backend raised and the frame fell back to eager (Dynamo does
    so for data-dependent and dynamic-output-shape exceptions instead of failing)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.found = []

    def emit(self, record):
        msg = record.getMessage()
        if "Backend compiler exception" in msg:
            line = next((ln.strip() for ln in msg.splitlines() if "Explanation:" in ln), msg.splitlines()[0])
            self.found.append(line.replace("Explanation: ", "")[:300])


def _fp64(fn, sample, cots):
    """(outputs, grads) of eager on the sample with float inputs in fp64, or (None, None)."""
    if cots is not None:
        cots = [c.to(torch.complex128 if c.is_complex() else torch.float64) for c in cots]
    try:
        torch.manual_seed(0)
        return execute(fn, sample, torch.float64, cots)
    except Exception:
        return None, None
