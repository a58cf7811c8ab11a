"""Grouped kernels: independent pointwise kernels launched as one (horizontal fusion).

A bf16 training step casts each weight to bf16 in a kernel of its own, next to the matmul that reads it, and
each weight's gradient back to float32 after the matmul that makes it: dozens of tiny launches.
``group_plans`` makes runs of such kernels one ``GroupPlan``, whose emitter splits the programs of one launch
in ranges, one per member. Two kinds of members are independent (none reads what another stores, directly or
through other nodes) by construction:

- ``EARLY``: kernels reading graph inputs only (placeholders, constants), ready at the graph's start; the group
  runs at its first member's place (``rewrite`` places a kernel there) and later members' outputs live longer;
- ``LATE``: kernels reading no graph input whose outputs only the graph returns, which nothing waits for; the
  group runs once its last member's inputs are ready and earlier members' inputs live longer.

A group keeps at most ``tuning.group_live_bytes`` alive beyond its members' own kernels and has at most
``tuning.group_max`` members.
"""
from dataclasses import dataclass

from kiln.codegen.schedule.chain import static_sizes
from kiln.codegen.schedule.plan import Kind, KernelPlan, Programs


@dataclass(frozen=True, eq=False)
class GroupPlan:
    """Independent pointwise kernel ``plans`` launched as one: their programs in ranges, in order. It reads
    what they read and stores what they store (``outputs``: theirs, in order)."""
    plans: tuple

    @property
    def device(self):
        return self.plans[0].device

    @property
    def stored(self) -> tuple:
        return tuple(b for p in self.plans for b in p.stored)

    @property
    def reads(self) -> frozenset:
        return frozenset().union(*[p.reads for p in self.plans])

    symbols = frozenset()   # members have static sizes
    tail = None

    def outputs(self) -> list:
        return list(self.stored)

    def describe(self, title: str = "group") -> str:
        inner = "\n".join(p.describe(f"member {i}") for i, p in enumerate(self.plans))
        return f"{title}: {len(self.plans)} kernels in one launch\n  " + inner.replace("\n", "\n  ")


EARLY, LATE = "early", "late"


def _kind(plan, buffers):
    """``EARLY``, ``LATE`` (see the module docstring) or None for a kernel that joins no group: only pointwise
    kernels of static sizes without random numbers or indirect reads (bounds checks)."""
    if not isinstance(plan, KernelPlan) or plan.kind is not Kind.POINTWISE or plan.programs is not Programs.BLOCKS:
        return None
    if plan.tail is not None or plan.chained or plan.random or plan.wide_index or plan.outer or not static_sizes(plan):
        return None
    if int(plan.xnumel) <= 0 or any(e.op == "checked" for m in plan.members for e in m.value.walk()):
        return None
    inputs = [buffers[n] for n in plan.reads]
    given = [b.compute is None and b.node is not None and b.node.op in ("placeholder", "get_attr") for b in inputs]
    if all(given):
        return EARLY
    returned = all(b.node is not None and b.node.users and all(u.op == "output" for u in b.node.users)
                   for b in plan.stored)
    return LATE if returned and not any(given) and all(b.numel.is_Integer for b in inputs) else None


def _nbytes(bufs) -> int:
    return sum(int(b.numel) * b.dtype.itemsize for b in bufs)


def group_plans(plans, buffers: dict, position: dict, tuning) -> list:
    """``plans`` (in launch order) with runs of kernels of one kind (in graph order, per device) made
    ``GroupPlan``s; ``position``: each FX node's index (a plan's place: its first member's)."""
    if not tuning.group_kernels or tuning.group_max < 2:
        return list(plans)
    place = {id(p): min((position[m.buffer.node] for m in p.members if m.buffer.node in position),
                        default=len(position)) for p in plans if isinstance(p, KernelPlan)}
    kinds = {id(p): _kind(p, buffers) for p in plans}
    runs, last = [], {}   # (device, kind) -> (its open run, the bytes it keeps alive beyond its members' kernels)
    for p in sorted((p for p in plans if kinds[id(p)] is not None), key=lambda p: place[id(p)]):
        key = (p.device, kinds[id(p)])
        run, extra = last.get(key, (None, 0))
        if run is not None:   # an early member's outputs made before their time, a late one's inputs kept
            extra += _nbytes(p.stored) if key[1] == EARLY else _nbytes(buffers[n] for n in run[-1].reads)
        if run is not None and len(run) < tuning.group_max and extra <= tuning.group_live_bytes:
            run.append(p)
            last[key] = (run, extra)
        else:
            last[key] = ([p], 0)
            runs.append((key[1], last[key][0]))
    # in launch order, a group takes its first member's turn (early: before any reader of its results) or its
    # last one's (late: after every writer of its inputs)
    turn = {i: n for n, i in enumerate(map(id, plans))}
    at = {id((min if kind == EARLY else max)(r, key=lambda p: turn[id(p)])): GroupPlan(tuple(r))
          for kind, r in runs if len(r) > 1}
    grouped = {id(p) for _, r in runs if len(r) > 1 for p in r}
    return [at.get(id(p), p) for p in plans if id(p) not in grouped or id(p) in at]
