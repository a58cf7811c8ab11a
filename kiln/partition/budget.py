"""``activation_memory_budget``: trade recomputation for saved bytes (PyTorch's semantics).

- 1: the runtime-optimal cut (``mincut.RUNTIME_OPTIMAL``, or the plain partition when that saves fewer
  bytes); its activation bytes are ``max``.
- 0: save only inputs (and what can never be recomputed: random and mutating ops).
- b in between: accept the first of the "more aggressive" and "aggressive" cuts whose activation bytes
  are at most ``b * max`` (activation bytes = saved tensors that are not graph inputs, so ``min`` = 0).
  Otherwise solve a 0/1 knapsack over the compute-heavy ops the aggressive cut saves: keep the set with
  the largest estimated runtime whose bytes fit in ``b * max``, let the others be recomputed, and cut
  again. The knapsack is solved exactly (a dynamic program up to ``opts.tuning.knapsack_dp_cells``,
  else scipy.optimize.milp / HiGHS on integer weights, checked).

hold.py adds the backward's hold set to these saved sets; limit.py searches budgets for
``activation_memory_limit``.

What is monotone in the budget. The knapsack is exact and its ties go to more bytes, so the set kept
at a larger capacity is worth at least as much, and when it is worth more it weighs more (a lighter
one would have fitted the smaller capacity too): kept bytes never fall as the budget rises, and the
saved bytes follow them when recomputing a matmul needs no value the backward does not read anyway
(seed 001's chains; a linear layer's input). A backward hold (hold.py) adds to the saved set, never
replaces it. tests/partition/test_budget_property.py checks this on random chains in random node
orders. The modelled activation peak is not monotone, and cannot be while the budget fixes which
matmuls are saved: on seed 001's own uneven chain the only plan saving 8 of 50 units models a higher
forward peak than the best plan saving 19 (``test_seed_budgets_rule_out_a_monotone_peak``). Forcing
it (a budget whose plan models more than the next larger budget's takes a plan of a lower budget)
would save less than the knapsack's optimum, which the seed's exact sums forbid.
"""
from __future__ import annotations

import math
from functools import reduce
from typing import Dict, List, Sequence

import numpy as np
import torch.fx as fx

from kiln.debug import counters, log, wanted
from kiln.options import current, UserError
from kiln.partition import ops
from kiln.partition.decisions import log_decisions
from kiln.partition.default import default_saved
from kiln.partition.estimate import runtime_estimator
from kiln.partition.joint_info import JointInfo
from kiln.partition.mincut import AGGRESSIVE, MORE_AGGRESSIVE, RECOMPUTE_ALL, RUNTIME_OPTIMAL, activation_bytes, min_cut

_TOL = 1e-9


class BudgetError(ValueError, UserError):
    """The knapsack solver failed (scipy missing or HiGHS reported an error); install scipy>=1.9 or use
    activation_memory_budget=1.0."""


def saved_for_budget(info: JointInfo, budget: float, opts, optimal=None) -> List[fx.Node]:
    """The saved values of the first cut whose activation bytes fit ``budget`` (see the module docstring);
    ``optimal``: budget 1's cut when the caller has it (default: ``runtime_optimal_saved``)."""
    optimal = optimal if optimal is not None else runtime_optimal_saved(info)
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
    groups = heavy_groups(info, cut)
    fixed = activation_bytes(info, cut) - sum(b for _, b in groups.values())
    estimate = runtime_estimator(opts.activation_memory_budget_runtime_estimator)
    owners = list(groups)
    sizes = [groups[o][1] for o in owners]
    values = [estimate(o) for o in owners]
    keep = knapsack(sizes, values, max(0.0, cap - fixed), opts)
    dont_ban = frozenset(o for i, o in enumerate(owners) if i not in keep)
    for i, o in enumerate(owners if wanted(3, "kiln_remat") else ()):
        log(3, f"remat: knapsack {'keeps' if i in keep else 'recomputes'} {o.name} "
               f"({sizes[i]} B, runtime {values[i]:.3g})", artifact="kiln_remat")
    policy = AGGRESSIVE.replace(dont_ban=dont_ban)
    saved = min_cut(info, policy)
    log_decisions(info, saved, policy, f"budget={budget}")
    return saved


