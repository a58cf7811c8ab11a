"""The FX surgery of code generation: ``rewrite(gm, code)`` puts ``generate``'s kernels into the graph, in
place: one node per kernel (its ``KernelRef``, or a declined kernel's ATen fallback) and ``getitem`` nodes
for several outputs, after the philox seed draws (``seed_nodes``); the replaced ATen nodes go and the graph
is ordered again, as it was where possible (``_stable_toposort``).
"""
import heapq
import operator
from dataclasses import replace

import torch
import torch.fx

from kiln.codegen.fallback import Fallback
from kiln.codegen.generate import CodegenError, FakeMaker, members
from kiln.codegen.schedule.plan import ScatterPlan
from kiln.debug import counters, log
from kiln.partition.ops import written_placeholders_of

aten = torch.ops.aten
SEEDS = "kiln_seeds"       # node.meta key: a node drawing philox seeds (``seed_nodes``)


def rewrite(gm: torch.fx.GraphModule, code) -> int:
    """Replace the nodes ``code`` computes by its kernels, in place; returns the number of kernel nodes."""
    position = dict(code.position)
    kernels = seed_nodes(gm.graph, code.kernels, position)
    n = _rewrite(gm, code.lowering, kernels, position)
    counters["codegen"]["kernels"] += n
    fused = sum(k.source.seeds for k in kernels)
    count_random(gm.graph, code.lowering.seeds.count - fused, fused)
    return n


def random_nodes(graph) -> list:
    """The graph's ATen calls that draw random numbers, kiln's own seed draws aside."""
    return [n for n in graph.nodes if n.op == "call_function" and not n.meta.get(SEEDS)
            and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())]


def count_random(graph, declined: int = 0, fused: int = 0) -> None:
    """``counters['random']``: ``fused``, the random ops drawn inside kernels, and ``aten``, those running as
    ATen calls (not lowered, or in a kernel the emitter ``declined``), each logged with its reason."""
    counters["random"]["fused"] += fused
    left = random_nodes(graph)
    counters["random"]["aten"] += len(left) + declined
    for n in left:
        log(1, f"codegen: random op {n.target} runs as ATen ({n.meta.get('kiln_why', 'no lowering')})")
    if declined:
        log(1, f"codegen: {declined} random op(s) run as ATen in declined kernels")


def _device(plan):
    return (plan.copy if isinstance(plan, ScatterPlan) else plan).device


def seed_nodes(graph, kernels, position) -> list:
    """``kernels`` with their philox seeds appended to their size-symbol nodes: one ``randint`` per device
    draws every seed of a graph call as an [n, 2] int64 tensor (rows 16-byte aligned: launch sites keep
    their fast path), with torch's generator (``manual_seed`` repeats it, CUDA graphs capture it)."""
    wanted = {}
    for k in kernels:
        if k.source.seeds:
            wanted[_device(k.plan)] = wanted.get(_device(k.plan), 0) + k.source.seeds
    if not wanted:
        return list(kernels)
    fake = FakeMaker(graph)
    anchor = [n for n in graph.nodes if n.op == "placeholder"]
    rows = {}
    for dev, n in wanted.items():
        ctx = graph.inserting_after(anchor[-1]) if anchor else graph.inserting_before(next(iter(graph.nodes)))
        with ctx:
            draw = graph.call_function(aten.randint.low, (-2 ** 63, 2 ** 63 - 1, [n, 2]),
                                       {"dtype": torch.int64, "device": dev})
        with graph.inserting_after(draw):
            split = graph.call_function(aten.unbind.int, (draw, 0))
        draw.meta["val"] = fake.empty((n, 2), torch.int64, dev)
        split.meta["val"] = tuple(fake.empty((2,), torch.int64, dev) for _ in range(n))
        rows[dev] = []
        last = split
        for i in range(n):
            with graph.inserting_after(last):
                last = graph.call_function(operator.getitem, (split, i))
            last.meta["val"] = split.meta["val"][i]
            rows[dev].append(last)
        for node in (draw, split, *rows[dev]):
            position[node] = -1
            node.meta[SEEDS] = True
    return [replace(k, symbols=k.symbols + tuple(rows[_device(k.plan)].pop(0) for _ in range(k.source.seeds)))
            if k.source.seeds else k for k in kernels]


