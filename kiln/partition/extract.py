"""Cut a joint graph into forward and backward GraphModules, given the values to save.

The joint graph (from AOTAutograd) has placeholders ``primals_*`` (plus ``fwd_seed``/``fwd_base_offset``)
then ``tangents_*`` (plus ``bwd_seed``/``bwd_base_offset``), and returns one flat list: the
``num_fwd_outputs`` forward values, then one gradient (or None) per primal.

The result follows AOTAutograd's partition_fn contract:
- forward: placeholders = the forward inputs in order; outputs = forward outputs, saved tensors, then
  saved SymInts last (AOT counts the trailing symbolic outputs through ``meta['val']``);
- backward: placeholders = saved SymInts, saved tensors, tangents (then backward seeds), each with
  ``meta['val']``; outputs = the gradients. Every free symbol in the shapes of the backward inputs is
  bound by a SymInt placeholder.

Everything the backward needs that is not saved is recomputed in the backward from the saved values.
"""
from __future__ import annotations

import operator
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_symbols

FWD_EXTRA = ("fwd_seed", "fwd_base_offset")
BWD_EXTRA = ("bwd_seed", "bwd_base_offset")


class PartitionError(RuntimeError):
    """The joint graph cannot be cut as asked: a value the forward or backward needs is neither
    computable from that graph's inputs nor saved. This is a partitioner bug or a joint graph that
    breaks AOTAutograd's layout; run with KILN_DEBUG=2 to print the joint graph and report it."""


# ----------------------------------------------------------------------------- joint graph layout
def is_tangent(node: fx.Node) -> bool:
    """A backward-only input: ``tangents_*`` or a backward RNG seed/offset."""
    if node.op != "placeholder":
        return False
    desc = node.meta.get("desc")
    if desc is not None and "Tangent" in type(desc).__name__:
        return True
    return node.name.startswith("tangents") or node.name in BWD_EXTRA


def split_inputs(graph: fx.Graph) -> Tuple[List[fx.Node], List[fx.Node]]:
    """(forward inputs, backward-only inputs) in placeholder order."""
    ph = [n for n in graph.nodes if n.op == "placeholder"]
    return [n for n in ph if not is_tangent(n)], [n for n in ph if is_tangent(n)]


def split_outputs(graph: fx.Graph, num_fwd_outputs: int) -> Tuple[list, list]:
    """(forward outputs, gradient outputs) of the joint graph; entries may be None."""
    outs = graph.output_node().args[0]
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    return outs[:num_fwd_outputs], outs[num_fwd_outputs:]


def is_sym(node: fx.Node) -> bool:
    """The node holds a SymInt/SymFloat/SymBool (or plain number), not a tensor."""
    val = node.meta.get("val")
    return isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def is_symint(node: fx.Node) -> bool:
    """The node holds a SymInt or an int: the only numbers a forward may save for its backward (compiled
    autograd takes SymInts alone; a saved SymFloat, ``var``'s Bessel factor N / (N - 1) under dynamic
    shapes, failed with 'an integer is required')."""
    val = node.meta.get("val")
    return isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool)


def tangent_closure(graph: fx.Graph) -> set:
    """Every node that depends (transitively) on a tangent: these can only run in the backward."""
    out = set()
    for n in graph.nodes:
        if n.op == "output":
            continue
        if is_tangent(n) or any(a in out for a in _inputs(n)):
            out.add(n)
    return out


_IMPURE: dict = {}


def is_impure(node: fx.Node) -> bool:
    """Mutating or side-effecting (never removed as dead); random ops are not impure here."""
    if node.op in ("placeholder", "output"):
        return True
    cacheable = node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
    if cacheable:
        hit = _IMPURE.get(id(node.target))
        if hit is not None and hit[0] is node.target:
            return hit[1]
    try:
        impure = node.is_impure(impure_random=False)
    except TypeError:  # torch without the impure_random flag
        impure = node.is_impure()
    if cacheable:
        _IMPURE[id(node.target)] = (node.target, impure)
    return impure


def dce(graph: fx.Graph) -> int:
    """Remove nodes nobody uses (in place, keeping placeholders and impure nodes); returns the count."""
    removed = 0
    for n in reversed(list(graph.nodes)):
        if not n.users and not is_impure(n):
            graph.erase_node(n)
            removed += 1
    return removed


