"""A peak-memory model of forward + backward for a saved set (limit.py and budget.py search with it): the
joint graph replayed, the backward as extract() lays it out; a tensor lives from its node to its last use
in the phase (saved values: in the backward), views share their base's storage, inputs are not counted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Sequence

import torch.fx as fx

from kiln.partition import ops
from kiln.partition.estimate import node_flops, size_bytes
from kiln.partition.extract import (_ancestors, _inputs, hold_steps, is_impure, lazy_order, normalize_saved,
                                    split_outputs, tangent_closure)


@dataclass
class Peak:
    forward: int     # peak live bytes during the forward
    backward: int    # peak live bytes during the backward (saved values included)
    saved: int       # bytes of saved non-input tensors
    recompute_flops: float  # FLOPs of forward ops the backward runs again

    @property
    def peak(self) -> int:
        return max(self.forward, self.backward)


_ROOTS: Dict[fx.Node, fx.Node] = {}   # memo of _root, emptied when each model_peak call ends


def _root(n: fx.Node) -> fx.Node:
    """The node owning ``n``'s storage (through views)."""
    hit = _ROOTS.get(n)
    if hit is not None:
        return hit
    m, seen = n, 0
    while ops.is_view(m) and m.args and isinstance(m.args[0], fx.Node) and seen < 1000:
        m, seen = m.args[0], seen + 1
    _ROOTS[n] = m
    return m


def saved_bytes(saved: Sequence[fx.Node]) -> int:
    """Bytes of the distinct storages ``saved`` keeps, graph inputs excluded (``Peak.saved``)."""
    return sum(size_bytes(r) for r in {_root(s) for s in saved if s.op != "placeholder"})


def _replay(steps, alive_at_start: dict, keep: set) -> int:
    """Peak live bytes running ``steps`` (as ``extract.hold_steps`` gives them; a node may run twice); a view
    shares its base's storage; ``keep`` keys never die within the phase."""
    root: dict = {}

    def rt(k):
        return root.get(k, k)

    for key, n, ins in steps:
        a0 = n.args[0] if n.args else None
        if ops.is_view(n) and isinstance(a0, fx.Node) and a0 in ins:
            root[key] = rt(ins[a0])
    last: dict = {}
    for i, (_, _, ins) in enumerate(steps):
        for k in ins.values():
            last[rt(k)] = i   # positions increase: the latest use wins
    live = dict(alive_at_start)
    cur = peak = sum(live.values())
    dying: Dict[int, list] = {}
    for r, i in last.items():
        if r not in keep:
            dying.setdefault(i, []).append(r)
    for i, (key, n, _) in enumerate(steps):
        if n.op != "placeholder" and rt(key) == key and key not in live:
            b = size_bytes(n) if not isinstance(n.meta.get("val"), (tuple, list)) else 0
            live[key] = b
            cur += b
            peak = max(peak, cur)
            if key not in last and key not in keep:  # never used: freed at once
                cur -= live.pop(key)
        for r in dying.get(i, ()):
            cur -= live.pop(r, 0)
    return peak


def _in_order(order: Sequence[fx.Node]) -> list:
    """``order`` as ``_replay``'s steps, each node its own key."""
    return [(n, n, {a: a for a in _inputs(n)}) for n in order]


def _model_hold(graph, saved, hold, grads, tang, fwd: int) -> Peak:
    """``model_peak`` when the backward rebuilds ``hold`` (``extract.hold_steps``)."""
    nodes = [n for n in graph.nodes if n.op != "output"]
    roots = [g for g in grads if isinstance(g, fx.Node)] + [n for n in nodes if n in tang and is_impure(n)]
    steps = hold_steps(nodes, saved, hold, roots, tang)
    start = {(a, 0): size_bytes(a) for a in saved if a.op != "placeholder" and _root(a) is a}
    start.update({(t, 0): size_bytes(t) for t in nodes if t.op == "placeholder" and t in tang})
    last = {n: k for k, n, _ in steps}
    keep = {last.get(_root(g), (_root(g), 0)) for g in grads if isinstance(g, fx.Node)}
    read = {k for _, _, ins in steps for k in ins.values()}   # a saved value no step reads dies at the start
    bwd = max(sum(start.values()), _replay(steps, {k: b for k, b in start.items() if k in read or k in keep}, keep))
    flops = sum(node_flops(n) for _, n, _ in steps if n not in tang)
    return Peak(fwd, bwd, saved_bytes(saved), flops)


def model_peak(joint_gm: fx.GraphModule, saved: Sequence[fx.Node], num_fwd_outputs: int, info=None) -> Peak:
    """Modelled activation peak of forward + backward when ``saved`` (a list or an ``extract.Saved``) is saved."""
    try:
        return _model_peak(joint_gm, saved, num_fwd_outputs, info)
    finally:
        _ROOTS.clear()


def _model_peak(joint_gm, saved, num_fwd_outputs, info) -> Peak:
    graph = joint_gm.graph
    tang = info.tang if info is not None else tangent_closure(graph)
    fwd_out, grads = split_outputs(graph, num_fwd_outputs)
    hold = getattr(saved, "hold", None)
    saved = normalize_saved(saved)
    saved_roots = {_root(s) for s in saved if s.op != "placeholder"}
    ph = {n for n in graph.nodes if n.op == "placeholder"}
    stop = set(saved) | ph   # what the backward has without recomputing
    fw_need = needed([o for o in fwd_out if isinstance(o, fx.Node)] + list(saved), ph)
    fw_order = [n for n in graph.nodes if n in fw_need and n not in tang and n.op != "output"]
    fw_keep = saved_roots | {_root(o) for o in fwd_out if isinstance(o, fx.Node)}
    fwd = _replay(_in_order(fw_order), {}, fw_keep)
    if hold is not None:
        return _model_hold(graph, saved, hold, grads, tang, fwd)
    bw_need = needed([g for g in grads if isinstance(g, fx.Node)], stop)
    bw_order = lazy_order([n for n in graph.nodes if n.op != "output"], bw_need, tang, stop)
    start = {r: size_bytes(r) for r in saved_roots}
    start.update({t: size_bytes(t) for t in graph.nodes if t.op == "placeholder" and t in tang})
    bwd = _replay(_in_order(bw_order), start, {_root(g) for g in grads if isinstance(g, fx.Node)})
    flops = sum(node_flops(n) for n in bw_order if n not in tang)
    return Peak(fwd, bwd, sum(size_bytes(r) for r in saved_roots), flops)


def needed(roots, stop) -> set:
    """The nodes ``roots`` need, transitively, not walking past ``stop`` nodes (but through the roots)."""
    return _ancestors(roots, set(stop) - set(roots))
