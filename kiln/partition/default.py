"""The plain partition: run the forward as eager would and save the forward values the backward uses.

The forward is every node that does not depend on a tangent, up to the last node that the forward
outputs need (or that AOTAutograd tagged ``is_forward``, or that mutates). SymInt nodes computed from
forward values join the forward too, so a backward that only needs a size saves the size, not the
tensor. Nodes after that point that do not depend on tangents (``t(w)``, ``ones_like``) are recomputed
in the backward.
"""
from __future__ import annotations

from typing import List, Optional

import torch.fx as fx

from kiln.partition.extract import is_impure, is_sym, is_symint
from kiln.partition.joint_info import GraphIndex


def forward_ids(gi) -> list:
    """Per node of ``gi`` (a joint_info.GraphIndex): True when the plain partition runs it in the forward."""
    nodes, tang, idx = gi.nodes, gi.tang_l, gi.index
    roots = [idx[o] for o in gi.fwd_out if isinstance(o, fx.Node)]
    roots += [i for i, n in enumerate(nodes) if not tang[i] and n.op != "placeholder"
              and (n.meta.get("partitioner_tag") == "is_forward" or is_impure(n))]
    need = gi.ancestors_l(roots)
    last = max((i for i, x in enumerate(need) if x), default=-1)
    fwd = [not tang[i] and (i <= last or n.op == "placeholder") for i, n in enumerate(nodes)]
    for i, n in enumerate(nodes):  # cheap size arithmetic on forward values stays in the forward
        if not fwd[i] and not tang[i] and n.op == "call_function" and is_symint(n) \
                and all(fwd[a] for a in gi.inputs_of[i]):
            fwd[i] = True
    return fwd


def default_saved(joint_gm: fx.GraphModule, num_fwd_outputs: int, gi=None) -> List[fx.Node]:
    """Forward nodes used by a backward node or returned as a gradient, in graph order."""
    gi: Optional[GraphIndex] = gi or GraphIndex(joint_gm, num_fwd_outputs)
    fwd = forward_ids(gi)
    return [n for i, n in enumerate(gi.nodes) if fwd[i]
            and (n in gi.grads or any(not fwd[u] for u in gi.users_of[i]))]
