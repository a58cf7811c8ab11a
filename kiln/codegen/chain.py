"""Chained kernels: a small kernel that only reads another kernel's results runs inside it.

A split reduction is two kernels: the partial results over chunks of each row, then a short
reduction of the partials (a layer norm's weight and bias gradients, a full sum). The second one
is tiny (a few thousand elements) but costs a launch and a kernel boundary. ``chain(head, tail)``
writes them as one kernel: the head's programs run as before; each then counts itself done on a
counter (``sem_ptr``), and the last one to arrive runs the tail's body in a loop over all of the
tail's elements, as one program, through a ``@triton.jit`` helper (its own names, inlined by
Triton). It then sets the counter back to 0 for the next launch.

The order of events is the one a second launch gives: the barrier before the count makes the
program's stores visible to the device, and the tail loads past L1 (``.cg``), where the other
programs' writes are not seen. The tail reads only what the head stores (not the head's inputs,
which a later node could have changed in place), has static sizes, no random numbers and at most
``TAIL_MAX`` elements; the head is an ordinary kernel with a static, non-empty row count (not one
with its own last program). There is one counter per kernel module, device and stream.
"""
from __future__ import annotations

from kiln.codegen import launch, modsource
from kiln.codegen.kernel import PLACEHOLDER
from kiln.codegen.schedule import Group

TAIL_MAX = 1 << 16   # elements a chained tail may reduce or write (one program does them all)
TAIL_TILE = 4096     # elements of a reducing tail's tile on the GPU
ENABLED = True       # False: every group is a kernel of its own (for comparison)


def _fits(head, tail) -> bool:
    """The checks on the emitted pair (``_tails`` already left out scatters and tails with roles)."""
    if head.outer:
        return False
    total = tail.xnumel * tail.rnumel
    if not (total.is_Integer and 0 < int(total) <= TAIL_MAX) or tail.sizes or tail.seeds:
        return False
    if not (head.xnumel.is_Integer and int(head.xnumel) > 0):   # a head that may not launch at all
        return False
    stored = set(head.out_args)
    return bool(tail.inputs) and set(tail.inputs) <= stored and not head.seeds \
        and tail.g.nodes[0].device == head.g.nodes[0].device


def chain(head_group, tail_group, buffers, interpret, autotune):
    """The ``triton.Source`` of ``tail_group`` run by ``head_group``'s last program, or None when the
    pair does not qualify (see the module docstring)."""
    from kiln.codegen.triton import TritonKernel
    head = TritonKernel(head_group, buffers, interpret, autotune).prepare()
    tail = TritonKernel(tail_group, buffers, interpret, False)
    tail.single_program = True
    tail.load_suffix = modsource.past_l1(interpret)
    tail.prepare()
    if not _fits(head, tail):
        return None
    kind = "reduction" if tail.red else "pointwise"
    inner = bool(tail.dims) and tail.dims[-1][1]
    xb, rb, _ = launch.config(kind, int(tail.xnumel), int(tail.rnumel), tail.persistent, inner, interpret)
    if tail.red and tail.persistent and not interpret:
        # one program does the whole tail with the head's warps: a tile of TAIL_TILE elements per step
        # (a [64, S] tile took 48 dependent steps for a 3072-column bias gradient)
        xb = max(xb, min(launch.next_pow2(int(tail.xnumel)), max(1, TAIL_TILE // rb)))
    static_x, static_r = modsource._static(tail)
    call = [head.out_args[b] for b in tail.inputs] + [f"tail_ptr{i}" for i in range(len(tail.g.stored))]
    call += ([] if static_x else [str(int(tail.xnumel))]) + ([] if static_r or not tail.red else [str(int(tail.rnumel))])
    call += [str(xb)] + ([str(rb)] if tail.red else [])
    head.extra_params = [f"tail_ptr{i}" for i in range(len(tail.g.stored))] + ["sem_ptr"]
    head.extra_args = [f"tail{i}" for i in range(len(tail.g.stored))] + ["sem"]
    tail_name = PLACEHOLDER + "_tail"
    head.tail_lines = modsource.last_program_if(head) + [f"    {tail_name}({', '.join(call)})",
                                                          modsource.LAST_PROGRAM_RESET]
    return modsource.assemble(head, PLACEHOLDER, tail, tail_name)


def merged(head_group, tail_group) -> Group:
    """One group standing for a chained pair in the graph rewrite (members, stored buffers)."""
    return Group(head_group.dims, head_group.nodes + tail_group.nodes, head_group.kind,
                 head_group.stored + tail_group.stored, dict(head_group.roles))


def pairs(groups, buffers, autotune):
    """[(group, Source or None)] in order: each chainable tail folded into the kernel before it that
    stores what it reads (None: emit the group on its own)."""
    from kiln.codegen import triton
    tails = _tails(groups) if ENABLED else {}
    folded = set()
    out = []
    for g in groups:
        if id(g) in folded:
            continue
        tail = tails.get(id(g))
        interpret = g.nodes[0].device.type != "cuda" and not triton.EMIT_FOR_GPU
        src = chain(g, tail, buffers, interpret, autotune and not interpret) if tail is not None else None
        if src is not None:
            out.append((merged(g, tail), src))
            folded.add(id(tail))
        else:
            out.append((g, None))
    return out


def _tails(groups) -> dict:
    """{id(head): tail}: for each small group whose reads are all stored by one earlier group, that
    group (the first such tail per head; ``chain`` checks the emitted kernels)."""
    from kiln.codegen.indexing import prod
    from kiln.codegen.schedule import body, loads
    owner = {b.name: g for g in groups for b in g.stored}
    out, taken = {}, set()
    for h in groups:
        total = prod([s for s, _ in h.dims])
        if h.kind == "scatter" or h.roles or not (total.is_Integer and int(total) <= TAIL_MAX):
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
