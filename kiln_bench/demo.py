"""``kiln demo``: compile a small GPT's training step and a small CNN's inference with TorchInductor and
kiln, check both against eager, and print eager, inductor and kiln side by side: step time (median ±half
the interquartile range), cold compile time and saved-activation memory.

Runs on the GPU when there is one, else on the CPU with torch's threads pinned to the physical cores
(``--threads N`` picks another count). Steps are measured in batches of ``--steps`` until the spread is
under 5% of the median or ``--max-seconds`` have passed for that backend and case. Caches start empty,
so compile times are cold. Finishes in about a minute on 2 CPU cores.

On a busy machine (other work that, beside the demo's threads, asks for more than the cores before or
after the run, or a step time whose spread stays above ±10%) the table is titled UNRELIABLE and says why: the figures are printed, marked, and
are no result (``kiln_bench.load``). Two small cases are no benchmark either: ``kiln bench --suite user``
measures eleven ordinary models.
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


def unreliable(results: dict, loads, threads: int) -> list:
    """Why the demo's figures are no result (empty when they are): ``kiln_bench.load.verdict`` over the
    load samples taken before and after the run (the busier counts), the ``threads`` it measures with and
    the spread of every step time. ``results`` is ``{case: {backend: row}}``."""
    from kiln_bench.load import others, verdict
    samples = [x for x in loads if x]
    worst = max(samples, key=others) if samples else None
    return verdict(worst, threads, [r["spread"] for rows in results.values() for r in rows.values()])


def render(console, results: dict, why: list) -> None:
    """The table of ``results`` (``{case: {backend: row}}``); when ``why`` lists reasons, titled UNRELIABLE,
    every step time marked with ``?`` and the reasons printed under it."""
    from rich.table import Table
    title = "UNRELIABLE: this machine is busy, the step times below are no result" if why else None
    table = Table("case", "backend", "step ms" + (" (?)" if why else ""), "steps", "compile s", "saved MiB",
                  "check", title=title)
    for case, rows in results.items():
        for backend, r in rows.items():
            cells = _cells(case, backend, r)
            if why:
                cells[2] += " ?"
            table.add_row(*cells)
    console.print(table)
    for reason in why:
        console.print(f"unreliable: {reason}", markup=False, highlight=False)
    if why:
        console.print("Run again on an idle machine (or with fewer --threads) before reading these as kiln's "
                      "speed.", markup=False, highlight=False)


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

    from kiln_bench.backends import fresh_caches, prime, save_template
    from kiln_bench.load import sample

    size = "tiny" if args.device == "cpu" else "cpu"
    backends = ("eager", "kiln") if args.no_inductor else ("eager", "inductor", "kiln")
    threads_before = torch.get_num_threads()
    console = Console()
    try:
        threads = _threads(args)
        console.print(f"kiln demo on {args.device} (torch {torch.__version__}, {threads}); caches empty, so "
                      f"compile times are cold. step ms: median ±half the interquartile range; saved: "
                      f"activations saved for backward; check: outputs and gradients against eager's")
        n = torch.get_num_threads() if args.device == "cpu" else 1
        before = sample() if args.device == "cpu" else None
        early = unreliable({}, [before], n)
        if early:
            console.print(f"note: {early[0]}; step times will be slow and noisy", markup=False, highlight=False)
        results = {}
        with fresh_caches() as root:
            prime(backends, args.device)
            save_template(root)
            for label, fn in zip(CASES, (_train_case, _infer_case)):
                results[label] = fn(backends, args.device, size, args)
        kiln_ok = all(rows["kiln"]["ok"] for rows in results.values())
        after = sample(own=n) if args.device == "cpu" else None
        render(console, results, unreliable(results, [before, after], n))
        if args.device == "cpu":
            console.print("Two small cases; `kiln bench --suite user --device cpu` measures eleven ordinary models "
                          "(the README quotes its geomean).", markup=False, highlight=False)
    finally:
        torch.set_num_threads(threads_before)
    return 0 if kiln_ok else 1
