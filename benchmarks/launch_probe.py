"""Host microseconds per launch (GPU), below Dynamo and AOTAutograd: each backend's generated graph function
called directly on a reused input list, for a graph of one pointwise kernel and one of ``--chain`` kernels
(steps reducing columns and rows in turn, so that neither backend fuses them).

    PYTHONPATH=. python3 benchmarks/launch_probe.py [--chain 32] [--n 3000]
"""
import argparse
import time

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"   # the CPU only checks that the probe runs


def graph_fn(backend, fn, x):
    """(compiled model, the generated graph function ``call(list)``) for ``fn`` on ``x``."""
    import torch._inductor.codecache as cc
    import kiln.runtime.load as L
    torch._dynamo.reset()
    seen = []
    if backend == "kiln":
        init = L.Compiled.__init__

        def record(self, *a, **k):
            init(self, *a, **k)
            seen.append(self)
        L.Compiled.__init__ = record
        try:
            f = torch.compile(fn, backend="kiln")
            f(x)
        finally:
            L.Compiled.__init__ = init
        return f, seen[-1]
    def modules():
        m = getattr(cc.PyCodeCache, "modules", None) or getattr(cc.PyCodeCache, "cache", {})
        return list(m.values()) if isinstance(m, dict) else list(m)
    before = {id(m) for m in modules()}
    f = torch.compile(fn)
    f(x)
    mods = [m for m in modules() if id(m) not in before and hasattr(m, "call")]
    return f, mods[-1].call


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def per_call(call, x, n):
    for _ in range(50):
        call([x])
    sync()
    t = time.perf_counter()
    for _ in range(n):
        call([x])
    host = (time.perf_counter() - t) / n * 1e6
    sync()
    return host


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chain", type=int, default=32)
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--backends", default="inductor,kiln")
    ap.add_argument("--profile", type=int, default=0, help="list this many functions of a cProfile of the chain")
    a = ap.parse_args()
    import kiln  # noqa: F401

    def one(x):
        return torch.sigmoid(x) * x + 1.0

    def chain(x):
        for i in range(a.chain):
            x = torch.sin(x - x.amax(0, keepdim=True)) if i % 2 else torch.cos(x - x.sum(-1, keepdim=True) * 1e-3)
        return x

    x = torch.randn(64, 256, device=DEV)
    if DEV == "cuda":
        def scope():
            with torch.cuda.device(0):
                pass
        for what, f in (("torch.cuda.device(0) scope", scope),
                        ("_cuda_getDevice", torch._C._cuda_getDevice), ("4 x stride()", lambda: (x.stride(), x.stride(), x.stride(), x.stride()))):
            t = time.perf_counter()
            for _ in range(20000):
                f()
            print(f"{what}: {(time.perf_counter() - t) / 20000 * 1e6:.2f} us", flush=True)
    with torch.no_grad():
        for be in a.backends.split(","):
            _, c1 = graph_fn(be, one, x)
            _, cn = graph_fn(be, chain, x)
            t1, tn = per_call(c1, x, a.n), per_call(cn, x, max(a.n // a.chain, 100))
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA if DEV == "cuda" else torch.profiler.ProfilerActivity.CPU])
            with prof:
                cn([x])
                sync()
            k = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA or DEV == "cpu" and e.name.startswith(("kiln_", "cpp_fused", "graph_")))
            if be == "kiln":   # ablations: what the per-launch checks cost
                from kiln.runtime import launch as L
                sites = L.launch.__self__
                hooks, dev = sites.hooks_on, sites.device
                sites.hooks_on = lambda: False
                h1, hn = per_call(c1, x, a.n), per_call(cn, x, max(a.n // a.chain, 100))
                d0 = dev()
                sites.device = lambda: d0
                s1, sn = per_call(c1, x, a.n), per_call(cn, x, max(a.n // a.chain, 100))
                sites.hooks_on, sites.device = hooks, dev
                base1, basen = per_call(c1, x, a.n), per_call(cn, x, max(a.n // a.chain, 100))
                print(f"kiln again: {base1:6.2f} / {basen:7.1f} us")
                print(f"kiln w/o hook check: {h1:6.2f} / {hn:7.1f} us; also w/o device check: {s1:6.2f} / {sn:7.1f} us")
            if a.profile:
                import cProfile
                import pstats
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(200):
                    cn([x])
                pr.disable()
                sync()
                st = pstats.Stats(pr)
                rows = sorted(((tt, nc, f"{fn.split('site-packages/')[-1]}:{line}({name})")
                               for (fn, line, name), (cc, nc, tt, ct, _) in st.stats.items()), reverse=True)
                for tt, nc, name in rows[:a.profile]:
                    print(f"    {tt / 200 * 1e6:8.1f} us/call {nc // 200:5d}x  {name[-90:]}")
            print(f"{be:9s} one kernel: {t1:6.2f} us/call   chain: {tn:7.1f} us/call, {k} kernels, "
                  f"{tn / max(k, 1):5.2f} us/kernel", flush=True)


if __name__ == "__main__":
    main()
