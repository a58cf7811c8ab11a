"""``kiln demo``: compile a small GPT's training step and a small CNN's inference with TorchInductor and
kiln, check both against eager, and print eager, inductor and kiln side by side: step time (median ±half
the interquartile range), cold compile time and saved-activation memory.

Runs on the GPU when there is one, else on the CPU with torch's threads pinned to the physical cores
(``--threads N`` picks another count). Steps are measured in batches of ``--steps`` until the spread is
under 5% of the median or ``--max-seconds`` have passed for that backend and case. Caches start empty,
so compile times are cold. Finishes in about a minute on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import copy
import os

import torch

CASES = ("GPT train", "CNN infer")   # a GPT's training step, a CNN's inference
TARGET_SPREAD = 0.05   # stop measuring a backend once half its IQR is under 5% of its median


def physical_cores() -> int:
    """Physical cores this process may run on (hyperthreads of one core count once), read from Linux's
    CPU topology; the number of usable CPUs where that is not available."""
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:   # not Linux
        return os.cpu_count() or 1
    cores = set()
    for c in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list") as fh:
                cores.add(fh.read().strip())
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


def _timing(step, device: str, args) -> dict:
    from kiln_bench.measure import spread, steady_times, summarize
    s = summarize(steady_times(step, device, batch=args.steps, target=TARGET_SPREAD,
                               max_seconds=args.max_seconds))
    return {"ms": s["ms"], "spread": spread(s), "iters": s["iters"]}


def _compiled(backend: str, model):
    from kiln_bench.backends import compile_model
    torch._dynamo.reset()
    return compile_model(backend, model)


def _train_case(backends, device: str, size: str, args) -> dict:
    """GPT: one forward + backward per step; the check covers the loss and every gradient."""
    from kiln_bench.backends import scope
    from kiln_bench.case import TOLERANCE
    from kiln_bench.measure import compare, saved_bytes, timed
    from kiln_bench.models import build_gpt

    model, (ids, targets) = build_gpt(size, device=device)
    copies = {b: copy.deepcopy(model) for b in backends if b != "eager"}
    loss = model(ids, targets)
    loss.backward()
    ref = [loss.detach()] + [p.grad.clone() for p in model.parameters()]
    rows = {}
    for name in backends:
        m = model if name == "eager" else copies[name]
        with scope(name):
            f = m if name == "eager" else _compiled(name, m)
            row = {}
            if name != "eager":
                def first():
                    out = f(ids, targets)
                    out.backward()
                    return [out.detach()] + [p.grad for p in m.parameters()]
                got, row["compile_s"] = timed(first, device)
                row["ok"] = compare(ref, got, TOLERANCE["fp32"])["ok"]
            row.update(_timing(lambda: f(ids, targets).backward(), device, args))
            row["saved"] = saved_bytes(lambda: f(ids, targets), lambda out: out.backward(),
                                       [ids, targets, *m.parameters()])["saved_bytes"]
        rows[name] = row
    return rows


def _infer_case(backends, device: str, size: str, args) -> dict:
    """CNN in eval mode under no_grad: one forward per step."""
    from kiln_bench.backends import scope
    from kiln_bench.case import TOLERANCE
    from kiln_bench.measure import compare, timed
    from kiln_bench.models import build_cnn

    model, (x, _) = build_cnn(size, device=device)
    model.eval()
    rows = {}
    with torch.no_grad():
        ref = [model(x)]
        for name in backends:
            with scope(name):
                f = model if name == "eager" else _compiled(name, copy.deepcopy(model))
                row = {}
                if name != "eager":
                    out, row["compile_s"] = timed(lambda: f(x), device)
                    row["ok"] = compare(ref, [out], TOLERANCE["fp32"])["ok"]
                row.update(_timing(lambda: f(x), device, args))
            rows[name] = row
    return rows


def _busy_note(threads: int) -> str:
    """A warning when the machine's load average already reaches the threads the demo will use: OpenMP
    threads that wait for a busy core make every step slow (each parallel region waits out a time slice)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return ""
    if load < threads:
        return ""
    return (f"note: load average {load:.1f} with {threads} threads: other processes compete for the cores, "
            f"so step times will be slow and noisy")


def _threads(args) -> str:
    """Pin torch's CPU threads (physical cores unless ``--threads``); a line that says how many."""
    if args.device != "cpu":
        return f"{torch.get_num_threads()} CPU threads"
    n = args.threads or physical_cores()
    torch.set_num_threads(n)
    return f"threads {n} ({'--threads' if args.threads else 'physical cores'})"


def _parser():
    ap = argparse.ArgumentParser(prog="kiln demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads on the CPU (default: the number of physical cores)")
    ap.add_argument("--steps", type=int, default=10, help="steps per measured batch (default 10)")
    ap.add_argument("--max-seconds", type=float, default=3.0,
                    help="time cap on measuring one backend in one case (default 3)")
    ap.add_argument("--no-inductor", action="store_true", help="skip TorchInductor (eager and kiln only)")
    return ap


def _cells(case: str, backend: str, r: dict) -> list:
    saved = f"{r['saved'] / 2**20:.2f}" if "saved" in r else "-"
    comp = f"{r['compile_s']:.1f}" if "compile_s" in r else "-"
    check = "" if "ok" not in r else ("ok" if r["ok"] else "FAIL")
    return [case, backend, f"{r['ms']:.2f} ±{r['spread'] * 100:.0f}%", str(r["iters"]), comp, saved, check]


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    from kiln_bench.backends import fresh_caches, prime, save_template

    size = "tiny" if args.device == "cpu" else "cpu"
    backends = ("eager", "kiln") if args.no_inductor else ("eager", "inductor", "kiln")
    threads_before = torch.get_num_threads()
    console = Console()
    try:
        threads = _threads(args)
        console.print(f"kiln demo on {args.device} (torch {torch.__version__}, {threads}); caches empty, so "
                      f"compile times are cold. step ms: median ±half the interquartile range; saved: "
                      f"activations saved for backward; check: outputs and gradients against eager's")
        note = _busy_note(torch.get_num_threads()) if args.device == "cpu" else ""
        if note:
            console.print(note)
        table = Table("case", "backend", "step ms", "steps", "compile s", "saved MiB", "check")
        kiln_ok = True
        with fresh_caches() as root:
            prime(backends, args.device)
            save_template(root)
            for label, fn in zip(CASES, (_train_case, _infer_case)):
                rows = fn(backends, args.device, size, args)
                kiln_ok &= rows["kiln"]["ok"]
                for backend, r in rows.items():
                    table.add_row(*_cells(label, backend, r))
        console.print(table)
    finally:
        torch.set_num_threads(threads_before)
    return 0 if kiln_ok else 1
