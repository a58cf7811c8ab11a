"""The OpInfo sweep: every op of PyTorch's ``op_db`` through kiln (ATen, Triton and C++ targets) and
inductor, values and gradients judged against eager at the op's own tolerances.

    kiln check-ops (or python -m kiln_bench.opinfo) [--backends kiln-aten,kiln-triton,kiln-cpp,inductor] [--ops REGEX]
        [--shard i/n] [--samples 2] [--dtypes fp32,bf16] [--json out.json] [--report REPORT.md] [--workers 2]
        [--db op,hop]

Each op in each dtype it supports on the CPU is a task for a pool of worker processes
(``opinfo_pool``); each of its first ``--samples`` samples runs forward (an inference graph) and, when it
has float inputs requiring grad, backward (a training graph), on every backend (``opinfo_sample``).
Records stream to ``<json>.jsonl`` as they come (``--resume`` continues from it); the end writes the JSON
(``{"meta": ..., "records": [...]}``) and the Markdown report (``opinfo_report``). ``--from-json A B ...``
merges saved results (shards, re-runs: a later file's results of an op replace an earlier one's, see
``merge``) into one report without running anything.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time

from kiln_bench import opinfo_cases as cases
from kiln_bench import opinfo_report as report
from kiln_bench.opinfo_pool import ROOT, Pool
from kiln_bench.opinfo_sample import BACKENDS, UnknownBackend

DEFAULT_BACKENDS = "kiln-aten,kiln-triton,kiln-cpp,inductor"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln check-ops", description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default=DEFAULT_BACKENDS, help=f"comma list of {', '.join(BACKENDS)}")
    p.add_argument("--ops", default=None, help="regex on op names (re.search), e.g. '^(add|sum)$'")
    p.add_argument("--device", default="cpu", help="cpu (Triton kernels in its interpreter) or cuda")
    p.add_argument("--db", default="op", help="comma list: op (op_db), hop (hop_db: higher-order ops)")
    p.add_argument("--shard", default="0/1", help="i/n: every n-th op from the i-th")
    p.add_argument("--samples", type=int, default=2, help="samples per op, at most")
    p.add_argument("--dtypes", default="fp32", help=f"comma list of {', '.join(cases.DTYPES)}")
    p.add_argument("--json", default=None, help="write the records here (and stream them to <json>.jsonl)")
    p.add_argument("--report", default=None, help="write the Markdown report here")
    p.add_argument("--workers", type=int, default=2, help="worker processes")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one unit may run")
    p.add_argument("--resume", action="store_true", help="skip units already in <json>.jsonl")
    p.add_argument("--without-fp32", action="store_true",
                   help="only the ops that run without fp32 (integer, bool, complex: --dtypes int64,bool,c64)")
    p.add_argument("--note", default=None, help="a line for the report's header")
    p.add_argument("--list", action="store_true", help="print the selected ops and exit")
    p.add_argument("--from-json", nargs="+", default=None, metavar="JSON",
                   help="merge these results into --json/--report without running anything")
    return p


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.release()}{gpu}"


def meta(argv) -> dict:
    import torch
    try:
        import triton
        tv = triton.__version__
    except ImportError:
        tv = "not installed"
    try:
        rev = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    return dict(date=datetime.datetime.now().isoformat(timespec="seconds"), machine=machine(),
                torch=torch.__version__, triton=tv, python=platform.python_version(),
                kiln=f"{rev or '?'} ({ROOT})",
                command="python -m kiln_bench.opinfo " + " ".join(shlex.quote(a) for a in argv))


def tasks(ops, dtypes, backends, samples, done, device="cpu") -> list:
    """One task per op and dtype it supports on ``device``, without the units ``done`` holds."""
    out = []
    for dtype_name in dtypes:
        dtype = cases.DTYPES[dtype_name]
        for op in ops:
            if not cases.supports(op, dtype, device):
                continue
            name = cases.full_name(op)
            if (name, dtype_name, "*") in done:
                continue
            skip = sorted(done.get((name, dtype_name), ()))
            out.append(dict(op=name, dtype=dtype_name, backends=backends, samples=samples, skip=skip,
                            device=device))
    return out


def _load(path) -> tuple[dict, list]:
    if path.endswith(".jsonl"):
        with open(path) as f:
            return {}, [json.loads(ln) for ln in f if ln.strip()]
    with open(path) as f:
        data = json.load(f)
    return data.get("meta", {}), data["records"]


def _done(records) -> dict:
    done: dict = {}
    for r in records:
        if r["backend"] == "*":
            done[(r["op"], r["dtype"], "*")] = True
        else:
            done.setdefault((r["op"], r["dtype"]), set()).add((r["sample"], r["mode"], r["backend"]))
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in done.items()}


def merge(paths) -> tuple[list, list]:
    """(records, sources) of saved results (shards, re-runs): an op in a dtype on a backend comes from the
    last file that ran it there (its op-level records too), each record marked with its file's number
    (``src``, from 1); a source is that file's meta with the count of records it gave."""
    kept: dict = {}
    metas = []
    for path in paths:
        m, recs = _load(path)
        base = len(metas)   # a merged file keeps its own sources
        metas += m.get("sources") or [dict(m, file=os.path.abspath(path))]
        ran = {(r["op"], r["dtype"], r["backend"]) for r in recs}
        ran |= {(op, dt, "*") for op, dt, _ in ran}
        for k in ran & set(kept):
            del kept[k]
        for r in recs:
            kept.setdefault((r["op"], r["dtype"], r["backend"]), []).append(
                dict(r, src=base + (r.get("src", 1) if m.get("sources") else 1)))
    records = [r for group in kept.values() for r in group]
    for i, m in enumerate(metas, 1):
        m["records"] = sum(r["src"] == i for r in records)
    return records, metas


