"""Min-cut rematerialization: choose the forward values to save so the backward can recompute the rest.

A vertex pair per tangent-free node: ``in_n -> out_n`` costs saving ``n`` (``JointInfo.weight``), ``out_n
-> in_u`` is infinite per user ``u``, ``out_n -> sink`` when the backward uses ``n``, ``source -> in_n``
when ``Policy`` bans recomputing ``n``. The cut's ``in -> out`` edges are the saved values (scipy's Dinic).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import FrozenSet, List, Optional

import numpy as np
import torch
import torch.fx as fx

from kiln import logs
from kiln.debug import log, wanted
from kiln.partition import ops
from kiln.partition.extract import PartitionError
from kiln.partition.joint_info import JointInfo

_SCALE_TOTAL = 2 ** 29  # finite capacities are scaled to sum to at most this (int32 flows)
_INF_CAP = 2 ** 30


@dataclass(frozen=True)
class Policy:
    """Which nodes must not be recomputed. Random and impure nodes and primals are always banned."""
    ban_heavy: bool = True           # matmul/conv/attention
    allowlist: bool = True           # ban ops outside the cheap-to-recompute list
    ban_materialized: bool = True    # ban nodes the forward returns or whose backward user (through views) does not
    #                                  fuse, and those whose recompute reads many saved tensors (``JointInfo.wide``)
    ban_reductions: bool = True      # ban reductions that shrink their input more than 4x
    dont_ban: FrozenSet[fx.Node] = field(default_factory=frozenset)  # lift the optional bans for these


RUNTIME_OPTIMAL = Policy()
MORE_AGGRESSIVE = Policy(ban_materialized=False)
AGGRESSIVE = Policy(ban_materialized=False, allowlist=False)
RECOMPUTE_ALL = Policy(ban_heavy=False, allowlist=False, ban_materialized=False, ban_reductions=False)


def ban_mask(info: JointInfo, policy: Policy) -> np.ndarray:
    """Boolean array over ``info.nodes``: True where the node must not be recomputed."""
    lift = np.zeros(len(info.nodes), dtype=bool)
    for n in policy.dont_ban:   # a lifted multi-output op lifts its getitems
        lift[[info.index[m] for m in (n, *n.users) if m is n or ops.is_getitem(m)]] = True
    optional = (policy.ban_heavy & info.heavy) | (policy.allowlist & ~info.cheap & ~info.heavy) | \
        (policy.ban_reductions & info.big_reduction) | (policy.ban_materialized & (info.materialized | info.wide))
    optional &= ~info.view & ~lift
    static = np.zeros(len(info.nodes), dtype=bool)
    static[list(info.static_reason)] = True
    return static | (optional & info.is_call)


def ban_reason(info: JointInfo, n: fx.Node, policy: Policy) -> Optional[str]:
    """Why ``n`` must be computed in the forward (None: it may be recomputed in the backward)."""
    i = info.index[n]
    if i in info.static_reason:
        return info.static_reason[i]
    if n.op != "call_function" or info.view[i] or not ban_mask(info, policy)[i]:
        return None
    if info.heavy[i]:
        return "compute-heavy"
    if policy.allowlist and not info.cheap[i]:
        return "not on the recompute list"
    if policy.ban_reductions and info.big_reduction[i]:
        return "reduction shrinks its input >4x"
    if n in info.fwd_out:
        return "returned by the forward"
    if info.wide[i] and not info.materialized[i]:
        return "recompute reads many saved tensors"
    return "backward user does not fuse"


def min_cut(info: JointInfo, policy: Policy) -> List[fx.Node]:
    """The saved values of the minimum cut under ``policy``, in graph order (cached: searches repeat cuts)."""
    cache = info.__dict__.setdefault("_cuts", {})
    if policy not in cache:
        cache[policy] = _min_cut(info, policy)
    return list(cache[policy])


def _min_cut(info: JointInfo, policy: Policy) -> List[fx.Node]:
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import breadth_first_order, maximum_flow

    fw_ids, k = info.fw_ids, len(info.fw_ids)
    nv = 2 + 2 * k
    local = np.full(len(info.nodes), -1, dtype=np.int64)
    local[fw_ids] = np.arange(k)
    ins, outs = 2 + 2 * np.arange(k), 3 + 2 * np.arange(k)
    w, finite = info.weight, np.isfinite(info.weight)
    total = float(w[finite].sum()) or 1.0
    scaled = np.where(finite, np.ceil(np.where(finite, w, 0) * (_SCALE_TOTAL / total)), _INF_CAP)
    scaled = np.where(w > 0, np.maximum(scaled, 1), 0).astype(np.int64)
    banned = ban_mask(info, policy)[fw_ids]
    src, dst, cap = [], [], []

    def add(u, v, c):
        src.append(u)
        dst.append(v)
        cap.append(np.broadcast_to(np.asarray(c, dtype=np.int64), np.shape(u)))

    pos = scaled > 0
    add(ins[pos], outs[pos], scaled[pos])
    add(np.zeros(int(banned.sum()), dtype=np.int64), ins[banned], _INF_CAP)
    mr = info.must_recompute[fw_ids]
    add(ins[mr], np.ones(int(mr.sum()), dtype=np.int64), _INF_CAP)
    bw = info.used_by_bw[fw_ids]
    add(outs[bw], np.ones(int(bw.sum()), dtype=np.int64), _INF_CAP)
    lu, lv = (local[e] for e in info.user_edges())
    keep = (lu >= 0) & (lv >= 0)
    add(outs[lu[keep]], ins[lv[keep]], _INF_CAP)
    u, v, c = np.concatenate(src), np.concatenate(dst), np.concatenate(cap)
    cap_m = csr_matrix((c.astype(np.int32), (u, v)), shape=(nv, nv))
    res = maximum_flow(cap_m, 0, 1, method="dinic")
    if res.flow_value >= _INF_CAP:
        bad = [n.name for n, b, ww in zip(info.fw, bw, w) if b and not np.isfinite(ww)]
        raise PartitionError(f"partition: no finite cut; the backward needs values that can be neither "
                             f"saved nor recomputed: {bad[:5]}")
    resid = (cap_m - res.flow).tocsr()
    resid.data[resid.data < 0] = 0
    resid.eliminate_zeros()
    reach = np.zeros(nv, dtype=bool)
    reach[breadth_first_order(resid, 0, directed=True, return_predecessors=False)] = True
    return [info.fw[i] for i in np.flatnonzero(reach[ins] & ~reach[outs])]


def activation_bytes(info: JointInfo, saved) -> int:
    """Bytes of the saved tensors that are not graph inputs."""
    return sum(info.size.get(n, 0) for n in saved if n.op != "placeholder")


# -- the decisions in words -------------------------------------------------------------------------
REMAT = "kiln_remat"   # the artifact (torch's logging) of remat decisions


def source_line(n: fx.Node) -> str:
    """``file:line: code`` of the user's innermost frame that made ``n`` (``meta['stack_trace']``, torch's
    frames skipped; a node a pass made without one takes its nearest neighbour's)."""
    frames = [f for f in _FRAME.findall(_described(n).meta.get("stack_trace") or "") if not f[0].startswith(_TORCH_DIR)]
    if not frames:
        return ""
    (path, line, code), here = frames[-1], os.getcwd() + os.sep
    return f"{path[len(here):] if path.startswith(here) else path}:{line}: {code.strip()}"


