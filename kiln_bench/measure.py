"""Measurements: step times, compile times, memory, and the correctness check against eager.

- Step time: CUDA events around each step on the GPU (synchronised after the step), ``perf_counter`` on
  the CPU; warm-up steps are excluded. ``summarize`` gives median, p25/p75, min and max in ms;
  ``steady_times`` measures in batches until the spread (half the IQR over the median) is small or a time
  cap is reached.
- Host time (``step_times(..., host=[])``): wall time from a step's start until the step function returns,
  i.e. until its last launch, with no synchronisation inside the step and no profiler. On the CPU it equals
  the step time. It includes any wait the step makes itself (a ``.item()``, a full launch queue).
- Kernels per step (``kernels_per_step``): a separate short pass under ``torch.profiler`` (on the GPU after
  every timed step of the run: ``runner.count_kernels``). On the GPU: the device kernels the profiler records
  (CUDA activity; memcpy, memset and the GPU ranges of
  ``record_function`` annotations such as ``Optimizer.step#AdamW.step`` not counted). On the CPU: the
  top-level ATen ops (ATen ops not called from another ATen op); the fused C++ kernels of inductor and
  kiln are invisible to the profiler and not counted, so on the CPU it counts what a compiler left to ATen.
- Memory on the GPU: ``torch.cuda.max_memory_allocated`` over one step (absolute, and above what
  was allocated when the step began).
- Saved bytes (every device): the distinct storages saved for backward during one forward, seen
  through ``torch.autograd.graph.saved_tensors_hooks``, minus storages of inputs and parameters.
- Correctness: per tensor ``max|got - ref| / max|ref|`` against a tolerance per dtype; when that
  fails, a float64 run referees (see ``compare``).
"""
from __future__ import annotations

import contextlib
import gc
import time

import torch

from kiln_bench.report import spread


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str):
    """``(result, seconds)`` of one call, synchronised (used for compile times)."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


class GcClock:
    """Time spent in Python's cyclic garbage collector while the context is active (``.ms``, ``.runs``):
    a host-bound step pays for collections over every object the process holds."""

    def __enter__(self):
        self.ms, self.runs, self._t0 = 0.0, 0, 0.0
        gc.callbacks.append(self._cb)
        return self

    def _cb(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.ms += (time.perf_counter() - self._t0) * 1e3
            self.runs += 1

    def __exit__(self, *exc):
        gc.callbacks.remove(self._cb)
        return False


class CompileClock:
    """Where a cold compile's time goes, for the bench row: kiln's pipeline stages (``stage_ms``
    counters, seconds by stage) and Triton compilations in this process (``hits``: loaded from
    Triton's disk cache, e.g. what precompile workers wrote; ``misses``: compiled here, with their
    seconds). Chains any compilation listener already installed."""

    def __enter__(self):
        from kiln import counters
        self.stages0 = dict(counters["stage_ms"])
        self.hits = self.misses = 0
        self.miss_s = 0.0
        try:
            import triton
            self._knobs = triton.knobs.compilation
        except (ImportError, AttributeError):   # no Triton, or one without knobs: stages only
            self._knobs = None
            return self
        self._prev = self._knobs.listener
        self._knobs.listener = self._listen
        return self

    def _listen(self, src=None, metadata=None, metadata_group=None, times=None, cache_hit=False, **kw):
        if cache_hit:
            self.hits += 1
        else:
            self.misses += 1
            self.miss_s += getattr(times, "total", 0) / 1e6
        if self._prev is not None:
            self._prev(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                       cache_hit=cache_hit, **kw)

    def __exit__(self, *exc):
        from kiln import counters
        if self._knobs is not None:
            self._knobs.listener = self._prev
        groups: dict = {}
        for name, ms in counters["stage_ms"].items():
            d = ms - self.stages0.get(name, 0.0)
            if d > 0:
                key = name.rsplit("_", 1)[0] if name.endswith(("_forward", "_backward")) else name
                groups[key] = groups.get(key, 0.0) + d / 1e3
        self.stage_s = {k: round(v, 2) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])}
        return False

    def summary(self) -> dict:
        return {"triton_hits": self.hits, "triton_misses": self.misses,
                "triton_compile_s": round(self.miss_s, 2), "kiln_stage_s": self.stage_s}


def step_times(step, device: str, warmup: int = 3, min_iters: int = 5, max_iters: int = 100,
               min_time: float = 0.5, clock: "GcClock | None" = None, host: "list | None" = None) -> list:
    """Milliseconds of each measured step: at least ``min_iters`` and until ``min_time`` seconds
    of steps have run, at most ``max_iters``; ``warmup`` steps run first and are not recorded.
    ``clock``: a GcClock to charge the measured steps' garbage-collection time to. ``host``: a list that
    receives each measured step's host time in ms (see the module docstring)."""
    for _ in range(warmup):
        step()
    sync(device)
    times = []
    with clock or contextlib.nullcontext():
        _measure(step, device, times, min_iters, max_iters, min_time, [] if host is None else host)
    return times


