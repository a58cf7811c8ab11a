"""The plain partition: run the forward as eager would and save the forward values the backward uses.

The forward is every node that does not depend on a tangent, up to the last node that the forward
outputs need (or that AOTAutograd tagged ``is_forward``). SymInt nodes computed from forward values
join the forward too, so a backward that only needs a size saves the size, not the tensor. Nodes after
that point that do not depend on tangents (``t(w)``, ``ones_like``) are recomputed in the backward.
"""
from __future__ import annotations

from typing import List

import torch.fx as fx

from kiln.partition.extract import is_impure, is_sym, split_outputs, tangent_closure


def forward_nodes(joint: fx.Graph, num_fwd_outputs: int) -> set:
    """The nodes the plain partition runs in the forward."""
    tang = tangent_closure(joint)
    fwd_out, _ = split_outputs(joint, num_fwd_outputs)
    nodes = list(joint.nodes)
    roots = [o for o in fwd_out if isinstance(o, fx.Node)]
    roots += [n for n in nodes if n not in tang and n.op != "output"
              and (n.meta.get("partitioner_tag") == "is_forward" or (is_impure(n) and n.op != "placeholder"))]
    need, stack = set(), roots
    while stack:
        n = stack.pop()
        if n not in need:
            need.add(n)
            stack.extend(n.all_input_nodes)
    last = max((i for i, n in enumerate(nodes) if n in need), default=-1)
    fwd = {n for n in nodes[: last + 1] if n not in tang and n.op != "output"}
    fwd |= {n for n in nodes if n.op == "placeholder" and n not in tang}
    for n in nodes:  # cheap size arithmetic on forward values stays in the forward
        if n not in fwd and n not in tang and n.op == "call_function" and is_sym(n) \
                and all(a in fwd for a in n.all_input_nodes):
            fwd.add(n)
    return fwd


def default_saved(joint: fx.Graph, num_fwd_outputs: int) -> List[fx.Node]:
    """Forward nodes used by a backward node or returned as a gradient, in graph order."""
    fwd = forward_nodes(joint, num_fwd_outputs)
    _, grads = split_outputs(joint, num_fwd_outputs)
    grads = {g for g in grads if isinstance(g, fx.Node)}
    return [n for n in joint.nodes if n in fwd
            and (n in grads or any(u not in fwd and u.op != "output" for u in n.users))]
