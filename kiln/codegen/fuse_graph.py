"""Entry point of kiln's code generation: ``fuse_graph(gm, example_inputs, opts, load_kernel) -> int``.

Lower the post-grad ATen graph to the loop IR (``lower/``), group computed buffers into kernels and
plan each one (``schedule/``: fusion, folds, chains), write each plan's Triton module
(``to_triton/``), then edit the graph in place: each kernel becomes one ``call_function`` node whose
target ``load_kernel(source, fallback)`` makes (``kiln.runtime.kernels.load_kernel``: the pipeline
passes it in, so that code generation never imports the runtime), followed by ``operator.getitem``
nodes when it has several outputs. Nodes without a lowering stay ATen calls. Returns the number of
kernel nodes created.
"""
from __future__ import annotations

import heapq
import operator
from dataclasses import replace

import sympy
import torch
import torch.fx

from kiln.codegen.fallback import NoFallback, extract, graph_inputs
from kiln.codegen.flex import lower_flex
from kiln.codegen.ir.loops import Unsupported, release_indirect
from kiln.codegen.lower import Lowering, is_tensor
from kiln.codegen.schedule.chain import chain_plans
from kiln.codegen.schedule.domain import body, loads, scatter_exprs
from kiln.codegen.schedule.fuse import schedule
from kiln.codegen.schedule.plan import ScatterPlan
from kiln.codegen.schedule.planner import numel_summary, plan_group
from kiln.codegen.to_cpp.module import declined, write_unit
from kiln.codegen.to_triton.emit import TritonTarget
from kiln.codegen.to_triton.module import write_module
from kiln.debug import counters, log
from kiln.partition.ops import written_placeholders_of

aten = torch.ops.aten


UNFUSED = "kiln_unfused"   # gm.meta key: the ATen graph, kept when some kernel has no fallback of its own
SEEDS = "kiln_seeds"       # node.meta key: a node drawing philox seeds (``seed_nodes``)


class CodegenError(RuntimeError):
    """kiln could not generate kernels for a graph; without ``strict`` the graph stays ATen.
    Report it with the graph (``KILN_DEBUG=2``) and run with ``codegen='aten'`` meanwhile."""


def triton_available() -> str:
    """Why Triton kernels cannot be generated here ('' when they can)."""
    try:
        import triton  # noqa: F401  (importable is all that is asked)
    except ImportError as e:
        return str(e)
    return ""


def wants_triton(gm, opts) -> bool:
    if opts.codegen == "aten":
        return False
    if opts.codegen == "triton":
        return True
    return _on_cuda(gm) != (opts.codegen == "cpp")   # 'auto': CUDA graphs; 'cpp': CPU graphs


def _on_cuda(gm) -> bool:
    return any(is_tensor(n.meta.get("val")) and n.meta["val"].device.type == "cuda" for n in gm.graph.nodes)


def interpreted(plan, opts, graph_on_cuda: bool) -> bool:
    """Whether ``plan``'s Triton kernel would run in Triton's interpreter inside a graph with CUDA values (a
    Python number written into a tensor is a CPU 0-dim constant): milliseconds a launch there, microseconds
    as ATen, which runs such plans; the interpreter serves graphs on the CPU throughout."""
    return graph_on_cuda and target_for(plan, opts).interpret


def fuse_graph(gm: torch.fx.GraphModule, example_inputs, opts, load_kernel, on_plans=None,
               strict: bool = False, build=None) -> int:
    """Replace fusible ATen nodes of ``gm`` by Triton kernels, in place; returns the kernel count.

    With ``opts.codegen == 'auto'`` only graphs on CUDA are fused; 'triton' also fuses CPU graphs
    (their kernels run in Triton's interpreter, unless ``opts.emit_for == 'cuda'``); 'cpp' fuses CPU graphs
    into one C++ translation unit, which ``build(unit, opts)`` compiles and loads (``runtime.cpp_build``);
    'aten' leaves the graph alone. ``on_plans(plans)`` receives the kernel plans (to show them). Any failure leaves the
    graph unchanged (``strict=True`` raises instead)."""
    if not wants_triton(gm, opts):
        return 0
    flex = lower_flex(gm, opts, load_kernel, build)   # FlexAttention's ops: kernels of their own (codegen/flex)
    try:
        generated = _generate(gm, opts, build)
        position = {n: i for i, n in enumerate(gm.graph.nodes)}
        generated = generated[0], seed_nodes(gm.graph, generated[1], position)
        calls = [_kernel_call(generated[0], position, load_kernel, *k) for k in generated[1]]
    except Exception as e:
        if strict:
            raise
        counters["codegen"]["fallback"] += 1
        counters["random"]["aten"] += len(random_nodes(gm.graph))
        log(1, f"codegen: graph stays ATen ({type(e).__name__}: {e})")
        return flex
    finally:
        release_indirect()
    if on_plans is not None:
        on_plans([plan for plan, *_ in generated[1]])
    n = _rewrite(gm, *generated, position, calls)
    counters["codegen"]["kernels"] += n
    _count_random(gm.graph, generated[0], generated[1])
    return n + flex


