"""The report behind ``kiln.explain_memory``: each saved value of the cut (module or parameter name, bytes, reason,
the user's source line), each forward op the backward recomputes, the modelled peak, and on request a sweep of
budgets, drawn as a PNG. Saved bytes are distinct storages, graph inputs excluded (as saved_tensors_hooks see).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch.fx as fx

from kiln.partition import ops
from kiln.partition.limit import choose_saved
from kiln.partition.joint_info import JointInfo
from kiln.partition.mincut import RUNTIME_OPTIMAL, Policy, ban_reason, module_path, source_line
from kiln.partition.peak import model_peak, needed


@dataclass
class Row:
    name: str      # the joint graph's node
    op: str
    bytes: int
    why: str
    source: str    # ``file:line: code`` of the user's frame ('' for inputs)
    module: str = ""   # ``layers.0.attn`` (the module that made it), or a parameter's or input's name


def _mib(b: int) -> str:
    return f"{b / 2 ** 20:.4f} MiB"


@dataclass
class MemoryReport:
    saved: List[Row]
    recomputed: List[Row]
    activation_bytes: int   # distinct storages saved for the backward, graph inputs excluded
    peak_bytes: int
    recompute_flops: float
    sweep: List[Tuple[float, int, float]] = field(default_factory=list)  # (budget, peak B, FLOPs)
    png: Optional[str] = None

    def __str__(self) -> str:
        lines = [f"saved for backward: {_mib(self.activation_bytes)} of activations; modelled peak "
                 f"{_mib(self.peak_bytes)}; recompute {self.recompute_flops:.3g} FLOPs"]
        for title, rows in (("saved", self.saved), ("recomputed", self.recomputed)):
            lines.append(f"{title} ({len(rows)}):")
            lines += [f"  {r.module or '-':28s} {r.name:16s} {r.op:28s} {_mib(r.bytes):>13s}  {r.why:28s} "
                      f"{r.source}".rstrip() for r in rows]
        if self.sweep:
            lines.append("budget -> modelled peak, recompute FLOPs:")
            lines += [f"  {b:4.2f} -> {_mib(p):>13s}, {f:.3g}" for b, p, f in self.sweep]
        return "\n".join(lines)


def report(gm: fx.GraphModule, saved: Sequence[fx.Node], n: int, opts, budgets: Optional[Sequence[float]] = None,
           png: Optional[str] = None, inputs: Sequence[str] = ()) -> MemoryReport:
    """The report of joint graph ``gm`` (``n`` forward outputs) cut at ``saved`` (see ``explain_memory``);
    ``inputs``: the user's name of each flat input (a placeholder's ``desc.idx``)."""
    info = JointInfo(gm, n, opts.tuning.remat_max_reads)
    peak = model_peak(gm, saved, n, info)
    policy = RUNTIME_OPTIMAL if opts.activation_memory_budget >= 1 else Policy(ban_materialized=False)

    def row(x, why):
        idx = getattr(x.meta.get("desc"), "idx", None) if x.op == "placeholder" else None
        name = inputs[idx] if isinstance(idx, int) and idx < len(inputs) else module_path(x)
        return Row(x.name, str(x.target), info.size.get(x, 0), why, source_line(x), name)

    rows = [row(s, ban_reason(info, s, policy) or "cheapest cut") for s in saved]
    rec_rows = [row(r, "") for r in _recomputed(gm, saved, info)]
    out = MemoryReport(rows, rec_rows, peak.saved, peak.peak, peak.recompute_flops)
    if png and budgets is None:
        budgets = [round(1 - i / 10, 2) for i in range(11)]
    for b in budgets or ():
        s = choose_saved(gm, num_fwd_outputs=n, opts=opts.replace(activation_memory_budget=b,
                                                                   activation_memory_limit=None))
        p = model_peak(gm, s, n, info)
        out.sweep.append((b, p.peak, p.recompute_flops))
    if png:
        out.png = plot_sweep(out.sweep, png)
    return out


def _recomputed(gm, saved, info) -> List[fx.Node]:
    """Forward-computable call nodes the backward runs (not saved, needed by a gradient)."""
    stop = set(saved) | {x for x in gm.graph.nodes if x.op == "placeholder"}
    need = needed([g for g in info.grads], stop)
    return [x for x in info.fw if x in need and x not in stop and x.op == "call_function"
            and not ops.is_view(x)]


def plot_sweep(sweep, path: str) -> str:
    """Write budget -> (peak MiB, recompute GFLOPs) as a PNG; returns the path."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError("explain_memory(png=...) draws with matplotlib: pip install 'kiln[bench]'",
                                  name=e.name) from e
    b = [s[0] for s in sweep]
    fig = Figure(figsize=(6, 4))
    FigureCanvasAgg(fig)  # Agg canvas, without touching the global pyplot backend
    ax = fig.add_subplot()
    ax.plot(b, [s[1] / 2 ** 20 for s in sweep], "o-", color="tab:blue")
    ax.set_xlabel("activation_memory_budget")
    ax.set_ylabel("modelled peak (MiB)", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(b, [s[2] / 1e9 for s in sweep], "s--", color="tab:red")
    ax2.set_ylabel("recompute GFLOPs", color="tab:red")
    ax.set_title("kiln: memory vs recomputation")
    fig.tight_layout()
    fig.savefig(path)
    return path
