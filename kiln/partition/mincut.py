"""Min-cut rematerialization: choose the forward values to save so the backward can recompute the rest.

Flow network (one pair of vertices per node that does not depend on a tangent):
- ``in_n -> out_n`` with capacity = the cost of saving ``n`` (bytes, x1.1 per step away from the
  backward, x2 when every user fuses with ``n``: saving then forces an extra write); primals cost 0
  (they are alive anyway), views and tuple values are never saved (infinite);
- ``out_n -> in_u`` (infinite) for every user ``u``;
- ``out_n -> sink`` (infinite) when a backward node (one that depends on a tangent) uses ``n``;
- ``source -> in_n`` (infinite) when ``n`` is banned from recomputation (``Policy``).
The minimum cut's ``in->out`` edges are the saved values; nodes past the cut are recomputed in the
backward. The max flow runs on integer capacities with scipy's Dinic (``scipy.sparse.csgraph``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional

import numpy as np
import torch
import torch.fx as fx

from kiln.debug import log
from kiln.partition import ops
from kiln.partition.estimate import size_bytes
from kiln.partition.extract import PartitionError, is_impure, is_sym, is_tangent, split_outputs, tangent_closure

MAX_DIST = 100
_SCALE_TOTAL = 2 ** 29  # finite capacities are scaled to sum to at most this (int32 flows)
_INF_CAP = 2 ** 30


@dataclass(frozen=True)
class Policy:
    """Which nodes must not be recomputed. Random and impure nodes and primals are always banned."""
    ban_heavy: bool = True           # matmul/conv/attention
    allowlist: bool = True           # ban ops outside the cheap-to-recompute list
    ban_materialized: bool = True    # ban nodes whose backward user (through views) does not fuse
    ban_reductions: bool = True      # ban reductions that shrink their input more than 4x
    dont_ban: FrozenSet[fx.Node] = field(default_factory=frozenset)  # lift the optional bans for these

    def replace(self, **kw) -> "Policy":
        return dataclasses.replace(self, **kw)


RUNTIME_OPTIMAL = Policy()
MORE_AGGRESSIVE = Policy(ban_materialized=False)
AGGRESSIVE = Policy(ban_materialized=False, allowlist=False)
RECOMPUTE_ALL = Policy(ban_heavy=False, allowlist=False, ban_materialized=False, ban_reductions=False)


class JointInfo:
    """Facts about a joint graph the cut needs, computed once per partition."""

    def __init__(self, joint_gm: fx.GraphModule, num_fwd_outputs: int):
        self.gm, self.graph = joint_gm, joint_gm.graph
        self.num_fwd_outputs = num_fwd_outputs
        self.nodes = [n for n in self.graph.nodes if n.op != "output"]
        self.tang = tangent_closure(self.graph)
        fwd_out, grads = split_outputs(self.graph, num_fwd_outputs)
        self.grads = {g for g in grads if isinstance(g, fx.Node)}
        self.fw = [n for n in self.nodes if n not in self.tang]  # nodes the forward could compute
        self.primals = [n for n in self.fw if n.op == "placeholder"]
        self.fwd_required = self._ancestors([o for o in fwd_out if isinstance(o, fx.Node)])
        self.size = {n: size_bytes(n) for n in self.fw}
        self.mutated = mutated_primals(self.graph, self.primals)
        self.dist = self._dist_from_bw()

    @staticmethod
    def _ancestors(roots):
        seen, stack = set(), list(roots)
        while stack:
            n = stack.pop()
            if n not in seen:
                seen.add(n)
                stack.extend(n.all_input_nodes)
        return seen

    def used_by_bw(self, n: fx.Node) -> bool:
        """A tangent-dependent node (or the gradient list) uses ``n`` directly."""
        return n in self.grads or any(u in self.tang for u in n.users)

    def _dist_from_bw(self) -> Dict[fx.Node, int]:
        dist = {}
        for n in reversed(self.fw):
            if self.used_by_bw(n):
                dist[n] = 0
            else:
                ds = [dist[u] + 1 for u in n.users if u in dist]
                dist[n] = min(ds + [MAX_DIST])
        return dist

    def materialized_in_bw(self, n: fx.Node) -> bool:
        """Some backward-side user (looking through views) cannot fuse with ``n``, so recomputing ``n``
        there would materialise it anyway."""
        stack, seen = [n], set()
        while stack:
            cur = stack.pop()
            for u in cur.users:
                if u.op == "output" or u in seen or u in self.fwd_required:
                    continue
                seen.add(u)
                if ops.is_view(u) and u not in self.tang:
                    stack.append(u)
                elif not ops.is_fusible(n, u):
                    return True
        return False


def mutated_primals(graph: fx.Graph, primals) -> Optional[set]:
    """Primals whose data AOTAutograd writes back after the forward (None when it cannot tell)."""
    descs = graph.output_node().meta.get("desc")
    idx = None
    if descs is not None:
        idx = {getattr(getattr(d, "mutated_input", None), "idx", None) for d in descs
               if type(d).__name__ == "InputMutationAOTOutput"}
    else:
        from torch._guards import TracingContext
        tc = TracingContext.try_get()
        meta = getattr(tc, "fw_metadata", None) if tc is not None else None
        if meta is None:
            return None
        idx = {i for i, info in enumerate(meta.input_info) if info.mutates_data}
    by_index = {}
    for n in primals:
        d = n.meta.get("desc")
        by_index[getattr(d, "idx", None) if d is not None else len(by_index)] = n
    return {by_index[i] for i in idx if i in by_index}


def ban_reason(info: JointInfo, n: fx.Node, policy: Policy) -> Optional[str]:
    """Why ``n`` must be computed in the forward (None: it may be recomputed in the backward)."""
    if n.op == "placeholder":
        return "input"
    if n.op != "call_function":
        return None if n.op == "get_attr" else "not an op"
    if is_impure(n):
        return "mutates"
    if ops.is_random(n) or (ops.is_getitem(n) and ops.is_random(n.args[0])):
        return "random"
    if ops.is_view(n):
        return None  # never saved: the backward re-views the saved base
    rec = n.meta.get("recompute")
    if rec is not None and "MUST_SAVE" in str(rec):
        return "tagged MUST_SAVE"
    if n in policy.dont_ban or (ops.is_getitem(n) and n.args[0] in policy.dont_ban):
        return None
    heavy = ops.is_heavy(n) or (ops.is_getitem(n) and ops.is_heavy(n.args[0]))
    if heavy:
        return "compute-heavy" if policy.ban_heavy else None
    if policy.allowlist and not ops.is_recomputable(n):
        return "not on the recompute list"
    if policy.ban_reductions and ops.is_big_reduction(n, lambda x: info.size.get(x, size_bytes(x))):
        return "reduction shrinks its input >4x"
    if policy.ban_materialized and info.materialized_in_bw(n):
        return "backward user does not fuse"
    return None


def node_weight(info: JointInfo, n: fx.Node) -> float:
    """Cost of saving ``n`` (inf: never saved)."""
    val = n.meta.get("val")
    if n.op == "placeholder":
        # An input is alive anyway, so saving it is free, unless the runtime mutates it after the
        # forward (the saved value would be stale): then prefer saving what was computed from it.
        if info.mutated is None:
            return float(info.size[n])
        return float(info.size[n]) * 1000.0 if n in info.mutated else 0.0
    if is_sym(n):
        return 1.0
    if not isinstance(val, torch.Tensor) or ops.is_view(n):
        return float("inf")
    w = float(info.size[n]) * 1.1 ** min(info.dist[n], MAX_DIST)
    users = list(n.users)
    if users and all(u.op != "output" and ops.is_fusible(n, u) for u in users):
        w *= 2
    return w


def min_cut(info: JointInfo, policy: Policy) -> List[fx.Node]:
    """The saved values of the minimum cut under ``policy``, in graph order."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import breadth_first_order, maximum_flow

    vid = {n: i for i, n in enumerate(info.fw)}
    nv = 2 + 2 * len(info.fw)
    weights = np.array([node_weight(info, n) for n in info.fw], dtype=np.float64)
    finite = np.isfinite(weights)
    total = float(weights[finite].sum()) or 1.0
    scaled = np.where(finite, np.ceil(weights * (_SCALE_TOTAL / total)), _INF_CAP)
    scaled = np.where(weights > 0, np.maximum(scaled, 1), 0).astype(np.int64)

    edges: Dict[tuple, int] = {}
    for i, n in enumerate(info.fw):
        a, b = 2 + 2 * i, 3 + 2 * i
        if scaled[i] > 0:
            edges[(a, b)] = int(scaled[i])
        if ban_reason(info, n, policy) is not None:
            edges[(0, a)] = _INF_CAP
        rec = n.meta.get("recompute")
        if rec is not None and "MUST_RECOMPUTE" in str(rec) and n.op == "call_function":
            edges[(a, 1)] = _INF_CAP
        if info.used_by_bw(n):
            edges[(b, 1)] = _INF_CAP
        for u in n.users:
            j = vid.get(u)
            if j is not None:
                edges[(b, 2 + 2 * j)] = _INF_CAP
    keys = np.array(list(edges.keys()), dtype=np.int64).reshape(-1, 2)
    caps = np.array(list(edges.values()), dtype=np.int32)
    cap = csr_matrix((caps, (keys[:, 0], keys[:, 1])), shape=(nv, nv))
    res = maximum_flow(cap, 0, 1, method="dinic")
    if res.flow_value >= _INF_CAP:
        bad = [n.name for n in info.fw if info.used_by_bw(n) and node_weight(info, n) == float("inf")
               and ban_reason(info, n, policy)]
        raise PartitionError(f"partition: no finite cut; the backward needs values that can be neither "
                             f"saved nor recomputed: {bad[:5]}")
    resid = (cap - res.flow).tocsr()
    resid.data[resid.data < 0] = 0
    resid.eliminate_zeros()
    reach = np.zeros(nv, dtype=bool)
    reach[breadth_first_order(resid, 0, directed=True, return_predecessors=False)] = True
    return [n for i, n in enumerate(info.fw) if reach[2 + 2 * i] and not reach[3 + 2 * i]]


