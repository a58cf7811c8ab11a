"""Static peak memory of compiled graphs, before and after fusion, on a machine without a GPU.

    python -m kiln_bench.graph_peak gpt2 --budgets 1,0.5,0.1

``graph_peak(gm)`` walks a GraphModule in order with the sizes in ``meta['val']``: placeholders are
alive from the start every value that owns memory is alive from the node that makes it to its last
use (graph outputs to the end), views and pieces of ``split`` share their base's memory, and each
element of a multi-output kernel is its own allocation. The result is the largest sum of live bytes
inside the graph (its inputs included until their last use, when the wrapper drops them), which is
what the wrapper holds at that point; memory held outside the graph (parameters' gradients, the
other graph's saved values) is not in it.

The CLI compiles a bench case with ``kiln_bench.offline`` (kiln's GPU pipeline on fake tensors) at each
budget and prints, per forward/backward graph, the peak of the graph the partitioner produced
("unfused", the stage the partitioner's model describes) and of the fused graph the wrapper runs.
This is how the far-fusion rule of ``codegen.schedule`` was checked: a fused graph whose peak is well
above its unfused graph's holds values longer than the partition planned.
"""
from __future__ import annotations

import argparse
import contextlib
import operator
import sys
from dataclasses import dataclass, field
from typing import Dict, List

import torch
import torch.fx as fx

from kiln import debug

from kiln_bench._internal import ops

MiB = 2 ** 20


@dataclass
class GraphPeak:
    peak: int                   # bytes
    at: str                     # the node where the peak is reached
    top: List[tuple] = field(default_factory=list)   # (bytes, node name) alive at the peak, largest first


def _bytes(v) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    return 0


def _owner(n: fx.Node) -> fx.Node:
    """The node whose allocation ``n``'s memory is (through views and split pieces)."""
    while n.op == "call_function" and n.args and isinstance(n.args[0], fx.Node):
        if n.target is operator.getitem:
            parent = n.args[0]
            if parent.op == "call_function" and ops.is_view(parent) and isinstance(parent.args[0], fx.Node):
                n = parent.args[0]
                continue
            return n
        if not ops.is_view(n):
            return n
        n = n.args[0]
    return n


def graph_peak(gm: fx.GraphModule, top: int = 10) -> GraphPeak:
    """The static peak of ``gm`` (see the module docstring)."""
    nodes = list(gm.graph.nodes)
    last: Dict[fx.Node, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            o = _owner(a)
            last[o] = i if n.op != "output" else len(nodes)
    live: Dict[fx.Node, int] = {}
    cur = best = 0
    at, snapshot = "", []
    dying: Dict[int, list] = {}
    for o, i in last.items():
        dying.setdefault(i, []).append(o)
    for i, n in enumerate(nodes):
        if n.op in ("placeholder", "call_function", "call_module", "get_attr") and _owner(n) is n:
            v = n.meta.get("val")
            b = 0 if isinstance(v, (tuple, list)) else _bytes(v)
            if n.target is operator.getitem and n.args[0].op == "placeholder":
                b = 0
            live[n] = b
            cur += b
            if n not in last and n.op != "placeholder":
                cur -= live.pop(n)
            elif cur > best:
                best, at = cur, n.name
                snapshot = sorted(((b, k.name) for k, b in live.items() if b), reverse=True)[:top]
        for o in dying.get(i, ()):
            cur -= live.pop(o, 0)
    return GraphPeak(best, at, snapshot)


@contextlib.contextmanager
def record():
    """Collect ``(graph name, 'unfused'|'fused', GraphPeak)`` for every graph kiln lowers meanwhile:
    'unfused' is the graph after the post-grad passes (the partitioner's graph, cleaned up), 'fused' the
    last stage's graph of the same forward/backward/inference graph (the one the wrapper runs)."""
    rows, last = [], {}

    def seen(event, data):
        if event != "graph":
            return
        trace, stage, gm = data["trace"], data["stage"], data["gm"]
        for kind in ("forward", "backward", "inference"):
            if stage.endswith("_" + kind):
                name = f"{kind}_{trace.id}"
                if stage == f"post_grad_{kind}":
                    rows.append((name, "unfused", graph_peak(gm)))
                last[name] = gm

    with debug.observe(seen):
        yield rows
    rows += [(name, "fused", graph_peak(gm)) for name, gm in last.items()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kiln_bench.graph_peak", description=__doc__.splitlines()[0])
    p.add_argument("case")
    p.add_argument("--budgets", default="1.0", help="comma list of activation_memory_budget values")
    p.add_argument("--top", action="store_true", help="also list the largest values alive at each peak")
    p.add_argument("--set", action="append", default=[], metavar="OPTION=VALUE", help="a kiln option, as offline's")
    a = p.parse_args(argv)
    from kiln_bench import offline
    print(f"{'budget':>6} {'graph':14} {'unfused MiB':>12} {'fused MiB':>10}  fused peak at")
    for b in a.budgets.split(","):
        with record() as rows, contextlib.redirect_stdout(sys.stderr):
            offline.main([a.case, "--budget", b] + [x for kv in a.set for x in ("--set", kv)])
        fused = {name: gp for name, stage, gp in rows if stage == "fused"}
        for name, stage, gp in rows:
            if stage != "unfused":
                continue
            f = fused.get(name)
            print(f"{float(b):6.2f} {name:14} {gp.peak / MiB:12.1f} {f.peak / MiB if f else float('nan'):10.1f}"
                  f"  {f.at if f else ''}")
            if a.top and f:
                for nbytes, n in f.top:
                    print(f"{'':24}{nbytes / MiB:10.1f}  {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
