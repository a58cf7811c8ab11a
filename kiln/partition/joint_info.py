"""Facts about a joint graph the min-cut needs, as flat arrays indexed by node number (graph order), computed
once so that a budget search can cut the same graph many times cheaply.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import torch
import torch.fx as fx

from kiln.options import Tuning
from kiln.partition import ops
from kiln.partition.estimate import size_bytes
from kiln.partition.extract import _inputs, is_impure, is_sym, is_symint, is_tangent, split_outputs

MAX_DIST = 100


def mutated_primals(graph: fx.Graph, primals) -> Optional[set]:
    """Primals whose data changes during the call, in the graph or written back by AOTAutograd (None when it
    cannot tell): a backward that read one would see the new value."""
    in_graph = ops.written_placeholders(graph) & set(primals)
    descs = graph.output_node().meta.get("desc")
    if descs is not None:
        idx = {getattr(getattr(d, "mutated_input", None), "idx", None) for d in descs
               if type(d).__name__ == "InputMutationAOTOutput"}
    else:
        from torch._guards import TracingContext
        tc = TracingContext.try_get()
        meta = getattr(tc, "fw_metadata", None) if tc is not None else None
        if meta is None:
            return in_graph or None
        idx = {i for i, info in enumerate(meta.input_info) if info.mutates_data}
    by_index = {}
    for n in primals:
        d = n.meta.get("desc")
        by_index[getattr(d, "idx", None) if d is not None else len(by_index)] = n
    return in_graph | {by_index[i] for i in idx if i in by_index}


class GraphIndex:
    """Nodes numbered in graph order with input/user lists and the tangent closure (plain lists)."""

    def __init__(self, joint_gm: fx.GraphModule, num_fwd_outputs: int):
        self.gm, self.graph, self.num_fwd_outputs = joint_gm, joint_gm.graph, num_fwd_outputs
        self.nodes: List[fx.Node] = [n for n in self.graph.nodes if n.op != "output"]
        self.index: Dict[fx.Node, int] = {n: i for i, n in enumerate(self.nodes)}
        N, idx = len(self.nodes), self.index
        self.inputs_of = [[idx[a] for a in _inputs(n)] for n in self.nodes]
        self.users_of = [[idx[u] for u in n.users if u.op != "output"] for n in self.nodes]
        tang = [False] * N  # plain lists in the per-node loops: numpy scalar access is slow
        for i, n in enumerate(self.nodes):
            tang[i] = (n.op == "placeholder" and is_tangent(n)) or any(tang[a] for a in self.inputs_of[i])
        self.tang_l = tang
        self.tang = {n for n, t in zip(self.nodes, tang) if t}
        self.fwd_out, grads = split_outputs(self.graph, num_fwd_outputs)
        self.grads = {g for g in grads if isinstance(g, fx.Node)}

    def ancestors_l(self, roots) -> list:
        seen = [False] * len(self.nodes)
        stack = list(roots)
        while stack:
            i = stack.pop()
            if not seen[i]:
                seen[i] = True
                stack.extend(self.inputs_of[i])
        return seen


# -- the plain partition: run the forward as eager would, save the forward values the backward uses -----
def forward_ids(gi) -> list:
    """Per node: whether the plain partition runs it in the forward (tangent-free, up to the last node the
    outputs need or tagged ``is_forward`` or mutating; SymInt arithmetic on forward values)."""
    nodes, tang, idx = gi.nodes, gi.tang_l, gi.index
    roots = [idx[o] for o in gi.fwd_out if isinstance(o, fx.Node)]
    roots += [i for i, n in enumerate(nodes) if not tang[i] and n.op != "placeholder"
              and (n.meta.get("partitioner_tag") == "is_forward" or is_impure(n))]
    need = gi.ancestors_l(roots)
    last = max((i for i, x in enumerate(need) if x), default=-1)
    fwd = [not tang[i] and (i <= last or n.op == "placeholder") for i, n in enumerate(nodes)]
    for i, n in enumerate(nodes):  # cheap size arithmetic on forward values stays in the forward
        if not fwd[i] and not tang[i] and n.op == "call_function" and is_symint(n) \
                and all(fwd[a] for a in gi.inputs_of[i]):
            fwd[i] = True
    return fwd


def default_saved(joint_gm: fx.GraphModule, num_fwd_outputs: int, gi=None) -> List[fx.Node]:
    """Forward nodes used by a backward node or returned as a gradient, in graph order."""
    gi = gi or GraphIndex(joint_gm, num_fwd_outputs)
    fwd = forward_ids(gi)
    return [n for i, n in enumerate(gi.nodes) if fwd[i]
            and (n in gi.grads or any(not fwd[u] for u in gi.users_of[i]))]


class JointInfo(GraphIndex):
    """Arrays over the joint graph's nodes; see the module docstring."""

    def __init__(self, joint_gm: fx.GraphModule, num_fwd_outputs: int, max_reads: int = Tuning.remat_max_reads):
        super().__init__(joint_gm, num_fwd_outputs)
        N, idx, tang, fwd_out = len(self.nodes), self.index, self.tang_l, self.fwd_out
        self.is_tang = np.array(tang, dtype=bool)
        self.is_call = np.array([n.op == "call_function" for n in self.nodes], dtype=bool)
        fw_ids = [i for i in range(N) if not tang[i]]
        self.fw: List[fx.Node] = [self.nodes[i] for i in fw_ids]
        self.fw_ids = np.array(fw_ids, dtype=np.int64)
        self.primals = [n for n in self.fw if n.op == "placeholder"]
        self.fwd_required = np.array(self.ancestors_l([idx[o] for o in fwd_out if isinstance(o, fx.Node)]), dtype=bool)
        self.size = {n: size_bytes(n) for n in self.fw}
        used = [False] * N
        for i in fw_ids:
            used[i] = self.nodes[i] in self.grads or any(tang[u] for u in self.users_of[i])
        self.used_by_bw = np.array(used, dtype=bool)
        self.dist = self._dist_from_bw(fw_ids, used, tang)
        self.mutated = mutated_primals(self.graph, self.primals)
        self._classify()
        self.wide = self._wide(max_reads)
        self.weight = self._weights()

    def user_edges(self):
        """(producer, user) node-number arrays, one entry per distinct pair."""
        if not hasattr(self, "_edges"):
            import itertools
            n = len(self.users_of)
            counts = np.fromiter((len(u) for u in self.users_of), dtype=np.int64, count=n)
            src = np.repeat(np.arange(n, dtype=np.int64), counts)
            dst = np.fromiter(itertools.chain.from_iterable(self.users_of), dtype=np.int64, count=int(counts.sum()))
            key = np.unique(src * max(n, 1) + dst)
            self._edges = (key // max(n, 1), key % max(n, 1))
        return self._edges

    def _dist_from_bw(self, fw_ids, used, tang) -> np.ndarray:
        dist = [MAX_DIST] * len(self.nodes)
        for i in reversed(fw_ids):
            dist[i] = 0 if used[i] else min([dist[u] + 1 for u in self.users_of[i] if not tang[u]] + [MAX_DIST])
        return np.array(dist, dtype=np.int64)

    def _classify(self):
        """Per-node op facts: always-banned reasons and the flags the policies combine."""
        facts = []
        for i, n in enumerate(self.nodes):
            parent = None
            if n.op == "call_function" and ops.is_getitem(n) and isinstance(n.args[0], fx.Node):
                parent = facts[self.index[n.args[0]]]
            facts.append(ops.node_facts(n, parent))
        f = np.array(facts, dtype=bool).reshape(-1, 7)
        self.view, random_, self.heavy, self.cheap, self.fusible_op, self.is_cat, reduction = f.T
        self.static_reason: Dict[int, str] = {}
        N = len(self.nodes)
        must_rec, big_red, mat = [False] * N, [False] * N, [False] * N
        rnd_l, red_l = random_.tolist(), reduction.tolist()
        # what the forward returns is written anyway: recomputing it saves memory the caller holds anyway
        returned = {self.index[o] for o in self.fwd_out if isinstance(o, fx.Node) and o in self.index}
        self._fus, self._cat, self._view_l = self.fusible_op.tolist(), self.is_cat.tolist(), self.view.tolist()
        self._tang_l, self._req_l = self.is_tang.tolist(), self.fwd_required.tolist()
        for i in self.fw_ids.tolist():
            n = self.nodes[i]
            reason = self._static_reason(n, rnd_l[i], self._view_l[i])
            if reason:
                self.static_reason[i] = reason
                continue
            if n.op != "call_function" or self._view_l[i]:
                continue
            must_rec[i] = "MUST_RECOMPUTE" in str(n.meta.get("recompute"))
            if red_l[i]:
                big_red[i] = ops.is_big_reduction(n, lambda x: self.size.get(x) or size_bytes(x))
            # a number (size arithmetic) is never a buffer: a SymFloat that cannot be saved is recomputed
            mat[i] = ((i in returned or self._materialized(i)) and not ops.constant_object(n)
                      and not is_sym(n))
        self.must_recompute, self.big_reduction, self.materialized = (np.array(x, dtype=bool)
                                                                       for x in (must_rec, big_red, mat))

    def _wide(self, max_reads: int) -> np.ndarray:
        """Nodes whose recompute would read more than ``max_reads`` tensors (saved or banned) of at least half
        their size: MLP-Mixer's residual stream, where saving each block's matmul outputs instead of the sums
        had the backward add them all up again per block (one kernel read 30 tensors)."""
        leaf = self.heavy | ~self.cheap | self.big_reduction | self.materialized
        leaf[list(self.static_reason)] = True
        wide, reads = np.zeros(len(self.nodes), dtype=bool), {}
        for i in self.fw_ids.tolist():
            n = self.nodes[i]
            if leaf[i] and not self._view_l[i] or n.op != "call_function":
                reads[i] = frozenset((i,))
                continue
            r = frozenset().union(*(reads.get(a, ()) for a in self.inputs_of[i]))
            big = sum(2 * self.size.get(self.nodes[j], 0) >= self.size[n] for j in r)
            wide[i] = big > max_reads and self.size[n] > 0 and not self._view_l[i] and not self.must_recompute[i]
            reads[i] = frozenset((i,)) if wide[i] else r
        return wide

    @staticmethod
    def _static_reason(n: fx.Node, random_: bool, view: bool) -> Optional[str]:
        if n.op in ("placeholder", "get_attr"):
            return "input" if n.op == "placeholder" else None
        why = "not an op" if n.op != "call_function" else "mutates" if is_impure(n) else "random" if random_ else None
        if why or view:
            return why
        return "tagged MUST_SAVE" if "MUST_SAVE" in str(n.meta.get("recompute")) else None

    def fusible(self, i: int, j: int) -> bool:
        return self._cat[j] or (self._fus[i] and self._fus[j])

    def _materialized(self, i: int) -> bool:
        """Some backward-side user (looking through views) cannot fuse with node ``i``."""
        if self._tang_l[i]:
            return False
        stack, seen = [i], set()
        while stack:
            cur = stack.pop()
            for u in self.users_of[cur]:
                if u in seen or self._req_l[u]:
                    continue
                seen.add(u)
                if self._view_l[u] and not self._tang_l[u]:
                    stack.append(u)
                elif not self.fusible(i, u):
                    return True
        return False

    def _weights(self) -> np.ndarray:
        """Cost of saving each ``fw`` node: bytes x1.1^dist_from_bw, x2 when all users fuse with it; inputs 0
        (mutated: more than all else), SymInts 1, views and non-tensors inf."""
        k = len(self.fw)
        size = np.zeros(k)
        kind = np.zeros(k, dtype=np.int8)  # 0 tensor, 1 placeholder, 2 sym, 3 never
        fuse_all = np.zeros(k, dtype=bool)
        view, fus, cat = self._view_l, self._fus, self._cat
        for j, (n, i) in enumerate(zip(self.fw, self.fw_ids.tolist())):
            size[j] = self.size[n]
            if n.op == "placeholder":
                kind[j] = 1
            elif not isinstance(n.meta.get("val"), torch.Tensor):
                kind[j] = 2 if is_symint(n) else 3   # a SymFloat is recomputed from the SymInts it needs
            elif view[i]:
                kind[j] = 3
            else:
                us = self.users_of[i]
                if us and len(us) == len(n.users):
                    fuse_all[j] = all(cat[u] or fus[u] for u in us) if fus[i] else all(cat[u] for u in us)
        w = size * np.power(1.1, np.minimum(self.dist[self.fw_ids], MAX_DIST)) * np.where(fuse_all, 2.0, 1.0)
        if self.mutated is None:
            inputs = size
        else:
            mutated = np.array([n in self.mutated for n in self.fw], dtype=bool)
            rest = float(w[np.isfinite(w) & (kind != 1)].sum())  # a cut that avoids them always costs less
            inputs = np.where(mutated, np.maximum(size * 1000.0, rest + 1.0), 0.0)
        return np.select([kind == 1, kind == 2, kind == 3], [inputs, 1.0, np.inf], w)