QUIET = ("graph_breaks", "fallback", "runtime_fallback", "declined")   # counts left out when 0


def _compact(r) -> dict:
    """The record without None values, zero ``QUIET`` counts, and, where it passed or was skipped, the
    sample's text and the tolerances."""
    ok = r["status"] in ("pass", "skip")
    return {k: v for k, v in r.items() if v is not None and not (k in QUIET and v == 0)
            and not (ok and k in ("desc", "atol", "rtol", "tol"))}


def write(records, info, json_path, report_path) -> None:
    if json_path:   # one record a line, without keys of no value (see ``_compact``)
        with open(json_path, "w") as f:
            f.write('{"meta": ' + json.dumps(info, default=str) + ',\n"records": [\n')
            f.write(",\n".join(json.dumps(_compact(r), default=str, separators=(",", ":")) for r in records))
            f.write("\n]}\n")
    if report_path:
        os.makedirs(os.path.dirname(os.path.abspath(report_path)), exist_ok=True)
        report.write(records, info, report_path)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.from_json:
        records, sources = merge(args.from_json)
        info = meta(argv)
        info["sources"] = sources
        if args.note:
            info["note"] = args.note
        write(records, info, args.json, args.report)
        _print_summary(records)
        return 0
    backends = [b for b in args.backends.split(",") if b]
    bad = [b for b in backends if b not in BACKENDS]
    if bad:
        raise UnknownBackend(f"unknown backends {bad}; choose from {', '.join(BACKENDS)}")
    dtypes = [d for d in args.dtypes.split(",") if d]
    if [d for d in dtypes if d not in cases.DTYPES]:
        raise SystemExit(f"--dtypes {args.dtypes!r}: choose from {', '.join(cases.DTYPES)}")
    ops = cases.select(args.ops, cases.parse_shard(args.shard), dbs=[d for d in args.db.split(",") if d])
    if args.without_fp32:
        ops = [op for op in ops if cases.without_fp32(op, args.device)]
    if args.list:
        print("\n".join(cases.full_name(op) for op in ops))
        return 0
    stream = (args.json + "l") if args.json and args.json.endswith(".json") else (args.json and args.json + ".jsonl")
    records = _load(stream)[1] if args.resume and stream and os.path.exists(stream) else []
    todo = tasks(ops, dtypes, backends, args.samples, _done(records), args.device)
    info = meta(argv)
    if args.note:
        info["note"] = args.note
    print(f"opinfo: {len(todo)} tasks ({len(ops)} ops x {dtypes}) on {backends}, {args.workers} workers",
          file=sys.stderr)
    out = open(stream, "a" if args.resume else "w") if stream else None
    t0, n = time.perf_counter(), [0]

    def on_record(rec):
        records.append(rec)
        n[0] += 1
        if out:
            out.write(json.dumps(rec, default=str) + "\n")
            out.flush()
        if rec["status"] not in ("pass", "skip"):
            print(f"  {report._unit(rec)} {rec['backend']}: {report._failure(rec)[:200]}", file=sys.stderr)
        if n[0] % 100 == 0:
            print(f"opinfo: {n[0]} units, {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    try:
        Pool(args.workers, args.timeout).run(todo, on_record)
    finally:
        if out:
            out.close()
    info["elapsed"] = f"{time.perf_counter() - t0:.0f} s with {args.workers} workers"
    write(records, info, args.json, args.report)
    _print_summary(records)
    return 0


def _print_summary(records) -> None:
    s = report.summary(records)
    for b in report.backends_of(records):
        c = s[b]
        print(f"{b:12s} " + " ".join(f"{x} {c[x]}" for x in report.STATUSES) + f"  pass rate {report.rate(c)}")


if __name__ == "__main__":
    sys.exit(main())
