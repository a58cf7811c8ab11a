"""Code generation for one graph, as data: ``generate(gm, opts, emit) -> Code``.

Lower the graph to the loop IR (``lower/``), group and plan kernels (``schedule/``), have the target's
emitter write each plan's text, name each kernel and extract its ATen fallback. Nothing here changes the
graph or builds anything (``codegen.rewrite``, ``kiln.runtime`` do). Nodes without a lowering stay ATen.
"""
from dataclasses import dataclass, replace
from typing import Optional

import sympy
import torch
import torch.fx

from kiln.codegen.fallback import NoFallback, extract, graph_inputs, size_expr
from kiln.codegen.ir.loops import Unsupported, release_indirect
from kiln.codegen.lower import Lowering, is_tensor
from kiln.codegen.schedule.chain import chain_plans
from kiln.codegen.schedule.domain import body, loads, scatter_exprs
from kiln.codegen.schedule.fuse import schedule
from kiln.codegen.schedule.group import GroupPlan, group_plans
from kiln.codegen.schedule.plan import ScatterPlan
from kiln.codegen.schedule.planner import numel_summary, plan_group
from kiln.codegen.text.source import Unit, named
from kiln.debug import log


class CodegenError(RuntimeError):
    """kiln could not generate kernels for a graph; without ``strict`` the graph stays ATen.
    Report it with the graph (``KILN_DEBUG=2``) and run with ``codegen='aten'`` meanwhile."""


@dataclass(frozen=True, eq=False)
class Generated:
    """One kernel of a graph: its node ``target`` (a named ``KernelRef``, or a declined kernel's ATen
    ``Fallback``), the nodes of its size arguments (``symbols``), whether it has a fallback of its own."""
    plan: object
    source: object
    target: object
    symbols: tuple
    vals: tuple
    own: bool


@dataclass(frozen=True, eq=False)
class Code:
    """What code generation makes of a graph: the lowering, the ``kernels`` in launch order, the C++ unit
    to build (or None) and, when some kernel has no ATen fallback of its own or a unit is to be built, the
    graph as it was (``unfused``). ``position``: each node's index in the graph."""
    lowering: object
    kernels: tuple
    unit: Optional[Unit]
    unfused: Optional[torch.fx.GraphModule]
    position: dict

    @property
    def plans(self) -> list:
        return [k.plan for k in self.kernels]


def generate(gm: torch.fx.GraphModule, opts, emit, group: bool = False) -> Code:
    """The kernels of ``gm``; ``emit(plans, on_cuda) -> (sources, unit)``: the target's emitter, which takes
    ``GroupPlan``s where ``group``."""
    try:
        return _generate(gm, opts, emit, group)
    finally:
        release_indirect()   # the indirect symbols of this graph's lowering


def _generate(gm, opts, emit, group) -> Code:
    lw = Lowering(gm, opts).run()
    groups = _toposort_groups(schedule(lw, opts.tuning), lw)
    summary = numel_summary(lw.buffers)
    plans = [plan_group(g, lw.buffers, opts.tuning, summary) for g in groups]
    plans = chain_plans(groups, plans, opts.tuning)   # small kernels chained into the one they read
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    if group:   # independent small kernels launched as one
        plans = group_plans(plans, lw.buffers, position, opts.tuning)
    sources, unit = emit(plans, on_cuda(gm))
    fakes = FakeMaker(gm.graph)
    kernels = []
    for plan, src in zip(plans, sources):
        if not src.text:   # declined: its ATen nodes run, reading the graph inputs they need too
            src = _declined(src, lw)
        symbols = tuple(_symbol_node(gm.graph, s) for s in src.scalars)
        vals = tuple(fakes(lw.buffers[name]) for name in src.outputs)
        kernels.append(_kernel(lw, position, plan, src, symbols, vals))
    _check_replaceable(gm, lw, plans)
    unit = unit if unit is not None and unit.functions else None
    unfused = None if all(k.own for k in kernels) and unit is None else _copy(gm)
    return Code(lw, tuple(kernels), unit, unfused, position)


def on_cuda(gm) -> bool:
    return any(is_tensor(n.meta.get("val")) and n.meta["val"].device.type == "cuda" for n in gm.graph.nodes)


