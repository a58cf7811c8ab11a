"""A fully dynamic CNN (batch, H and W symbolic: ``dynamic=True``) on the CPU: eager, inductor and kiln in one
process, their steps interleaved (round after round, every backend at every size and thread count in turn), so
that a shared machine's load falls on all of them alike (#35).

    PYTHONPATH=. python benchmarks/dyn_cnn.py [--rounds 5] [--steps 3] [--threads 1,2] [--backends eager,inductor,kiln]

Prints, per mode (train: forward + cross-entropy + backward; infer: eval mode, no_grad) and thread count, each
backend's mean over the sizes of its per-size median step, with the spread of that mean over the rounds
(min..max), and kiln's ratio to eager and inductor (the median of the per-round ratios); the load average before
and after. ``wall``: elapsed time; ``cpu``: the process's CPU time (every thread's), which a busy machine's
waiting does not inflate: at 1 thread the steadier figure on a shared machine.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.nn.functional as F

SIZES = [(8, 32, 32), (6, 40, 28), (8, 28, 36), (12, 36, 24), (4, 44, 40), (16, 24, 32)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--backends", default="eager,inductor,kiln")
    p.add_argument("--modes", default="train,infer")
    a = p.parse_args()
    import kiln  # noqa: F401
    from kiln_bench import models
    torch._dynamo.config.cache_size_limit = 64
    base = models.CNN(models.CNN_SIZES["cpu"])
    backends, threads, modes = a.backends.split(","), [int(t) for t in a.threads.split(",")], a.modes.split(",")
    fns = {}
    for b in backends:   # each backend its own copy of the model and its own compiled callable
        m = copy.deepcopy(base)
        fns[b] = (m, m if b == "eager" else torch.compile(m, backend=b, dynamic=True))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(n, 3, h, w, generator=g), torch.randint(0, 10, (n,), generator=g)) for n, h, w in SIZES]

    def step(b, mode, x, y):
        m, f = fns[b]
        if mode == "train":
            m.train()
            F.cross_entropy(f(x), y).backward()
            m.zero_grad(set_to_none=True)
        else:
            m.eval()
            with torch.no_grad():
                f(x)
    t0 = time.time()
    for t in threads:   # compile (and warm) every backend at every size in both modes, per thread count (Dynamo
        torch.set_num_threads(t)   # guards on it: a change recompiles)
        for b in backends:
            for mode in modes:
                for x, y in data:
                    step(b, mode, x, y)
    print(f"compiled in {time.time() - t0:.0f} s; torch {torch.__version__}; load {os.getloadavg()}", flush=True)
    counts = dict(torch._dynamo.utils.counters["stats"])
    means = {}   # (mode, threads, backend) -> [mean over sizes of the per-size median, per round]
    for _ in range(a.rounds):
        for mode in modes:
            for t in threads:
                torch.set_num_threads(t)
                for b in backends:
                    per_size = []
                    for x, y in data:
                        ts = []
                        for _ in range(a.steps):
                            s, c = time.perf_counter(), time.process_time()
                            step(b, mode, x, y)
                            ts.append((time.perf_counter() - s, time.process_time() - c))
                        per_size.append([statistics.median(v) for v in zip(*ts)])
                    for clock, v in zip(("wall", "cpu"), zip(*per_size)):
                        means.setdefault((mode, t, clock, b), []).append(1e3 * statistics.mean(v))
    assert dict(torch._dynamo.utils.counters["stats"]) == counts, "a recompile while timing"
    print(f"load after {os.getloadavg()}; {a.rounds} rounds x {a.steps} steps per size; sizes (n, h, w) {SIZES}")
    for mode in modes:
        for t in threads:
            for clock in ("wall", "cpu"):
                row = {b: means[mode, t, clock, b] for b in backends}
                cells = "  ".join(f"{b} {statistics.median(v):6.1f} ({min(v):.1f}..{max(v):.1f})"
                                  for b, v in row.items())
                ratio = "  ".join(f"kiln/{b} {statistics.median([k / e for k, e in zip(row['kiln'], row[b])]):.2f}"
                                  for b in backends if b != "kiln" and "kiln" in row)
                print(f"{mode:5} {t} thread(s) {clock:4} ms: {cells}   {ratio}", flush=True)


if __name__ == "__main__":
    main()
