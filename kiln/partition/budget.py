"""``activation_memory_budget``: trade recomputation for saved bytes (PyTorch's semantics).

- 1: the runtime-optimal cut (or the plain partition when that saves fewer bytes), saving ``max`` bytes of
  activations; 0: save only inputs (and what can never be recomputed: random and mutating ops).
- b in between: the first of the "more aggressive" and "aggressive" cuts saving at most ``b * max``; else
  an exact 0/1 knapsack (ties to more bytes: monotone in b) keeps the heavy ops of largest runtime whose
  gated bytes fit (``heavy_groups``: a matmul gates its softmax), and the cut recomputes the others.

The hold set (issues #5, #37): below budget 1 a layered model reran its whole forward at the start of the
backward, and the peak rose as the budget fell. The forward still saves the budget's set, but the backward
may first rebuild from it the saved set of a higher budget of the ``LADDER``, then run that budget's backward
(``extract.hold_steps``). The knapsack's sets are not nested (GPT's budget 0.4 saved matmuls that 0.5
recomputes, alive until their late use: 7.5 -> 9.0 MB), so without the hold a lower budget could model a
higher peak. The hold (or none) of lowest modelled peak wins (tests/partition/test_monotone.py).
"""
from __future__ import annotations

import dataclasses
import math
from functools import reduce
from typing import Dict, List, Sequence

import numpy as np
import torch.fx as fx

from kiln.debug import counters, log, wanted
from kiln.options import current, UserError
from kiln.partition import ops
from kiln.partition.estimate import runtime_estimator
from kiln.partition.extract import Saved, normalize_saved
from kiln.partition.joint_info import JointInfo, default_saved
from kiln.partition.mincut import (AGGRESSIVE, MORE_AGGRESSIVE, RECOMPUTE_ALL, RUNTIME_OPTIMAL, activation_bytes,
                                   ban_mask, log_decisions, min_cut)
from kiln.partition.peak import model_peak, saved_bytes

_TOL = 1e-9
_GAIN = 0.01   # a hold set is modelled only if it might lower the peak by more than this fraction


class BudgetError(ValueError, UserError):
    """The knapsack solver failed (scipy missing, HiGHS failed): install scipy>=1.9 or use a budget of 1.0."""


def saved_for_budget(info: JointInfo, budget: float, opts) -> List[fx.Node]:
    """The saved values of the first cut whose activation bytes fit ``budget`` (see the module docstring)."""
    optimal = runtime_optimal_saved(info)
    max_b = activation_bytes(info, optimal)
    if budget >= 1.0 or max_b == 0:
        log_decisions(info, optimal, RUNTIME_OPTIMAL, "budget=1")
        return optimal
    cap = budget * max_b * (1 + _TOL)
    if budget <= 0.0:
        saved = min_cut(info, RECOMPUTE_ALL)
        log_decisions(info, saved, RECOMPUTE_ALL, "budget=0")
        return saved
    cut = optimal
    for name, policy in (("more aggressive", MORE_AGGRESSIVE), ("aggressive", AGGRESSIVE)):
        cut = min_cut(info, policy)
        got = activation_bytes(info, cut)
        log(3, f"remat: budget {budget}: {name} cut saves {got} of {max_b} B", artifact="kiln_remat")
        if got <= cap:
            log_decisions(info, cut, policy, f"budget={budget}")
            return cut
    return knapsack_cut(info, cut, cap, budget, opts)


def knapsack_cut(info: JointInfo, cut, cap: float, budget: float, opts) -> List[fx.Node]:
    """Keep the heavy ops (``heavy_groups(cut)``) of largest runtime whose bytes fit ``cap`` beside the bytes no
    heavy op gates, cut again letting the others be recomputed. The bytes are a model (a value may need two
    recomputed ops): while the cut saves more than ``cap``, solve again with the excess off the room."""
    groups = heavy_groups(info, cut)
    owners = [o for o, (_, gross, extra) in groups.items() if gross > extra]   # recomputing them frees bytes
    estimate = runtime_estimator(opts.activation_memory_budget_runtime_estimator)
    sizes = [groups[o][1] - groups[o][2] for o in owners]   # the bytes keeping each costs
    values, room = [estimate(o) for o in owners], cap - activation_bytes(info, cut) + sum(sizes)
    for _ in range(4):
        keep = knapsack(sizes, values, max(0.0, room), opts)
        policy = dataclasses.replace(AGGRESSIVE, dont_ban=frozenset(o for i, o in enumerate(owners) if i not in keep))
        over = activation_bytes(info, saved := min_cut(info, policy)) - cap
        for i, o in enumerate(owners if wanted(3, "kiln_remat") else ()):
            log(3, f"remat: knapsack {'keeps' if i in keep else 'recomputes'} {o.name} "
                   f"({sizes[i]} B, runtime {values[i]:.3g})", artifact="kiln_remat")
        if over <= 0 or room <= 0:
            break
        log(3, f"remat: budget {budget}: the cut saves {over:.0f} B too many; again", artifact="kiln_remat")
        room -= over
    log_decisions(info, saved, policy, f"budget={budget}")
    return saved