# ----------------------------------------------------------------------------- building subgraphs
def _ancestors(outputs: Iterable, stop: set) -> set:
    seen, stack = set(), [o for o in outputs if isinstance(o, fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n not in stop:
            stack.extend(_inputs(n))
    return seen


def _inputs(n: fx.Node):
    d = getattr(n, "_input_nodes", None)  # all_input_nodes copies this dict's keys, slowly
    return d.keys() if isinstance(d, dict) else n.all_input_nodes


def lazy_order(nodes: Sequence[fx.Node], need: set, anchors: set, available: set) -> List[fx.Node]:
    """``need`` in the order the backward should run it: the ``anchors`` (tangent-dependent nodes) in
    graph order, each preceded by the recomputation it needs that has not run yet (depth-first), so a
    recomputed value is made just before its first use rather than all at the start (as the autograd
    engine would). Nodes left over (not feeding any anchor) follow in graph order."""
    done, out = set(available), []

    def emit(root):
        stack = [(root, False)]
        while stack:
            cur, ready = stack.pop()
            if cur in done:
                continue
            if ready:
                done.add(cur)
                out.append(cur)
                continue
            stack.append((cur, True))
            stack.extend((a, False) for a in reversed(list(_inputs(cur))) if a not in done and a in need)

    for n in nodes:
        if n in need and n in anchors:
            emit(n)
    for n in nodes:
        if n in need:
            emit(n)
    return out


class Saved(list):
    """The values to save (a plain list) and, optionally, ``hold``: forward values the backward rebuilds
    from the saved ones at its start and keeps beside them, recomputing everything else it needs from
    both (``hold_steps``). A hold never replaces a saved value: the forward saves the same list with or
    without one. Built by ``kiln.partition.hold``; ``extract`` and ``peak.model_peak`` read it."""
    hold: Optional[List[fx.Node]] = None

    @staticmethod
    def of(saved, hold=None) -> "Saved":
        out = Saved(saved)
        out.hold = list(hold) if hold is not None else None
        return out


def hold_steps(nodes: Sequence[fx.Node], saved: Sequence[fx.Node], hold: Sequence[fx.Node],
               roots: Sequence[fx.Node], anchors: set) -> list:
    """The backward's steps when it rebuilds ``hold``: ``[(key, node, {input node: input key})]``.

    Phase 1 runs, in graph order, the forward nodes that compute ``hold`` from ``saved`` and the
    placeholders (keys ``(n, 1)``); phase 2 runs what ``roots`` need in ``lazy_order`` around
    ``anchors`` from ``hold``, ``saved`` and the placeholders (keys ``(n, 2)``), so a forward value used
    by both phases is computed twice and phase 1's copy dies with the phase. Values available at the
    start have keys ``(n, 0)``.

    Phase 2 reads the saved values too: were it to recompute one instead, ``extract`` would stop saving
    it (it saves what the backward reads), and the forward would save less than the partitioner chose
    (seed 001's uneven chain saved 3 of 19 units at budget 19/50 when the hold of a higher budget
    left out two of its three matmuls)."""
    ph = {n for n in nodes if n.op == "placeholder"}
    avail1 = set(saved) | ph
    hold = normalize_saved(hold) if hold else []
    need1 = _ancestors(hold, avail1)
    p1 = [n for n in nodes if n in need1 and n not in avail1]
    k1 = {n: ((n, 1) if n in set(p1) else (n, 0)) for n in need1}
    avail2 = set(hold) | avail1
    need2 = _ancestors(roots, avail2)
    p2 = lazy_order(nodes, need2, anchors, avail2)
    p2set = set(p2)
    steps = [((n, 1), n, {a: k1[a] for a in _inputs(n)}) for n in p1]

    def key2(a):
        return (a, 2) if a in p2set else k1.get(a, (a, 0))

    steps += [((n, 2), n, {a: key2(a) for a in _inputs(n)}) for n in p2]
    return steps


def phase_key(steps) -> dict:
    """node -> the key of its last copy in ``steps`` (what the graph's outputs refer to)."""
    return {n: k for k, n, _ in steps}


def _subgraph(joint: fx.Graph, inputs: Sequence[fx.Node], outputs: Sequence, keep, what: str,
              anchors: Optional[set] = None) -> fx.Graph:
    """Copy of the part of ``joint`` that computes ``outputs`` (and the impure nodes ``keep`` accepts)
    from ``inputs``: in graph order, or in ``lazy_order`` around ``anchors`` when given."""
    g = fx.Graph()
    env = {}
    for n in inputs:  # create_node: Graph.placeholder() searches for the last placeholder each time
        p = g.create_node("placeholder", n.name, name=n.name, type_expr=n.type)
        p.meta = dict(n.meta)
        env[n] = p
    nodes = [n for n in joint.nodes if n.op != "output"]
    roots = [o for o in outputs if isinstance(o, fx.Node)]
    roots += [n for n in nodes if n.op != "placeholder" and n not in env and is_impure(n) and keep(n)]
    need = _ancestors(roots, set(inputs))
    missing = [n.name for n in nodes if n.op == "placeholder" and n in need and n not in env]
    if missing:
        raise PartitionError(f"partition: the {what} graph needs inputs {missing}, which it does not get")
    order = lazy_order(nodes, need, anchors, set(env)) if anchors is not None else \
        [n for n in nodes if n in need and n not in env]
    for n in order:
        env[n] = g.node_copy(n, env.__getitem__)
    g.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outputs))
    dce(g)
    g.lint()
    return g


