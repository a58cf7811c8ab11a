"""Where a training step's host time goes (GPU): bench cases, one process, one backend after another.

For each backend: host ms per step (until the step returns, no sync inside), then a cProfile of ``--steps``
steps with each function's own time summed by where its code lives (kiln's runtime, kiln's generated
modules, Dynamo's guards and frames, AOTAutograd's runtime wrappers, the autograd engine, torch.optim,
Triton's launchers, Inductor's runtime), and the top functions by own time.

    PYTHONPATH=. python3 benchmarks/host_probe.py zoo_llama --backends inductor,kiln [--top 25]
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_step import times  # noqa: E402  (step and host ms per step, as probe_step measures them)

BUCKETS = (("kiln generated", ("<kiln", "/kiln_pw_", "/kiln_red_", "/kiln_")), ("kiln runtime", ("kiln/runtime",)),
           ("kiln other", ("/kiln/",)), ("dynamo", ("_dynamo",)), ("aot runtime", ("_functorch",)),
           ("inductor runtime", ("_inductor",)), ("triton", ("triton",)), ("optim", ("torch/optim",)),
           ("autograd", ("torch/autograd", "_tensor.py")), ("nn modules", ("torch/nn",)),
           ("torch other", ("torch/",)))


def bucket(filename: str) -> str:
    for name, keys in BUCKETS:
        if any(k in filename for k in keys):
            return name
    return "builtin/C" if filename.startswith("~") or filename == "" else "other"


def boundary(step, n):
    """(ms per step, calls per step, {graph: ms per step}, host ms per step of the same steps) inside the callables the compilers hand to
    AOTAutograd: kiln's ``Compiled`` and Inductor's ``CompiledFxGraph`` (their ``__call__`` timed for ``n`` steps;
    graphs named by kiln's name, else by their first call's order: g0 the forward, g1 the backward)."""
    import time
    from kiln.runtime.load import Compiled
    classes = [Compiled]
    try:
        from torch._inductor.output_code import CompiledFxGraph
        classes.append(CompiledFxGraph)
    except ImportError:
        pass
    per: dict = {}
    saved = [(c, c.__call__) for c in classes]

    def timing(orig):
        def call(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return orig(self, *a, **k)
            finally:
                key = getattr(self, "name", None) or per.setdefault(("order", id(self)), f"g{len(per)}")
                per[key] = per.get(key, 0.0) + time.perf_counter() - t0
                per["calls"] = per.get("calls", 0) + 1
        return call
    for c, orig in saved:
        c.__call__ = timing(orig)
    hosts = []
    try:
        for _ in range(n):   # each step from an empty queue, as ``times`` measures (no launch waits for room)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            hosts.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    finally:
        for c, orig in saved:
            c.__call__ = orig
    graphs = {k: v * 1e3 / n for k, v in per.items() if isinstance(k, str) and k != "calls"}
    return sum(graphs.values()), per.get("calls", 0) / n, graphs, sum(hosts) * 1e3 / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("case")
    ap.add_argument("--suite", default="zoo")
    ap.add_argument("--backends", default="inductor,kiln")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--size", default="gpu")
    ap.add_argument("--api", type=int, default=0, help="also list this many CUDA API calls by host time")
    ap.add_argument("--callers", default="", help="also list the callers of functions whose name has this text")
    a = ap.parse_args()
    import kiln  # noqa: F401
    from kiln_bench import cores
    print("host cores:", cores.pin_process("cuda"), flush=True)
    from kiln_bench import backends as B
    from kiln_bench.suites import select
    (case,), _ = select(a.suite, "cuda", [a.case])
    torch.manual_seed(0)
    pristine = case.build("cuda", case.dtypes[0], a.size)
    pristine.park()
    for be in a.backends.split(","):
        wl = pristine.fresh()
        torch._dynamo.reset()
        f = B.compile_model(be, wl.model, case.options)
        for _ in range(4):
            wl.step(f)
        torch.cuda.synchronize()
        host = times(lambda: wl.step(f), 20)[1]
        inside, calls, graphs, mean = boundary(lambda: wl.step(f), 20)
        print(f"== {case.name} {be}: host {host:.2f} ms/step (median; the timed steps' mean {mean:.2f}), "
              f"{inside:.2f} ms of it inside the compiled graphs' "
              f"callables ({calls:.0f} calls/step: {', '.join(f'{k} {v:.2f}' for k, v in graphs.items())}), "
              f"{mean - inside:.2f} ms outside (Dynamo, AOTAutograd, autograd, optimizer)", flush=True)
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        prof.enable()
        for _ in range(a.steps):
            wl.step(f)
        prof.disable()
        torch.cuda.synchronize()
        st = pstats.Stats(prof)
        sums: dict = {}
        rows = []
        for (fn, line, name), (cc, nc, tt, ct, _) in st.stats.items():
            b = bucket(fn)
            s = sums.setdefault(b, [0.0, 0])
            s[0] += tt
            s[1] += nc
            rows.append((tt, nc, f"{fn.split('site-packages/')[-1].split('/work/main/')[-1]}:{line}({name})"))
        total = sum(s[0] for s in sums.values())
        print(f"== {case.name} {be}: host {host:.2f} ms/step; profiled {total / a.steps * 1e3:.2f} ms/step")
        for b, (tt, nc) in sorted(sums.items(), key=lambda kv: -kv[1][0]):
            print(f"  {b:18s} {tt / a.steps * 1e3:8.2f} ms/step  {nc // a.steps:7d} calls/step")
        for tt, nc, name in sorted(rows, reverse=True)[:a.top]:
            print(f"    {tt / a.steps * 1e3:7.3f} ms {nc // a.steps:6d}x  {name}")
        if a.callers:   # who calls e.g. Tensor.copy_ (cProfile's caller table)
            st.print_callers(a.callers)
        if a.api:   # CUDA runtime and driver calls of a few steps (a synchronizing call shows here)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as p:
                for _ in range(a.steps):
                    wl.step(f)
                torch.cuda.synchronize()
            avg = [e for e in p.key_averages() if e.count and e.device_type == torch.autograd.DeviceType.CPU]
            ev = [e for e in avg if e.key.startswith(("cuda", "cu"))]
            for e in sorted(ev, key=lambda e: -e.cpu_time_total)[:a.api]:
                print(f"    api {e.key[:40]:40s} {e.count // a.steps:6d}x/step {e.cpu_time_total / a.steps / 1e3:7.3f} ms/step")
            for e in sorted(avg, key=lambda e: -e.self_cpu_time_total)[:a.api]:   # every host op by own time
                print(f"    op  {e.key[:40]:40s} {e.count // a.steps:6d}x/step "
                      f"{e.self_cpu_time_total / a.steps / 1e3:7.3f} ms/step own")
        del f, wl
        torch._dynamo.reset()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