def module_path(n: fx.Node) -> str:
    """The module that made ``n`` as its user names it (``layers.0.attn``; '' outside any module), from
    ``meta['nn_module_stack']`` (a backward node's ``fwd_nn_module_stack``)."""
    meta = _described(n).meta
    stack = list((meta.get("nn_module_stack") or meta.get("fwd_nn_module_stack") or {}).values())
    return user_path(str(stack[-1][0] if isinstance(stack[-1], tuple) else stack[-1])) if stack else ""


def user_path(source: str) -> str:
    """Dynamo's name of a module or tensor as the user writes it: ``L['self']._modules['layers']._modules['0']
    ._parameters['weight']`` -> ``layers.0.weight``, ``G['m'].attn`` -> ``m.attn``, ``L['x']`` -> ``x``."""
    s = re.sub(r"\._(?:modules|parameters|buffers)\[(['\"])(.*?)\1\]", r".\2", source)
    s = re.sub(r"^L\[(['\"])(?:self|fn)\1\]\.?", "", s)   # the compiled module (``fn``: Dynamo's wrapper)
    s = re.sub(r"^[LG]\[(['\"])(.*?)\1\]", r"\2", s)
    return re.sub(r"\[(['\"]?)([^\]]*?)\1\]", r".\2", s)


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in [^\n]*(?:\n(?![ \t]*File ")([^\n]*))?')
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_WHENCE = ("stack_trace", "nn_module_stack", "fwd_nn_module_stack")


def _described(n: fx.Node) -> fx.Node:
    """``n``, or when a pass made it without provenance (``_WHENCE``), the nearest call node that has it."""
    todo, seen = [n], {n}
    while todo and len(seen) < 64 and n.op == "call_function":
        cur = todo.pop(0)
        if any(k in cur.meta for k in _WHENCE):
            return cur
        for m in (*cur.users, *cur.all_input_nodes):
            if m not in seen and m.op == "call_function":
                seen.add(m)
                todo.append(m)
    return n


def log_decisions(info: JointInfo, saved, policy: Policy, tag: str) -> None:
    """KILN_DEBUG=3, the ``kiln_remat`` artifact and trace entry: what is saved (bytes, why) and recomputed."""
    if not wanted(3, REMAT) and not logs.tracing():
        return
    saved_set = set(saved)
    lines = [f"remat[{tag}]: save {n.name} ({info.size.get(n, 0)} B, "
             f"{ban_reason(info, n, policy) or 'cheapest cut'}){_at(n)}" for n in saved]
    lines += [f"remat[{tag}]: recompute {n.name} ({info.size.get(n, 0)} B){_at(n)}" for n in info.fw
              if n not in saved_set and n.op == "call_function" and _recomputed(info, n, saved_set)]
    for line in lines:
        log(3, line, artifact=REMAT)
    logs.trace(f"kiln_remat_{tag}", lambda: "\n".join(lines))


def _recomputed(info: JointInfo, n: fx.Node, saved_set: set) -> bool:
    """Some backward node or gradient needs ``n`` through values that are not saved."""
    stack, seen = [n], set()
    while stack:
        cur = stack.pop()
        for u in cur.users:
            if u in info.tang or u in info.grads:
                return True
            if u not in seen and u not in saved_set and u in info.size:
                seen.add(u)
                stack.append(u)
    return False


def _at(n: fx.Node) -> str:
    where, line = module_path(n), source_line(n)
    return (f" in {where}" if where else "") + (f" at {line}" if line else "")
