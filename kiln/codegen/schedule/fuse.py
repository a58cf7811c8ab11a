"""Fusion: group the computed buffers of a lowered graph into kernels (``Group``s over a domain).

Buffers are visited in topological order; each joins the first group (a producer's, then a sibling's that
shares an input) where the domains agree (a pointwise group takes on a reduction's domain if all members
still fit), every read of a member is of the element the kernel computes (in registers: a layer norm's
reductions and epilogue share one kernel), and no path leaves the group and comes back (a cycle). A buffer
is stored when something outside its kernel reads it.
"""
from dataclasses import dataclass, field

import torch

from kiln.codegen.ir.indexing import equal, prod, same_sizes
from kiln.codegen.ir.loops import Pointwise, Reduction, Scatter
from kiln.codegen.schedule.colpart import colpart_shape
from kiln.codegen.schedule.domain import (Role, body, current, dims_key, domain_ranges, loads, node_dims, scatter_exprs,
                                          squeeze)
from kiln.codegen.schedule.split import split_reductions
from kiln.options import Tuning


@dataclass(eq=False)
class Group:
    """One kernel: ``nodes`` (computed buffers, topological order) over the domain ``dims``."""
    dims: tuple
    nodes: list = field(default_factory=list)
    kind: str = "pointwise"   # 'pointwise' | 'reduction' | 'scatter'
    stored: list = field(default_factory=list)   # buffers written to memory (set by schedule())
    roles: dict = field(default_factory=dict)    # buffer name -> Role, for members that are not rows

    def role(self, buf) -> Role:
        return self.roles.get(buf.name, Role.ROW)

    @property
    def xs(self):
        return [s for s, r in self.dims if not r]

    @property
    def rs(self):
        return [s for s, r in self.dims if r]

    @property
    def ranges(self):
        return domain_ranges(self.dims)


