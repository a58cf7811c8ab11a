"""What a fuzz run leaves in its output folder: a reproducer script per failure, ``results.jsonl``
(one line per program), ``summary.md`` and ``summary.json``.

A reproducer is standalone: the program's source, then ``check_program`` from the harness on the
target it failed on; it prints what differs and exits 1 while the failure is there (a crash kills it).
"""
from __future__ import annotations

import collections
import json
import os
import re

from kiln_bench.fuzz.program import Program

FAILING = ("wrong", "exception", "crash", "timeout")


def key(rec: dict) -> tuple:
    """The group of a failure: status and kind, the exception's type and message with numbers and
    value names masked, where a wrong value showed (output, grad, input)."""
    st = rec["status"]
    if st == "wrong":
        p = rec["problems"][0]
        return ("wrong", p["what"], p["where"].split()[0])
    if st == "fallback":
        return ("fallback", rec["error"])
    if st == "exception":
        msg = re.sub(r"\b(buf|v|a|tmp|x|y|r)\d+\b", r"\1#", rec["error"])
        msg = re.sub(r"\d+", "#", msg)[:120]
        return ("exception", rec["error_type"], msg)
    return (st, rec.get("detail", ""))


def describe(rec: dict) -> str:
    if rec["status"] == "wrong":
        return "; ".join(f"{p['where']}: {p['what']}: {p['detail']}" for p in rec["problems"][:3])
    return rec.get("error") or rec.get("detail") or rec["status"]


