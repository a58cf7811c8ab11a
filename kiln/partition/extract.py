"""Cut a joint graph into forward and backward GraphModules, given the values to save.

AOTAutograd's joint graph takes primals then tangents and returns the ``num_fwd_outputs`` forward values,
then a gradient per primal. As partition_fn's contract wants, the forward returns its outputs, the saved
tensors, then the saved SymInts; the backward takes those SymInts and tensors and the tangents.
"""
from __future__ import annotations

import operator
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_symbols

BWD_EXTRA = ("bwd_seed", "bwd_base_offset")


class PartitionError(RuntimeError):
    """The joint graph cannot be cut as asked: a value the forward or backward needs is neither
    computable from that graph's inputs nor saved. This is a partitioner bug or a joint graph that
    breaks AOTAutograd's layout; run with KILN_DEBUG=2 to print the joint graph and report it."""


# ----------------------------------------------------------------------------- joint graph layout
def is_tangent(node: fx.Node) -> bool:
    """A backward-only input: ``tangents_*`` or a backward RNG seed/offset."""
    desc = node.meta.get("desc")
    return node.op == "placeholder" and ("Tangent" in type(desc).__name__ if desc is not None else False
                                         or node.name.startswith("tangents") or node.name in BWD_EXTRA)


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
    """The node holds a SymInt or an int: the only numbers a forward may save (compiled autograd takes SymInts
    alone; a saved SymFloat failed with 'an integer is required')."""
    val = node.meta.get("val")
    return isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool)


def tangent_closure(graph: fx.Graph) -> set:
    """Every node that depends (transitively) on a tangent: these can only run in the backward."""
    out = set()
    for n in graph.nodes:
        if n.op != "output" and (is_tangent(n) or any(a in out for a in _inputs(n))):
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
    """``need`` in backward order: each of ``anchors`` (graph order) after the recomputation it needs, so a
    recomputed value is made just before its first use; leftovers follow in graph order."""
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
    """The values to save and, optionally, ``hold``: values the backward rebuilds first (``hold_steps``)."""
    hold: Optional[List[fx.Node]] = None

    @staticmethod
    def of(saved, hold=None) -> "Saved":
        out = Saved(saved)
        out.hold = list(hold) if hold is not None else None
        return out


def hold_steps(nodes: Sequence[fx.Node], saved: Sequence[fx.Node], hold: Sequence[fx.Node],
               roots: Sequence[fx.Node], anchors: set) -> list:
    """The backward's ``[(key, node, {input: key})]`` rebuilding ``hold``: phase 1 ``(n, 1)`` computes it from
    ``saved`` and inputs ``(n, 0)``; phase 2 ``(n, 2)`` what ``roots`` need (``lazy_order``) from ``hold`` and
    inputs alone (a saved value outside ``hold`` dies with phase 1: phase 2 is a higher budget's backward)."""
    ph = {n for n in nodes if n.op == "placeholder"}
    avail1 = set(saved) | ph
    hold = normalize_saved(hold) if hold else []
    need1 = _ancestors(hold, avail1)
    p1 = [n for n in nodes if n in need1 and n not in avail1]
    k1 = {n: (n, 0 if n in avail1 else 1) for n in need1}
    avail2 = set(hold) | ph
    need2 = _ancestors(roots, avail2)
    p2 = lazy_order(nodes, need2, anchors, avail2)
    p2set = set(p2)
    steps = [((n, 1), n, {a: k1[a] for a in _inputs(n)}) for n in p1]
    return steps + [((n, 2), n, {a: (a, 2) if a in p2set else k1.get(a, (a, 0)) for a in _inputs(n)}) for n in p2]


