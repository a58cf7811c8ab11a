"""Where a CUDA-graphed training step's memory goes (GPU): one bench case under kiln plain and kiln with
``mode="reduce-overhead"``; per step the peak allocated and reserved bytes, and for the graphed run what each
captured graph holds (outputs by kind: user / alias / copied out) and the reserved bytes of the private pool
against the general allocator's (from ``torch.cuda.memory_snapshot``).

    PYTHONPATH=. python3 benchmarks/cg_memory.py zoo_gpt2
"""
from __future__ import annotations

import gc
import sys

import torch


def main():
    name = sys.argv[1]
    import kiln  # noqa: F401
    from kiln.runtime import cudagraph
    from kiln_bench import backends as B
    from kiln_bench.suites import select
    (case,), _ = select("zoo", "cuda", [name])
    torch.manual_seed(0)
    pristine = case.build("cuda", case.dtypes[0], "gpu")
    pristine.park()
    mib = 2 ** -20
    for be in ("kiln", "kiln-cg"):
        gc.collect()
        torch.cuda.empty_cache()
        wl = pristine.fresh()
        torch._dynamo.reset()
        f = B.compile_model(be, wl.model, case.options)
        for i in range(4):
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            wl.step(f)
            torch.cuda.synchronize()
            print(f"{be} step {i}: start {start * mib:.0f} peak {torch.cuda.max_memory_allocated() * mib:.0f} "
                  f"reserved peak {torch.cuda.max_memory_reserved() * mib:.0f} MiB")
        if be == "kiln-cg":
            for pool in cudagraph._POOLS.values():
                for g in pool.graphs:
                    by: dict = {}
                    seen = set()
                    for s in g.specs:
                        if s[0] == "value" or s[1] in seen:
                            continue
                        seen.add(s[1])
                        by[s[0]] = by.get(s[0], 0) + g.storages[s[1]].nbytes()
                    big = sorted(((g.storages[s[1]].nbytes(), s[0], s[3], s[5]) for s in g.specs if s[0] != "value"),
                                 key=lambda r: -r[0])[:6]
                    print(f"  graph {g.name}: copies {len(g.copies)} "
                          f"({sum(b.nbytes for b in g.copies.values()) * mib:.0f} MiB), held by kind "
                          f"{ {k: round(v * mib) for k, v in by.items()} }, largest "
                          f"{[(round(b * mib), k, sz, str(dt)) for b, k, sz, dt in big]}")
        seg: dict = {}
        for s in torch.cuda.memory_snapshot():
            key = "pool" if tuple(s.get("segment_pool_id", (0, 0))) != (0, 0) else "general"
            a = seg.setdefault(key, [0, 0])
            a[0] += s["total_size"]
            a[1] += s["allocated_size"]
        print(f"{be} segments now: " + ", ".join(f"{k} reserved {v[0] * mib:.0f} allocated {v[1] * mib:.0f} MiB"
                                                  for k, v in seg.items()))
        del f, wl
        torch._dynamo.reset()
        gc.collect()


if __name__ == "__main__":
    main()
