"""Run one case for every backend in this process and yield one row (a dict) per backend and budget.

Per case, eager's check runs twice first: the two must agree, or some random op is still on in the
check (see ``dropout``) and every row of the case is an error. Order per backend: fresh model copy,
``torch._dynamo.reset()``, compile, first call = cold compile time and the correctness check against
eager (dropout off), then (``warm``) reset and compile again (a cache hit) for the warm compile time;
then, when the model has dropout, reset and compile again with it on (``steps_compile_s``: that compile
and one step), timed steps (GPU time and host time), memory, and a short profiled pass that counts
kernels per step. A failure in any stage becomes the row's ``error`` (with the stage) and never stops
the other backends or cases.
"""
from __future__ import annotations

import gc
import re
import sys
import traceback
import warnings
from dataclasses import dataclass

import torch

from kiln_bench import backends as B
from kiln_bench import measure as M
from kiln_bench.cores import pinned
from kiln_bench.dropout import random_sites
from kiln.debug import log


@dataclass
class RunConfig:
    """How long to measure: warm-up steps, iteration bounds, minimum measured time (s); whether to
    compile twice (warm compile time) and to count kernels."""
    device: str = "cpu"
    size: str = "cpu"
    warmup: int = 3
    min_iters: int = 5
    max_iters: int = 100
    min_time: float = 0.5
    warm_compile: bool = True
    kernels: bool = True          # count kernels per step in a profiled pass after the timed steps
    cores: tuple = ()             # host cores to pin every thread to while timing (``cores.fast_cores``)
    rounds: int = 0               # >= 2: time the case's backends again in alternating rounds (``interleave``)


def variants(case, backends, budgets):
    """(backend, budget) pairs: compiled backends once per budget on training cases."""
    out = []
    for b in backends:
        if b == "eager" or not case.train or not budgets:
            out.append((b, None))
        else:
            out.extend((b, x) for x in budgets)
    return out


def _error(e: BaseException) -> str:
    """``Type: first line [... last line]`` of the error; Dynamo's BackendCompilerFailed is unwrapped
    to its cause (Triton's CompilationError puts the reason on its last line)."""
    inner = getattr(e, "inner_exception", None)
    prefix = ""
    if inner is not None:
        prefix, e = f"{type(e).__name__} <- ", inner
    msg = [m.strip() for m in str(e).strip().splitlines() if m.strip()]
    text = msg[0][:200] if msg else ""
    if len(msg) > 1:
        text += " ... " + msg[-1][:200]
    return f"{prefix}{type(e).__name__}: {text}"


def _host(ts) -> list:
    return [t.detach().cpu() if isinstance(t, torch.Tensor) else t for t in ts]


def _dynamo_counts():
    from torch._dynamo.utils import counters
    return counters["stats"].get("unique_graphs", 0), sum(counters["graph_break"].values())


def _cleanup(device):
    torch._dynamo.reset()
    _drop_compiled_globals()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


_COMPILED_NAME = re.compile(r"^__(?:compiled_fn|resume_at)[^\n]*", re.M)
_SCANNED_AT: list = [None]   # Dynamo's name count at the last scan


def _dynamo_names_made():
    """How many names Dynamo's ``unique_id`` has made (those of compiled graphs and resume functions among
    them), or None where this torch has no such counter (every call then scans)."""
    counter = getattr(sys.modules.get("torch._dynamo.bytecode_transformation"), "_unique_id_counter", None)
    m = re.fullmatch(r"count\((\d+)\)", repr(counter))
    return int(m.group(1)) if m else None


def _drop_compiled_globals() -> int:
    """Release the ``__compiled_fn_*`` / ``__resume_at_*`` functions Dynamo installs in traced modules' globals:
    ``torch._dynamo.reset()`` leaves some (those of a graph break's resume function), and with them each
    compiled graph and what it holds, so a later case's memory counted an earlier case's leftovers (about
    300 MiB on the zoo's GPU runs). Set to None, not deleted: Dynamo deletes the names itself when their code
    dies. Returns how many. When Dynamo has made no name since the last scan (nothing compiled), there is
    nothing new to find and the call returns at once; a scan matches each module's names joined into one string
    (a Python-level test of every name of every module took 50 ms, three times per row of the dynamic suite)."""
    made = _dynamo_names_made()
    if made is not None and made == _SCANNED_AT[0]:
        return 0
    n = 0
    for module in list(sys.modules.values()):
        d = getattr(module, "__dict__", None)
        if isinstance(d, dict):
            try:
                names = _COMPILED_NAME.findall("\n".join(d))
            except TypeError:   # a name that is not a string
                names = [k for k in d if isinstance(k, str) and _COMPILED_NAME.match(k)]
            for k in names:
                if d.get(k) is not None:
                    d[k] = None
                    n += 1
    _SCANNED_AT[0] = made
    return n