class Scheduler:
    """Greedy fusion over one lowering; ``run()`` returns the groups in topological order."""

    def __init__(self, lowering, tuning: Tuning):
        self.lw, self.tuning = lowering, tuning
        self.buffers = lowering.buffers
        self.groups, self.group_of, self.reads = [], {}, {}
        self.readers = {}   # buffer name -> groups that read it (for sibling fusion)
        self._succ = None
        self._rank = None          # unit -> position in a topological order of _succ
        self._grouped_rank = -1    # at least the rank of every unit ever put in a group

    # -- dependency graph over units (computed buffers and kept FX nodes) ---------------------
    def _build_graph(self):
        succ = {}
        for buf in self.lw.computed:
            succ.setdefault(buf, set())
            for name in self.reads[buf]:
                b = self.buffers[name]
                u = b if b.compute is not None else b.node
                if u is not None:
                    succ.setdefault(u, set()).add(buf)
        for node in self.lw.kept:
            succ.setdefault(node, set())
            for a in node.all_input_nodes:
                v = self.lw.values.get(a)
                u = a if a in self.lw.kept else v.buffer if isinstance(v, Pointwise) else None
                if u is not None:
                    succ.setdefault(u, set()).add(node)
        self._succ = succ
        self._rank = _topological_rank(succ)

    def _cycle(self, members):
        """Whether merging ``members`` into one kernel would create a dependency cycle. An ungrouped unit
        ranked above every grouped unit and member leads only to higher ranks: it is not walked."""
        rank = self._rank
        top = max(self._grouped_rank, max(rank[m] for m in members))
        stack = [s for m in members for s in self._succ.get(m, ()) if s not in members]
        seen = set()
        while stack:
            u = stack.pop()
            if u in members:
                return True
            if id(u) in seen:
                continue
            seen.add(id(u))
            g = self.group_of.get(u)
            if g is None and rank[u] > top:
                continue
            for m in (g.nodes if g is not None else [u]):
                seen.add(id(m))
                stack.extend(s for s in self._succ.get(m, ()) if s in members or id(s) not in seen)
        return False

    # -- grouping ----------------------------------------------------------------------------
    def run(self):
        split_reductions(self.lw, self.tuning)
        for buf in self.lw.computed:
            exprs = scatter_exprs(buf) if isinstance(buf.compute, Scatter) else [body(buf, node_dims(buf))]
            self.reads[buf] = {n for e in exprs for n, _ in loads(e)}
        self._build_graph()
        self.order = {b: i for i, b in enumerate(self.lw.computed)}
        for buf in self.lw.computed:
            self._add(buf)
        self._merge_outer()
        self._merge_updates()
        for g in self.groups:
            g.stored = [b for b in g.nodes if self._needed_outside(b, g)]
        return [g for g in self.groups if g.stored]

    def _add(self, buf):
        if isinstance(buf.compute, Scatter):
            return self._new_group(buf, (), "scatter")
        reads = sorted(self.reads[buf])
        producers = [p for p in (self.group_of.get(self.buffers[n]) for n in reads) if p is not None]
        siblings = [g for n in reads for g in self.readers.get(n, ())]
        # and readers of a producer kernel's other outputs (the halves of split reductions over the same rows)
        cousins = [g for p in producers for b in p.nodes for g in self.readers.get(b.name, ())]
        candidates = list(dict.fromkeys(g for g in producers + siblings + cousins if g.kind != "scatter"))
        for g in candidates:
            if self._try_join(g, buf):
                for other in candidates:
                    if other is not g and other in self.groups and self.group_of.get(buf) is g:
                        self._try_merge(g, other)
                return
        kind = "reduction" if isinstance(buf.compute, Reduction) else "pointwise"
        self._new_group(buf, node_dims(buf), kind)

    def _new_group(self, buf, dims, kind):
        g = Group(dims, [], kind, roles={buf.name: Role.COLPART} if colpart_shape(buf) is not None else {})
        self.groups.append(g)
        self._join(g, buf)

    def _join(self, g, buf):
        g.nodes.append(buf)
        self.group_of[buf] = g
        self._grouped_rank = max(self._grouped_rank, self._rank[buf])
        for name in self.reads[buf]:
            self.readers.setdefault(name, []).append(g)

    def _role(self, g, buf) -> Role:
        """How ``buf`` would sit in ``g``: a row, an outer reduction or a scalar epilogue."""
        c = buf.compute
        if isinstance(c, Reduction) and c.fold:
            return Role.COLPART
        if g.kind != "reduction" or not g.rs:
            return Role.ROW
        xs = g.xs
        if isinstance(c, Reduction) and not c.split and len(c.reduced) == len(c.ranges) and len(c.ranges) > 0 \
                and c.kind in ("sum", "max", "min", "prod") and same_sizes(squeeze(c.ranges), xs):
            if not prod(xs).is_Integer or int(prod(xs)) > 1:
                return Role.OUTER
        if isinstance(c, Pointwise) and not squeeze(buf.shape) and Role.OUTER in g.roles.values():
            return Role.SCALAR
        return Role.ROW

    def _try_join(self, g, buf, cycle=True, near=True):
        if len(g.nodes) >= self.tuning.max_group or (near and self._far(g, buf)):
            return False
        is_red = isinstance(buf.compute, Reduction)
        role = self._role(g, buf)
        dims = g.dims
        if not self._roles_agree(g, buf, role):
            return False
        if role is Role.COLPART and g.kind == "pointwise":
            dims = node_dims(buf)   # the pointwise members must fit the partial's (rows, columns)
        if role is Role.ROW:
            if is_red and g.kind == "reduction" and dims_key(node_dims(buf)) != dims_key(g.dims):
                return False
            if is_red and g.kind == "pointwise":
                dims = node_dims(buf)
        members = g.nodes + [buf]
        roles = {**g.roles, buf.name: role} if role is not Role.ROW else g.roles
        check = members if dims is not g.dims else [buf]
        for b in check:
            e = body(b, dims, roles.get(b.name, Role.ROW))
            if e is None or not self._reads_current(e, members, dims, roles, roles.get(b.name, Role.ROW)):
                return False
        if cycle and self._cycle(set(members)):
            return False
        g.dims, g.roles = dims, roles
        if is_red:
            g.kind = "reduction"
        self._join(g, buf)
        return True

    def _roles_agree(self, g, buf, role) -> bool:
        """A kernel's colparts have the same row chunks, and a kernel with colparts no outer reduction."""
        roles = set(g.roles.values())
        if role is Role.COLPART:
            mine = colpart_shape(buf)
            others = [colpart_shape(b) for b in g.nodes if g.role(b) is Role.COLPART]
            return not roles & {Role.OUTER, Role.SCALAR} and all(same_sizes(o, mine) for o in others)
        return not (role in (Role.OUTER, Role.SCALAR) and Role.COLPART in roles)

    def _far(self, g, buf) -> bool:
        """Joining ``buf`` to ``g`` would compute it far earlier than the graph does (a kernel runs where its
        first member was): a far sibling or producer pulls the backward's recomputation into its first
        phase (partition/hold.py). A consumer may follow its producer member within ``tuning.near`` graph
        nodes; a sibling may join only while the kernel spans at most that many."""
        pos = self._fx_position()
        here = pos.get(buf.node)
        if here is None:
            return False
        names = self.reads[buf]
        producers = [pos[m.node] for m in g.nodes if m.name in names and m.node in pos]
        if producers:
            return here - max(producers) > self.tuning.near
        span = [pos[m.node] for m in g.nodes if m.node in pos] + [here]
        return max(span) - min(span) > self.tuning.near

    def _fx_position(self) -> dict:
        if getattr(self, "_pos", None) is None:
            graphs = {b.node.graph for b in self.lw.computed if getattr(b, "node", None) is not None}
            self._pos = {n: i for gr in graphs for i, n in enumerate(gr.nodes)}
        return self._pos

    def _try_merge(self, g, h, near=True):
        """Merge group ``h`` into ``g``: join its buffers one by one, then check the whole."""
        if h.kind == "scatter" or g.kind == "scatter" or len(g.nodes) + len(h.nodes) > self.tuning.max_group:
            return False
        saved = (list(g.nodes), g.dims, dict(g.roles), g.kind)

        def undo():
            g.nodes, g.dims, g.roles, g.kind = saved
            for b in h.nodes:
                self.group_of[b] = h
            return False
        for b in sorted(h.nodes, key=self.order.get):
            if not self._try_join(g, b, cycle=False, near=near):
                return undo()
        g.nodes.sort(key=self.order.get)
        for b in g.nodes:
            e = body(b, g.dims, g.role(b))
            if e is None or not self._reads_current(e, g.nodes, g.dims, g.roles, g.role(b)):
                return undo()
        if self._cycle(set(g.nodes)):
            return undo()
        for lst in self.readers.values():
            lst[:] = [g if x is h else x for x in lst]
        self.groups.remove(h)
        return True

    def _merge_outer(self):
        """Fold groups of whole-tensor reductions (a loss's sums) into a row kernel they read."""
        for h in list(self.groups):
            if h not in self.groups or h.kind != "reduction" or h.xs:
                continue
            for g in list(self.groups):
                if g is not h and g.kind == "reduction" and g.rs and self._try_merge(g, h):
                    break

    def _merge_updates(self):
        """Horizontal fusion of input updates: pointwise kernels over one domain of at most
        ``tuning.merge_updates`` elements whose every output is a graph input's new value (an optimizer's
        per-parameter steps, running statistics) merge into one kernel, however far apart (``max_group``
        members at most). Not over large domains: one loop writing many tensors ran slower on the CPU."""
        heads: dict = {}
        for h in list(self.groups):
            n = prod(h.xs)
            if h.kind != "pointwise" or h.roles or not n.is_Integer or int(n) > self.tuning.merge_updates or not all(
                    _written_back(b) for b in h.nodes if self._needed_outside(b, h)):
                continue
            same = heads.setdefault(dims_key(h.dims), [])
            if not any(self._try_merge(g, h, near=False) for g in same):
                same.append(h)

    def _reads_current(self, expr, members, dims, roles, reader):
        """Every read of a member is of the element this kernel has in registers."""
        ranges = domain_ranges(dims)
        names = {b.name for b in members}
        for name, index in loads(expr):
            if name not in names:
                continue
            role = roles.get(name, Role.ROW)
            if role is Role.COLPART:   # known only when the program's chunk is done, read by another kernel
                return False
            after = role in (Role.OUTER, Role.SCALAR)   # known only after the loop over rows
            if after != (reader is Role.SCALAR):
                return False
            if not equal(index, current(self.buffers[name], dims, role), ranges):
                return False
        return True

    def _needed_outside(self, buf, g):
        users = buf.node.users if buf.node is not None else ()
        return any(u.op == "output" or u in self.lw.kept for u in users) or any(
            self.group_of.get(o) is not g and buf.name in self.reads[o] for o in self.lw.computed)


def _written_back(buf) -> bool:
    """Whether the graph copies ``buf`` into one of its inputs (AOTAutograd's input mutation)."""
    return buf.node is not None and any(u.target is torch.ops.aten.copy_.default and u.args[0].op == "placeholder"
                                        and u.args[1] is buf.node for u in buf.node.users)


def _topological_rank(succ) -> dict:
    """unit -> the length of the longest path reaching it in ``succ`` (a successor always ranks higher)."""
    indeg = {}
    for u, ss in succ.items():
        indeg.setdefault(u, 0)
        for s in ss:
            indeg[s] = indeg.get(s, 0) + 1
    rank = dict.fromkeys(indeg, 0)
    ready = [u for u, d in indeg.items() if d == 0]
    done = 0
    while ready:
        u = ready.pop()
        done += 1
        for s in succ.get(u, ()):
            rank[s] = max(rank[s], rank[u] + 1)
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    if done != len(indeg):   # not a DAG (never expected): no pruning
        return dict.fromkeys(indeg, -1)
    return rank


def schedule(lowering, tuning: Tuning):
    """Group ``lowering.computed`` into kernels (see the module docstring)."""
    return Scheduler(lowering, tuning).run()
