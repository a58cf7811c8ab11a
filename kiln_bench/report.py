"""Rows to text: the live console line, the markdown section for RESULTS.md, JSON, and the cliff guard.

Rows are flat dicts (see ``runner.measure_backend``). The markdown pivots them to one line per
(case, dtype, budget) with a column per backend and the ratios kiln/eager and kiln/inductor of the
median step time (below 1 means kiln is faster), host time and kernels per step of each backend, the
guard's verdict, followed by the geometric means and the errors.

The guard (``cliff``, ``failures``): a line where kiln's median step time is above ``GUARD['inductor']``
times inductor's or ``GUARD['eager']`` times eager's fails (lines of a budget sweep below 1 are exempt:
they trade time for memory on purpose); so does any failed check and any kiln row that errored.
``kiln bench`` exits nonzero when anything fails, unless ``--no-guard``.
"""
from __future__ import annotations

import json
import math
import os
import time

LIVE = [("case", 16), ("dtype", 8), ("backend", 9), ("budget", 6), ("step ms", 16), ("host ms", 8),
        ("kernels", 8), ("cold s", 7), ("warm s", 7), ("mem MiB", 9), ("GB/s (of STREAM)", 17), ("check", 10)]
GUARD = {"inductor": 1.5, "eager": 1.0}   # kiln's step time may be at most these multiples of theirs


def _num(x, digits=3):
    if x is None:
        return "-"
    if x == 0:
        return "0"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.{digits}g}"


def step_cell(row) -> str:
    """'1.23 ±4%': median step ms and half the interquartile range relative to it."""
    if row.get("status") != "ok" or row.get("ms") is None:
        return "error"
    return f"{_num(row['ms'])} ±{spread(row) * 100:.0f}%"


def spread(summary: dict) -> float:
    """Half the interquartile range relative to the median of a ``measure.summarize`` result or a row
    (0.04 = ±4%)."""
    return (summary["p75"] - summary["p25"]) / 2 / summary["ms"] if summary["ms"] else 0.0


def mem_cell(row) -> str:
    b = row.get("mem_bytes")
    return "-" if b is None else _num(b / 2**20)


def bw_cell(row) -> str:
    """'12.3 (81%)': achieved GB/s and its fraction of the machine's STREAM bandwidth (when measured)."""
    gbps = row.get("gbps")
    if not gbps:
        return "-"
    return _num(gbps, 4) + (f" ({row['bw_frac']:.0%})" if row.get("bw_frac") else "")


def budget_cell(budget) -> str:
    return "-" if budget is None else f"{budget:g}"


def live_header() -> str:
    return " ".join(f"{name:<{w}}" for name, w in LIVE)


def live_line(row) -> str:
    """One console line for a finished row; errors show the stage and the message."""
    if row.get("status") != "ok":
        head = [row["case"], row.get("dtype", ""), row["backend"], budget_cell(row.get("budget"))]
        return " ".join(f"{v:<{w}}" for v, (_, w) in zip(head, LIVE)) + \
            f" ERROR in {row.get('stage')}: {row.get('error')}"
    cells = [row["case"], row["dtype"], row["backend"], budget_cell(row.get("budget")), step_cell(row),
             _num(row.get("host_ms")), _num(row.get("kernels"), 4), _num(row.get("compile_s")),
             _num(row.get("warm_compile_s")), mem_cell(row), bw_cell(row), row.get("check", "")[:40]]
    return " ".join(f"{str(v):<{w}}" for v, (_, w) in zip(cells, LIVE))


def pivot(rows):
    """``[(key, {backend: row})]`` with key (case, dtype, budget); eager rows join every budget."""
    groups: dict = {}
    eager: dict = {}
    for r in rows:
        k = (r["case"], r["dtype"])
        if r["backend"] == "eager":
            eager[k] = r
        groups.setdefault(k, {}).setdefault(r.get("budget") if r["backend"] != "eager" else "__eager", {})[
            r["backend"]] = r
    out = []
    for k, by_budget in groups.items():
        budgets = [b for b in by_budget if b != "__eager"] or ["__eager"]
        for b in budgets:
            cells = dict(by_budget.get(b, {}))
            if k in eager:
                cells["eager"] = eager[k]
            out.append(((k[0], k[1], None if b == "__eager" else b), cells))
    return out


def _ms(row):
    return row["ms"] if row and row.get("status") == "ok" and row.get("ms") else None


