"""The cost of kiln's bounds checks of indirect indices (``index_checks``) on the CPU's C++ kernels.

    PYTHONPATH=. python benchmarks/bounds_cost.py [--threads 2] [--rounds 30] [--size cpu|gpu]

Each case is compiled twice in one process, with ``index_checks='auto'`` (the default: checked) and
``'never'`` (unchecked); the two are timed in alternating rounds (so load from other processes hits both
alike) and their medians and minima (the least disturbed samples) compared; with one thread, in the
process's CPU time. Cases: the micro suite's ``embedding`` and ``cross_entropy`` (forward, and forward +
backward), and a gather whose index varies per element (the check inside the vectorized loop: the worst
case). For the GPU, ``benchmarks/ab_probe.py index_checks auto never --cases
embedding,cross_entropy``.
"""
from __future__ import annotations

import argparse
import statistics
import time
import types

import torch
import torch.nn.functional as F

import kiln

SIZES = {"cpu": dict(vocab=8192, dim=256, tokens=8192, rows=1024, classes=1024, g=(256, 4096)),
         "gpu": dict(vocab=50304, dim=768, tokens=16384, rows=8192, classes=8192, g=(4096, 4096))}


def cases(size):
    s = SIZES[size]
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(s["vocab"], s["dim"], generator=gen, requires_grad=True)
    ids = torch.randint(0, s["vocab"], (s["tokens"],), generator=gen)
    logits = torch.randn(s["rows"], s["classes"], generator=gen, requires_grad=True)
    target = torch.randint(0, s["classes"], (s["rows"],), generator=gen)
    x = torch.randn(*s["g"], generator=gen)
    gidx = torch.randint(0, s["g"][1], s["g"], generator=gen)

    def emb(w, i):
        return F.embedding(i, w)

    def ce(a, t):
        return F.cross_entropy(a, t)

    def gather(x, i):
        return torch.gather(x, 1, i) * 2

    return [("embedding fwd", emb, (w.detach(), ids), False), ("embedding fwd+bwd", emb, (w, ids), True),
            ("cross_entropy fwd", ce, (logits.detach(), target), False),
            ("cross_entropy fwd+bwd", ce, (logits, target), True), ("gather per element fwd", gather, (x, gidx), False)]


def step(fn, args, backward):
    out = fn(*args)
    if backward:
        out.sum().backward() if out.dim() else out.backward()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--size", choices=list(SIZES), default="cpu")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(f"| case | checked ms | unchecked ms | cost (median) | cost (min) | ({a.threads} threads, {a.rounds} rounds)")
    print("|---|---|---|---|---|")
    for name, fn, args, backward in cases(a.size):
        compiled = {}
        for mode in ("auto", "never"):   # a code object per mode: Dynamo's cache is per code object
            own = types.FunctionType(fn.__code__.replace(co_name=f"{fn.__name__}_{mode}"), fn.__globals__)
            with kiln.config.patch(codegen="cpp", index_checks=mode, cache=False):
                c = torch.compile(own, backend="kiln", dynamic=False)
                for _ in range(3):
                    step(c, args, backward)
            compiled[mode] = c
        times = {m: [] for m in compiled}
        # one thread: the process's CPU time, which other processes' load disturbs less than the wall clock
        clock = time.process_time if a.threads == 1 else time.perf_counter
        t0 = clock()
        step(compiled["auto"], args, backward)
        n = max(1, int(0.02 / max(clock() - t0, 1e-6)))   # about 20 ms per sample
        for _ in range(a.rounds):
            for m, c in compiled.items():
                t0 = clock()
                for _ in range(n):
                    step(c, args, backward)
                times[m].append((clock() - t0) / n * 1e3)
        on, off = statistics.median(times["auto"]), statistics.median(times["never"])
        best = min(times["auto"]) / min(times["never"])   # the least disturbed sample of each (a shared machine)
        print(f"| {name} | {on:.3f} | {off:.3f} | {100 * (on / off - 1):+.1f}% | {100 * (best - 1):+.1f}% |",
              flush=True)


if __name__ == "__main__":
    main()