def random_nodes(graph) -> list:
    """The graph's ATen calls that draw random numbers (torch's ``nondeterministic_seeded`` tag), kiln's own
    seed draws aside."""
    return [n for n in graph.nodes if n.op == "call_function" and not n.meta.get(SEEDS)
            and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())]


def _count_random(graph, lw, kernels):
    """``counters['random']``: ``fused``, the random ops drawn inside kernels, and ``aten``, those running as
    ATen calls (not lowered, or in a kernel the emitter declined), each logged with its reason."""
    fused = sum(src.seeds for _, src, *_ in kernels)
    counters["random"]["fused"] += fused
    left = random_nodes(graph)
    declined = lw.seeds.count - fused
    counters["random"]["aten"] += len(left) + declined
    for n in left:
        log(1, f"codegen: random op {n.target} runs as ATen ({n.meta.get('kiln_why', 'no lowering')})")
    if declined:
        log(1, f"codegen: {declined} random op(s) run as ATen in declined kernels")


def target_for(plan, opts) -> TritonTarget:
    """The Triton target of ``plan``'s kernels under ``opts``."""
    device = (plan.copy if isinstance(plan, ScatterPlan) else plan).device
    interpret = device.type != "cuda" and opts.emit_for != "cuda"
    autotune = opts.max_autotune or opts.mode in ("max-autotune", "max-autotune-no-cudagraphs")
    return TritonTarget(interpret, autotune and not interpret, opts.tuning)


def _generate(gm, opts, build=None):
    """(lowering, [(plan, source, size-symbol nodes, fake outputs)]): the graph's kernels, written."""
    gm.graph.eliminate_dead_code()
    lw = Lowering(gm, opts).run()
    groups = _toposort_groups(schedule(lw, opts.tuning), lw)
    summary = numel_summary(lw.buffers)
    plans = [plan_group(g, lw.buffers, opts.tuning, summary) for g in groups]
    plans = chain_plans(groups, plans, opts.tuning)   # small kernels chained into the one they read
    graph = gm.graph
    fakes = _FakeMaker(graph)
    kernels = []
    if opts.codegen == "cpp":   # one translation unit: every kernel of the graph, built once
        unit, sources = write_unit(plans, opts.tuning)
        if unit.functions:
            if build is None:
                raise CodegenError("codegen: codegen='cpp' needs a build function (runtime.cpp_build.build)")
            build(unit, opts)
    else:
        on_cuda = _on_cuda(gm)
        sources = [declined(plan) if interpreted(plan, opts, on_cuda) else write_module(plan, target_for(plan, opts))
                   for plan in plans]
    for plan, src in zip(plans, sources):
        if not src.text:   # declined: its ATen nodes run, reading the graph inputs they need too
            src = _declined(src, lw)
        sym_nodes = [_symbol_node(graph, s) for s in src.scalars]
        vals = [fakes(lw.buffers[name]) for name in src.outputs]
        kernels.append((plan, src, sym_nodes, vals))
    _check_replaceable(gm, lw, plans)
    return lw, kernels


