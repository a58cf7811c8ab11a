"""Keep the activation peak from rising as ``activation_memory_budget`` falls (issue #5).

Why the peak rose. Below budget 1 the backward recomputes what was not saved, each value just before
its first use (``extract.lazy_order``), and keeps it until its last use. In a layered model the first
backward op (the loss) needs the last layer's output, which, when the residual stream is not saved,
needs every earlier layer recomputed first: the whole forward runs again at the start of the backward
and every value some later backward op reads stays alive until that op. The backward then holds about
what the plain partition saves, more than the runtime-optimal cut saves at budget 1. Measured on the
built-in GPT ('cpu' size, ATen codegen, ``kiln.partition.livemem``) the peak went 11.27 MiB at budget
1.0 -> 9.25 MiB at 0.1 -> 12.30 MiB at 0.0, and ``peak.model_peak`` predicted the same numbers, so
the cause is the partition's backward schedule, not the code generator's ordering.

The fix: rebuild a smaller hold set in the backward. The forward still saves exactly the budget's
set ``S_b`` (saved bytes keep PyTorch's budget semantics). The backward may instead start by rerunning
the forward from ``S_b`` to rebuild a hold set ``H`` (phase 1, whose other values die with the phase),
then run as the backward of a partition that saved ``H`` and ``S_b`` (phase 2: recompute from them
lazily, ``extract.hold_steps``). The candidates for ``H`` are the saved sets the same joint graph gets
at the higher budgets of the ladder 0.1, 0.2, ..., 1.0; the plan keeps the candidate (or no hold) with
the lowest modelled peak, ties going to fewer recompute FLOPs, so a hold is used only when the model
says it lowers the peak. Phase 2 with ``H = S_b'`` is the backward of budget ``b'`` (when ``S_b`` is
inside ``S_b'``, as at budget 0), so a searched plan's modelled peak at ``b`` is at most that of ``b'``
unless phase 1 (``S_b`` plus the rerun forward, bounded by the forward of ``b'``) is higher. The price
is recompute: values phase 2 needs that ``H`` does not hold run twice (a forward's worth of extra
FLOPs at most, counted in ``Peak.recompute_flops``).

Phase 2 reads ``S_b`` as well as ``H`` because ``extract`` saves only what the backward reads: when
phase 2 read ``H`` alone, a hold from a higher budget whose knapsack had kept other matmuls made the
forward drop saved values (seed 001's uneven chain written as one sum over its matmuls saved 3 units
at budget 19/50 and 8 at budget 8/50).

The search (a min-cut per rung) runs only when the plain plan's modelled peak is not below budget 1's,
the pathology above; a plan below it is kept as is, which keeps the common case cheap on big graphs
(budget 1's cut is cached, and its saved bytes bound its peak from below, so the check usually costs
no peak model). Between two budgets below 1 the curve is therefore not non-increasing by
construction (nor can it be with exact saved bytes: budget.py); tests/partition/test_monotone.py
measures it on the built-in GPT.

``plan_for_budget(info, b, opts)`` is what the partitioner saves at budget ``b``: ``saved_for_budget``'s
set and, below budget 1, the hold set this search picks (an ``extract.Saved``).
"""
from __future__ import annotations

from typing import List

import torch.fx as fx

from kiln.debug import log
from kiln.partition.budget import saved_for_budget
from kiln.partition.extract import Saved, normalize_saved
from kiln.partition.peak import model_peak, saved_bytes

LADDER = tuple(round(i / 10, 1) for i in range(10, 0, -1))  # 1.0, 0.9, ..., 0.1


def plan_for_budget(info, budget: float, opts) -> List[fx.Node]:
    """``budget.saved_for_budget``, plus the backward hold set that keeps the peak down (a ``Saved``)."""
    saved = ladder_saved(info, budget, opts)
    if budget >= 1.0:
        return saved
    return plan_with_hold(info, saved, budget, opts)


def ladder_saved(info, budget: float, opts) -> list:
    """``budget.saved_for_budget`` cached on ``info`` (the hold candidates are shared by budgets)."""
    cache = info.__dict__.setdefault("_ladder_saved", {})
    if budget not in cache:
        cache[budget] = list(saved_for_budget(info, budget, opts))
    return cache[budget]


def plan_with_hold(info, saved: List[fx.Node], budget: float, opts) -> Saved:
    """``saved`` with the hold set (or none) of lowest modelled peak; see the module docstring."""
    n = info.num_fwd_outputs
    plain = Saved.of(saved)
    p = model_peak(info.gm, plain, n, info)
    best, best_key = plain, (p.peak, p.recompute_flops)
    top = ladder_saved(info, LADDER[0], opts)   # budget 1's cut (cached)
    # below budget 1's peak: no search. Budget 1's saved bytes bound its peak from below (all of them
    # are alive when the forward ends), so the peak model of budget 1 is needed only above that bound.
    if p.peak < saved_bytes(normalize_saved(top)) or p.peak < model_peak(info.gm, Saved.of(top), n, info).peak:
        return plain
    for b in LADDER:
        if b <= budget:
            break
        hold = [h for h in normalize_saved(ladder_saved(info, b, opts)) if h.op != "placeholder"]
        cand = Saved.of(saved, hold=hold)
        q = model_peak(info.gm, cand, n, info)
        log(3, f"remat: budget {budget}: hold the budget-{b} set -> modelled peak {q.peak} B "
               f"(no hold {p.peak} B)", artifact="kiln_remat")
        if (q.peak, q.recompute_flops) < best_key:
            best, best_key = cand, (q.peak, q.recompute_flops)
    if best.hold is not None:
        log(3, f"remat: budget {budget}: the backward rebuilds {len(best.hold)} values first "
               f"(modelled peak {p.peak} -> {best_key[0]} B)", artifact="kiln_remat")
    return best