def _rewrite(gm, lw, kernels, position):
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    produced, new_nodes, priority, inlined = {}, [], {}, []
    for k in kernels:
        src, vals = k.source, k.vals
        args = [produced[name] if lw.buffers[name].compute is not None else lw.buffers[name].node
                for name in src.inputs] + list(k.symbols)
        first = min((position[b.node] for b in members(k.plan) if b.node in position), default=len(position))
        if isinstance(k.target, Fallback):   # declined: its ATen nodes go back into the graph, no module call
            copies, out = _inline(graph, k.target.graph, args, output)
            inlined += copies
            priority.update(dict.fromkeys(copies, first))
            produced.update(zip(src.outputs, out if len(vals) > 1 else [out]))
            continue
        with graph.inserting_before(output):   # node names must not shadow the kernel's name
            node = graph.create_node("call_function", k.target, tuple(args), {}, name=f"fused_{src.outputs[0]}")
        priority[node] = first
        new_nodes.append(node)
        if len(vals) == 1:
            node.meta["val"] = vals[0]
            produced[src.outputs[0]] = node
        else:
            node.meta["val"] = tuple(vals)
            for i, name in enumerate(src.outputs):
                with graph.inserting_before(output):
                    gi = graph.call_function(operator.getitem, (node, i))
                gi.meta["val"] = vals[i]
                priority[gi] = first
                produced[name] = gi
    for name, repl in produced.items():
        buf = lw.buffers[name]
        if buf.node is not None:
            buf.node.replace_all_uses_with(repl)
    keep = set(lw.kept) | set(new_nodes) | set(inlined) | set(produced.values()) | \
        {n for n in graph.nodes if n.meta.get(SEEDS)}
    for n in reversed(list(graph.nodes)):
        # a kept ATen node nothing reads any more (the ``empty`` a lowered ``bernoulli_`` wrote into) goes too
        if n.op in ("placeholder", "output") or (n in keep and (n.users or n not in lw.kept or n.is_impure())):
            continue
        if n.users:
            raise CodegenError(f"codegen: lowered node {n.name} still has users {list(n.users)}")
        graph.erase_node(n)
    _stable_toposort(graph, position, priority)
    graph.lint()
    gm.recompile()
    return len(new_nodes)


def _inline(graph, sub, args, before) -> list:
    """Copy ``sub``'s nodes into ``graph`` before ``before``, its placeholders bound to ``args``: (the copies,
    what ``sub`` outputs: a node or a tuple of them)."""
    env, copies, placeholders = {}, [], iter(args)
    with graph.inserting_before(before):
        for n in sub.nodes:
            if n.op == "placeholder":
                env[n] = next(placeholders)
            elif n.op == "output":
                out = n.args[0]
                return copies, tuple(env[o] for o in out) if isinstance(out, (tuple, list)) else env[out]
            else:
                env[n] = graph.node_copy(n, lambda a: env[a])
                copies.append(env[n])
    raise CodegenError("codegen: a fallback graph without an output")


def _reads_before_writes(nodes) -> dict:
    """{node: [writers]}: a node writing a graph input (AOTAutograd's ``copy_``) runs after every other node
    reading that input (a fused kernel, placed by its stores, may read it late: fuzz seed 11 #2718)."""
    after = {}
    for w in nodes:
        for ph in written_placeholders_of(w):
            later, todo = set(), [w]   # the writer's descendants cannot run before it
            while todo:
                for u in todo.pop().users:
                    if u not in later:
                        later.add(u)
                        todo.append(u)
            for r in ph.users:
                if r is not w and r not in later:
                    after.setdefault(r, []).append(w)
    return after


def _stable_toposort(graph, position, priority):
    """Reorder nodes topologically, keeping the original order where possible, writes after reads."""
    nodes = list(graph.nodes)
    rank = {n: priority.get(n, position.get(n, len(position))) for n in nodes}
    indeg = {n: len(set(n.all_input_nodes)) for n in nodes}
    after = _reads_before_writes(nodes)
    for ws in after.values():
        for w in ws:
            indeg[w] += 1
    heap = [(rank[n], i, n) for i, n in enumerate(nodes) if indeg[n] == 0]
    heapq.heapify(heap)
    order, idx = [], {n: i for i, n in enumerate(nodes)}
    while heap:
        _, _, n = heapq.heappop(heap)
        order.append(n)
        for u in list(n.users) + after.get(n, []):
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(heap, (rank[u], idx[u], u))
    if len(order) != len(nodes):
        raise CodegenError("codegen: the fused graph has a cycle")
    order.sort(key=lambda n: {"placeholder": 0, "output": 2}.get(n.op, 1))   # stable: placeholders first, output last
    prev = order[0]
    for n in order[1:]:
        prev.append(n)
        prev = n