def seed_nodes(graph, kernels, position) -> list:
    """``kernels`` with the philox seeds each kernel's ``call`` takes appended to its size-symbol nodes: one
    ``randint`` per device draws every seed of a graph call on that device, as an [n, 2] int64 tensor whose
    rows (16-byte aligned, so launch sites keep their fast path) are the kernels' seeds. The draw uses torch's
    generator of that device (``torch.manual_seed`` repeats it; CUDA graphs capture it), costs one launch per
    graph call and no host synchronization. The new nodes come first (``position`` -1)."""
    wanted = {}
    for plan, src, *_ in kernels:
        if src.seeds:
            dev = (plan.copy if isinstance(plan, ScatterPlan) else plan).device
            wanted[dev] = wanted.get(dev, 0) + src.seeds
    if not wanted:
        return kernels
    fake = _FakeMaker(graph)
    anchor = [n for n in graph.nodes if n.op == "placeholder"]
    rows = {}
    for dev, n in wanted.items():
        make = (lambda *a, **k: graph.call_function(*a, **k))
        ctx = graph.inserting_after(anchor[-1]) if anchor else graph.inserting_before(next(iter(graph.nodes)))
        with ctx:
            draw = make(aten.randint.low, (-2 ** 63, 2 ** 63 - 1, [n, 2]), {"dtype": torch.int64, "device": dev})
        with graph.inserting_after(draw):
            split = make(aten.unbind.int, (draw, 0))
        draw.meta["val"] = fake.empty((n, 2), torch.int64, dev)
        split.meta["val"] = tuple(fake.empty((2,), torch.int64, dev) for _ in range(n))
        rows[dev] = []
        last = split
        for i in range(n):
            with graph.inserting_after(last):
                last = make(operator.getitem, (split, i))
            last.meta["val"] = split.meta["val"][i]
            rows[dev].append(last)
        for node in (draw, split, *rows[dev]):
            position[node] = -1
            node.meta[SEEDS] = True
    out = []
    for plan, src, sym_nodes, vals in kernels:
        if src.seeds:
            dev = (plan.copy if isinstance(plan, ScatterPlan) else plan).device
            sym_nodes = list(sym_nodes) + [rows[dev].pop(0) for _ in range(src.seeds)]
        out.append((plan, src, sym_nodes, vals))
    return out


def _declined(src, lw):
    nodes = {b.node: name for name, b in lw.buffers.items() if b.compute is None and b.node is not None}
    extra = graph_inputs([lw.buffers[n].node for n in src.inputs], [lw.buffers[n].node for n in src.outputs])
    return replace(src, inputs=src.inputs + tuple(nodes[n] for n in extra if n in nodes))


def _check_replaceable(gm, lw, plans):
    """Every lowered node that an ATen call or the output still uses must be a kernel output."""
    stored = {b.node for p in plans for b in p.outputs() if b.node is not None}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n in lw.kept or n in stored:
            continue
        for u in n.users:
            if u.op == "output" or u in lw.kept:
                raise CodegenError(f"codegen: {n.name} is used by {u.name} but no kernel writes it")


def _toposort_groups(groups, lw):
    owner = {b.name: g for g in groups for b in g.nodes}
    deps = {}
    for g in groups:
        d = set()
        for b in g.nodes:
            exprs = scatter_exprs(b) if g.kind == "scatter" else [body(b, g.dims, g.role(b))]
            for e in exprs:
                for name, _ in loads(e):
                    o = owner.get(name)
                    if o is not None and o is not g:
                        d.add(id(o))
        deps[id(g)] = d
    order, done = [], set()
    pending = list(groups)
    while pending:
        progressed = False
        for g in list(pending):
            if deps[id(g)] <= done:
                order.append(g)
                done.add(id(g))
                pending.remove(g)
                progressed = True
        if not progressed:
            raise CodegenError("codegen: kernel groups depend on each other in a cycle")
    return order


class _FakeMaker:
    """``maker(buf)``: a FakeTensor for a kernel-internal buffer that crosses kernels. The graph's
    fake mode and its SymInts by expression are gathered on the first call, once per graph."""

    def __init__(self, graph):
        self.graph, self.mode, self.table = graph, None, None

    def _scan(self):
        self.table = {}
        for n in self.graph.nodes:
            v = n.meta.get("val")
            if is_tensor(v) and hasattr(v, "fake_mode"):
                self.mode = v.fake_mode
                for s in list(v.shape) + list(v.stride()):
                    if isinstance(s, torch.SymInt):
                        self.table.setdefault(sympy.sympify(s.node.expr), s)
            elif isinstance(v, torch.SymInt):
                self.table.setdefault(sympy.sympify(v.node.expr), v)

    def empty(self, shape, dtype, device):
        """A FakeTensor (or a meta tensor where the graph has no fake mode) of a new dense tensor."""
        if self.table is None:
            self._scan()
        if self.mode is None:
            return torch.empty(shape, dtype=dtype, device="meta")
        with self.mode:
            return torch.empty(shape, dtype=dtype, device=device)

    def __call__(self, buf):
        if buf.fake is not None:
            return buf.fake
        if self.table is None:
            self._scan()
        conv = lambda e: _to_symint(sympy.sympify(e), self.table)  # noqa: E731
        shape, stride = [conv(s) for s in buf.shape], [conv(s) for s in buf.stride]
        if self.mode is None:
            return torch.empty_strided(shape, stride, dtype=buf.dtype, device="meta")
        with self.mode:
            return torch.empty_strided(shape, stride, dtype=buf.dtype, device=buf.device)


