"""The saved set for the options (``choose_saved``), and ``activation_memory_limit``: the largest budget, from
``activation_memory_budget`` down, whose modelled activation peak (peak.py) fits a byte limit.
"""
from __future__ import annotations

from typing import List

import torch.fx as fx

from kiln.debug import log
from kiln.options import parse_bytes, UserError
from kiln.partition.budget import plan_for_budget
from kiln.partition.joint_info import JointInfo, default_saved
from kiln.partition.peak import model_peak
from kiln.passes.cse import gc_paused


class MemoryLimitError(RuntimeError, UserError):
    """``activation_memory_limit`` is below the modelled peak even when the backward recomputes every
    op it can (budget 0). Raise the limit, shrink the batch, or shard the model."""


def limit_saved(info, budget: float, opts) -> List[fx.Node]:
    """The largest budget (at most ``budget``) whose modelled peak fits ``activation_memory_limit``."""
    limit = parse_bytes(opts.activation_memory_limit)

    def peak_at(b):
        saved = plan_for_budget(info, b, opts)
        p = model_peak(info.gm, saved, info.num_fwd_outputs, info)
        log(3, f"remat: limit {limit} B: budget {b:.4f} -> modelled peak {p.peak} B", artifact="kiln_remat")
        return saved, p.peak

    saved, peak = peak_at(budget)
    if peak <= limit:
        return saved
    # The peak is not monotone in the budget (recomputing a whole chain at once can cost more than
    # saving part of it), so scan a grid downwards, then bisect above the best grid point.
    best_b, best, lowest = None, None, peak
    for b in (budget * (1 - i / 20) for i in range(1, 21)):
        s_b, p_b = peak_at(b)
        lowest = min(lowest, p_b)
        if p_b <= limit:
            best_b, best = b, s_b
            break
    if best is None:
        raise MemoryLimitError(f"partition: activation_memory_limit={opts.activation_memory_limit!r} "
                               f"({limit} B) is unreachable: the lowest modelled peak over budgets "
                               f"[0, {budget}] is {lowest} B; raise the limit or shrink the batch")
    lo, hi = best_b, min(budget, best_b + budget / 20)
    for _ in range(5):
        mid = (lo + hi) / 2
        s_m, p_m = peak_at(mid)
        if p_m <= limit:
            lo, best = mid, s_m
        else:
            hi = mid
    return best


@gc_paused()
def choose_saved(joint_gm: fx.GraphModule, *, num_fwd_outputs: int, opts) -> list:
    """``partitioner='default'``: what the backward uses; ``'mincut'``: the cut under the budget (a float
    ``meta['memory_budget']`` on a node overrides it), or under ``activation_memory_limit``."""
    if opts.partitioner == "default":
        return default_saved(joint_gm, num_fwd_outputs)
    info = JointInfo(joint_gm, num_fwd_outputs, opts.tuning.remat_max_reads)
    budget = next((b for n in info.nodes if isinstance(b := n.meta.get("memory_budget"), float)),
                  float(opts.activation_memory_budget))
    return (plan_for_budget if opts.activation_memory_limit is None else limit_saved)(info, budget, opts)
