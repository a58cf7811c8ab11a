"""``kiln bench``: measure kiln against eager and TorchInductor, side by side, in one process.

    kiln bench [--suite micro|models|zoo|flex|user|dynamic|all] [--backends eager,inductor,kiln] [--device cpu|cuda]
               [--dtype fp32,bf16] [--budget 1.0,0.5,0.1] [--cases 'gpt*,softmax']
               [--json out.json] [--md out.md] [--record | --record-dir DIR]
               [--no-guard | --guard 1.5,1.0] [--no-kernels] [--dynamic-mode shared|fresh|both]

Each case runs every backend in turn (see ``runner``); a row is printed as soon as it is measured,
under a progress bar, with its step time (GPU time on the GPU), host time and kernels per step. At the
end the markdown summary is printed, and that is all unless asked: ``--json``/``--md`` write the rows and
the section to files; ``--record`` appends the section to the kiln checkout's ``benchmarks/RESULTS.md``
(with the JSON in ``benchmarks/results/`` and the budget plots beside it), ``--record-dir DIR`` does the
same in ``DIR``. ``--from-json a.json [b.json ...]`` re-renders saved runs (e.g. fetched from a GPU
machine) instead.

The cliff guard (``report.failures``): a line where kiln's step time is above 1.5x inductor's or above
eager's, a failed check, or a kiln row that errored is printed as FAIL, and the exit status is 1.
``--no-guard`` reports the same but exits 0 (unless ``--strict`` finds errors).

``--suite dynamic`` (``suites/dynamic.py``) runs each case over a sequence of sizes and prints its own table:
compiles, compile time, mean and worst step per size, in one process and (``--dynamic-mode``) in fresh ones.
"""
from __future__ import annotations

import argparse
import platform
import sys
import time

DEFAULTS = {  # warm-up, min iters, max iters, min measured seconds
    "cuda": dict(warmup=3, min_iters=10, max_iters=200, min_time=1.0),
    "cpu": dict(warmup=2, min_iters=5, max_iters=50, min_time=0.3),
}


def _csv(text):
    return [t.strip() for t in text.split(",") if t.strip()]


def _floats(text):
    vals = [float(t) for t in _csv(text)]
    bad = [v for v in vals if not 0.0 <= v <= 1.0]
    if bad:
        raise argparse.ArgumentTypeError(f"budgets must lie in [0, 1]; got {bad}")
    return vals


def _guard(text):
    vals = [float(t) for t in _csv(text)]
    if len(vals) != 2 or min(vals) <= 0:
        raise argparse.ArgumentTypeError(f"--guard takes two positive limits, vs inductor and vs eager "
                                         f"(e.g. 1.5,1.0); got {text!r}")
    return {"inductor": vals[0], "eager": vals[1]}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=["micro", "models", "zoo", "flex", "user", "dynamic", "all"], default="micro",
                   help="all: micro and models (the zoo, flex, user and dynamic suites run on their own)")
    p.add_argument("--dynamic-mode", choices=["shared", "fresh", "both"], default="both",
                   help="--suite dynamic: all backends in one process, each in its own, or both")
    p.add_argument("--cases", type=_csv, default=None, help="comma list of case names or fnmatch patterns")
    p.add_argument("--backends", type=_csv, default=["eager", "inductor", "kiln"])
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--dtype", type=_csv, default=None,
                   help="micro dtypes: fp32,bf16,fp16 (default: fp32,bf16 on cuda, fp32 on cpu); "
                        "models use their own precision")
    p.add_argument("--budget", type=_floats, default=None,
                   help="sweep activation_memory_budget on training cases, e.g. 1.0,0.5,0.1")
    p.add_argument("--size", choices=["tiny", "cpu", "gpu"], default=None, help="default: by device")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--md", default=None, help="also write the markdown section to this file")
    p.add_argument("--record", action="store_true",
                   help="append the section to the kiln checkout's benchmarks/RESULTS.md (JSON in benchmarks/results/)")
    p.add_argument("--record-dir", default=None, metavar="DIR",
                   help="append the section to DIR/RESULTS.md (JSON in DIR/results/) instead")
    p.add_argument("--no-record", action="store_true", help="record nothing (the default; kept for old scripts)")
    p.add_argument("--plot-dir", default=None, help="budget PNGs (default: the record dir, when recording)")
    p.add_argument("--caches", choices=["fresh", "keep"], default="fresh",
                   help="fresh: empty compile caches for this run (cold compile is cold); keep: the user's")
    p.add_argument("--no-warm", action="store_true", help="skip the warm (cache-hit) recompile")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None, help="exact number of measured steps")
    p.add_argument("--min-time", type=float, default=None, help="measure steps for at least this many s")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads on the CPU")
    p.add_argument("--no-stream", action="store_true",
                   help="skip the STREAM-style bandwidth measurement printed with memory-bound rows")
    p.add_argument("--strict", action="store_true", help="exit 1 when any row errored or failed its check")
    p.add_argument("--guard", type=_guard, default=None, metavar="VS_INDUCTOR,VS_EAGER",
                   help="the cliff guard's limits on kiln's step time (default 1.5,1.0: at most 1.5x inductor's "
                        "and at most eager's)")
    p.add_argument("--no-guard", action="store_true",
                   help="report cliffs, failed checks and kiln errors but exit 0 for them")
    p.add_argument("--no-kernels", action="store_true", help="skip the profiled pass that counts kernels per step")
    p.add_argument("--rounds", type=int, default=0,
                   help="N >= 2: after a case's rows, time its backends again in N rounds of alternating order "
                        "(warm compiles, all kept alive): ratios that host drift cannot tilt")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--from-json", nargs="+", default=None, metavar="JSON",
                   help="render and record saved runs instead of running")
    return p