def measure_backend(case, wl_pristine, ref, backend, budget, cfg: RunConfig, ref64=None,
                    compile_model=None) -> dict:
    """One row: compile times, check, step-time summary and memory for ``backend`` at ``budget``.

    ``compile_model(backend, model, options, budget)`` makes the callable to measure (default:
    ``backends.compile_model``; tests pass one that fails or returns wrong values)."""
    compile_model = compile_model or B.compile_model
    row = {"backend": backend, "budget": budget, "status": "ok"}
    stage, f, wl = "copy", None, None
    try:
        wl = wl_pristine.fresh()
        with B.scope(backend, budget) as dirs:
            stage = "compile"
            torch._dynamo.reset()
            g0, b0 = _dynamo_counts()
            f = compile_model(backend, wl.model, case.options, budget)
            with M.CompileClock() as cc:
                got, cold = M.timed(lambda: wl.check(f), cfg.device)
            if backend != "eager":
                g1, b1 = _dynamo_counts()
                row.update(compile_s=cold, graphs=g1 - g0, graph_breaks=b1 - b0, **cc.summary())
                log(1, f"bench: {case.name} {backend} cold compile {cold:.1f} s: Triton {cc.misses} compiled "
                       f"({cc.miss_s:.1f} s), {cc.hits} from cache; kiln stages {cc.stage_s}")
            stage = "check"
            row.update(M.compare(ref, got, wl.tol, ref64) if backend != "eager"
                       else {"ok": True, "err": 0.0, "check": "ref"})
            del got
            if cfg.warm_compile and backend != "eager":
                stage = "warm compile"
                torch._dynamo.reset()
                f = compile_model(backend, wl.model, case.options, budget)
                _, row["warm_compile_s"] = M.timed(lambda: wl.check(f), cfg.device)
            row["random_sites"] = _live_sites(wl.model)
            if row["random_sites"] and backend != "eager":   # the check's graphs have dropout off
                stage = "compile for steps"
                torch._dynamo.reset()
                f = compile_model(backend, wl.model, case.options, budget)
                _, row["steps_compile_s"] = M.timed(lambda: wl.step(f), cfg.device)
            stage = "steps"
            clock, host = M.GcClock(), []
            with pinned(cfg.cores):
                times = M.step_times(lambda: wl.step(f), cfg.device, cfg.warmup, cfg.min_iters, cfg.max_iters,
                                     cfg.min_time, clock, host)
            hs = M.summarize(host)
            row.update(M.summarize(times), times_ms=[round(t, 4) for t in times],
                       host_ms=hs["ms"], host_p25=hs["p25"], host_p75=hs["p75"],
                       host_times_ms=[round(t, 4) for t in host],
                       gc_ms_per_step=clock.ms / max(1, len(times)), gc_runs=clock.runs)
            if case.memory_bound and wl.min_bytes:
                row.update(min_bytes=wl.min_bytes, gbps=wl.min_bytes / (row["ms"] * 1e-3) / 1e9)
            stage = "memory"
            if cfg.device == "cuda":
                row.update(M.cuda_peak(lambda: wl.step(f)))
            if wl.train:
                row.update(M.saved_bytes(lambda: wl.forward_for_memory(f), wl.backward_for_memory, wl.state()))
            row["mem_bytes"] = row.get("peak_bytes") if cfg.device == "cuda" else row.get("saved_bytes")
            if cfg.rounds >= 2:
                row["_dirs"] = dirs   # timed again by interleave, beside the case's other backends
            if cfg.kernels and cfg.device == "cuda":
                row["_later"] = {"dirs": dirs}   # counted by count_kernels after every timed step of the run
            elif cfg.kernels:
                row.update(_kernels(lambda: wl.step(f), cfg.device))
    except Exception as e:  # a backend failure is a row, not a crash
        row.update(status="error", stage=stage, error=_error(e), traceback=traceback.format_exc(limit=8))
    finally:
        del f, wl
        _cleanup(cfg.device)
    return row


