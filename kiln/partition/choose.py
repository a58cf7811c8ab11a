"""Which forward values to save for the backward, according to ``opts.partitioner``.

- ``'default'``: the plain partition (default.py): every forward value the backward uses;
- ``'mincut'``: the min-cut under ``activation_memory_budget`` (hold.py: budget.py's cut plus the
  backward's hold set), or, when ``activation_memory_limit`` is set, the largest budget whose modelled
  peak fits the limit (limit.py). A float ``meta['memory_budget']`` on a node overrides the budget.

Only the saved set is chosen here; extract.py builds the graphs from it.
"""
from __future__ import annotations

import contextlib
import gc
from typing import List

import torch.fx as fx

from kiln.partition.default import default_saved
from kiln.partition.hold import plan_for_budget
from kiln.partition.joint_info import JointInfo
from kiln.partition.limit import limit_saved


@contextlib.contextmanager
def gc_paused():
    """Cyclic GC passes over a big fx graph dominate per-node loops; pause it while partitioning."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def choose_saved(joint_gm: fx.GraphModule, *, num_fwd_outputs: int, opts) -> list:
    """The forward values to save, according to ``opts.partitioner`` (no graphs are built)."""
    with gc_paused():
        if opts.partitioner == "default":
            return default_saved(joint_gm, num_fwd_outputs)
        return mincut_saved(joint_gm, num_fwd_outputs=num_fwd_outputs, opts=opts)


def mincut_saved(joint_gm: fx.GraphModule, *, num_fwd_outputs: int, opts) -> List[fx.Node]:
    """Saved values for ``opts``: the cut for the budget, or the budget search for the limit."""
    info = JointInfo(joint_gm, num_fwd_outputs)
    budget = graph_budget(info, opts.activation_memory_budget)
    if opts.activation_memory_limit is not None:
        return limit_saved(info, budget, opts)
    return plan_for_budget(info, budget, opts)


def graph_budget(info: JointInfo, budget: float) -> float:
    """A float ``meta['memory_budget']`` on any node overrides the option (first one wins)."""
    for n in info.nodes:
        b = n.meta.get("memory_budget")
        if isinstance(b, float):
            return b
    return float(budget)
