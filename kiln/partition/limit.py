"""``activation_memory_limit``: the largest budget whose modelled activation peak fits a byte limit.

The peak is modelled (peak.py) for the saved set that ``hold.plan_for_budget`` picks at each budget
tried; the search starts at ``activation_memory_budget`` and only lowers it.
"""
from __future__ import annotations

from typing import List

import torch.fx as fx

from kiln.debug import log
from kiln.options import parse_bytes, UserError
from kiln.partition.hold import plan_for_budget
from kiln.partition.peak import model_peak


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
    grid = [budget * (1 - i / 20) for i in range(1, 21)]
    best_b, best, lowest = None, None, peak
    for b in grid:
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