def ratio(a, b):
    """a/b of median step times, None when either is missing."""
    x, y = _ms(a), _ms(b)
    return x / y if x and y else None


def geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _elapsed(meta) -> str:
    """'84 s', or 'partial run' for a JSON written before the run finished (a timed-out command)."""
    return f"{meta['elapsed_s']:.0f} s" if "elapsed_s" in meta else "partial run (stopped before the end)"


def markdown(meta: dict, rows: list) -> str:
    """The RESULTS.md section: header with versions, the pivot table, geometric means, errors."""
    backends = meta.get("backends") or sorted({r["backend"] for r in rows})
    compiled = [b for b in backends if b != "eager"]
    pairs = (("kiln", "eager"), ("kiln", "inductor"), ("kiln-cg", "inductor-cg"), ("kiln-cg", "inductor"),
             ("kiln-auto", "inductor"))
    ratios = [(n, d) for n, d in pairs if n in backends and d in backends]
    limits = meta.get("guard") or GUARD
    guarded = any(b.startswith("kiln") for b in backends)
    has_host = any(r.get("host_ms") is not None for r in rows)
    has_kernels = any(r.get("kernels") is not None for r in rows)
    head = ["case", "dtype", "budget"] + [f"{b} ms" for b in backends] + [f"{n}/{d}" for n, d in ratios]
    head += [f"host ms {'/'.join(backends)}"] if has_host else []
    head += [f"kernels {'/'.join(backends)}"] if has_kernels else []
    head += ["guard"] if guarded else []
    head += [f"{b} compile s cold/warm" for b in compiled] + [f"mem MiB {'/'.join(backends)}"]
    has_saved = any(r.get("peak_bytes") is not None and r.get("saved_bytes") is not None for r in rows)
    if has_saved:
        head.append(f"saved MiB {'/'.join(backends)}")
    has_bw = any(r.get("gbps") for r in rows)
    if has_bw:
        head.append(f"GB/s {'/'.join(backends)}")
    head.append(f"check {'/'.join(compiled)}" if compiled else "check")
    lines = [f"## {meta['date']} · {meta['device_name']} · torch {meta['torch']} · triton {meta['triton']}"
             f" · kiln {meta['kiln']}", "",
             f"`{meta['command']}`" + (f" (recorded from {', '.join(meta['recorded_from'])})"
                                       if meta.get("recorded_from") else "") + "  ", f"suite {meta['suite']}, size {meta['size']}, caches {meta['caches']}, "
             f"threads {meta['threads']}, {_elapsed(meta)}. Step time = median ±half IQR; "
             f"ratios are of median step times (< 1: kiln faster). Memory: {meta['mem_kind']}. "
             f"Check: max error relative to eager's max, or ok~fp64 when a float64 run shows the backend "
             f"no less accurate than eager. "
             f"Cold compile = first call (compile + one step) with empty caches; warm = the same after "
             f"torch._dynamo.reset(). Training steps run with the models' own dropout and stochastic depth; "
             f"the check runs with them off. " + _host_note(meta, rows, has_host, has_kernels)
             + (_guard_note(meta, limits) if guarded else ""), "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    if meta.get("note"):
        lines.insert(-2, f"Note: {meta['note']}\n")
    if _load_note(meta, rows):
        lines.insert(-2, _load_note(meta, rows) + "\n")
    if meta.get("bandwidth"):
        from kiln_bench.stream import describe
        lines.insert(-2, describe(meta["bandwidth"]) + "; GB/s cells show (in parentheses) the fraction of the "
                     "larger.\n")
    per_ratio = {rt: [] for rt in ratios}
    for (case, dtype, budget), cells in pivot(rows):
        line = [case, dtype, budget_cell(budget)] + [step_cell(cells[b]) if b in cells else "-" for b in backends]
        for rt in ratios:
            x = ratio(cells.get(rt[0]), cells.get(rt[1]))
            per_ratio[rt].append(x)
            line.append(f"{x:.2f}" if x else "-")
        if has_host:
            line.append("/".join(_num(cells[b].get("host_ms")) if b in cells else "-" for b in backends))
        if has_kernels:
            line.append("/".join(_num(cells[b].get("kernels"), 4) if b in cells else "-" for b in backends))
        if guarded:
            line.append(_guard_cell(cells, budget, limits))
        for b in compiled:
            c = cells.get(b, {})
            line.append(f"{_num(c.get('compile_s'))}/{_num(c.get('warm_compile_s'))}" if c.get("status") == "ok"
                        else "-")
        line.append("/".join(mem_cell(cells[b]) if b in cells else "-" for b in backends))
        if has_saved:
            line.append("/".join(_num(cells[b]["saved_bytes"] / 2**20) if cells.get(b, {}).get("saved_bytes")
                                 is not None else "-" for b in backends))
        if has_bw:
            line.append("/".join(bw_cell(cells[b]) if b in cells else "-" for b in backends))
        line.append("/".join(_check(cells.get(b)) for b in (compiled or backends)))
        lines.append("| " + " | ".join(line) + " |")
    lines.append("")
    for (n, d), xs in per_ratio.items():
        g = geomean(xs)
        if g:
            lines.append(f"- geomean {n}/{d}: **{g:.2f}** over {len([x for x in xs if x])} rows")
    lines += summary(rows, backends, ratios)
    errors = [r for r in rows if r.get("status") != "ok"]
    for r in errors:
        lines.append(f"- error: {r['case']} {r.get('dtype')} {r['backend']}"
                     f"{'@' + budget_cell(r.get('budget')) if r.get('budget') is not None else ''}"
                     f" in {r.get('stage')}: {r.get('error')}")
    for r in rows:
        if r.get("status") == "ok" and r.get("ok") is False:
            lines.append(f"- check failed: {r['case']} {r['dtype']} {r['backend']}"
                         f"{'@' + budget_cell(r.get('budget')) if r.get('budget') is not None else ''}: {r['check']}")
    for r in rows:
        if r.get("kernels_error"):
            lines.append(f"- kernel count failed: {r['case']} {r.get('dtype')} {r['backend']}: {r['kernels_error']}")
    for name, why in meta.get("skipped", []):
        lines.append(f"- skipped: {name}: {why}")
    if guarded:
        bad = failures(rows, limits)
        lines.append(f"- guard{'' if meta.get('guard_enforced', True) else ' (not enforced: --no-guard)'}: "
                     + (f"**{len(bad)} FAILED**" if bad else "passed"))
        lines += [f"  - {b}" for b in bad]
    return "\n".join(lines) + "\n"


def _host_note(meta, rows, has_host, has_kernels) -> str:
    out = ""
    if has_host:
        out += ("Host ms: median wall time from a step's start until the step function returns (its last "
                "launch), no sync inside the step, no profiler" + ("; on the CPU it is the step time. "
                                                                   if meta.get("device") == "cpu" else ". "))
    kinds = sorted({r["kernels_kind"] for r in rows if r.get("kernels_kind")})
    if has_kernels:
        later = " after every timed step (a profiled pass slows later launches)" if meta.get("device") == "cuda" else ""
        out += f"Kernels: {', '.join(kinds) or 'kernels'} per step, counted in a separate profiled pass{later}. "
    return out


def _load_note(meta, rows) -> str:
    """The machine's load during the run (one-minute load average at the start, after each row, at the end)
    on its cores, and a warning when other work competed with the run's threads (``load.verdict``); empty
    for runs that did not sample it."""
    from kiln_bench.load import others, verdict
    start, end = meta.get("load"), meta.get("load_end")
    if not (start or end):
        return ""
    s = start or end
    threads = meta.get("threads", 1) if meta.get("device") == "cpu" else 1
    seen = [x for x in (start, end) if x] + [dict(s, load1=r["load1"], own=threads) for r in rows
                                             if r.get("load1") is not None]
    worst = max(seen, key=others)
    why = verdict(worst, threads)
    return (f"Load average {min(x['load1'] for x in seen):.1f} to {max(x['load1'] for x in seen):.1f} over the "
            f"run on {s['cores']} cores" +
            (f": UNRELIABLE timings, {why[0]}; the step times include waiting for them." if why else "."))


def _guard_note(meta, limits) -> str:
    return (f"Guard: a line fails when kiln's step time is above {limits['inductor']:g}x inductor's or "
            f"{limits['eager']:g}x eager's (budget sweeps below 1 exempt), or a check fails, or kiln errs.")


def _vs(cells, kiln_name) -> list:
    """``[(name, limit key, row)]``: what kiln_name's row is held against, its inductor (inductor-cg for
    kiln-cg when measured) and eager."""
    ind = "inductor-cg" if kiln_name == "kiln-cg" and "inductor-cg" in cells else "inductor"
    return [(ind, "inductor", cells.get(ind)), ("eager", "eager", cells.get("eager"))]


def cliff(cells, budget, limits=None):
    """Why the kiln row of one pivoted line is a cliff ('6.08x inductor (limit 1.5x)'), '' when it is not, or
    None when nothing was compared (no measured kiln row, a budget below 1, no baseline measured)."""
    limits = limits or GUARD
    if budget is not None and budget < 1.0:
        return None
    found, why = None, []
    for name in ("kiln", "kiln-cg", "kiln-auto"):
        for other, key, row in _vs(cells, name):
            x = ratio(cells.get(name), row)
            if x is None:
                continue
            found = found or ""
            if x > limits[key]:
                why.append(f"{name} {x:.2f}x {other} (limit {limits[key]:g}x)")
    return "; ".join(why) if why else found


def _guard_cell(cells, budget, limits) -> str:
    """'ok', '-' (nothing compared) or '**FAIL** <why>' for one pivoted line."""
    why = cliff(cells, budget, limits)
    bad = [why] if why else []
    bad += [f"{b} error" for b, r in cells.items() if b.startswith("kiln") and r.get("status") != "ok"]
    bad += [f"{b} check" for b, r in cells.items() if r.get("status") == "ok" and r.get("ok") is False]
    return f"**FAIL** {'; '.join(bad)}" if bad else ("ok" if why is not None else "-")


def failures(rows, limits=None) -> list:
    """What fails the guard, one line each: cliffs (see ``cliff``), failed checks of any backend, and
    kiln rows that errored."""
    out = []
    for (case, dtype, budget), cells in pivot(rows):
        why = cliff(cells, budget, limits)
        if why:
            out.append(f"cliff: {case} {dtype}{'' if budget is None else ' @' + budget_cell(budget)}: {why}")
    for r in rows:
        tag = f"{r['case']} {r.get('dtype')} {r['backend']}" + \
            ("" if r.get("budget") is None else f" @{budget_cell(r['budget'])}")
        if r.get("status") == "ok" and r.get("ok") is False:
            out.append(f"check failed: {tag}: {r.get('check')}")
        elif r.get("status") != "ok" and r["backend"].startswith("kiln"):
            out.append(f"error: {tag} in {r.get('stage')}: {r.get('error')}")
    return out


def _passed(row) -> bool:
    return row.get("status") == "ok" and (row.get("ok") is True or row.get("check") == "ref")


def summary(rows, backends, ratios) -> list:
    """Lines under the geomeans: per-mode geomeans when training and inference rows mix, the pass rate
    of each compiled backend (no error, values within tolerance of eager or of the fp64 referee), and
    the rows where kiln's peak memory is above eager's or inductor's."""
    out = []
    cells = pivot(rows)
    modes = {(c.get("kiln") or c.get("eager") or next(iter(c.values()))).get("train") for _, c in cells}
    if len(modes) > 1:
        for train in (True, False):
            for n, d in ratios:
                xs = [ratio(c.get(n), c.get(d)) for _, c in cells
                      if (c.get(n) or {}).get("train") is train]
                g = geomean(xs)
                if g:
                    out.append(f"- geomean {n}/{d}, {'training' if train else 'inference'}: **{g:.2f}** over "
                               f"{len([x for x in xs if x])} rows (max {max(x for x in xs if x):.2f})")
    for b in backends:
        if b == "eager":
            continue
        mine = [r for r in rows if r["backend"] == b]
        if mine:
            out.append(f"- pass rate {b}: {sum(_passed(r) for r in mine)}/{len(mine)}")
    for n, d in ratios:   # runner.interleave: the backends timed again in alternating rounds
        timed = [(k[0], c[n], c[d]) for k, c in cells
                 if (c.get(n) or {}).get("ms_rounds") and (c.get(d) or {}).get("ms_rounds")]
        if not timed:
            continue
        g = geomean([a["ms_rounds"] / b["ms_rounds"] for _, a, b in timed])
        out.append(f"- interleaved ({timed[0][1]['rounds']} rounds, alternating order) {n}/{d}: "
                   f"geomean **{g:.2f}**; " + ", ".join(
                       f"{case} {a['ms_rounds'] / b['ms_rounds']:.2f}" + (
                           f" (host {a['host_ms_rounds'] / b['host_ms_rounds']:.2f})"
                           if a.get("host_ms_rounds") and b.get("host_ms_rounds") else "") for case, a, b in timed))
    if "kiln" in backends:
        for other in ("eager", "inductor"):
            above = [f"{k[0]} ({c['kiln']['peak_bytes'] / c[other]['peak_bytes']:.2f})" for k, c in cells
                     if all((c.get(x) or {}).get("peak_bytes") for x in ("kiln", other))
                     and c["kiln"]["peak_bytes"] > c[other]["peak_bytes"]]
            if any((c.get(other) or {}).get("peak_bytes") for _, c in cells):
                out.append(f"- kiln's peak memory above {other}'s: " + (", ".join(above) if above else "none"))
    return out


def _check(row) -> str:
    if not row:
        return "-"
    if row.get("status") != "ok":
        return "err"
    if row.get("check") == "ref":
        return "ref"
    if str(row.get("check", "")).startswith("ok vs fp64"):
        return "ok~fp64"  # differs from eager, but not less accurate than eager against float64
    if str(row.get("check", "")).startswith("ok in fp64"):
        return "ok~fp64 run"  # its own float64 compile computes eager's float64 function (measure.compare)
    return ("ok" if row.get("ok") else "FAIL") + (f" {row['err']:.0e}" if row.get("err") is not None else "")


def write_json(path: str, meta: dict, rows: list) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1, default=str)
    return path