def _hold_subgraph(joint: fx.Graph, inputs: Sequence[fx.Node], outputs: Sequence, roots, hold, tang) -> fx.Graph:
    """The backward graph of ``hold_steps``: phase-1 copies, then phase-2 copies of forward nodes."""
    g = fx.Graph()
    env = {}
    for n in inputs:
        p = g.create_node("placeholder", n.name, name=n.name, type_expr=n.type)
        p.meta = dict(n.meta)
        env[(n, 0)] = p
    nodes = [n for n in joint.nodes if n.op != "output"]
    steps = hold_steps(nodes, [n for n in inputs if n not in tang], hold, roots, tang)
    for key, n, ins in steps:
        missing = [a.name for a in ins if ins[a] not in env]
        if missing:
            raise PartitionError(f"partition: the backward graph needs inputs {missing}, which it does not get")
        env[key] = g.node_copy(n, lambda a, ins=ins: env[ins[a]])
    last = phase_key(steps)
    g.output(tuple(env[last.get(o, (o, 0))] if isinstance(o, fx.Node) else o for o in outputs))
    dce(g)
    g.lint()
    return g


# ----------------------------------------------------------------------------- saved values
def normalize_saved(saved: Iterable[fx.Node]) -> List[fx.Node]:
    """Saved values in graph order, tuple-valued nodes replaced by their getitem users."""
    out = []
    for n in saved:
        if isinstance(n.meta.get("val"), (tuple, list)):
            out.extend(u for u in n.users if u.target is operator.getitem)
        else:
            out.append(n)
    order = {n: i for i, n in enumerate(next(iter(out)).graph.nodes)} if out else {}
    return sorted(set(out), key=order.__getitem__)


def _sym_expr(node: fx.Node):
    val = node.meta.get("val")
    return val.node.expr if isinstance(val, torch.SymInt) else None


def _bind_symbols(joint: fx.Graph, bw_inputs: Sequence[fx.Node], syms: List[fx.Node], fwd_inputs) -> List[fx.Node]:
    """SymInt nodes (existing or new ``sym_size`` nodes on a forward input) that bind every free symbol
    of the backward inputs' shapes; returns the extra sym nodes to save."""
    bound = {_sym_expr(s) for s in syms}
    wanted = set()
    for n in bw_inputs:
        wanted |= free_symbols(n.meta.get("val"))
    wanted = {s for s in wanted if s not in bound}
    if not wanted:
        return []
    tang = tangent_closure(joint)
    extra = []
    for n in joint.nodes:  # existing bindings: SymInt placeholders or sym_size nodes
        e = _sym_expr(n)
        if e in wanted and n not in tang:
            extra.append(n)
            wanted.discard(e)
    for p in fwd_inputs:  # otherwise read the size off a forward input
        val = p.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for dim, size in enumerate(val.shape):
            if isinstance(size, torch.SymInt) and size.node.expr in wanted:
                with joint.inserting_after(p):
                    s = joint.call_function(torch.ops.aten.sym_size.int, (p, dim))
                s.meta["val"] = size
                extra.append(s)
                wanted.discard(size.node.expr)
    if wanted:
        raise PartitionError(f"partition: no forward value binds symbols {sorted(map(str, wanted))} used by "
                             f"backward inputs; mark those sizes static or report the graph")
    return extra


