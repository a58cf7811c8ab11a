"""Where a backend's step time goes: ``python -m kiln_bench.profile --cases gpt --backends kiln,inductor``.

For each case and backend: compile, warm up, then profile a few steps with ``torch.profiler`` and
report per step the wall time, the GPU busy time (sum of kernel times), the host time to enqueue
the step (no sync), the kernel count and the top kernels by GPU time. ``--launch`` adds a
per-call overhead probe: a tiny pointwise function called many times on a small tensor, so the
time is all host work. A benchmark aid, not a test; output is text (and JSON with ``--json``).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from kiln_bench import backends as B
from kiln_bench import measure as M
from kiln_bench.suites import all_cases


def _case(name):
    for c in all_cases("every"):
        if c.name == name:
            return c
    raise SystemExit(f"unknown case {name!r}")


def _host_ms(step, n=5):
    """Host time to enqueue ``n`` steps, without waiting for the GPU (ms per step)."""
    M.sync("cuda")
    t = time.perf_counter()
    for _ in range(n):
        step()
    host = (time.perf_counter() - t) * 1e3 / n
    M.sync("cuda")
    return host


def host_profile(step, n=5, top=30):
    """cProfile of ``n`` steps: the host functions with the most own time (text)."""
    import cProfile
    import io
    import pstats
    M.sync("cuda")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step()
    prof.disable()
    M.sync("cuda")
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def profile_backend(case, dtype, backend, steps=3, top=25, host=False):
    torch.manual_seed(0)
    wl = case.build("cuda", dtype, "gpu").fresh()
    with B.scope(backend):
        torch._dynamo.reset()
        f = B.compile_model(backend, wl.model, case.options)
        t0 = time.perf_counter()
        wl.step(f)
        M.sync("cuda")
        compile_s = time.perf_counter() - t0
        for _ in range(3):
            wl.step(f)
        wall = M.summarize(M.step_times(lambda: wl.step(f), "cuda", 2, 10, 30, 1.0))["ms"]
        host_text = host_profile(lambda: wl.step(f)) if host else None
        host = _host_ms(lambda: wl.step(f))
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                wl.step(f)
            M.sync("cuda")
    kernels = {}
    gpu_us = 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            d = e.device_time if hasattr(e, "device_time") else e.cuda_time
            gpu_us += d
            k = kernels.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += d
    rows = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
    n_kernels = sum(c for c, _ in kernels.values()) / steps
    return {"case": case.name, "backend": backend, "compile_s": round(compile_s, 2), "wall_ms": round(wall, 3),
            "host_ms": round(host, 3), "gpu_ms": round(gpu_us / steps / 1e3, 3), "kernels_per_step": n_kernels,
            "top": [(name[:110], c / steps, round(us / steps / 1e3, 4)) for name, (c, us) in rows],
            "host_profile": host_text,
            "host_ops": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top) if host_text else None}


def launch_probe(backends, n=2000, chain=32):
    """Host microseconds per launch: ``call`` per call of ``sigmoid(x) * x + 1`` on 1024 floats through
    ``torch.compile`` (Dynamo's guards and the wrapper included), and ``kernel`` per kernel of a graph of
    ``chain`` steps reducing columns and rows in turn (neither backend fuses them), its generated function
    called directly on a reused input list, below Dynamo and AOTAutograd."""
    out = {}
    x = torch.randn(1024, device="cuda")
    xs = torch.randn(64, 256, device="cuda")

    def fn(x):
        return torch.sigmoid(x) * x + 1.0

    def steps(x):
        for i in range(chain):
            x = torch.sin(x - x.amax(0, keepdim=True)) if i % 2 else torch.cos(x - x.sum(-1, keepdim=True) * 1e-3)
        return x

    def per(f, arg, k):
        for _ in range(20):
            f(arg)
        M.sync("cuda")
        t = time.perf_counter()
        for _ in range(k):
            f(arg)
        us = (time.perf_counter() - t) / k * 1e6
        M.sync("cuda")
        return us
    with torch.no_grad():
        for backend in backends:
            torch._dynamo.reset()
            row = {"call": round(per(B.compile_model(backend, fn), x, n), 2)}
            graph = _graph_fn(backend, steps, xs)
            if graph is not None:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                with prof:
                    graph([xs])
                    M.sync("cuda")
                kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
                row["kernels"] = kernels
                row["kernel"] = round(per(lambda a: graph([a]), xs, max(n // chain, 50)) / max(kernels, 1), 2)
            out[backend] = row
    return out


def _graph_fn(backend, fn, x):
    """The generated graph function ``call(args)`` of ``backend`` compiling ``fn`` on ``x`` (None: not known)."""
    torch._dynamo.reset()
    if backend == "kiln":
        from kiln_bench._internal import Compiled
        seen, init = [], Compiled.__init__

        def record(self, *a, **k):
            init(self, *a, **k)
            seen.append(self)
        Compiled.__init__ = record
        try:
            B.compile_model("kiln", fn)(x)
        finally:
            Compiled.__init__ = init
        return seen[-1] if seen else None
    if backend == "inductor":
        import torch._inductor.codecache as cc

        def modules():
            m = getattr(cc.PyCodeCache, "modules", None) or getattr(cc.PyCodeCache, "cache", {})
            return list(m.values()) if isinstance(m, dict) else list(m)
        before = {id(m) for m in modules()}
        B.compile_model("inductor", fn)(x)
        new = [m for m in modules() if id(m) not in before and hasattr(m, "call")]
        return new[-1].call if new else None
    return None


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m kiln_bench.profile", description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="gpt")
    p.add_argument("--backends", default="kiln,inductor")
    p.add_argument("--dtype", default="fp32", help="micro cases: fp32 or bf16; models ignore it")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--launch", action="store_true", help="also run the per-call overhead probe")
    p.add_argument("--host", action="store_true", help="also cProfile the host side of a few steps and list the ATen ops by host time")
    p.add_argument("--sources", help="write every kiln kernel's source into this directory")
    p.add_argument("--json")
    a = p.parse_args(argv)
    backends = B.check_names(a.backends.split(","))
    results = {"versions": B.versions(), "device": torch.cuda.get_device_name(), "rows": []}
    from kiln_bench import cores
    results["host_cores"] = cores.pin_process("cuda")
    print("host cores:", results["host_cores"], flush=True)
    if a.launch:
        results["launch_us"] = launch_probe(backends)
        print("host us per call through torch.compile (one 1024-element kernel) and per kernel below Dynamo:",
              results["launch_us"], flush=True)
    for name in a.cases.split(","):
        if not name:
            continue
        for backend in backends:
            try:
                r = profile_backend(_case(name), a.dtype, backend, top=a.top, host=a.host)
            except Exception as e:
                r = {"case": name, "backend": backend, "error": f"{type(e).__name__}: {e}"[:500]}
                print(r, flush=True)
                continue
            results["rows"].append(r)
            print(f"\n== {name} / {backend}: wall {r['wall_ms']} ms, host {r['host_ms']} ms, gpu {r['gpu_ms']} ms, "
                  f"{r['kernels_per_step']:.0f} kernels/step, compile {r['compile_s']} s", flush=True)
            for kname, c, ms in r["top"]:
                print(f"  {ms:8.3f} ms  x{c:5.1f}  {kname}", flush=True)
            if r.get("host_profile"):
                print(r["host_profile"], flush=True)
                print(r["host_ops"], flush=True)
            torch.cuda.empty_cache()
    if a.sources:   # the text of every kiln kernel, to read the top ones by name
        import os

        from kiln_bench._internal import kernel_cache as _CACHE
        os.makedirs(a.sources, exist_ok=True)
        for name, k in list(_CACHE.items()):
            with open(os.path.join(a.sources, f"{name}.py"), "w") as fh:
                fh.write(k.source)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