def _kernel(lw, position, plan, src, symbols, vals) -> Generated:
    """One kernel: a ``KernelRef`` with the group's ATen nodes as fallback, or (declined) that fallback."""
    # the call passes the philox seeds after the sizes (``rewrite.seed_nodes``): the fallback takes them unused
    ins = [lw.buffers[name].node for name in src.inputs] + list(symbols) + [None] * src.seeds
    outs = [lw.buffers[name].node for name in src.outputs]
    why = None
    try:
        fb = extract(ins, outs, len(vals) > 1, position)
    except Exception as e:   # NoFallback, or any surprise: the kernel just runs without one
        fb, why = None, e
    if not src.text:
        if fb is None:
            raise CodegenError(f"codegen: a declined kernel has no ATen fallback ({why})")
        return Generated(plan, src, fb, symbols, vals, True)
    target = named(src, fb)
    log(4, f"codegen: kernel {target.name} ({len(members(plan))} buffers, {src.kind})\n{target.source}")
    if why is not None:
        log(4 if isinstance(why, NoFallback) else 1,
            f"codegen: kernel {target.name} has no ATen fallback of its own ({type(why).__name__}: {why}); "
            f"the graph keeps its ATen nodes for it")
    return Generated(plan, src, target, symbols, vals, fb is not None)


def members(plan) -> list:
    """The buffers a plan's kernel computes (its tail's or its group members' too)."""
    if isinstance(plan, ScatterPlan):
        return [plan.write.scatter.buffer]
    if isinstance(plan, GroupPlan):
        return [b for p in plan.plans for b in members(p)]
    return [m.buffer for m in plan.members] + (members(plan.tail) if plan.tail is not None else [])


def _declined(src, lw):
    nodes = {b.node: name for name, b in lw.buffers.items() if b.compute is None and b.node is not None}
    extra = graph_inputs([lw.buffers[n].node for n in src.inputs], [lw.buffers[n].node for n in src.outputs])
    # a size placeholder they read (a view's symbolic shape) becomes a size argument
    sizes = {size_expr(n) for n in extra if n not in nodes} - {None} - set(src.scalars)
    return replace(src, inputs=src.inputs + tuple(nodes[n] for n in extra if n in nodes),
                   scalars=src.scalars + tuple(sorted(sizes, key=str)))


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
        exprs = [e for b in g.nodes
                 for e in (scatter_exprs(b) if g.kind == "scatter" else [body(b, g.dims, g.role(b))])]
        deps[id(g)] = {id(owner[name]) for e in exprs for name, _ in loads(e) if owner.get(name, g) is not g}
    order, done = [], set()
    while len(order) < len(groups):
        before = len(order)
        for g in groups:
            if id(g) not in done and deps[id(g)] <= done:
                order.append(g)
                done.add(id(g))
        if len(order) == before:
            raise CodegenError("codegen: kernel groups depend on each other in a cycle")
    return order


def _copy(gm) -> torch.fx.GraphModule:
    """The graph as it is now (before kernels replace its nodes), runnable."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph, class_name="KilnUnfused")


class FakeMaker:
    """``maker(buf)``: a FakeTensor (the graph's mode) for a kernel-internal buffer crossing kernels."""

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

    def empty(self, shape, dtype, device, stride=None):
        """A FakeTensor (or a meta tensor where the graph has no fake mode) of a new tensor."""
        if self.table is None:
            self._scan()
        stride = stride if stride is not None else torch.empty(shape, device="meta").stride()
        if self.mode is None:
            return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        with self.mode:
            return torch.empty_strided(shape, stride, dtype=dtype, device=device)

    def __call__(self, buf):
        if buf.fake is not None:
            return buf.fake
        if self.table is None:
            self._scan()
        conv = lambda e: _to_symint(sympy.sympify(e), self.table)  # noqa: E731
        return self.empty([conv(s) for s in buf.shape], buf.dtype, buf.device, [conv(s) for s in buf.stride])


def _to_symint(e, table):
    if e.is_Integer:
        return int(e)
    if e in table:
        return table[e]
    if e.is_Add or e.is_Mul or (e.is_Pow and e.exp.is_Integer):
        terms = [e.base] * int(e.exp) if e.is_Pow else e.args
        out = 0 if e.is_Add else 1
        for t in terms:
            out = out + _to_symint(t, table) if e.is_Add else out * _to_symint(t, table)
        return out
    raise Unsupported(f"size {e} has no SymInt in the graph")


def _symbol_node(graph, sym):
    for n in graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.SymInt) and sympy.sympify(v.node.expr) == sym:
            return n
    raise Unsupported(f"no graph value carries size {sym}")
