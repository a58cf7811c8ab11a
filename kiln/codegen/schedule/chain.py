"""Chained kernels: a small kernel that only reads another kernel's results runs inside it.

The second kernel of a split reduction (the short reduction of the partials) is tiny but costs a launch.
``chain_plans`` makes such a pair one kernel (``KernelPlan.tail``): each of the head's programs counts itself
done, and the last to arrive runs the tail as one program (``Programs.ONE``, ``chained``; the counting is
the emitter's). The tail reads only what the head stores (not its inputs, which a later node could change
in place); both have static sizes, since the tail's call passes no size symbol.
"""
from dataclasses import replace

import sympy

from kiln.codegen.ir.indexing import prod
from kiln.codegen.schedule.domain import body, loads
from kiln.codegen.schedule.plan import KernelPlan, Programs
from kiln.options import Tuning


def fits(head: KernelPlan, tail: KernelPlan, tuning: Tuning) -> bool:
    """Whether ``tail`` may run in ``head``'s last program (see the module docstring)."""
    if head.outer or head.tail is not None:
        return False
    total = tail.xnumel * tail.rnumel
    if not (total.is_Integer and 0 < int(total) <= tuning.tail_max) or tail.symbols or tail.random:
        return False
    # not a head that may not launch at all; static sizes: the tail's call passes no size arguments
    if not (head.xnumel.is_Integer and int(head.xnumel) > 0 and static_sizes(head) and static_sizes(tail)):
        return False
    stored = {b.name for b in head.stored}
    return bool(tail.reads) and tail.reads <= stored and not head.random and tail.device == head.device


def static_sizes(plan: KernelPlan) -> bool:
    """Whether ``plan`` has no size symbol: not in its indices, numels, nor its stored buffers' layouts."""
    sizes = [plan.xnumel, plan.rnumel] + [x for b in plan.stored for x in (*b.shape, *b.stride)]
    return not plan.symbols and all(sympy.sympify(x).is_Integer for x in sizes)


def tails(groups, tuning: Tuning) -> dict:
    """{id(head group): tail group}: a small group whose reads are all stored by one earlier group (the
    first such tail per head; ``fits`` checks the plans)."""
    owner = {b.name: g for g in groups for b in g.stored}
    out, taken = {}, set()
    for h in groups:
        total = prod([s for s, _ in h.dims])
        if h.kind == "scatter" or h.roles or not (total.is_Integer and int(total) <= tuning.tail_max):
            continue
        mine = {b.name for b in h.nodes}
        reads = {n for b in h.nodes for n, _ in loads(body(b, h.dims, h.role(b)))} - mine
        heads = {owner.get(n) for n in reads}
        if len(heads) != 1 or None in heads:
            continue
        head = heads.pop()
        if head is h or head.kind == "scatter" or id(head) in out or id(head) in taken:
            continue
        out[id(head)] = h
        taken.add(id(h))
    return out


def chain_plans(groups, plans, tuning: Tuning) -> list:
    """``plans`` (one per group, in order) with each chainable tail folded into its head's plan."""
    pairs = tails(groups, tuning) if tuning.chain else {}
    index = {id(g): i for i, g in enumerate(groups)}
    out, folded = [], set()
    for g, plan in zip(groups, plans):
        if id(g) in folded:
            continue
        tail = pairs.get(id(g))
        if tail is not None:
            tail_plan = replace(plans[index[id(tail)]], programs=Programs.ONE, chained=True)
            if fits(plan, tail_plan, tuning):
                plan = replace(plan, tail=tail_plan)
                folded.add(id(tail))
        out.append(plan)
    return out