def read_json(path: str):
    with open(path) as fh:
        data = json.load(fh)
    return data["meta"], data["rows"]


class RecordError(ValueError):
    """``--record`` found no kiln checkout to record into (kiln installed from a wheel, not a clone), or
    was combined with ``--no-record``: name a directory with ``--record-dir DIR`` instead."""


def checkout_benchmarks() -> str | None:
    """The ``benchmarks/`` folder of the kiln checkout these tools run from (beside ``pyproject.toml`` one
    level above the ``kiln_bench`` package); None when they were installed elsewhere."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "benchmarks")
    return path if os.path.isfile(os.path.join(root, "pyproject.toml")) and os.path.isdir(path) else None


def record_dir(record: bool, directory: str | None, no_record: bool = False) -> str | None:
    """Where ``kiln bench`` / ``bench-compile`` record a run: ``directory`` (``--record-dir``), the checkout's
    ``benchmarks/`` (``--record``) or nowhere (the default: print only). Raises ``RecordError``."""
    if no_record and (record or directory):
        raise RecordError("--no-record contradicts --record/--record-dir; drop one")
    if directory or not record:
        return directory
    found = checkout_benchmarks()
    if found is None:
        raise RecordError("--record: these tools do not run from a kiln checkout (no benchmarks/ beside "
                          "pyproject.toml); name a directory with --record-dir DIR")
    return found


def write_outputs(args, meta: dict, rows: list, text: str, console) -> None:
    """The files a run asked for: ``--json``, ``--md`` (``text``) and ``--record``/``--record-dir``."""
    if args.json:
        write_json(args.json, meta, rows)
    if args.md:
        with open(args.md, "w") as fh:
            fh.write(text)
    if args.record_dir:
        md_path, json_path = record(meta, rows, args.record_dir, text)
        console.print(f"recorded: {md_path}, {json_path}", markup=False, highlight=False)


def record(meta: dict, rows: list, record_dir: str, text: str | None = None) -> tuple:
    """Append the markdown section (``text``, default ``markdown(meta, rows)``) to ``record_dir/RESULTS.md``
    and write ``record_dir/results/*.json``."""
    os.makedirs(os.path.join(record_dir, "results"), exist_ok=True)
    md_path = os.path.join(record_dir, "RESULTS.md")
    new = not os.path.exists(md_path)
    with open(md_path, "a") as fh:
        if new:
            fh.write("# kiln bench results\n\nAppended by `kiln bench` (newest last). JSON for each run is in "
                     "`results/`.\n\n")
        fh.write((text or markdown(meta, rows)) + "\n")
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(meta.get("t0", time.time())))
    json_path = os.path.join(record_dir, "results", f"{stamp}_{meta['device']}_{meta['suite']}.json")
    if os.path.abspath(json_path) not in [os.path.abspath(p) for p in meta.get("recorded_from", [])]:
        write_json(json_path, meta, rows)
    return md_path, json_path