def _live_sites(model) -> int:
    """Dropout probabilities that draw in the steps: those of ``random_sites``, none when every module is
    in eval mode (inference rows)."""
    if not isinstance(model, torch.nn.Module) or not any(m.training for m in model.modules()):
        return 0
    return len(random_sites(model))


def _kernels(step, device) -> dict:
    """Kernels per step (``measure.kernels_per_step``); a profiler failure is noted in the row and leaves
    the timings standing."""
    try:
        return M.kernels_per_step(step, device)
    except Exception as e:
        return {"kernels": None, "kernels_error": _error(e)}


def _build(case, dtype: str, cfg: RunConfig):
    """``case``'s workload as every pass over it builds it: seeded alike, so the same weights and inputs."""
    torch.manual_seed(0)
    return case.build(cfg.device, dtype, cfg.size)


def count_kernels(case, dtype: str, rows: list, cfg: RunConfig, compile_model=None) -> None:
    """Kernels per step of the GPU ``rows`` of ``case`` (those marked ``_later``), counted after every timed
    step of the run: launches after a ``torch.profiler`` pass are slower (CUPTI stays attached, pytorch#144455;
    the mechanism was not isolated here, the effect was). On an
    H200 (2026-11-28, zoo Llama training) the backend timed after another's profiled pass took 1-3 ms more
    host time per step, whichever it was; without the pass neither order did. Each backend compiles again
    in its row's cache directories (a warm compile), takes two steps and is profiled for two."""
    compile_model = compile_model or B.compile_model
    todo = [r for r in rows if "_later" in r]
    if not todo:
        return
    try:
        pristine = _build(case, dtype, cfg)
        pristine.park()
    except Exception as e:
        for row in todo:
            row.pop("_later")
            row.update(kernels=None, kernels_error=_error(e))
        return
    for row in todo:
        later, f, wl = row.pop("_later"), None, None
        try:
            wl = pristine.fresh()
            with B.scope(row["backend"], row["budget"], later["dirs"]):
                torch._dynamo.reset()
                f = compile_model(row["backend"], wl.model, case.options, row["budget"])
                for _ in range(2):
                    wl.step(f)
                row.update(_kernels(lambda: wl.step(f), cfg.device))
        except Exception as e:
            row.update(kernels=None, kernels_error=_error(e))
        finally:
            del f, wl
            _cleanup(cfg.device)
    del pristine
    _cleanup(cfg.device)


def interleave(case, dtype: str, rows: list, cfg: RunConfig, compile_model=None) -> None:
    """Step and host times of ``case``'s rows measured again side by side: every backend compiled again in
    its row's cache directories (a warm compile) and kept, then ``cfg.rounds`` rounds each timing every
    backend for ``min_time / rounds`` s, the order reversed each round (A B C, C B A, ...). A drift of the
    host (launch cost moved 1.5x between processes on the H200) then lands on every backend alike; rows get
    ``ms_rounds`` / ``host_ms_rounds`` (medians over all rounds). Runs before any profiled pass."""
    compile_model = compile_model or B.compile_model
    todo = [r for r in rows if "_dirs" in r]
    live = []
    try:
        if len(todo) >= 2:
            pristine = _build(case, dtype, cfg)
            pristine.park()
            for row in todo:
                wl = pristine.fresh()
                with B.scope(row["backend"], row["budget"], row["_dirs"]):
                    f = compile_model(row["backend"], wl.model, case.options, row["budget"])
                    for _ in range(max(cfg.warmup, 2)):
                        wl.step(f)
                live.append((row, wl, f, [], []))
            share = cfg.min_time / cfg.rounds
            for k in range(cfg.rounds):
                for row, wl, f, times, host in (live if k % 2 == 0 else live[::-1]):
                    with pinned(cfg.cores):
                        times += M.step_times(lambda: wl.step(f), cfg.device, 1, 3, cfg.max_iters, share, None, host)
            for row, _, _, times, host in live:
                row.update(ms_rounds=M.summarize(times)["ms"], host_ms_rounds=M.summarize(host)["ms"] if host else None,
                           rounds=cfg.rounds)
    except Exception as e:   # the rounds are an extra: their failure is noted, the row's own timings stand
        for row in todo:
            row["rounds_error"] = _error(e)
    finally:
        for row in todo:
            row.pop("_dirs", None)
        del live
        _cleanup(cfg.device)