def _subgraph(joint: fx.Graph, inputs: Sequence[fx.Node], outputs: Sequence, keep, what: str,
              anchors: Optional[set] = None, hold=None) -> fx.Graph:
    """Copy of the part of ``joint`` computing ``outputs`` (and impure nodes ``keep`` accepts) from
    ``inputs``, in graph order, ``lazy_order`` around ``anchors``, or as ``hold_steps`` with ``hold``."""
    g = fx.Graph()
    env = {}
    for n in inputs:  # create_node: Graph.placeholder() searches for the last placeholder each time
        p = g.create_node("placeholder", n.name, name=n.name, type_expr=n.type)
        p.meta = dict(n.meta)
        env[(n, 0)] = p
    nodes = [n for n in joint.nodes if n.op != "output"]
    roots = [o for o in outputs if isinstance(o, fx.Node)]
    roots += [n for n in nodes if n.op != "placeholder" and (n, 0) not in env and is_impure(n) and keep(n)]
    if hold is not None:
        steps = hold_steps(nodes, [n for n in inputs if n not in anchors], hold, roots, anchors)
    else:
        need = _ancestors(roots, set(inputs))
        order = lazy_order(nodes, need, anchors, set(inputs)) if anchors is not None else \
            [n for n in nodes if n in need and n not in inputs]
        steps = [((n, 0), n, {a: (a, 0) for a in _inputs(n)}) for n in order]
    for key, n, ins in steps:
        missing = [a.name for a in ins if ins[a] not in env] + ([n.name] if n.op == "placeholder" else [])
        if missing:
            raise PartitionError(f"partition: the {what} graph needs inputs {missing}, which it does not get")
        env[key] = g.node_copy(n, lambda a, ins=ins: env[ins[a]])
    last = {n: k for k, n, _ in steps}   # the last copy of each node: what the outputs read
    g.output(tuple(env[last.get(o, (o, 0))] if isinstance(o, fx.Node) else o for o in outputs))
    dce(g)
    g.lint()
    return g


# ----------------------------------------------------------------------------- saved values
def normalize_saved(saved: Iterable[fx.Node]) -> List[fx.Node]:
    """Saved values in graph order, tuple-valued nodes replaced by their getitem users."""
    out = [m for n in saved for m in ([u for u in n.users if u.target is operator.getitem]
                                      if isinstance(n.meta.get("val"), (tuple, list)) else [n])]
    order = {n: i for i, n in enumerate(next(iter(out)).graph.nodes)} if out else {}
    return sorted(set(out), key=order.__getitem__)


def _sym_expr(node: fx.Node):
    val = node.meta.get("val")
    return val.node.expr if isinstance(val, torch.SymInt) else None


def _bind_symbols(joint: fx.Graph, bw_inputs: Sequence[fx.Node], syms: List[fx.Node], fwd_inputs) -> List[fx.Node]:
    """The extra SymInt nodes to save (or new ``sym_size`` nodes) that bind the backward inputs' free symbols."""
    wanted = set().union(*(free_symbols(n.meta.get("val")) for n in bw_inputs)) - {_sym_expr(s) for s in syms}
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
    """The values of ``saved`` (a list or ``Saved``) the backward reads, in graph order: what ``extract`` saves."""
    joint = joint_gm.graph
    tang = tang if tang is not None else tangent_closure(joint)
    _, bwd_in = split_inputs(joint)
    roots = [o for o in split_outputs(joint, num_fwd_outputs)[1] if isinstance(o, fx.Node)]
    roots += [n for n in tang if is_impure(n)]
    hold = getattr(saved, "hold", None)
    saved = normalize_saved(saved)
    need = _ancestors(roots, set(saved) | set(bwd_in))
    if hold is not None:   # a hold keeps the budget's saved bytes (what phase 2 does not read dies with phase 1)
        nodes = [n for n in joint.nodes if n.op != "output"]
        need |= {a for _, _, ins in hold_steps(nodes, saved, hold, roots, tang) for a, k in ins.items() if k[1] == 0}
    return [n for n in saved if n in need]


def extract(joint_gm: fx.GraphModule, saved: Iterable[fx.Node], *, num_fwd_outputs: int
            ) -> Tuple[fx.GraphModule, fx.GraphModule]:
    """(forward, backward) GraphModules from ``joint_gm`` saving ``saved`` (less what the backward does not
    use, plus SymInts that bind shapes). The joint graph may gain sym_size nodes."""
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

    saved = order(read_saved(joint_gm, Saved.of(saved, hold), num_fwd_outputs, tang))
    syms = [n for n in saved if is_sym(n)]
    saved = order(saved + _bind_symbols(joint, saved + bwd_in, syms, fwd_in))
    tensors, syms = [n for n in saved if not is_sym(n)], [n for n in saved if is_sym(n)]

    bw = _subgraph(joint, syms + tensors + bwd_in, bwd_out, in_bw, "backward", anchors=tang, hold=hold)
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