def runtime_optimal_saved(info: JointInfo) -> List[fx.Node]:
    """Budget 1's cut (``RUNTIME_OPTIMAL``), or the plain partition when that saves fewer activation bytes."""
    if "_optimal" in info.__dict__:   # cached: each rung of the ladder starts here
        return info._optimal
    saved = min_cut(info, RUNTIME_OPTIMAL)
    plain = default_saved(info.gm, info.num_fwd_outputs, gi=info)
    if activation_bytes(info, saved) > activation_bytes(info, plain):
        log(3, "remat: min-cut saves more than the plain partition; keeping the plain one", artifact="kiln_remat")
        saved = plain
    info._optimal = saved
    return saved


def heavy_groups(info: JointInfo, saved: Sequence[fx.Node]) -> Dict[fx.Node, tuple]:
    """Heavy ops and the values of ``saved`` each gates: op -> (values, their bytes, bytes of the banned values
    ``saved`` lacks that recomputing them reads: a softmax's row max). A value is gated by the heavy op it is
    (or a getitem of), else by the nearest one it is computed from through ops the aggressive policy may
    recompute, which the cut can then drop (a linear's relu, a matmul's softmax, a residual sum). Seeing only
    heavy ops' own outputs, the knapsack took the rest as fixed and, over the budget with it alone, recomputed
    every matmul it saw (a TransformerEncoderLayer's QKV projection at budgets 0.5 and 0.2, saving 10 of 14 MiB)."""
    banned, in_cut, groups = ban_mask(info, AGGRESSIVE), {info.index[n] for n in saved}, {}
    for n in saved:
        owner, reads = _gate(info, info.index[n], banned, in_cut) if n.op != "placeholder" else (None, ())
        if owner is not None:
            groups.setdefault(owner, ([], set()))[0].append(n)
            groups[owner][1].update(reads)
    return {o: (ns, sum(info.size.get(n, 0) for n in ns), sum(info.size.get(info.nodes[j], 0) for j in extra))
            for o, (ns, extra) in groups.items()}


def _gate(info: JointInfo, i: int, banned, in_cut) -> tuple:
    """(the heavy op gating node ``i`` or None, the banned values outside ``in_cut`` that recomputing ``i``
    reads), breadth first through the recomputable inputs of ``i`` that ``in_cut`` lacks."""
    todo, seen, owner, reads = [i], {i}, None, []
    for j in todo:
        if info.heavy[j] and j not in info.static_reason:   # (a heavy op that must be saved gates nothing)
            owner = owner or (info.nodes[j].args[0] if ops.is_getitem(info.nodes[j]) else info.nodes[j])
        elif not banned[j] and (j == i or j not in in_cut):
            todo += [a for a in info.inputs_of[j] if a not in seen and not seen.add(a)]
        elif banned[j] and j not in in_cut and info.nodes[j].op != "placeholder":
            reads.append(j)
    return owner, reads