def _measure(step, device, times, min_iters, max_iters, min_time, host):
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    while len(times) < max_iters and (len(times) < min_iters or sum(times) < min_time * 1e3):
        if device == "cuda":
            start.record()
            t0 = time.perf_counter()
            step()
            host.append((time.perf_counter() - t0) * 1e3)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
            host.append(times[-1])
    return times


def _top_level_aten(events) -> int:
    n = 0
    for e in events:
        if not e.name.startswith("aten::"):
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        n += parent is None
    return n


def kernels_per_step(step, device: str, steps: int = 2) -> dict:
    """Kernels per step, counted under ``torch.profiler`` over ``steps`` steps (a pass of its own, never
    timed): device kernels on the GPU, top-level ATen ops on the CPU (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device == "cuda"
    sync(device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            step()
        sync(device)
    events = prof.events()
    if cuda:
        n = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                and not getattr(e, "is_user_annotation", False)       # record_function ranges on the GPU
                and not e.name.startswith(("Memcpy", "Memset")))
        return {"kernels": n / steps, "kernels_kind": "CUDA kernels (profiler)"}
    return {"kernels": _top_level_aten(events) / steps, "kernels_kind": "top-level ATen ops (profiler)"}


def steady_times(step, device: str, batch: int = 10, target: float = 0.05, max_seconds: float = 3.0,
                 warmup: int = 1) -> list:
    """Milliseconds of each measured step, taken ``batch`` steps at a time until the spread (half the
    interquartile range over the median, see ``spread``) is below ``target`` or ``max_seconds`` have
    passed (warm-up included); always at least one batch."""
    t0 = time.perf_counter()
    times = step_times(step, device, warmup=warmup, min_iters=batch, max_iters=batch, min_time=0.0)
    while spread(summarize(times)) >= target and time.perf_counter() - t0 < max_seconds:
        times += step_times(step, device, warmup=0, min_iters=batch, max_iters=batch, min_time=0.0)
    return times


def _quantile(sorted_xs, q):
    pos = q * (len(sorted_xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def summarize(times) -> dict:
    """median, p25, p75, min, max (ms) and the count of ``times``."""
    xs = sorted(times)
    return {"ms": _quantile(xs, 0.5), "p25": _quantile(xs, 0.25), "p75": _quantile(xs, 0.75),
            "min": xs[0], "max": xs[-1], "iters": len(xs)}


def cuda_peak(step) -> dict:
    """Peak allocated bytes during one ``step()``: absolute and above the step's starting point. Garbage
    of earlier steps (reference cycles Python has not collected yet) is collected first: when a collection
    happens to run is no property of the backend."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    # reserved too: a CUDA graph's private pool writes into blocks that it does not count as allocated
    return {"peak_bytes": peak, "peak_above_start": peak - base, "reserved_bytes": torch.cuda.max_memory_reserved()}


def _storage_key(t):
    s = t.untyped_storage()
    return (t.device, s.data_ptr()), s.nbytes()


