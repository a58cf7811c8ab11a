"""The OpInfo sweep's report: a summary per backend, the samples inductor passes but kiln fails, kiln's
ATen fallbacks by reason, and one row per op.

A unit is one (op, dtype, sample, mode) on one backend; its status is pass, mismatch, error, crash,
timeout or skip. The pass rate counts passes over the units that were not skipped. A pass with no Dynamo
graph ran entirely in eager (a graph break before the op) and tests nothing of the backend: the summary
counts those apart.
"""
from __future__ import annotations

import collections
import re

STATUSES = ("pass", "mismatch", "error", "crash", "timeout", "skip")
FAILS = ("mismatch", "error", "crash", "timeout")
SHORT = {"pass": "p", "mismatch": "m", "error": "e", "crash": "c", "timeout": "t", "skip": "s"}


def key(rec) -> tuple:
    """(op, dtype, sample, mode): the unit of work apart from the backend."""
    return rec["op"], rec["dtype"], rec.get("sample"), rec.get("mode")


def backends_of(records) -> list:
    order = ["kiln-aten", "kiln-triton", "kiln-cpp", "inductor", "aot_eager", "eager"]
    found = {r["backend"] for r in records if r["backend"] != "*"}
    return [b for b in order if b in found] + sorted(found - set(order))


def expand(records) -> list:
    """Records with op-level entries (backend ``*``: the op's samples failed or its worker died before
    a unit) kept once per op, never counted against a backend."""
    return [r for r in records if r["backend"] != "*"]


def summary(records) -> dict:
    """{backend: Counter of statuses, plus 'no_graph', 'breaks', 'fallback_units', 'runtime_fallback_units',
    'declined_units' (a kernel the C++ emitter declined ran its ATen nodes)}."""
    out = collections.defaultdict(collections.Counter)
    for r in expand(records):
        c = out[r["backend"]]
        c[r["status"]] += 1
        if r["status"] == "pass" and r.get("graphs") == 0:
            c["no_graph"] += 1
        c["backend_exception"] += bool(r.get("backend_exception"))
        c["breaks"] += r.get("graph_breaks") or 0
        c["fallback_units"] += bool(r.get("fallback"))
        c["runtime_fallback_units"] += bool(r.get("runtime_fallback"))
        c["declined_units"] += bool(r.get("declined"))
        c["seconds"] += r.get("seconds") or 0
    return out


def rate(c) -> str:
    n = sum(c[s] for s in FAILS) + c["pass"]
    return f"{100.0 * c['pass'] / n:.2f}%" if n else "-"


def regressions(records, kiln_backend: str, baseline: str = "inductor") -> list:
    """Units ``baseline`` passes and ``kiln_backend`` fails, as (baseline record, kiln record)."""
    base = {key(r): r for r in records if r["backend"] == baseline and r["status"] == "pass"}
    return [(base[key(r)], r) for r in records
            if r["backend"] == kiln_backend and r["status"] in FAILS and key(r) in base]


def _norm(reason: str) -> str:
    """A fallback reason without the parts that vary per graph (kernel names, sizes, numbers)."""
    reason = re.sub(r"kernel \S+", "kernel K", reason)
    reason = re.sub(r"\b\d+\b", "N", reason)
    return reason[:160]


def fallback_reasons(records, backend: str) -> list:
    """[(reason, units, example ops)] for the ATen fallbacks ``backend`` logged, most frequent first."""
    count, ops = collections.Counter(), collections.defaultdict(list)
    for r in records:
        if r["backend"] != backend:
            continue
        for reason in r.get("reasons", ()):
            n = _norm(reason)
            count[n] += 1
            if r["op"] not in ops[n]:
                ops[n].append(r["op"])
    return [(n, c, ops[n]) for n, c in count.most_common()]


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _unit(r) -> str:
    return f"{r['op']} {r['dtype']} #{r.get('sample')} {r.get('mode')}"


def _failure(r) -> str:
    bits = [r["status"]]
    if r.get("where"):
        bits.append(f"in {r['where']}")
    if r.get("max_err") is not None and r["status"] == "mismatch":
        bits.append(f"max err {r['max_err']:.3g}")
    if r.get("fp64_ok"):
        bits.append("(fp64 arbiter: ok)")
    text = " ".join(bits)
    if r.get("error"):
        text += f": {r['error']}"
    if r.get("kiln_frame"):
        text += f" [{r['kiln_frame']}]"
    return _cell(text[:400])