def activation_bytes(info: JointInfo, saved) -> int:
    """Bytes of the saved tensors that are not graph inputs."""
    return sum(info.size.get(n, 0) for n in saved if n.op != "placeholder")


def log_decisions(info: JointInfo, saved, policy: Policy, tag: str) -> None:
    """KILN_DEBUG=3: what is saved (bytes, why) and what the backward recomputes, with source lines."""
    from kiln.debug import level
    if level() < 3:
        return
    saved_set = set(saved)
    for n in saved:
        log(3, f"remat[{tag}]: save {n.name} ({info.size.get(n, 0)} B, {ban_reason(info, n, policy) or 'cheapest cut'})"
               f"{_source(n)}")
    for n in info.fw:
        if n not in saved_set and n.op == "call_function" and _recomputed(info, n, saved_set):
            log(3, f"remat[{tag}]: recompute {n.name} ({info.size.get(n, 0)} B){_source(n)}")


def _recomputed(info, n, saved_set) -> bool:
    stack, seen = [n], set()
    while stack:
        cur = stack.pop()
        for u in cur.users:
            if u in info.tang or u in info.grads:
                return True
            if u not in seen and u not in saved_set and u in info.size:
                seen.add(u)
                stack.append(u)
    return False


def _source(n: fx.Node) -> str:
    st = n.meta.get("stack_trace")
    if not st:
        return ""
    lines = [s.strip() for s in st.strip().splitlines() if s.strip()]
    return f" at {lines[-2] if len(lines) > 1 else lines[-1]}"