def knapsack(sizes: Sequence[int], values: Sequence[float], capacity: float, opts=None) -> set:
    """Indices to keep: maximum value with size <= capacity, exactly (ties keep more bytes), sizes over their
    gcd: dynamic programming up to ``tuning.knapsack_dp_cells``, else HiGHS checked (``counters``)."""
    sizes = [int(s) for s in sizes]
    g = reduce(math.gcd, [s for s in sizes if s > 0], 0) or 1
    w = np.array([s // g for s in sizes], dtype=np.float64)
    limit = int(math.floor(capacity / g + 1e-6))
    if not sizes or limit < 0:
        return set()
    v = np.array(values, dtype=np.float64)
    v = v / (v.max() if v.max() > 0 else 1.0) + 1e-7 * w / max(w.max(), 1.0)
    free = {i for i, s in enumerate(sizes) if s == 0}
    members, bw, bv = _bundle([i for i, s in enumerate(sizes) if s > 0], w, v)
    dp_cells = (opts if opts is not None else current()).tuning.knapsack_dp_cells
    solve = _dp if len(bw) * (limit + 1) <= dp_cells else _checked_milp
    counters["partition"]["knapsack_dp" if solve is _dp else "knapsack_milp"] += 1
    keep = solve(bw.astype(np.int64), bv, limit)
    chosen = {i for b in keep for i in members[b]}
    assert sum(sizes[i] for i in chosen) <= limit * g
    return chosen | free


def _bundle(items, w, v):
    """Identical items merged into bundles of 1, 2, 4, ... (exact for a 0/1 knapsack; equal layers -> a dozen
    items)."""
    groups = {}
    for i in items:
        groups.setdefault((w[i], v[i]), []).append(i)
    members, bw, bv = [], [], []
    for (wi, vi), idx in groups.items():
        k, start = 1, 0
        while start < len(idx):   # the last bundle takes what is left
            members.append(idx[start:start + k])
            bw.append(wi * len(members[-1]))
            bv.append(vi * len(members[-1]))
            start, k = start + k, 2 * k
    return members, np.array(bw, dtype=np.float64), np.array(bv, dtype=np.float64)


def _checked_milp(w, v, limit) -> set:
    """HiGHS, then verified in integers: its feasibility tolerance may overshoot, so tighten and retry."""
    cap = limit
    for _ in range(4):
        keep = _milp(w.astype(np.float64), v, cap)
        used = int(sum(w[i] for i in keep))
        if used <= limit:
            return keep
        cap -= max(1, used - limit)
    return _dp(w, v, max(cap, 0))


def _milp(w, v, limit) -> set:
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
    except ImportError as e:  # pragma: no cover
        raise BudgetError("partition: activation_memory_budget needs scipy.optimize.milp") from e
    res = milp(-v, constraints=LinearConstraint(w[None, :], -np.inf, limit), integrality=np.ones_like(w),
               bounds=Bounds(0, 1), options={"mip_rel_gap": 0.0, "presolve": True})
    if res.x is None:  # pragma: no cover
        raise BudgetError(f"partition: knapsack solver failed: {res.message}")
    return {i for i, x in enumerate(res.x) if x > 0.5}


def _dp(w, v, limit) -> set:
    """Exact 0/1 knapsack by dynamic programming over integer sizes (fallback, O(n * limit))."""
    best = np.zeros(limit + 1)
    take = np.zeros((len(w), limit + 1), dtype=bool)
    for i in range(len(w)):
        if w[i] > limit:
            continue
        cand = np.concatenate([np.full(w[i], -np.inf), best[: limit + 1 - w[i]] + v[i]])
        take[i] = cand > best
        best = np.maximum(best, cand)
    keep, c = set(), int(np.argmax(best))
    for i in reversed(range(len(w))):
        if take[i, c]:
            keep.add(i)
            c -= w[i]
    return keep


# -- the backward's hold set -----------------------------------------------------------------------------
LADDER = tuple(round(i / 10, 1) for i in range(10, 0, -1))  # 1.0, 0.9, ..., 0.1


def plan_for_budget(info, budget: float, opts) -> List[fx.Node]:
    """``budget.saved_for_budget``, plus the backward hold set that keeps the peak down (a ``Saved``)."""
    saved = ladder_saved(info, budget, opts)
    return saved if budget >= 1.0 else plan_with_hold(info, saved, budget, opts)


def ladder_saved(info, budget: float, opts) -> list:
    """``budget.saved_for_budget`` cached on ``info`` (the hold candidates are shared by budgets)."""
    cache = info.__dict__.setdefault("_ladder_saved", {})
    if budget not in cache:
        cache[budget] = list(saved_for_budget(info, budget, opts))
    return cache[budget]


def plan_with_hold(info, saved: List[fx.Node], budget: float, opts) -> Saved:
    """``saved`` with the hold set (or none) of lowest modelled peak, then FLOPs, searched below budget 1's peak
    too (a CNN's rose 4.5 -> 6.3 MB from 0.4 to 0.2). All of a hold is alive once rebuilt: the forward's peak
    and its bytes (growing with the rung) bound the peak, so the rungs are tried upwards until that bound is
    within ``_GAIN`` of the best; the best is tried again holding ``saved`` too (nothing saved is recomputed)."""
    n, tried, best = info.num_fwd_outputs, set(), [None, (math.inf,)]

    def consider(hold):
        plan = Saved.of(saved, hold=hold)
        q = model_peak(info.gm, plan, n, info)
        if (q.peak, q.recompute_flops) < best[1]:
            best[:] = plan, (q.peak, q.recompute_flops)
        return q

    p = consider(None)
    for b in (r for r in reversed(LADDER) if r > budget):
        rung = [h for h in normalize_saved(ladder_saved(info, b, opts)) if h.op != "placeholder"]
        if max(p.forward, saved_bytes(rung)) >= best[1][0] * (1 - _GAIN):
            break
        if frozenset(rung) not in tried:   # rungs often share a cut
            tried.add(frozenset(rung))
            q = consider(rung)
            log(3, f"remat: budget {budget}: hold the budget-{b} set -> modelled peak {q.peak} B "
                   f"(no hold {p.peak} B)", artifact="kiln_remat")
    if best[0].hold is not None:
        consider(normalize_saved(best[0].hold + [s for s in saved if s.op != "placeholder"]))
        log(3, f"remat: budget {budget}: the backward rebuilds {len(best[0].hold)} values first "
               f"(modelled peak {p.peak} -> {best[1][0]} B)", artifact="kiln_remat")
    return best[0]
