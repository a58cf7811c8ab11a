"""Which host cores a GPU measurement runs on.

On the shared GPU hosts the cost of a kernel launch depends on the core: on an H200 machine of 16 vCPUs
(2026-11-28, one NUMA node) eight cores launched a small kernel in about 7 us and eight in 10-11 us, the same
on every call. A process the scheduler placed on the slow kind measured a whole step's host time 1.5x
longer, and two backends timed one after the other in one process could land on different kinds: the
bench's "backend order" effect of that day was this. So before timing, the bench measures each allowed
core's launch cost once and pins every thread of the process to the fast ones (those within ``tolerance``
of the fastest) while it times steps; the choice and the per-core figures go into the results' metadata.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time

import torch


def _launch_us(x, launches: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    y = x
    for _ in range(launches):
        y = y + 1
    us = (time.perf_counter() - t0) * 1e6 / launches
    torch.cuda.synchronize()
    return us


def launch_cost(cores, launches: int = 200, reps: int = 7) -> dict:
    """Median host us per small-kernel launch with the calling thread on each core of ``cores``."""
    mine = os.sched_getaffinity(0)
    x = torch.zeros(1024, device="cuda")
    out = {}
    try:
        for c in sorted(cores):
            os.sched_setaffinity(0, {c})
            _launch_us(x, launches)   # settle on the new core
            out[c] = round(statistics.median(_launch_us(x, launches) for _ in range(reps)), 2)
    finally:
        os.sched_setaffinity(0, mine)
    return out


def pin_all(cores) -> None:
    """Every thread of this process (and those its threads start later) on ``cores``."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:   # a thread that ended meanwhile
            pass


def fast_cores(device: str, tolerance: float = 1.15) -> dict:
    """On the GPU (Linux): each allowed core's launch cost and the fast ones (within ``tolerance`` of the best).
    Returns ``{"cores": [...], "launch_us": {core: us}}`` for the metadata; ``{}`` where there is nothing to pick."""
    if device != "cuda" or not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        return {}
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        return {}
    cost = launch_cost(allowed)
    best = min(cost.values())
    return {"cores": sorted(c for c, us in cost.items() if us <= best * tolerance), "launch_us": cost}


def pin_process(device: str) -> dict:
    """For diagnostics: ``fast_cores(device)``, every thread pinned to them from now on; returns the choice."""
    fast = fast_cores(device)
    if fast:
        pin_all(set(fast["cores"]))
    return fast


@contextlib.contextmanager
def pinned(cores):
    """Every thread on ``cores`` (empty: no change) for the timed steps, back on all allowed cores after: compiles
    keep the whole machine (Inductor's and kiln's compile workers start with the process's mask)."""
    if not cores:
        yield
        return
    allowed = os.sched_getaffinity(0)
    pin_all(set(cores))
    try:
        yield
    finally:
        pin_all(allowed)