def mincut_saved(joint_gm: fx.GraphModule, *, num_fwd_outputs: int, opts) -> List[fx.Node]:
    """Saved values for ``opts``: the runtime-optimal cut, or the budget/limit search in budget.py."""
    info = JointInfo(joint_gm, num_fwd_outputs)
    budget = _graph_budget(info, opts.activation_memory_budget)
    if budget < 1.0 or opts.activation_memory_limit is not None:
        from kiln.partition.budget import budget_saved
        return budget_saved(info, budget, opts)
    saved = min_cut(info, RUNTIME_OPTIMAL)
    saved = _no_worse_than_default(info, saved)
    log_decisions(info, saved, RUNTIME_OPTIMAL, "budget=1")
    return saved


def _graph_budget(info: JointInfo, budget: float) -> float:
    """A float ``meta['memory_budget']`` on any node overrides the option (first one wins)."""
    for n in info.nodes:
        b = n.meta.get("memory_budget")
        if isinstance(b, float):
            return b
    return float(budget)


def _no_worse_than_default(info: JointInfo, saved):
    """Budget 1 never saves more activation bytes than the plain (eager-like) partition."""
    from kiln.partition.default import default_saved
    plain = default_saved(info.graph, info.num_fwd_outputs)
    if activation_bytes(info, saved) > activation_bytes(info, plain):
        log(3, "remat: min-cut saves more than the plain partition; keeping the plain one")
        return plain
    return saved