def runtime_optimal_saved(info: JointInfo) -> List[fx.Node]:
    """Budget 1's cut (``RUNTIME_OPTIMAL``), or the plain (eager-like) partition when the cut would save
    more activation bytes than it."""
    saved = min_cut(info, RUNTIME_OPTIMAL)
    plain = default_saved(info.gm, info.num_fwd_outputs, gi=info)
    if activation_bytes(info, saved) > activation_bytes(info, plain):
        log(3, "remat: min-cut saves more than the plain partition; keeping the plain one", artifact="kiln_remat")
        return plain
    return saved


def heavy_groups(info: JointInfo, saved: Sequence[fx.Node]) -> Dict[fx.Node, tuple]:
    """Compute-heavy ops whose outputs ``saved`` holds: op -> (saved outputs, their bytes)."""
    groups: Dict[fx.Node, list] = {}
    for n in saved:
        owner = n.args[0] if ops.is_getitem(n) else n
        if isinstance(owner, fx.Node) and ops.is_heavy(owner) and n.op != "placeholder":
            groups.setdefault(owner, []).append(n)
    return {o: (ns, sum(info.size.get(n, 0) for n in ns)) for o, ns in groups.items()}


def knapsack(sizes: Sequence[int], values: Sequence[float], capacity: float, opts=None) -> set:
    """Indices of the items to keep: maximum total value with total size <= capacity, solved exactly.

    Ties in value prefer keeping more bytes (less recomputation). Sizes are divided by their gcd so the
    solver works on small integers: a dynamic program when items x capacity units are at most
    ``opts.tuning.knapsack_dp_cells`` (``opts`` None: ``kiln.options.current()``), else HiGHS MILP (gap 0)
    whose answer is checked in exact integer arithmetic. ``kiln.debug.counters["partition"]`` counts
    ``knapsack_dp`` and ``knapsack_milp`` solves."""
    n = len(sizes)
    if n == 0:
        return set()
    sizes = [int(s) for s in sizes]
    g = reduce(math.gcd, [s for s in sizes if s > 0], 0) or 1
    w = np.array([s // g for s in sizes], dtype=np.float64)
    limit = int(math.floor(capacity / g + 1e-6))
    if limit < 0:
        return set()
    v = np.array(values, dtype=np.float64)
    v = v / (v.max() if v.max() > 0 else 1.0) + 1e-7 * w / max(w.max(), 1.0)
    free = {i for i in range(n) if sizes[i] == 0}
    members, bw, bv = _bundle([i for i in range(n) if sizes[i] > 0], w, v)
    dp_cells = (opts if opts is not None else current()).tuning.knapsack_dp_cells
    solve = _dp if len(bw) * (limit + 1) <= dp_cells else _checked_milp
    counters["partition"]["knapsack_dp" if solve is _dp else "knapsack_milp"] += 1
    keep = solve(bw.astype(np.int64), bv, limit)
    chosen = {i for b in keep for i in members[b]}
    assert sum(sizes[i] for i in chosen) <= limit * g
    return chosen | free


def _bundle(items, w, v):
    """Identical items (same size and value) merged into bundles of 1, 2, 4, ... (binary splitting keeps
    the 0/1 knapsack exact and turns thousands of equal layers into a dozen items)."""
    groups = {}
    for i in items:
        groups.setdefault((w[i], v[i]), []).append(i)
    members, bw, bv = [], [], []
    for (wi, vi), idx in groups.items():
        k, start = 1, 0
        while start < len(idx):
            take = min(k, len(idx) - start)
            members.append(idx[start:start + take])
            bw.append(wi * take)
            bv.append(vi * take)
            start += take
            k *= 2
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
