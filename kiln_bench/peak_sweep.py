"""Peak memory of the built-in GPT trained with kiln across ``activation_memory_budget`` values.

    python -m kiln_bench.peak_sweep --device cuda --size gpu --budgets 1,0.8,0.6,0.4,0.2,0.1,0 --json OUT
    python -m kiln_bench.peak_sweep --device cpu --size cpu --png sweep.png

For each budget (``torch._dynamo.reset()`` between budgets) it compiles the GPT with kiln, runs
``--warmup`` training steps (forward, backward, gradients set to None; bf16 autocast on CUDA unless
``--dtype fp32``), then measures ``--steps`` more and reports per budget
- ``measured``: CUDA ``max_memory_allocated()`` above the allocated bytes before the step, or on the CPU
  the peak of live storage bytes created during the step (``kiln_bench.livemem``);
- ``requested`` (CUDA): the same peak in the bytes the program asked for (the allocator's
  ``requested_bytes`` statistic). ``measured`` counts whole allocator blocks, and the allocator hands
  out a cached block up to 1 MiB larger than the request rather than split it: that slack depends
  on what the cache held, so two programs whose requested peaks differ by a MiB can rank the other
  way in ``measured`` (``measured_steps`` lists each step's value);
- ``saved``: bytes of the activations the partitioner saved for the backward (graph inputs excluded);
- ``modelled``: ``kiln.partition.peak.model_peak`` of that saved set (forward and backward peaks too).
Gradients are created inside each measured step (set to None before it), in both measures.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import linecache
import os
import sys
from typing import List, Optional

import torch

from kiln import debug


@contextlib.contextmanager
def record_partitions():
    """Collect ``(joint_gm, saved, num_fwd_outputs)`` for every graph kiln partitions meanwhile."""
    got = []

    def seen(event, data):
        if event == "partition":
            got.append((data["joint"], data["saved"], data["num_fwd_outputs"]))

    with debug.observe(seen):
        yield got


def modelled(parts) -> dict:
    """Saved bytes and modelled peaks, summed over the partitioned graphs (one for the GPT)."""
    from kiln_bench._internal import model_peak
    out = {"saved": 0, "modelled": 0, "modelled_fw": 0, "modelled_bw": 0, "recompute_flops": 0.0}
    for gm, saved, n in parts:
        p = model_peak(gm, saved, n)
        out["saved"] += p.saved
        out["modelled"] += p.peak
        out["modelled_fw"] += p.forward
        out["modelled_bw"] += p.backward
        out["recompute_flops"] += p.recompute_flops
    return out


def peak_blocks(events, top: int = 25) -> dict:
    """The blocks alive at the peak of a CUDA memory trace (``torch.cuda.memory._snapshot()``'s
    ``device_traces[0]``, recorded over one step): ``{"peak": bytes above the start, "at": index of
    the allocation that reached it, "blocks": [(bytes, where allocated)] largest first}``.
    Blocks freed during the trace but allocated before it count against the start, as in
    ``max_memory_allocated() - memory_allocated()``."""
    live, cur, best, at, best_live = {}, 0, 0, -1, {}
    for i, e in enumerate(events):
        act = e.get("action")
        if act == "alloc":
            live[e["addr"]] = (e["size"], _where(e.get("frames") or []))
            cur += e["size"]
            if cur > best:
                best, at, best_live = cur, i, dict(live)
        elif act == "free_completed":
            live.pop(e["addr"], None)
            cur -= e["size"]
    blocks = sorted(best_live.values(), key=lambda b: -b[0])
    return {"peak": best, "at": at, "blocks": blocks[:top], "n_live": len(blocks),
            "at_where": _where(events[at].get("frames") or []) if at >= 0 else ""}


def _where(frames) -> str:
    """The innermost frames outside torch, as ``file:line name`` (generated wrappers and kernels)."""
    out = []
    for f in frames:
        name = f.get("filename", "")
        if not (name.endswith(".py") or name.startswith("<kiln")) or "/torch/" in name or "/triton/" in name:
            continue
        text = linecache.getline(name, f.get("line") or 0).strip()[:90]
        out.append(f"{os.path.basename(name)}:{f.get('line')} {f.get('name')}" + (f" [{text}]" if text else ""))
        if len(out) == 2:
            break
    return " < ".join(out)


def explain_peak(step) -> dict:
    """Run ``step`` once with CUDA memory history on; ``peak_blocks`` of its trace."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return peak_blocks(snap["device_traces"][0])


def measure_budget(model, batch, budget: float, *, device: str, autocast: bool, steps: int = 2,
                   warmup: int = 1, explain: bool = False, **options) -> dict:
    """Compile ``model`` with kiln at ``budget`` and measure its training step (see module docstring)."""
    import kiln
    from kiln_bench.livemem import measure_peak
    torch._dynamo.reset()
    compiled = kiln.compile(model, activation_memory_budget=budget, **options)
    ctx = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if autocast else contextlib.nullcontext

    def step():
        model.zero_grad(set_to_none=True)
        with ctx():
            loss = compiled(*batch)
        loss.backward()

    with record_partitions() as parts:
        for _ in range(max(1, warmup)):
            step()
    row = {"budget": budget, **modelled(parts)}
    peaks, requested = [], []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            req0 = torch.cuda.memory_stats().get("requested_bytes.all.current", 0)
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - base)
            requested.append(torch.cuda.memory_stats().get("requested_bytes.all.peak", 0) - req0)
        else:
            peaks.append(measure_peak(step).peak)
    row["measured"] = max(peaks)
    row["measured_steps"] = peaks
    if requested:
        row["requested"] = max(requested)
    if explain and device == "cuda":
        model.zero_grad(set_to_none=True)
        row["peak_blocks"] = explain_peak(step)
    model.zero_grad(set_to_none=True)
    return row