def _doc(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"""', "'''")


def _options_source(options: dict) -> tuple:
    """(import lines, the text of a dict) for kiln ``options`` (callables imported by module and name)."""
    imports, items = [], []
    for name, value in (options or {}).items():
        if callable(value):
            imports.append(f"from {value.__module__} import {value.__name__}\n")
            items.append(f"{name!r}: {value.__name__}")
        else:
            items.append(f"{name!r}: {value!r}")
    return "".join(imports), "{" + ", ".join(items) + "}"


def write_repro(path: str, program: Program, rec: dict, target: str, original_ops: int, options=None,
                zero_sign=True) -> None:
    header = (f'"""kiln fuzz reproducer: {program.note or "program"}, target {target!r}: {rec["status"]}.\n'
              f"{_doc(describe(rec)[:600])}\n"
              + (f"Upstream: {_doc(rec['upstream'])}\n" if rec.get("upstream") else "")
              + f"Shrunk from {original_ops} to {len(program.ops)} statements ({program.describe()}).\n"
              f"Run from the repository root: PYTHONPATH=. .venv/bin/python {path}\n"
              f'Exits 1 while the failure is there (a crash kills the process)."""\n')
    imports, opts = _options_source(options)
    body = (header + "import sys\n\nimport torch\nimport torch.nn.functional as F  # noqa: F401\n\n"
            "from kiln_bench.fuzz.harness import check_program, leaf, make_input  # noqa: F401\n" + imports + "\n\n"
            + program.source() + "\n\nif __name__ == \"__main__\":\n"
            f"    res = check_program(make_inputs, program, target={target!r}, train={program.train}, "
            f"dynamic={program.dynamic},\n                        verbose=True"
            + (f", options={opts}" if options else "")
            + ("" if zero_sign else ", zero_sign=False") + ")\n"
            + ("    sys.exit(1 if res.fallbacks else 0)   # a kernel fell back to ATen at run time\n"
               if rec["status"] == "fallback" else
               "    sys.exit(0 if res.status in (\"pass\", \"discard\") else 1)\n"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(body)


def _mask(text: str, width: int = 100) -> str:
    """``text`` with kernel names and numbers masked, cut to ``width``: a key to count alike lines by."""
    return re.sub(r"\d+", "#", re.sub(r"kiln_\w+?_[0-9a-f]{12}", "kiln_K", text))[:width]


def _fallback_kinds(rs: list) -> dict:
    kinds = collections.Counter()
    for r in rs:
        for line in r.get("fallback_reasons", []):
            m = re.search(r"running its ATen nodes instead \((.*)\)$", line) or re.search(
                r"C\+\+ build failed \((.*)\); the graph runs ATen", line)
            if m:   # (a C++ build's message names files by folder and hash)
                kinds[_mask(re.sub(r"kiln_[0-9a-f]{20}", "kiln_K", re.sub(r"(/[^\s/:]+)+/", "", m.group(1))))] += 1
    return dict(kinds.most_common())


def summarize(records: list, wall: float, workers: int) -> dict:
    """Counts per target: programs, passed, discarded (by reason), failures by kind, crashes, upstream
    failures, ATen fallbacks (by reason), timing."""
    out = {}
    for target in sorted({r["target"] for r in records}):
        rs = [r for r in records if r["target"] == target and r["task"] == "run"]
        counts = collections.Counter(r["status"] for r in rs)
        kiln_fail = [r for r in rs if r["status"] in FAILING + ("fallback",) and not r.get("upstream")]
        secs = [r["seconds"].get("total", 0) for r in rs if r.get("seconds")]
        out[target] = {
            "programs": len(rs), "passed": counts["pass"], "discarded": counts["discard"],
            "discarded_by_reason": dict(collections.Counter(_mask(r.get("error", ""), 80) for r in rs
                                                            if r["status"] == "discard").most_common()),
            "failed": len(kiln_fail),
            "failed_by_kind": dict(collections.Counter(" ".join(map(str, key(r)[:2])) for r in kiln_fail)),
            "crashes": sum(r["status"] == "crash" for r in kiln_fail),
            "timeouts": sum(r["status"] == "timeout" for r in kiln_fail),
            "upstream": sum(1 for r in rs if r.get("upstream")),
            "upstream_wrong": sum(1 for r in rs if r.get("upstream") and r["status"] == "wrong"),
            # compiles that raised, which users never see: kiln's eager fallback (on_error) runs them right
            "exceptions_fallback_passes": sum(1 for r in rs if r["status"] == "exception"
                                              and r.get("eager_fallback") == "passes"),
            "harness_errors": counts["harness_error"],
            "programs_with_fallbacks": sum(1 for r in rs if r.get("fallbacks")),   # failures too under --strict
            "fallback_kernels": sum(r.get("fallbacks", 0) for r in rs),
            "fallbacks_by_reason": _fallback_kinds(rs),   # the first 5 kernels of a program at most
            "excused": sum(1 for r in rs if r.get("excused")),   # differences eager's own loops share
            "seconds_per_program": round(sum(secs) / max(len(secs), 1), 3),
            "wall_seconds_per_program": round(wall * workers / max(len(records), 1), 3),
        }
    return out


def write_summary(out_dir: str, records: list, failures: list, wall: float, workers: int, config: dict,
                  state: dict | None = None) -> dict:
    """``summary.json`` and ``summary.md``: counts, failure groups with their reproducers, fallbacks.
    ``state``: how the run stands ('stopped': '', 'deadline' or 'signal ...'; programs 'unstarted' and
    'unfinished'; failures still 'shrinking', whose groups are not listed yet)."""
    state = state or {}
    summary = {"config": config, "wall_seconds": round(wall, 1), "state": state,
               "targets": summarize(records, wall, workers)}
    groups = collections.defaultdict(list)
    for f in failures:
        groups[(f["target"],) + tuple(map(str, key(f))) + (("upstream",) if f.get("upstream") else ())].append(f)
    summary["groups"] = [{"key": list(k), "count": len(v), "programs": [f["index"] for f in v],
                          "repro": v[0].get("repro"), "detail": describe(v[0])[:300],
                          "upstream": v[0].get("upstream", ""),
                          "eager_fallback": sorted({f.get("eager_fallback", "") for f in v} - {""})}
                         for k, v in sorted(groups.items(), key=lambda kv: -len(kv[1]))]
    summary["fallbacks"] = [{"target": r["target"], "index": r["index"], "kernels": r["fallbacks"],
                             "reasons": r.get("fallback_reasons", [])} for r in records if r.get("fallbacks")]
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    how = ("still running" if state.get("running") else f"stopped ({state['stopped']})" if state.get("stopped")
           else "complete")
    if state.get("unstarted") or state.get("unfinished") or state.get("shrinking"):
        how += (f": {state.get('unstarted', 0)} programs not started, {state.get('unfinished', 0)} abandoned while"
                f" running, {state.get('shrinking', 0)} failures being shrunk")
    lines = [f"# kiln fuzz: {config}", "", f"wall time {wall:.0f} s, {how}", ""]
    for target, s in summary["targets"].items():
        lines.append(f"## {target}")
        lines += [f"- {k}: {v}" for k, v in s.items()]
        lines.append("")
    lines.append("## Failure groups (kiln's first; 'upstream' ones fail with aot_eager too)")
    for g in summary["groups"]:
        lines.append(f"- {' | '.join(g['key'])}: {g['count']} programs {g['programs'][:8]}"
                     f"{' (upstream)' if g['upstream'] else ''}\n  repro: {g['repro']}\n  {g['detail']}"
                     + (f"\n  eager fallback: {'; '.join(g['eager_fallback'])}" if g["eager_fallback"] else ""))
    lines += ["", f"## Programs with ATen fallbacks at run time or failed C++ builds ({len(summary['fallbacks'])})"]
    lines += [f"- {f['target']} {f['index']}: {f['kernels']} kernels; {f['reasons'][:1]}" for f in summary["fallbacks"]]
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return summary