def saved_bytes(forward, backward, inputs) -> dict:
    """Bytes of distinct storages saved for backward by ``forward()`` that are not ``inputs``.

    ``forward()`` runs under a pack hook that records each saved tensor's storage (deduplicated by
    its data pointer); ``backward(out)`` then consumes the graph. Returns bytes and tensor count.
    """
    skip = {_storage_key(t)[0] for t in inputs if isinstance(t, torch.Tensor)}
    seen: dict = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            try:
                key, size = _storage_key(t)
            except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
                return t
            if key not in skip and key[1] != 0:
                seen[key] = size
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    backward(out)
    return {"saved_bytes": sum(seen.values()), "saved_tensors": len(seen)}


def _rmse(a, b) -> float:
    return (a.double() - b.double()).pow(2).mean().sqrt().item() if a.numel() else 0.0


def errors64(truth, *xs) -> tuple:
    """(float64 tensor ``truth``'s largest finite magnitude, each of ``xs``' RMSE against it over its finite
    elements)."""
    fin = torch.isfinite(truth)
    t = truth[fin]
    scale = t.abs().max().item() if t.numel() else 0.0
    return scale, [_rmse(x.detach().to(truth.device)[fin], t) for x in xs]


def compare(ref: list, got: list, tol: float, ref64=None, got64=None) -> dict:
    """Check ``got`` against eager's ``ref`` (same order); ``ref64`` (a callable returning float64
    results) referees a disagreement.

    First test: per tensor ``max|got - ref| / max|ref|`` within ``tol``. When that fails and ``ref64``
    is given, the backend still passes if, for every tensor, its RMSE against float64 is at most twice
    eager's plus ``tol / 10`` times the tensor's scale: it is not less accurate than eager. When that
    fails too and ``got64`` (the backend's own compile of the float64 model, a callable) is given, the
    backend passes if its float64 results meet ``ref64``'s within ``tol``: it computes the same function,
    and the float32 gap is rounding that decided a discontinuity (a ReLU input within an ulp of 0 flips
    its mask, and BatchNorm's backward spreads that one element over its channel). Either way ``err`` is
    the worst eager-relative error, and a failing check counts elements beyond ``tol``.
    """
    if len(ref) != len(got):
        return {"ok": False, "err": None, "check": f"{len(got)} tensors vs eager's {len(ref)}"}
    worst, where, bad = 0.0, None, ""
    for i, (r, g) in enumerate(zip(ref, got)):
        if g is None or r is None or tuple(r.shape) != tuple(g.shape):
            return {"ok": False, "err": None, "check": f"tensor {i}: shape {getattr(g, 'shape', None)} "
                                                      f"vs eager {getattr(r, 'shape', None)}"}
        r32, g32 = r.detach().float(), g.detach().float().to(r.device)
        if r32.numel() == 0:
            continue
        finite = torch.isfinite(r32)
        if not torch.equal(finite, torch.isfinite(g32)):
            return {"ok": False, "err": float("inf"), "check": f"tensor {i}: non-finite values differ"}
        if not finite.any():
            continue
        delta = (r32[finite] - g32[finite]).abs()
        scale = max(r32[finite].abs().max().item(), 1e-6)
        err = delta.max().item() / scale
        if err > worst:
            worst, where = err, i
            bad = f"{int((delta > tol * scale).sum())}/{r32.numel()} elements"
    if worst <= tol:
        return {"ok": True, "err": worst, "check": "ok"}
    failed = f"tensor {where}: rel err {worst:.2e} > {tol:g} ({bad})"
    if ref64 is None:
        return {"ok": False, "err": worst, "check": failed}
    truth = ref64()
    for i, (r, g, t) in enumerate(zip(ref, got, truth)):
        scale, (e_ref, e_got) = errors64(t, r, g)
        if e_got > 2 * e_ref + tol / 10 * scale:
            lost = f"{failed}; vs fp64 tensor {i}: rmse {e_got:.2e} > 2x eager's {e_ref:.2e}"
            if got64 is not None:
                same = compare(truth, got64(), tol)
                if same["ok"]:
                    return {"ok": True, "err": worst, "err64": e_got,
                            "check": f"ok in fp64 (its fp64 compile within {tol:g} of eager's fp64; fp32: {lost})"}
                lost += f"; its fp64 compile too: {same['check']}"
            return {"ok": False, "err": worst, "err64": e_got, "check": lost}
    return {"ok": True, "err": worst, "check": f"ok vs fp64 (eager differs: {failed})"}
