"""Which Python frames issue a step's top-level ATen calls (GPU or CPU): one bench case, one backend, one
profiled step with stacks; ATen ops counted by name and by their nearest frames in kiln, AOTAutograd, autograd.

    PYTHONPATH=. python3 benchmarks/aten_stacks.py zoo_mixer --backend kiln [--device cuda] [--top 20]
"""
import argparse
import collections

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("case")
    ap.add_argument("--backend", default="kiln")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", default=None)
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()
    import kiln  # noqa: F401
    from kiln_bench import backends as B
    from kiln_bench.suites import select
    (case,), _ = select("zoo", a.device, [a.case])
    torch.manual_seed(0)
    pristine = case.build(a.device, case.dtypes[0], a.size or ("gpu" if a.device == "cuda" else "cpu"))
    pristine.park()
    wl = pristine.fresh()
    f = B.compile_model(a.backend, wl.model, case.options)
    for _ in range(4):
        wl.step(f)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if a.device == "cuda" else [])
    with torch.profiler.profile(activities=acts, with_stack=True, record_shapes=True) as p:
        wl.step(f)
        if a.device == "cuda":
            torch.cuda.synchronize()
    cnt = collections.Counter()
    host = collections.Counter()
    where = collections.defaultdict(collections.Counter)
    shapes = collections.defaultdict(collections.Counter)
    for e in p.events():
        if not e.name.startswith("aten::") or e.device_type != torch.autograd.DeviceType.CPU:
            continue
        chain, par = [], e.cpu_parent
        while par is not None:
            chain.append(par.name)
            par = par.cpu_parent
        if any(n.startswith("aten::") for n in chain):
            continue
        cnt[e.name] += 1
        host[e.name] += e.cpu_time_total
        frames = [s for s in chain if ".py(" in s and "torch/profiler" not in s and "torch/nn/modules/module.py" not in s]
        where[e.name][" < ".join(s.split("site-packages/")[-1] for s in frames[:4]) or
                      f"(no Python frame; parent {chain[0] if chain else None}, thread {e.thread})"] += 1
        shapes[e.name][str(e.input_shapes)[:160]] += 1
    print(f"== {a.case} {a.backend}: {sum(cnt.values())} top-level ATen calls, {sum(host.values()) / 1e3:.2f} ms host")
    for n, c in cnt.most_common(a.top):
        print(f"{c:6d} {host[n] / 1e3:8.2f} ms  {n}")
        for s, k in where[n].most_common(3):
            print(f"         {k:5d}  {s[:400]}")
        for s, k in shapes[n].most_common(3):
            print(f"         {k:5d}  shapes {s}")


if __name__ == "__main__":
    main()
