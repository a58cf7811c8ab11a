"""Where a training step's time goes (GPU): one model, eager / inductor / kiln in one process; step and host
time (host: from the step's start until the step function returns, no sync inside), kernels per step, and the
profiler's top CPU ops and CUDA kernels of each backend.

    PYTHONPATH=. python3 benchmarks/probe_step.py resnet18 --batch 8 --hw 128 [--dynamic] [--dtype fp32|bf16]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def _model(name):
    import torchvision
    return getattr(torchvision.models, name)()


def first_call(step, warm=3) -> float:
    """Seconds of ``step``'s first call (the compile), then ``warm`` more calls."""
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for _ in range(warm):
        step()
    torch.cuda.synchronize()
    return first


def times(step, n):
    """(median step ms, median host ms, worst step ms) of ``n`` calls of ``step``: host until it returns (no sync
    inside), step until the GPU finished (also used by cliff_probe.py)."""
    steps, hosts = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        hosts.append(t1 - t0)
        steps.append(time.perf_counter() - t0)
    return statistics.median(steps) * 1e3, statistics.median(hosts) * 1e3, max(steps) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--hw", type=int, default=128)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--dynamic", action="store_true")
    ap.add_argument("--backends", default="eager,inductor,kiln")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    import kiln  # noqa: F401  (registers the backend)
    x = torch.randn(a.batch, 3, a.hw, a.hw, device="cuda")
    y = torch.randint(0, 10, (a.batch,), device="cuda")
    for be in a.backends.split(","):
        torch.manual_seed(0)
        model = _model(a.model).cuda()
        f = model if be == "eager" else torch.compile(model, backend=be, dynamic=a.dynamic or None)

        def step():
            with torch.autocast("cuda", torch.bfloat16, enabled=a.dtype == "bf16"):
                loss = F.cross_entropy(f(x).float(), y)
            loss.backward()
        first = first_call(step)
        ms, host, _ = times(step, a.steps)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        ev = prof.key_averages()
        kernels = sum(e.count for e in ev if e.device_type == torch.autograd.DeviceType.CUDA)
        print(f"== {be}: step {ms:.2f} ms, host {host:.2f} ms, kernels/step {kernels}, first call {first:.1f} s, "
              f"peak {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")
        print(ev.table(sort_by="self_cpu_time_total", row_limit=a.top, max_name_column_width=60))
        print(ev.table(sort_by="self_cuda_time_total", row_limit=a.top, max_name_column_width=60))
        torch._dynamo.reset()
        torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    main()