def read_saved(joint_gm: fx.GraphModule, saved, num_fwd_outputs: int, tang: Optional[set] = None
               ) -> List[fx.Node]:
    """The values of ``saved`` (a list or a ``Saved``) that the backward reads, in graph order: what
    ``extract`` saves, before the SymInts that bind shapes (with a hold: what ``hold_steps`` reads at
    its start). ``tang``: the joint graph's ``tangent_closure`` when the caller has it."""
    joint = joint_gm.graph
    tang = tang if tang is not None else tangent_closure(joint)
    _, bwd_in = split_inputs(joint)
    roots = [o for o in split_outputs(joint, num_fwd_outputs)[1] if isinstance(o, fx.Node)]
    roots += [n for n in tang if is_impure(n)]
    hold = getattr(saved, "hold", None)
    saved = normalize_saved(saved)
    if hold is None:
        need = _ancestors(roots, set(saved) | set(bwd_in))
        return [n for n in saved if n in need]
    nodes = [n for n in joint.nodes if n.op != "output"]
    steps = hold_steps(nodes, saved, hold, roots, tang)
    start = {a for _, _, ins in steps for a, k in ins.items() if k[1] == 0}
    start |= {o for o in roots if o not in phase_key(steps)}
    return normalize_saved(start - set(bwd_in))


def extract(joint_gm: fx.GraphModule, saved: Iterable[fx.Node], *, num_fwd_outputs: int
            ) -> Tuple[fx.GraphModule, fx.GraphModule]:
    """Build (forward, backward) GraphModules from ``joint_gm`` saving exactly ``saved`` (minus values the
    backward turns out not to use, plus SymInts that bind shapes). The joint graph may gain sym_size
    nodes; it is otherwise unchanged."""
    joint = joint_gm.graph
    fwd_in, bwd_in = split_inputs(joint)
    fwd_out, bwd_out = split_outputs(joint, num_fwd_outputs)
    hold = getattr(saved, "hold", None)
    saved = normalize_saved(saved)
    tang = tangent_closure(joint)
    bad = [n.name for n in saved if n in tang]
    if bad:
        raise PartitionError(f"partition: cannot save {bad}: they depend on tangents")
    in_bw = lambda n: n in tang  # noqa: E731  impure nodes that belong to the backward
    in_fw = lambda n: n not in tang and n.meta.get("partitioner_tag") != "is_backward"  # noqa: E731

    def order(sv):
        return [n for n in sv if not is_sym(n)] + [n for n in sv if is_sym(n)]

    roots = [o for o in bwd_out if isinstance(o, fx.Node)] + [n for n in tang if is_impure(n)]
    saved = order(read_saved(joint_gm, Saved.of(saved, hold), num_fwd_outputs, tang))
    syms = [n for n in saved if is_sym(n)]
    saved = order(saved + _bind_symbols(joint, saved + bwd_in, syms, fwd_in))
    tensors, syms = [n for n in saved if not is_sym(n)], [n for n in saved if is_sym(n)]

    if hold is not None:
        bw = _hold_subgraph(joint, syms + tensors + bwd_in, bwd_out, roots, hold, tang)
    else:
        bw = _subgraph(joint, syms + tensors + bwd_in, bwd_out, in_bw, "backward", anchors=tang)
    fw = _subgraph(joint, fwd_in, list(fwd_out) + tensors + syms, in_fw, "forward")
    for p in bw.nodes:
        if p.op == "placeholder" and "val" not in p.meta:
            raise PartitionError(f"partition: backward input {p.name} has no meta['val']; run FakeTensorProp "
                                 f"on the joint graph before partitioning")
    return fx.GraphModule(joint_gm, fw), fx.GraphModule(joint_gm, bw)


def saved_values(fw_gm: fx.GraphModule, num_fwd_outputs: int) -> List[fx.Node]:
    """The forward graph's saved outputs (tensors then SymInts), for reports and tests."""
    outs = fw_gm.graph.output_node().args[0]
    return [o for o in outs[num_fwd_outputs:] if isinstance(o, fx.Node)]