def _list(console, suite, device, size=None):
    """The cases of ``suite``, each described at the size the bench would run on ``device``."""
    from kiln_bench.suites import all_cases
    size = size or ("gpu" if device == "cuda" else "cpu")
    for c in all_cases(suite):
        mark = "" if device in c.devices and not c.missing() else "  (not here)"
        about = c.about(size) if callable(c.about) else c.about
        console.print(f"{c.suite:7} {c.name:26} {'train' if c.train else 'infer'}  {about}{mark}",
                      markup=False, highlight=False)
    return 0


def _meta(args, argv, device, size, cases, skipped):
    import torch
    from kiln_bench import backends as B, load
    name = torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or platform.machine())
    return {**B.versions(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "t0": time.time(),
            "device": device, "device_name": name, "size": size, "suite": args.suite, "threads": torch.get_num_threads(),
            "backends": args.backends, "budgets": args.budget, "dtypes": args.dtype, "caches": args.caches, "python": platform.python_version(),
            "load": load.sample(),
            "command": "kiln bench " + " ".join(argv), "cases": [c.name for c in cases], "skipped": skipped,
            "mem_kind": "CUDA peak allocated during one step" if device == "cuda"
            else "bytes saved for backward (distinct storages, not inputs)"}


def _run(args, cfg, cases, console, meta):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from kiln_bench import load, report, runner
    jobs = [(c, d) for c in cases for d in (c.dtypes if c.dtypes == ("auto",) else
                                            [x for x in args.dtype if x in c.dtypes])]
    total = sum(len(runner.variants(c, args.backends, args.budget)) for c, _ in jobs)
    rows, done = [], []
    with Progress(TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("starting", total=total)
        progress.console.print(report.live_header(), markup=False, highlight=False)
        for case, dtype in jobs:
            def started(backend, budget, case=case, dtype=dtype):
                tag = "" if budget is None else f"@{budget:g}"
                progress.update(task, description=f"{case.name} {dtype} {backend}{tag}")
            mine = []
            for row in runner.run_case(case, dtype, args.backends, args.budget, cfg, on_start=started):
                if row.get("gbps") and meta.get("bandwidth"):   # achieved / this machine's STREAM bandwidth
                    row["bw_frac"] = row["gbps"] / meta["bandwidth"]["peak"]
                row["load1"] = (load.sample() or {}).get("load1")   # the machine's load as the row finished
                rows.append(row)
                mine.append(row)
                if args.json:  # partial results survive a timeout or a crash of the process
                    report.write_json(args.json, {**meta, "partial": True}, rows)
                progress.console.print(report.live_line(row), markup=False, highlight=False)
                progress.advance(task)
            for line in report.failures(mine, meta.get("guard") or report.GUARD):
                progress.console.print(f"FAIL {line}", markup=False, highlight=False)
            if cfg.rounds >= 2:   # before any profiled pass (count_kernels)
                progress.update(task, description=f"{case.name} {dtype}: {cfg.rounds} interleaved rounds")
                runner.interleave(case, dtype, mine, cfg)
            done.append((case, dtype, mine))
        for case, dtype, mine in done:   # GPU: a profiled pass slows later launches (runner.count_kernels)
            progress.update(task, description=f"{case.name} {dtype}: kernels per step")
            runner.count_kernels(case, dtype, mine, cfg)
        if args.json:
            report.write_json(args.json, {**meta, "partial": True}, rows)
    return rows


def _finish(args, meta, rows, console) -> int:
    from kiln_bench import plot, report
    text = report.markdown(meta, rows)
    console.print()
    console.print(text, markup=False, highlight=False)
    report.write_outputs(args, meta, rows, text, console)
    plot_dir = args.plot_dir or args.record_dir
    if plot_dir:
        for path in plot.plot_budgets(rows, plot_dir, meta["device"], "saved for backward"
                                      if meta["device"] == "cpu" else "CUDA peak"):
            console.print(f"plot: {path}", markup=False, highlight=False)
    bad = [r for r in rows if r.get("status") != "ok" or r.get("ok") is False]
    if not rows or (rows and len(bad) == len(rows)):
        return 1
    failed = report.failures(rows, meta.get("guard") or report.GUARD)
    if failed:
        console.print(f"guard: {len(failed)} failed" + (" (not enforced: --no-guard)" if args.no_guard else ""),
                      markup=False, highlight=False)
    return 1 if (args.strict and bad) or (failed and not args.no_guard) else 0


def _limits(args) -> dict:
    """The guard's limits and whether they are enforced, for the run's meta."""
    from kiln_bench import report
    return {"guard": args.guard or dict(report.GUARD), "guard_enforced": not args.no_guard}


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kiln bench`` and ``python -m kiln_bench``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    args = p.parse_args(argv)
    from kiln_bench import report
    try:
        args.record_dir = report.record_dir(args.record, args.record_dir, args.no_record)
    except report.RecordError as e:
        p.error(str(e))
    from rich.console import Console
    console = Console(soft_wrap=True)
    if args.from_json:
        from kiln_bench import report
        loaded = [report.read_json(p) for p in args.from_json]
        meta = dict(loaded[0][0], recorded_from=list(args.from_json), **_limits(args))
        if meta.get("suite") == "dynamic":
            from kiln_bench.suites import dynamic
            return dynamic.finish(args, meta, [r for _, rs in loaded for r in rs], console)
        return _finish(args, meta, [r for _, rs in loaded for r in rs], console)
    import torch
    from kiln_bench import backends as B
    from kiln_bench import load, runner
    if args.suite == "dynamic":   # a sequence of sizes per case, its own runner and table
        from kiln_bench.suites import dynamic
        try:
            args.backends = B.check_names(args.backends)
        except B.UnknownBackendError as e:
            console.print(str(e), markup=False)
            return 2
        return dynamic.main(args, argv, console)
    from kiln_bench.suites import UnknownCaseError, select
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        console.print("--device cuda: no CUDA device here; use --device cpu", markup=False)
        return 2
    try:
        args.backends = B.check_names(args.backends)
        if args.list:
            return _list(console, args.suite, device, args.size)
        cases, skipped = select(args.suite, device, args.cases)
    except (B.UnknownBackendError, UnknownCaseError) as e:
        console.print(str(e), markup=False)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    size = args.size or ("gpu" if device == "cuda" else "cpu")
    args.dtype = args.dtype or (["fp32", "bf16"] if device == "cuda" else ["fp32"])
    d = DEFAULTS[device]
    cfg = runner.RunConfig(device=device, size=size, warmup=d["warmup"] if args.warmup is None else args.warmup,
                           min_iters=args.iters or d["min_iters"], max_iters=args.iters or d["max_iters"],
                           min_time=0.0 if args.iters else (args.min_time if args.min_time is not None
                                                            else d["min_time"]),
                           warm_compile=not args.no_warm, kernels=not args.no_kernels, rounds=args.rounds)
    meta = dict(_meta(args, argv, device, size, cases, skipped), **_limits(args))
    for name, why in skipped:
        console.print(f"skip {name}: {why}", markup=False, highlight=False)
    from kiln_bench import cores
    meta["host_cores"] = cores.fast_cores(device)
    cfg.cores = tuple(meta["host_cores"].get("cores", ()))
    with B.fresh_caches(args.caches == "fresh") as cache_root:
        meta["prime_errors"] = {b: e for b, e in B.prime(args.backends, device).items() if e}
        if "inductor" in args.backends and "inductor" not in meta["prime_errors"]:
            B.save_template(cache_root)
        for b, e in meta["prime_errors"].items():
            console.print(f"warning: backend {b} failed a trivial compile: {e}", markup=False, highlight=False)
        if any(c.memory_bound for c in cases) and not args.no_stream:
            from kiln_bench import stream
            meta["bandwidth"] = stream.bandwidth(device, array_bytes=8 * stream.MiB if size == "tiny" else 0)
            console.print(stream.describe(meta["bandwidth"]), markup=False, highlight=False)
        rows = _run(args, cfg, cases, console, meta)
    meta["elapsed_s"] = time.time() - meta["t0"]
    meta["load_end"] = load.sample(own=torch.get_num_threads() if device == "cpu" else 1)
    return _finish(args, meta, rows, console)


if __name__ == "__main__":
    sys.exit(main())
