"""Entry point of kiln's code generation: ``fuse_graph(gm, example_inputs, opts) -> int``.

Lower the post-grad ATen graph to the loop IR (``lower.py``), group computed buffers into kernels
(``schedule.py``), write one Triton kernel per group (``triton.py``), then edit the graph in
place: each group becomes one ``call_function`` node whose target is a ``kernel.Kernel``, followed
by ``operator.getitem`` nodes when it has several outputs. Nodes without a lowering stay ATen
calls. Returns the number of kernel nodes created.
"""
from __future__ import annotations

import heapq
import operator

import sympy
import torch
import torch.fx

from kiln.codegen.chain import pairs
from kiln.codegen.fallback import KernelCall, NoFallback, extract
from kiln.codegen.kernel import PLACEHOLDER, kernel_for
from kiln.codegen.loops import Unsupported, release_indirect
from kiln.codegen.lower import Lowering, is_tensor
from kiln.codegen.schedule import loads, schedule
from kiln.debug import counters, log


class CodegenError(RuntimeError):
    """kiln could not generate kernels for a graph; without ``strict`` the graph stays ATen.
    Report it with the graph (``KILN_DEBUG=2``) and run with ``codegen='aten'`` meanwhile."""


def wants_triton(gm, opts) -> bool:
    mode = getattr(opts, "codegen", "auto") if opts is not None else "auto"
    if mode == "aten":
        return False
    if mode == "triton":
        return True
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if is_tensor(v) and v.device.type == "cuda":
            return True
    return False


def fuse_graph(gm: torch.fx.GraphModule, example_inputs, opts, strict: bool = False) -> int:
    """Replace fusible ATen nodes of ``gm`` by Triton kernels, in place; returns the kernel count.

    With ``opts.codegen == 'auto'`` only graphs on CUDA are fused; 'triton' also fuses CPU graphs
    (their kernels run in Triton's interpreter); 'aten' leaves the graph alone. Any failure
    leaves the graph unchanged (``strict=True`` raises instead)."""
    if not wants_triton(gm, opts):
        return 0
    try:
        plan = _plan(gm, opts)
    except Exception as e:
        if strict:
            raise
        counters["codegen"]["fallback"] += 1
        log(1, f"codegen: graph stays ATen ({type(e).__name__}: {e})")
        return 0
    finally:
        release_indirect()
        from kiln.codegen.triton import forget_buffers
        forget_buffers()
    n = _rewrite(gm, *plan)
    counters["codegen"]["kernels"] += n
    return n


def _plan(gm, opts):
    from kiln.codegen.triton import emit
    gm.graph.eliminate_dead_code()
    lw = Lowering(gm, opts).run()
    groups = _toposort_groups(schedule(lw), lw)
    autotune = bool(getattr(opts, "max_autotune", False)) or getattr(opts, "mode", None) in (
        "max-autotune", "max-autotune-no-cudagraphs")
    kernels = []
    graph = gm.graph
    fakes = _FakeMaker(graph)
    planned = pairs(groups, lw.buffers, autotune)   # small kernels chained into the one they read
    groups = [g for g, _ in planned]
    for g, src in planned:
        device = g.nodes[0].device
        if src is None:
            src = emit(g, lw.buffers, device, PLACEHOLDER, autotune)
        k = kernel_for(src.text, src.kind, device.type != "cuda", len(src.outputs), getattr(src, "reuse", ()))
        log(4, f"codegen: kernel {k.name} ({len(g.nodes)} buffers, {g.kind})\n{k.source}")
        sym_nodes = [_symbol_node(graph, s) for s in src.scalars]
        vals = [fakes(lw.buffers[name]) for name in src.outputs]
        kernels.append((k, src, sym_nodes, vals))
    _check_replaceable(gm, lw, groups)
    return lw, groups, kernels


def _check_replaceable(gm, lw, groups):
    """Every lowered node that an ATen call or the output still uses must be a kernel output."""
    stored = {b.node for g in groups for b in g.stored if b.node is not None}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n in lw.kept or n in stored:
            continue
        for u in n.users:
            if u.op == "output" or u in lw.kept:
                raise CodegenError(f"codegen: {n.name} is used by {u.name} but no kernel writes it")


def _toposort_groups(groups, lw):
    owner = {b.name: g for g in groups for b in g.nodes}
    from kiln.codegen.schedule import body, scatter_exprs
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


def _rewrite(gm, lw, groups, kernels):
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    position = {n: i for i, n in enumerate(graph.nodes)}
    produced, new_nodes, priority = {}, [], {}
    calls = [_kernel_call(lw, position, *k) for k in kernels]
    for g, call, (kernel, src, sym_nodes, vals) in zip(groups, calls, kernels):
        args = []
        for name in src.inputs:
            buf = lw.buffers[name]
            args.append(produced[name] if buf.compute is not None else buf.node)
        args += sym_nodes
        with graph.inserting_before(output):   # node names must not shadow the kernel's name
            node = graph.create_node("call_function", call, tuple(args), {}, name=f"fused_{src.outputs[0]}")
        first = min((position[b.node] for b in g.nodes if b.node in position), default=len(position))
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
    keep = set(lw.kept) | set(new_nodes) | set(produced.values())
    for n in reversed(list(graph.nodes)):
        if n.op in ("placeholder", "output") or n in keep:
            continue
        if n.users:
            raise CodegenError(f"codegen: lowered node {n.name} still has users {list(n.users)}")
        graph.erase_node(n)
    _stable_toposort(graph, position, priority)
    graph.lint()
    gm.recompile()
    return len(new_nodes)


def _kernel_call(lw, position, kernel, src, sym_nodes, vals):
    """The node target for one kernel: the kernel plus its group's original ATen nodes, which run
    if the kernel fails on its first call (``fallback.KernelCall``)."""
    ins = [lw.buffers[name].node for name in src.inputs] + list(sym_nodes)
    outs = [lw.buffers[name].node for name in src.outputs]
    try:
        fb = extract(ins, outs, len(vals) > 1, position)
    except Exception as e:   # NoFallback, or any surprise: the kernel just runs without one
        log(4 if isinstance(e, NoFallback) else 1,
            f"codegen: kernel {kernel.name} has no ATen fallback ({type(e).__name__}: {e})")
        fb = None
    return KernelCall(kernel, fb)


def _stable_toposort(graph, position, priority):
    """Reorder nodes topologically, keeping the original order where possible."""
    nodes = list(graph.nodes)
    rank = {n: priority.get(n, position.get(n, len(position))) for n in nodes}
    indeg = {n: len(set(n.all_input_nodes)) for n in nodes}
    heap = [(rank[n], i, n) for i, n in enumerate(nodes) if indeg[n] == 0]
    heapq.heapify(heap)
    order, idx = [], {n: i for i, n in enumerate(nodes)}
    while heap:
        _, _, n = heapq.heappop(heap)
        order.append(n)
        for u in n.users:
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
