"""Run one fuzz program eagerly, in float64 (the arbiter) and compiled with kiln; compare the three.

``check_program(make_inputs, program, target, train, dynamic)`` is the whole check and returns a
``Result``; reproducer scripts call it with their own ``make_inputs``/``program``. Steps:

1. eager, twice on fresh inputs: an exception, or two runs that disagree, discard the program; so does
   a write through memory that overlaps itself (``watch.Watch``: the values then depend on the order of
   eager's writes) and a result that changes when overlapping inputs are dense copies (eager
   then computes with aliasing);
2. the arbiter: the same program on inputs built in float64/complex128 (views and aliases kept);
3. kiln: ``torch.compile(program, backend="kiln", dynamic=dynamic, options={"codegen": target})`` (target:
   aten, triton or cpp) after ``torch._dynamo.reset()`` and ``kiln.runtime.kernels.reset()`` (so each
   program's ATen fallbacks are counted: ``kiln.counters['codegen']['runtime_fallback']``, and on the C++
   target the graphs whose build failed: ``cpp_build_failed``);
4. compare outputs, gradients of the inputs with ``grad`` (training) and the final values of every input
   (in-place mutation), as ``compare`` says; a difference that another way of eager's shares (its scalar
   loops: eager run on strided copies of the inputs and cotangents, and of the tensors of
   ``SCALAR_LOOP_OPS`` inside the graph; a two-pass ``var_mean``) is not held against kiln
   (``_eager_alternative``); ``Result.excused`` lists them.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import io
import math
import re
import time
import traceback
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kiln_bench.fuzz.compare import Problem, compare, same
from kiln_bench.fuzz.watch import Watch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "bool": torch.bool,
          "complex64": torch.complex64, "complex128": torch.complex128}
SPECIAL = (math.nan, math.inf, -math.inf, -0.0, 0.0)


# -- inputs -------------------------------------------------------------------------------------------------
def _values(n: int, dtype, seed: int, values: str, special: bool):
    g = torch.Generator().manual_seed(seed)
    kind, _, arg = values.partition(":")
    if dtype == torch.bool or kind == "mask":
        return torch.randint(0, 2, (n,), generator=g).to(dtype)
    if kind in ("index", "sindex", "oobindex", "oobsindex"):
        hi = max(int(arg), 1)
        v = torch.randint(-hi if kind.endswith("sindex") else 0, hi, (n,), generator=g)
        if kind.startswith("oob") and n:   # one index out of range (``generate.Gen.index``)
            wide = 2 ** 31 - 1 if dtype == torch.int32 else 10 ** 12
            bad = [hi, hi + 2, -hi - 1, wide] + ([-1] if kind == "oobindex" else [])
            v[int(torch.randint(0, n, (), generator=g))] = bad[int(torch.randint(0, len(bad), (), generator=g))]
        return v.to(dtype)
    if kind == "perm":
        return torch.randperm(max(int(arg), n), generator=g)[:n].to(dtype)
    if not (dtype.is_floating_point or dtype.is_complex):
        return torch.randint(-5, 6, (n,), generator=g).to(dtype)
    v = torch.randint(-12, 13, (n,), generator=g).double() / 4
    if dtype.is_complex:
        v = torch.complex(v, torch.randint(-12, 13, (n,), generator=g).double() / 4)
    if special and n:
        pick = torch.rand(n, generator=g) < 0.2
        which = torch.randint(0, len(SPECIAL), (n,), generator=g)
        sp = torch.tensor(SPECIAL, dtype=torch.float64)[which]
        v = torch.where(pick, sp.to(v.dtype), v)
    return v.to(dtype)


def make_input(shape, dtype, seed=0, layout="contiguous", values="grid", special=False, grad=False, up=False,
               dense=False):
    """A deterministic input of ``shape`` and ``dtype`` (a name in DTYPES) laid out as ``layout``;
    ``up``: float64/complex128 instead of a floating dtype, same values and layout (the arbiter's);
    ``dense``: an 'overlapping' input as a contiguous copy of the same values."""
    dt = DTYPES[dtype]
    vals_dt = dt
    if up and dt.is_floating_point:
        dt = torch.float64
    elif up and dt.is_complex:
        dt = torch.complex128
    shape, nd = tuple(shape), len(shape)
    base_shape, view = shape, lambda b: b
    if layout == "transposed" and nd >= 2:
        base_shape, view = shape[:-2] + (shape[-1], shape[-2]), lambda b: b.transpose(-1, -2)
    elif layout == "sliced" and nd >= 1:
        base_shape, view = shape[:-1] + (2 * shape[-1],), lambda b: b[..., ::2]
    elif layout == "offset":
        n = math.prod(shape)
        base_shape, view = (n + 3,), lambda b: b[3:].view(shape)
    elif layout == "expanded" and nd >= 1:
        base_shape = tuple(1 if i % 2 == 0 else s for i, s in enumerate(shape))
        view = lambda b: b.expand(shape)  # noqa: E731
    elif layout == "overlapping" and nd >= 2 and min(shape) > 0:
        base_shape = (sum(s - 1 for s in shape) + 1,)
        view = lambda b: b.as_strided(shape, (1,) * nd)  # noqa: E731
    elif layout == "channels_last" and nd == 4:
        view = lambda b: b.contiguous(memory_format=torch.channels_last)  # noqa: E731
    base = _values(math.prod(base_shape), vals_dt, seed, values, special).to(dt).reshape(base_shape)
    x = view(base)
    return leaf(x.contiguous() if dense else x, grad)


def leaf(x, grad=False):
    """``x`` itself, or (``grad``) a leaf sharing its storage and strides that requires grad."""
    return x.detach().requires_grad_() if grad else x


def cotangent(t, seed):
    v = _values(t.numel(), t.dtype, seed, "grid", False)
    return v.reshape(t.shape).to(t.dtype)


# -- running -------------------------------------------------------------------------------------------------
@dataclass
class Run:
    outs: list
    grads: list          # one per input: a tensor, or None (no grad asked or none flowed)
    inputs: list
    overlap: list = field(default_factory=list)   # ops that wrote through overlapping memory (``Watch``)
    low: dict = field(default_factory=dict)       # 'outs'/'grads'/'inputs' -> a less precise float dtype (or None) each


def execute(fn, inputs, train: bool, strided: bool = False, track: bool = False) -> Run:
    """``fn(*inputs)`` (under no_grad unless ``train``), then the gradients of the leaf inputs that
    require grad for fixed cotangents of the outputs that require grad (``strided`` ones: ``_strided``);
    ``track``: watch how eager computes (``watch.Watch``: ``Run.overlap``, ``Run.low``; eager runs only)."""
    mode = Watch() if track else None
    with mode or contextlib.nullcontext():
        outs, grads = _execute(fn, inputs, train, strided)
    det = lambda x: x.detach() if isinstance(x, torch.Tensor) else x  # noqa: E731
    low = {f: [mode.of(x) for x in xs] for f, xs in (("outs", outs), ("grads", grads), ("inputs", inputs))} \
        if mode else {}
    return Run([det(o) for o in outs], [det(g) for g in grads], [det(x) for x in inputs],
               mode.overlapping if mode else [], low)


def _execute(fn, inputs, train, strided):
    with (contextlib.nullcontext() if train else torch.no_grad()):
        outs = fn(*inputs)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    grads = [None] * len(inputs)
    if train:
        leaves = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.requires_grad and x.is_leaf]
        diff = [(i, o) for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
        if leaves and diff:
            got = torch.autograd.grad([o for _, o in diff], [inputs[i] for i in leaves],
                                      [(_strided if strided else _same_tensor)(cotangent(o, 1000 + i))
                                       for i, o in diff], allow_unused=True)
            for i, g in zip(leaves, got):
                grads[i] = g
    return outs, grads


def _layout_dependent(make_inputs, program, train, eager) -> bool:
    """Whether eager gives other values when overlapping inputs are dense copies: ops that clone an input
    and write into the clone (``select_scatter``, ``index_put``...) keep its overlapping strides, so
    eager's result then depends on the aliasing (kiln computes the values the program means)."""
    if "dense" not in inspect.signature(make_inputs).parameters:
        return False
    plain, dense = make_inputs(), make_inputs(dense=True)
    if all(not isinstance(a, torch.Tensor) or a.stride() == b.stride() for a, b in zip(plain, dense)):
        return False
    try:
        return not same(eager, execute(program, dense, train))
    except Exception:
        return True


def _same_tensor(x):
    return x


def _dense(x):
    """A contiguous copy of ``x`` (a leaf like it)."""
    if not isinstance(x, torch.Tensor):
        return x
    with torch.no_grad():
        y = x.detach().contiguous().clone()
    return leaf(y, x.requires_grad)


def _strided(x):
    """A copy of ``x`` whose last dim has stride 2: eager's TensorIterator runs its scalar loops on it."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return x
    y = torch.empty(tuple(x.shape) + (2,), dtype=x.dtype).select(-1, 0)
    with torch.no_grad():
        y.copy_(x)
    return leaf(y, x.requires_grad)


# Backward ops whose vectorized and scalar CPU loops disagree at a NaN input (torch 2.13, checked with
# 64 contiguous elements against one or a strided copy): elu/celu/selu and hardswish give NaN in one and
# the gradient in the other; hardtanh/relu6, hardshrink and softshrink 0 in one and the gradient in the
# other. Which loop runs depends on the layout and length of the tensors inside the graph, so eager's
# gradient there is not defined; kiln's decompositions follow the scalar loops. gelu (erf form) forward at
# +inf: NaN in the vectorized loop, inf in the scalar one (and in fp64: the arbiter's).
SCALAR_LOOP_OPS = ("elu_backward", "hardtanh_backward", "hardswish_backward", "hardshrink_backward",
                   "softshrink_backward", "gelu")


class _ScalarLoopOps(TorchDispatchMode):
    """Run the ``SCALAR_LOOP_OPS`` on strided copies of their tensors, i.e. in eager's scalar loops."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in SCALAR_LOOP_OPS:
            args = [_strided(a.detach()) if isinstance(a, torch.Tensor) else a for a in args]
        return func(*args, **(kwargs or {}))


class _TwoPassMoments(TorchDispatchMode):
    """``var_mean`` and ``std_mean`` as a variance and a plain mean: eager's Welford update makes the mean of
    a row holding an infinity NaN (``inf - inf``) unless the infinity comes last, where the mean is that
    infinity (fuzz seed 10 #4054, #4616); the float64 arbiter runs the same update, so only this says
    which one kiln's infinite mean agrees with."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        spread = {torch.ops.aten.var_mean.correction: torch.ops.aten.var.correction,
                  torch.ops.aten.std_mean.correction: torch.ops.aten.std.correction}.get(func)
        if spread is None:
            return func(*args, **kwargs)
        x, dim = args[0], args[1] if len(args) > 1 else kwargs.get("dim")
        keepdim = kwargs.get("keepdim", False)
        return (spread(x, dim, correction=kwargs.get("correction"), keepdim=keepdim),
                torch.ops.aten.mean.dim(x, dim, keepdim))


def _eager_alternative(make_inputs, program, train, got, ref, zero_sign) -> str:
    """The other way of eager's that kiln's run ``got`` matches ('' when none does):
    - eager's scalar loops: eager run with strided inputs and cotangents, and with the ``SCALAR_LOOP_OPS``
      inside the graph on strided copies. Eager's vectorized and scalar loops disagree at NaN in some ops
      and kiln may follow either. The inputs stay as they are when they share memory (strided copies would
      no longer alias);
    - eager on contiguous copies of the inputs: a channels-last or transposed input keeps eager in loops
      that disagree at NaN with the ones a contiguous input takes;
    - a two-pass ``var_mean``/``std_mean`` (``_TwoPassMoments``), for programs that call one."""
    inputs = make_inputs()
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    alias = len({x.untyped_storage().data_ptr() for x in tensors}) < len(tensors)
    ways = [("eager's scalar loops", _ScalarLoopOps,
             lambda: execute(program, inputs if alias else [_strided(x) for x in inputs], train, strided=not alias))]
    if not alias:   # and its vectorized loops, which a channels-last or transposed input may have kept from
        ways.append(("eager on contiguous inputs", contextlib.nullcontext,   # running (seed 13 #82: relu6's
                     lambda: execute(program, [_dense(x) for x in make_inputs()], train)))   # grad at NaN)
    try:
        if re.search(r"\b(var|std)_mean\b", inspect.getsource(program)):
            ways.append(("eager with a two-pass var_mean/std_mean", _TwoPassMoments,
                         lambda: execute(program, make_inputs(), train)))
    except (OSError, TypeError):
        pass
    for name, mode, run in ways:
        try:
            with mode():
                alt = run()
        except Exception:
            continue
        if not compare(alt, got, ref, zero_sign):
            return name
    return ""


# -- the check ----------------------------------------------------------------------------------------------
@dataclass
class Result:
    status: str                  # 'pass', 'wrong', 'exception', 'discard'
    problems: list = field(default_factory=list)
    error: str = ""              # 'Type: first line' (kiln's exception, or eager's for a discard)
    error_type: str = ""
    traceback: str = ""
    fallbacks: int = 0
    fallback_reasons: list = field(default_factory=list)
    seconds: dict = field(default_factory=dict)
    upstream: str = ""           # set when aot_eager fails the same way (see ``upstream``)
    excused: list = field(default_factory=list)   # differences not held against kiln, and why
    eager_fallback: str = ""     # for an exception: 'passes' when kiln's eager fallback (on_error) runs it right

    def signature(self) -> tuple:
        """What a shrunk program must keep failing with: the status and the kind of problem or error
        (the runner adds 'upstream' when aot_eager fails alike)."""
        if self.status == "wrong":
            return ("wrong", self.problems[0].what)
        return (self.status, self.error_type) if self.status == "exception" else (self.status,)

    def to_dict(self) -> dict:
        return {**self.__dict__, "problems": [p.__dict__ for p in self.problems]}


def _error(e: BaseException) -> tuple:
    inner = e
    while getattr(inner, "inner_exception", None) is not None or (
            type(inner).__name__ == "BackendCompilerFailed" and inner.__cause__ is not None):
        inner = getattr(inner, "inner_exception", None) or inner.__cause__
    first = (str(inner).strip().splitlines() or [""])[0][:300]
    return type(inner).__name__, f"{type(inner).__name__}: {first}"


def compile_with_kiln(program, target: str, dynamic: bool, options=None):
    """``program`` compiled for ``target``, without the compile cache (a fuzzer tests compiles, not hits),
    raising where compiling fails (``check_program`` tries the eager fallback separately)."""
    return torch.compile(program, backend="kiln", dynamic=dynamic,
                         options={"codegen": target, "cache": False, "on_error": "raise", **(options or {})})


def _kiln_run(make_inputs, program, target, train, dynamic, options=None):
    import kiln
    from kiln_bench._internal import kernels
    torch._dynamo.reset()
    kernels.reset()
    c = kiln.counters["codegen"]
    before = c["runtime_fallback"] + c["cpp_build_failed"]
    run = execute(compile_with_kiln(program, target, dynamic, options), make_inputs(), train)
    return run, c["runtime_fallback"] + c["cpp_build_failed"] - before   # a failed C++ build: its whole graph


def upstream(make_inputs, program, train, dynamic, eager, ref, res, zero_sign=True) -> str:
    """'' unless torch.compile with the aot_eager backend (Dynamo and AOTAutograd without kiln) fails
    the same way as kiln did (``res``): then a line saying so."""
    torch._dynamo.reset()
    try:
        got = execute(torch.compile(program, backend="aot_eager", dynamic=dynamic), make_inputs(), train)
    except Exception as e:
        typ, msg = _error(e)
        return f"aot_eager raises too: {msg}" if res.status == "exception" and typ == res.error_type else ""
    problems = compare(eager, got, ref, zero_sign)
    if res.status == "wrong" and problems and problems[0].what == res.problems[0].what:
        return f"aot_eager is wrong too: {problems[0]}"
    return ""


def _with_eager_fallback(make_inputs, program, target, train, dynamic, options, eager, ref, zero_sign) -> str:
    """What a user gets from a program whose compile raised: kiln again with ``on_error='eager'`` (the
    default), compared with eager: 'passes', or what goes wrong."""
    import warnings
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got, _ = _kiln_run(make_inputs, program, target, train, dynamic, {**(options or {}), "on_error": "eager"})
    except Exception as e:
        return f"raises: {_error(e)[1]}"
    problems = compare(eager, got, ref, zero_sign)
    return f"wrong: {problems[0]}" if problems else "passes"


def _fallback_reasons(make_inputs, program, target, train, dynamic, options=None) -> list:
    """Run kiln again at debug level 1 and keep its 'failed on its first call' and 'C++ build failed' lines."""
    import kiln
    err = io.StringIO()
    try:
        with kiln.config.patch(debug=1), contextlib.redirect_stderr(err):
            _kiln_run(make_inputs, program, target, train, dynamic, options)
    except Exception:
        pass
    return [ln.strip() for ln in err.getvalue().splitlines()
            if "failed on its first call" in ln or "C++ build failed" in ln][:5]


def check_program(make_inputs, program, target="triton", train=False, dynamic=False, verbose=False,
                  baseline=True, options=None, zero_sign=True) -> Result:
    """Run ``program`` on ``make_inputs()`` eagerly, on ``make_inputs(up=True)`` (the arbiter) and with
    kiln on ``target``; compare (see the module docstring). ``baseline``: when kiln fails, try the
    aot_eager backend too and say in ``Result.upstream`` if it fails alike (a bug outside kiln).
    ``options``: more kiln options for ``torch.compile(options=...)``; ``zero_sign``: check the signs of
    zeros (off for programs whose zeros' signs eager leaves to the implementation: ``compare.SIGN_FREE``)."""
    res = _check(make_inputs, program, target, train, dynamic, baseline, options, zero_sign)
    if verbose:
        print(f"{res.status}: " + (res.error or "; ".join(map(str, res.problems)) or "ok")
              + (f" ({res.fallbacks} kernels fell back to ATen: {res.fallback_reasons})" if res.fallbacks else ""))
        for line in [f"upstream: {res.upstream}"] * bool(res.upstream) + res.excused:
            print(line)
        if res.traceback:
            print(res.traceback)
    return res


_NAN_BOUND = re.compile(r"clamp\w*\([^\n]*float\('nan'\)")


@functools.lru_cache(maxsize=None)
def eager_clamp_ignores_nan_bounds() -> bool:
    """Whether this torch's ``clamp(x, min=nan)`` returns ``x`` (torch 2.11: while ``clamp_min(x, nan)`` and
    torch 2.13 give NaN; kiln gives NaN): eager is then inconsistent and such programs say nothing."""
    return not bool(torch.clamp(torch.ones(1), min=float("nan")).isnan().item())


def _eager_inconsistent(program) -> str:
    """Why eager's result of ``program`` is no reference ('' when it is one)."""
    try:
        src = inspect.getsource(program)
    except (OSError, TypeError):
        return ""
    if eager_clamp_ignores_nan_bounds() and _NAN_BOUND.search(src):
        return "this torch's eager clamp ignores a NaN scalar bound (torch 2.13 and kiln give NaN)"
    return ""


_INDEX_ERROR = re.compile(r"out of bounds|out of range")


def index_error(e: BaseException) -> bool:
    """Whether ``e`` is eager's error for an out-of-range index (``x[i]``, gather, embedding, nll_loss...)."""
    return isinstance(e, (IndexError, RuntimeError)) and bool(_INDEX_ERROR.search(str(e)))


def _expect_error(make_inputs, program, target, train, dynamic, options, error) -> Result:
    """Where eager raises for an out-of-range index (``error``), kiln must raise an exception of its type (not
    read out of bounds, not return values)."""
    typ, msg = _error(error)
    try:
        _kiln_run(make_inputs, program, target, train, dynamic, options)
    except Exception as e:
        got, got_msg = _error(e)
        if got == typ:
            return Result("pass", excused=[f"eager and kiln raise {typ}"])
        return Result("wrong", problems=[Problem("error", "error_type", f"eager raises {msg}; kiln {got_msg}")],
                      traceback=traceback.format_exc()[-4000:])
    return Result("wrong", problems=[Problem("error", "no_error", f"eager raises {msg}; kiln returns values")])


def _check(make_inputs, program, target, train, dynamic, baseline, options, zero_sign) -> Result:
    seconds = {}
    t = time.perf_counter()
    try:
        eager = execute(program, make_inputs(), train, track=True)
        again = execute(program, make_inputs(), train)
    except Exception as e:
        if index_error(e):
            return _expect_error(make_inputs, program, target, train, dynamic, options, e)
        return Result("discard", error=_error(e)[1], error_type=_error(e)[0])
    if not same(eager, again):
        return Result("discard", error="eager is not deterministic")
    if eager.overlap:
        return Result("discard", error=f"eager wrote through memory that overlaps itself ({', '.join(eager.overlap)})")
    if _layout_dependent(make_inputs, program, train, eager):
        return Result("discard", error="eager's result depends on how an overlapping input's memory aliases")
    try:
        ref = execute(program, make_inputs(up=True), train)
    except Exception:
        ref = None
    seconds["eager"] = time.perf_counter() - t
    t = time.perf_counter()
    try:
        got, fallbacks = _kiln_run(make_inputs, program, target, train, dynamic, options)
    except Exception as e:
        typ, msg = _error(e)
        res = Result("exception", error=msg, error_type=typ, traceback=traceback.format_exc()[-4000:])
    else:
        problems = compare(eager, got, ref, zero_sign)
        excused = []
        other = _eager_alternative(make_inputs, program, train, got, ref, zero_sign) if problems else ""
        if other:
            excused, problems = [f"{other} agrees with kiln: {p}" for p in problems], []
        inconsistent = _eager_inconsistent(program) if problems else ""
        if inconsistent:
            return Result("discard", error=inconsistent)
        res = Result("wrong" if problems else "pass", problems=problems, fallbacks=fallbacks, excused=excused)
        if fallbacks:
            res.fallback_reasons = _fallback_reasons(make_inputs, program, target, train, dynamic, options)
    seconds["kiln"] = time.perf_counter() - t
    if res.status != "pass" and baseline:
        try:
            res.upstream = upstream(make_inputs, program, train, dynamic, eager, ref, res, zero_sign)
        except Exception as e:   # the baseline itself misbehaving says nothing about kiln
            res.upstream = ""
            res.traceback += f"\n(aot_eager baseline raised {type(e).__name__})"
    if res.status == "exception":
        res.eager_fallback = _with_eager_fallback(make_inputs, program, target, train, dynamic, options, eager, ref,
                                                  zero_sign)
    res.seconds = seconds
    return res