class RandomCheckError(RuntimeError):
    """Two runs of eager's check, with every dropout probability the bench knows set to 0, gave different
    values: a random op the bench cannot turn off (a probability under a name without "drop", a bare
    ``torch.rand``) still runs in the check, and comparing backends would compare random draws. Name the
    probability with "drop" (see ``kiln_bench.dropout``) or leave the random op out of the case."""


def _reference(pristine) -> list:
    """Eager's check values, in CPU memory, after making sure a second run gives the same values. Runs that
    differ are repeated with deterministic kernels (GPU atomics in a bf16 backward can differ beyond the
    tolerance): two equal deterministic runs mean no random op is left, and the first run stands."""
    eager = pristine.fresh()
    ref = _host(eager.check(eager.model))   # references live in CPU memory: GPU peaks stay clean
    again = M.compare(ref, _host(eager.check(eager.model)), pristine.tol)
    if not again["ok"]:
        was = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                first = _host(eager.check(eager.model))
                second = _host(eager.check(eager.model))
                det = M.compare(first, second, pristine.tol)
        finally:
            torch.use_deterministic_algorithms(was)
        if not det["ok"] and not _scattered(first, second, pristine.tol) and not _both_near_fp64(pristine, first, ref):
            raise RandomCheckError(f"eager's check differs from itself, also with deterministic kernels "
                                   f"({det['check']}): random ops still on in the check; see kiln_bench.dropout")
    return ref


def _scattered(a: list, b: list, tol: float) -> bool:
    """Whether two eager runs differ beyond ``tol`` (relative to each tensor's largest value) in at most 1% of
    any tensor's elements and at most a tenth of the tensors: atomics reordering a few sums (BART's bf16
    backward on the H200: 1-4 of 768 elements of one gradient of 200), not a random op, whose draws reach
    every element downstream of them."""
    hit = []
    for x, y in zip(a, b):
        x, y = x.float(), y.float()
        n = int(((x - y).abs() > tol * max(x.abs().max().item() if x.numel() else 0.0, 1e-6)).sum())
        if n:
            hit.append(n / x.numel())
    return bool(hit) and max(hit) <= 0.01 and len(hit) <= max(1, len(a) // 10)


def _both_near_fp64(pristine, a: list, b: list) -> bool:
    """Whether two eager runs that differ are both within the check's tolerance (RMSE, relative to each
    tensor's scale) of the float64 run: summation order (flash attention's backward has no deterministic
    kernel) rather than a random op, which leaves eager O(1) away from float64 in every tensor it reaches."""
    truth = _host(pristine.reference64())
    for x, y, t in zip(a, b, truth):
        scale, errs = M.errors64(t, x, y)
        if max(errs) > pristine.tol * scale:
            return False
    return True


def run_case(case, dtype: str, backend_names, budgets, cfg: RunConfig, on_start=None, compile_model=None):
    """Yield a row per (backend, budget) of ``case`` in ``dtype``; build errors yield error rows.
    ``compile_model``: see ``measure_backend``."""
    base = {"suite": case.suite, "case": case.name, "device": cfg.device, "dtype": dtype,
            "train": case.train, "options": dict(case.options)}
    pairs = variants(case, backend_names, budgets)
    stage = "build"
    try:
        pristine = _build(case, dtype, cfg)
        stage = "reference"
        ref = _reference(pristine)
        pristine.park()
        base["dtype"] = pristine.dtype
        if pristine.min_bytes and case.memory_bound:
            base["min_bytes"] = pristine.min_bytes
    except Exception as e:
        for backend, budget in pairs:
            yield {**base, "backend": backend, "budget": budget, "status": "error", "stage": stage,
                   "error": _error(e), "traceback": traceback.format_exc(limit=8)}
        _cleanup(cfg.device)
        return
    truth: list = []

    def ref64():  # float64 referee, computed at most once per case and only when a check fails
        if not truth:
            truth.append(_host(pristine.reference64()))
        return truth[0]

    for backend, budget in pairs:
        if on_start:
            on_start(backend, budget)
        yield {**base, **measure_backend(case, pristine, ref, backend, budget, cfg, ref64, compile_model)}
    del pristine, ref, truth
    _cleanup(cfg.device)
