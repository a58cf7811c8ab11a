"""What is alive at a step's CUDA memory peak, by the line that allocated it (GPU):
``python -m kiln_bench.live_at_peak --cases zoo_bart --backends eager,inductor,kiln``.

For each case and backend: compile, warm up, then record the CUDA allocator's history over one step
(``torch.cuda.memory._record_memory_history``), replay its allocations and frees to find the peak,
and group the blocks alive there by the first frame in compiled code (a kiln wrapper line, an
inductor output-code line) or, failing that, the first frame outside torch. Memory allocated before
the step (parameters, inputs, leftovers) is reported as one number. A diagnosis aid, not a test.
"""
from __future__ import annotations

import argparse
import gc
import linecache
import os

import torch

from kiln_bench import backends as B
from kiln_bench import measure as M
from kiln_bench.profile import _case
from kiln_bench.runner import _cleanup

_TORCH = os.path.dirname(torch.__file__)


def _site(frames) -> str:
    """The frame that names an allocation: compiled code first, else the first frame outside torch."""
    outside = None
    for f in frames:
        name = f.get("filename", "")
        if name.startswith("<kiln") or "torchinductor" in name:
            text = linecache.getline(name, f.get("line", 0)).strip()
            return f"{os.path.basename(name)}:{f.get('line')}  {text[:140]}"
        if outside is None and not name.startswith(_TORCH) and name[:1] != "<":
            outside = f"{name.split('site-packages/')[-1]}:{f.get('line')} {f.get('name')}"
    return outside or "(no python frame)"


def _by_site(blocks) -> dict:
    sites: dict = {}
    for e in blocks:
        s = _site(e.get("frames", []))
        sites[s] = sites.get(s, 0) + e["size"]
    return sites


def live_at_peak(trace, start=0):
    """(peak bytes above the level at event ``start``, {site: bytes alive at that peak}, {site: bytes
    alive at ``start``}) from one device's trace; the peak is looked for from ``start`` on, blocks
    allocated before it (parameters, an earlier step's leftovers) count where they are still alive."""
    # a block is dead from its free request on (``memory_allocated`` drops then); its completion (stream
    # events recorded on it) may come later and finds it gone
    kinds = ("alloc", "free_requested", "free_completed")
    events = [e for e in trace if e["action"] in kinds]
    start = sum(1 for e in trace[:start] if e["action"] in kinds)
    live, now, base, peak, at = {}, 0, 0, 0, start - 1
    snapshots = {}
    for i, e in enumerate(events):
        if i == start:
            base, peak, snapshots["start"] = now, now, list(live.values())
        if e["action"] == "alloc":
            live[e["addr"]] = e
            now += e["size"]
        elif live.pop(e["addr"], None) is not None:
            now -= e["size"]
        if i >= start and now > peak:
            peak, at = now, i
    if "start" not in snapshots:
        base, peak, snapshots["start"] = now, now, list(live.values())
    live = {}
    for e in events[:at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        else:
            live.pop(e["addr"], None)
    return peak - base, _by_site(live.values()), _by_site(snapshots["start"])


def probe(case, backend, top=25) -> str:
    _cleanup("cuda")   # earlier rows' compiled graphs (the bench's own cleanup between rows)
    torch.manual_seed(0)
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=5_000_000)   # from the start: what the
    wl = case.build("cuda", "fp32", "gpu").fresh()   # model, the compile and earlier steps leave alive
    with B.scope(backend):                            # has its sites (models ignore the dtype)
        torch._dynamo.reset()
        f = B.compile_model(backend, wl.model, case.options)
        for _ in range(3):
            wl.step(f)
        M.sync("cuda")
        gc.collect()   # as the bench does before it measures memory
        mark = len(torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()])
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        wl.step(f)
        M.sync("cuda")
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        peak_alloc = torch.cuda.max_memory_allocated()
    trace = snap["device_traces"][torch.cuda.current_device()]
    peak, sites, carried = live_at_peak(trace, mark)
    mib = 2 ** 20
    lines = [f"== {case.name} / {backend}: peak allocated {peak_alloc / mib:.0f} MiB = {before / mib:.0f} "
             f"before the step + {peak / mib:.0f} allocated in it; alive at the peak, by site:"]
    lines += [f"  {b / mib:9.1f} MiB  {s}" for s, b in sorted(sites.items(), key=lambda kv: -kv[1])[:top]]
    lines.append(f"   the {before / mib:.0f} MiB before the step, by site (the model, the compile, earlier steps):")
    lines += [f"  {b / mib:9.1f} MiB  {s}" for s, b in sorted(carried.items(), key=lambda kv: -kv[1])[:top]]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m kiln_bench.live_at_peak", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", required=True)
    p.add_argument("--backends", default="eager,inductor,kiln")
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args(argv)
    for name in a.cases.split(","):
        for backend in B.check_names(a.backends.split(",")):
            try:
                print(probe(_case(name), backend, a.top), flush=True)
            except Exception as e:  # one failing row does not stop the others
                print(f"== {name} / {backend}: {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    main()