def _to_symint(e, table):
    if e.is_Integer:
        return int(e)
    if e in table:
        return table[e]
    if e.is_Add:
        out = 0
        for t in e.args:
            out = out + _to_symint(t, table)
        return out
    if e.is_Mul:
        out = 1
        for t in e.args:
            out = out * _to_symint(t, table)
        return out
    if e.is_Pow and e.exp.is_Integer:
        out = 1
        for _ in range(int(e.exp)):
            out = out * _to_symint(e.base, table)
        return out
    raise Unsupported(f"size {e} has no SymInt in the graph")


def _symbol_node(graph, sym):
    for n in graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.SymInt) and sympy.sympify(v.node.expr) == sym:
            return n
    raise Unsupported(f"no graph value carries size {sym}")


def _members(plan) -> list:
    """The buffers a plan's kernel computes (its tail's too)."""
    if isinstance(plan, ScatterPlan):
        return [plan.write.scatter.buffer]
    return [m.buffer for m in plan.members] + (_members(plan.tail) if plan.tail is not None else [])


def _rewrite(gm, lw, kernels, position, calls):
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    produced, new_nodes, priority = {}, [], {}
    if not all(own for _, own in calls):   # a kernel without its own fallback: keep the whole ATen graph
        gm.meta[UNFUSED] = _copy(gm)
    for (call, _), (plan, src, sym_nodes, vals) in zip(calls, kernels):
        args = []
        for name in src.inputs:
            buf = lw.buffers[name]
            args.append(produced[name] if buf.compute is not None else buf.node)
        args += sym_nodes
        with graph.inserting_before(output):   # node names must not shadow the kernel's name
            node = graph.create_node("call_function", call, tuple(args), {}, name=f"fused_{src.outputs[0]}")
        first = min((position[b.node] for b in _members(plan) if b.node in position), default=len(position))
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
    keep = set(lw.kept) | set(new_nodes) | set(produced.values()) | {n for n in graph.nodes if n.meta.get(SEEDS)}
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


def _kernel_call(lw, position, load_kernel, plan, src, sym_nodes, vals):
    """The node target for one kernel: ``load_kernel(src, fallback)``, the fallback being the group's
    original ATen nodes, which run if the kernel fails on its first call (``runtime.kernels.KernelCall``). A
    kernel the emitter declined (a source without text) is its fallback."""
    ins = [lw.buffers[name].node for name in src.inputs] + list(sym_nodes)
    outs = [lw.buffers[name].node for name in src.outputs]
    why = None
    try:
        fb = extract(ins, outs, len(vals) > 1, position)
    except Exception as e:   # NoFallback, or any surprise: the kernel just runs without one
        fb, why = None, e
    if not src.text:
        if fb is None:
            raise CodegenError(f"codegen: a declined kernel has no ATen fallback ({why})")
        return fb, True
    target = load_kernel(src, fb)
    log(4, f"codegen: kernel {target.name} ({len(_members(plan))} buffers, {src.kind})\n{target.source}")
    if why is not None:
        log(4 if isinstance(why, NoFallback) else 1,
            f"codegen: kernel {target.name} has no ATen fallback of its own ({type(why).__name__}: {why}); "
            f"the graph keeps its ATen nodes for it")
    return target, fb is not None


def _copy(gm) -> torch.fx.GraphModule:
    """The graph as it is now (before kernels replace its nodes), runnable."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph, class_name="KilnUnfused")


def _reads_before_writes(nodes) -> dict:
    """{node: [writers]}: a node that writes a graph input (AOTAutograd's ``copy_`` of a mutated input)
    runs after every other node reading that input, since they all mean its value before the write. A
    fused kernel is placed by its stored buffers and may read the input for a value computed earlier in
    the graph (fuzz seed 11 #2718: ``a0 - a1`` read ``a1`` after the copy)."""
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
    """Reorder nodes topologically, keeping the original order where possible; writes to graph inputs
    come after their reads (``_reads_before_writes``)."""
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
    out = [n for n in order if n.op == "output"]
    order = [n for n in order if n.op != "output"] + out
    ph = [n for n in order if n.op == "placeholder"]
    order = ph + [n for n in order if n.op != "placeholder"]
    prev = order[0]
    for n in order[1:]:
        prev.append(n)
        prev = n
