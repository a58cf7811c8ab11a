"""Compile times in new processes: cold, warm-cache and in-process recompile, kiln and Inductor alike.

    kiln bench-compile [--cases gpt,cnn] [--backends kiln,inductor] [--device cpu|cuda]
                       [--repeat 1] [--json out.json] [--md out.md] [--record | --record-dir DIR]

For every case and backend, in a fresh set of empty caches (Inductor's FX-graph and AOTAutograd
caches, Triton's, kiln's compile cache and kernel directory, all under one temporary directory):

- **cold**: a new process compiles the case (the first call of its checked step: forward, and
  backward for training cases), with every cache empty;
- **recompile**: the same process resets Dynamo and compiles again (caches now warm in memory and on
  disk);
- **warm**: a second new process compiles it with the caches the first one left (a restarted job).

Times are the first call's seconds less one step's (the fastest of three later calls of the same
checked step), measured inside the child: what compiling cost; ``process`` is the child's whole life,
imports included. Children run with Python's bytecode cache on, as users do. ``--repeat`` runs the pair
of processes several times (each with fresh caches) and keeps the median.

A line is printed per case and backend as it finishes, then the table; ``--json`` writes the rows to a
file, ``--record`` appends the table to the kiln checkout's ``benchmarks/RESULTS.md`` (``--record-dir DIR``:
to ``DIR/RESULTS.md``); by default nothing is written.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = "--child"


def _child(case_name: str, backend: str, device: str) -> dict:
    t_start = time.perf_counter()
    import torch
    from kiln_bench import backends as B, suites
    from kiln_bench.measure import timed
    cases, _ = suites.select("every", device, [case_name])
    case = cases[0]
    torch.manual_seed(0)
    wl = case.build(device, case.dtypes[0], "gpu" if device == "cuda" else "cpu")
    out = {}
    for what in ("first", "recompile"):
        torch._dynamo.reset()
        fresh = wl.fresh()
        with B.scope(backend):
            f = B.compile_model(backend, fresh.model, case.options, None)
            _, out[what] = timed(lambda: fresh.check(f), device)
            if what == "first":   # a compiled step's own time, taken out of the first call's
                out["step"] = min(timed(lambda: fresh.check(f), device)[1] for _ in range(3))
    import kiln
    out["process"] = time.perf_counter() - t_start
    out["kiln_cache"] = dict(kiln.counters["cache"])
    return out


def _run_child(case: str, backend: str, device: str, env: dict, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "kiln_bench.compile_times", CHILD, case, backend, device]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    line = next((ln for ln in reversed(res.stdout.splitlines()) if ln.startswith("{")), None)
    if res.returncode != 0 or line is None:
        tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"exit {res.returncode}: {tail[0][:300]}"}
    return json.loads(line)


def measure(case: str, backend: str, device: str, timeout: float = 1800.0) -> dict:
    """One cold/warm/recompile measurement with caches of its own."""
    root = tempfile.mkdtemp(prefix="kiln-ctime-")
    env = dict(os.environ)
    env.update(TORCHINDUCTOR_CACHE_DIR=os.path.join(root, "inductor"), TRITON_CACHE_DIR=os.path.join(root, "triton"),
               KILN_CACHE_DIR=os.path.join(root, "kiln"), KILN_KERNEL_DIR=os.path.join(root, "kernels"), KILN_CACHE="1")
    env.pop("PYTHONDONTWRITEBYTECODE", None)   # as users run: imports read bytecode
    try:
        cold = _run_child(case, backend, device, env, timeout)
        warm = _run_child(case, backend, device, env, timeout) if "error" not in cold else cold
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if "error" in cold or "error" in warm:
        return {"error": cold.get("error") or warm.get("error")}
    step = min(cold["step"], warm["step"])
    return {"cold_s": cold["first"] - step, "recompile_s": cold["recompile"] - step, "warm_s": warm["first"] - step,
            "step_s": step, "warm_process_s": warm["process"], "cold_process_s": cold["process"],
            "kiln_cache_warm": warm.get("kiln_cache", {})}


def _median_rows(samples: list) -> dict:
    ok = [s for s in samples if "error" not in s]
    if not ok:
        return samples[0]
    keys = [k for k in ok[0] if k.endswith("_s")]
    row = {k: statistics.median(s[k] for s in ok) for k in keys}
    row["spread"] = {k: [round(min(s[k] for s in ok), 2), round(max(s[k] for s in ok), 2)] for k in keys}
    row["kiln_cache_warm"] = ok[-1].get("kiln_cache_warm", {})
    return row


def markdown(meta: dict, rows: list) -> str:
    lines = [f"## Compile times, {meta['date']} ({meta['device_name']}, torch {meta['torch']}, {meta['threads']})",
             "", f"`{meta['command']}`: the first call's time less a compiled step's, in a new process with "
             "empty caches (cold), the same process after `torch._dynamo.reset()` (recompile), a second new "
             f"process on the caches the first left (warm); median of {meta['repeat']}.", "",
             "| case | backend | cold s | warm s | recompile s | step s | warm/cold | process s (warm) | "
             "cold vs inductor | warm vs inductor | cold above aot_eager's, vs inductor's |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    by = {(r["case"], r["backend"]): r for r in rows}
    ok = lambda r: r is not None and "error" not in r  # noqa: E731
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['backend']} | error: {r['error']} | | | | | | | | |")
            continue
        ind, floor = by.get((r["case"], "inductor")), by.get((r["case"], "aot_eager"))
        rel = (lambda k: f"{r[k] / ind[k]:.2f}" if ok(ind) and r["backend"] != "inductor" else "")
        # what a compiler adds to Dynamo and AOTAutograd's cold compile (aot_eager's), against inductor's
        own = f"{(r['cold_s'] - floor['cold_s']) / (ind['cold_s'] - floor['cold_s']):.2f}" \
            if ok(ind) and ok(floor) and r["backend"] not in ("inductor", "aot_eager") else ""
        lines.append(f"| {r['case']} | {r['backend']} | {r['cold_s']:.2f} | {r['warm_s']:.2f} | "
                     f"{r['recompile_s']:.2f} | {r['step_s']:.3f} | {r['warm_s'] / r['cold_s']:.2f} | "
                     f"{r['warm_process_s']:.1f} | "
                     f"{rel('cold_s')} | {rel('warm_s')} | {own} |")
    return "\n".join(lines) + "\n"


LIVE = (("case", 22), ("backend", 10), ("cold s", 8), ("warm s", 8), ("recompile s", 12), ("step s", 8),
        ("process s (warm)", 16))


def live_line(row: dict) -> str:
    """One console line for a finished (case, backend): its times in seconds, or its error."""
    head = f"{row['case']:<22} {row['backend']:<10} "
    if "error" in row:
        return head + f"error: {row['error']}"
    cells = [f"{row[k]:.2f}" for k in ("cold_s", "warm_s", "recompile_s")] + [f"{row['step_s']:.3f}",
                                                                              f"{row['warm_process_s']:.1f}"]
    return head + " ".join(f"{c:<{w}}" for c, (_, w) in zip(cells, LIVE[2:]))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln bench-compile", description=__doc__.split("\n\n")[0],
                                epilog="Cases are kiln bench's (`kiln bench --list --suite all`); each runs in new "
                                       "processes, so a case takes a few times its compile time.")
    p.add_argument("--cases", default="gpt,cnn", help="comma list of kiln bench case names (default gpt,cnn)")
    p.add_argument("--backends", default="kiln,inductor",
                   help="comma list of backends (default kiln,inductor; aot_eager measures Dynamo and AOTAutograd "
                        "alone, the floor both compilers stand on)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--repeat", type=int, default=1, help="pairs of processes per case and backend; the median is "
                                                         "kept (default 1)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows to this JSON file")
    p.add_argument("--md", default=None, metavar="PATH", help="also write the markdown table to this file")
    p.add_argument("--record", action="store_true", help="append the table to the kiln checkout's "
                                                         "benchmarks/RESULTS.md")
    p.add_argument("--record-dir", default=None, metavar="DIR", help="append the table to DIR/RESULTS.md instead")
    p.add_argument("--no-record", action="store_true", help="record nothing (the default; kept for old scripts)")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == CHILD:
        print(json.dumps(_child(*argv[1:4])))
        return 0
    from kiln_bench import report
    p = parser()
    a = p.parse_args(argv)
    try:
        record_dir = report.record_dir(a.record, a.record_dir, a.no_record)
    except report.RecordError as e:
        p.error(str(e))
    import torch
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    print(" ".join(f"{name:<{w}}" for name, w in LIVE), flush=True)
    for case in [c for c in a.cases.split(",") if c]:
        for backend in [b for b in a.backends.split(",") if b]:
            row = _median_rows([measure(case, backend, device) for _ in range(max(1, a.repeat))])
            row.update(case=case, backend=backend)
            rows.append(row)
            print(live_line(row), flush=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__, "repeat": a.repeat,
            "device_name": torch.cuda.get_device_name() if device == "cuda" else f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "threads": f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}",
            "command": "kiln bench-compile " + " ".join(argv)}
    md = markdown(meta, rows)
    print("\n" + md)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if a.md:
        with open(a.md, "w") as f:
            f.write(md)
    if record_dir:
        path = os.path.join(record_dir, "RESULTS.md")
        with open(path, "a") as f:
            f.write("\n" + md)
        print(f"recorded: {path}")
    return 1 if rows and all("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