def sweep(size: str = "cpu", budgets=(1.0, 0.5, 0.0), *, device: str = "cpu", autocast: Optional[bool] = None,
          steps: int = 2, warmup: int = 1, overrides: Optional[dict] = None, explain: bool = False,
          **options) -> List[dict]:
    """Rows of ``measure_budget`` for the built-in GPT ``size`` at each budget."""
    from kiln_bench.models import build_gpt
    model, batch = build_gpt(size, device=device, **(overrides or {}))
    autocast = (device == "cuda") if autocast is None else autocast
    return [measure_budget(model, batch, b, device=device, autocast=autocast, steps=steps, warmup=warmup,
                           explain=explain, **options) for b in budgets]


def non_increasing(values, slack: float = 0.0) -> bool:
    """Each value is at most the previous one (times ``1 + slack``)."""
    return all(b <= a * (1 + slack) for a, b in zip(values, values[1:]))


def table(rows) -> str:
    mib = 2 ** 20
    lines = [f"{'budget':>6} {'saved MiB':>10} {'model MiB':>10} {'(fw/bw)':>15} {'measured MiB':>13} "
             f"{'requested MiB':>13} {'GFLOP rec':>9}"]
    for r in rows:
        req = f"{r['requested'] / mib:13.3f}" if "requested" in r else f"{'-':>13}"
        lines.append(f"{r['budget']:6.2f} {r['saved'] / mib:10.3f} {r['modelled'] / mib:10.3f} "
                     f"{r['modelled_fw'] / mib:7.2f}/{r['modelled_bw'] / mib:<7.2f} {r['measured'] / mib:13.3f} "
                     f"{req} {r['recompute_flops'] / 1e9:9.3f}")
    return "\n".join(lines)


def plot(rows, path: str) -> str:
    """The measured and modelled peaks (MiB) and recompute GFLOPs against the budget, as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    b = [r["budget"] for r in rows]
    fig = Figure(figsize=(6, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(b, [r["measured"] / 2 ** 20 for r in rows], "o-", color="tab:blue", label="measured peak")
    if all("requested" in r for r in rows):
        ax.plot(b, [r["requested"] / 2 ** 20 for r in rows], "d--", color="tab:purple", label="requested peak")
    ax.plot(b, [r["modelled"] / 2 ** 20 for r in rows], "^:", color="tab:green", label="modelled peak")
    ax.plot(b, [r["saved"] / 2 ** 20 for r in rows], "x-.", color="tab:gray", label="saved")
    ax.set_xlabel("activation_memory_budget")
    ax.set_ylabel("MiB")
    ax.legend(loc="upper left")
    ax2 = ax.twinx()
    ax2.plot(b, [r["recompute_flops"] / 1e9 for r in rows], "s--", color="tab:red")
    ax2.set_ylabel("recompute GFLOPs", color="tab:red")
    ax.set_title("kiln GPT: peak memory vs activation_memory_budget")
    fig.tight_layout()
    fig.savefig(path)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kiln_bench.peak_sweep", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", default=None, help="GPT_SIZES key (default: gpu on cuda, cpu on cpu)")
    p.add_argument("--budgets", default="1,0.9,0.8,0.7,0.6,0.5,0.4,0.3,0.2,0.1,0")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="bf16 autocast (default on cuda)")
    p.add_argument("--codegen", default=None, help="kiln codegen option ('aten', 'triton')")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--override", action="append", default=[], help="GPTConfig field=int, e.g. n_layer=4")
    p.add_argument("--explain-peak", action="store_true",
                   help="CUDA: list the blocks alive at each budget's peak (memory history of one more step)")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--png", default=None, help="draw the curve here")
    a = p.parse_args(argv)
    size = a.size or ("gpu" if a.device == "cuda" else "cpu")
    budgets = [float(x) for x in a.budgets.split(",")]
    autocast = None if a.dtype is None else a.dtype == "bf16"
    overrides = {k: int(v) for k, v in (o.split("=") for o in a.override)}
    options = {"codegen": a.codegen} if a.codegen else {}
    rows = sweep(size, budgets, device=a.device, autocast=autocast, steps=a.steps, warmup=a.warmup,
                 overrides=overrides, explain=a.explain_peak, **options)
    print(table(rows))
    for r in rows:
        if "peak_blocks" in r:
            pb = r["peak_blocks"]
            print(f"\nbudget {r['budget']}: peak {pb['peak'] / 2 ** 20:.3f} MiB above the start, "
                  f"{pb['n_live']} blocks, reached by {pb['at_where']}")
            for size, where in pb["blocks"]:
                print(f"  {size / 2 ** 20:10.3f} MiB  {where}")
    ok_m = non_increasing([r["measured"] for r in rows])
    ok_p = non_increasing([r["modelled"] for r in rows])
    ok_r = non_increasing([r["requested"] for r in rows]) if all("requested" in r for r in rows) else None
    print(f"measured peak non-increasing: {ok_m}; requested peak non-increasing: {ok_r}; "
          f"modelled peak non-increasing: {ok_p}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": a.device, "size": size, "overrides": overrides, "options": options,
                       "rows": rows, "measured_monotone": ok_m, "requested_monotone": ok_r,
                       "modelled_monotone": ok_p}, f, indent=1)
    if a.png:
        print("wrote", plot(rows, a.png))
    return 0


if __name__ == "__main__":
    sys.exit(main())