def write(records, meta: dict, path: str | None = None) -> str:
    """The report as Markdown; written to ``path`` when given."""
    backends = backends_of(records)
    s = summary(records)
    lines = ["# OpInfo sweep", ""]
    for k in ("date", "machine", "torch", "triton", "python", "kiln", "command", "elapsed", "note"):
        if meta.get(k):
            lines.append(f"- {k}: `{meta[k]}`" if k == "command" else f"- {k}: {meta[k]}")
    lines += _sources(meta.get("sources"))
    lines += ["", "Statuses: pass, mismatch (values or gradients outside the op's tolerance), error (an exception),",
              "crash (the worker died), timeout, skip (eager cannot run the sample, or the op's output is not",
              "comparable). A unit is one op, dtype, sample and mode (forward: an inference graph; backward: a",
              "training graph, values and gradients). Pass rate: passes over units not skipped.", "",
              "## Summary", "",
              "| backend | units | pass | mismatch | error | crash | timeout | skip | pass rate | passes with no graph "
              "| backend raised, Dynamo ran eager | graph breaks | units with a graph left ATen "
              "| units with a runtime fallback | units with a kernel declined (C++) | seconds |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for b in backends:
        c = s[b]
        lines.append(f"| {b} | {sum(c[x] for x in STATUSES)} | " + " | ".join(str(c[x]) for x in STATUSES)
                     + f" | {rate(c)} | {c['no_graph']} | {c['backend_exception']} | {c['breaks']} | {c['fallback_units']} "
                       f"| {c['runtime_fallback_units']} | {c['declined_units']} | {c['seconds']:.0f} |")
    lines += _by_dtype(records, backends)
    op_level = [r for r in records if r["backend"] == "*"]
    if op_level:
        lines += ["", f"Ops with no unit run ({len(op_level)}): "
                  + "; ".join(_cell(f"{r['op']} {r['dtype']}: {r['status']} ({r.get('error')})")
                              for r in op_level[:40]) + (" ..." if len(op_level) > 40 else "")]
    for b in [b for b in backends if b.startswith("kiln")]:
        lines += _regression_section(records, b, "inductor" in backends)
    for b in [b for b in backends if b.startswith("kiln")]:
        reasons = fallback_reasons(records, b)
        if reasons:
            lines += ["", f"## {b}: ATen fallbacks by logged reason", "", "| reason | units | ops |", "|---|---|---|"]
            lines += [f"| {_cell(n)} | {c} | {_cell(', '.join(o[:6]) + (' ...' if len(o) > 6 else ''))} |"
                      for n, c, o in reasons]
    lines += _per_op(records, backends)
    text = "\n".join(lines) + "\n"
    if path:
        with open(path, "w") as f:
            f.write(text)
    return text


def _by_dtype(records, backends) -> list:
    """Pass rates per backend and dtype (passes / units not skipped)."""
    dtypes = sorted({r["dtype"] for r in expand(records)}, key=lambda d: (d != "fp32", d != "bf16", d))
    per = {d: summary([r for r in records if r["dtype"] == d]) for d in dtypes}
    lines = ["", "Pass rate by dtype (passes / units not skipped):", "",
             "| backend | " + " | ".join(dtypes) + " |", "|---|" + "---|" * len(dtypes)]
    for b in backends:
        cells = [f"{rate(per[d][b])} ({per[d][b]['pass']}/{sum(per[d][b][x] for x in FAILS) + per[d][b]['pass']})"
                 if b in per[d] else "-" for d in dtypes]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return lines


def _sources(sources) -> list:
    """The merged files (``opinfo.merge``): where each record of the report comes from."""
    if not sources:
        return []
    lines = ["", "## Sources", "", "Each record comes from the last of these runs that ran its op in its dtype on its "
             "backend (the per-op table's `src` column).", "",
             "| src | run | kiln tree | records | command |", "|---|---|---|---|---|"]
    for i, m in enumerate(sources, 1):
        lines.append(f"| {i} | {_cell(m.get('date', '?'))}, {_cell(m.get('elapsed', ''))} | {_cell(m.get('kiln', '?'))} "
                     f"| {m.get('records', 0)} | `{_cell(m.get('command', ''))}` |")
    return lines


def eager_fallbacks(records, kiln_backend: str, baseline: str = "inductor") -> list:
    """Units where ``kiln_backend`` raised while compiling and Dynamo ran the frame eagerly (values then
    match trivially) but ``baseline`` compiled without raising."""
    base = {key(r) for r in records if r["backend"] == baseline and r.get("graphs")
            and not r.get("backend_exception")}
    return [r for r in records if r["backend"] == kiln_backend and r.get("backend_exception") and key(r) in base]


def _regression_section(records, b, have_inductor) -> list:
    lines = []
    if have_inductor:
        regs = regressions(records, b)
        lines += ["", f"## {b}: units inductor passes and {b} fails ({len(regs)})", ""]
        lines += [f"- {_cell(_unit(k))}: {_failure(k)}" for _, k in regs] or ["none"]
        eager = eager_fallbacks(records, b)
        lines += ["", f"## {b}: units where {b} raised, Dynamo ran them eagerly, and inductor compiled "
                      f"({len(eager)})", ""]
        lines += [f"- {_cell(_unit(r))}: {_cell(r['backend_exception'])}" for r in eager] or ["none"]
    both = [r for r in records if r["backend"] == b and r["status"] in FAILS]
    if have_inductor:
        passed = {key(x) for x in records if x["backend"] == "inductor" and x["status"] == "pass"}
        both = [r for r in both if key(r) not in passed]
        title = f"## {b}: other failing units (inductor fails or did not run them too) ({len(both)})"
    else:
        title = f"## {b}: failing units ({len(both)})"
    lines += ["", title, ""] + ([f"- {_cell(_unit(r))}: {_failure(r)}" for r in both] or ["none"])
    return lines


def _per_op(records, backends) -> list:
    rows = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
    src = collections.defaultdict(set)
    for r in expand(records):
        rows[(r["op"], r["dtype"])][r["backend"]][r["status"]] += 1
        if r.get("src"):
            src[(r["op"], r["dtype"])].add(r["src"])
    col = " src |" if src else ""
    lines = ["", "## Per op", "", "Counts per backend as pass/mismatch/error/crash/timeout/skip.", "",
             "| op | dtype | " + " | ".join(backends) + " |" + col, "|---|---|" + "---|" * (len(backends) + bool(src))]
    for (op, dt), per in sorted(rows.items()):
        cells = []
        for b in backends:
            c = per.get(b)
            cells.append("/".join(str(c[x]) for x in STATUSES) if c else "-")
            if c and any(c[x] for x in FAILS):
                cells[-1] = f"**{cells[-1]}**"
        where = f" {','.join(map(str, sorted(src[(op, dt)])))} |" if src else ""
        lines.append(f"| {_cell(op)} | {dt} | " + " | ".join(cells) + " |" + where)
    return lines
