"""FlexAttention's higher-order ops as kiln finds them in a post-grad graph: ``parse(gm, node) -> FlexCall``.

``flex_attention(q, k, v, score_mod, block_mask, scale, kernel_options, score_mod_other_buffers,
mask_mod_other_buffers) -> (out, lse[, max_scores])`` and ``flex_attention_backward(q, k, v, out, lse,
grad_out, grad_lse, fw_graph, joint_graph, block_mask, scale, kernel_options, score_mod_other_buffers,
mask_mod_other_buffers) -> (dq, dk, dv, (grads of the score_mod's buffers))``. The subgraphs are
``get_attr`` nodes of GraphModules. The block mask is a tuple: torch 2.13 writes ``(q_len, kv_len,
kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, q_num_blocks, q_indices,
full_q_num_blocks, full_q_indices, dq_write_order, dq_write_order_full, dq_kv_order, dq_kv_order_spt,
Q_BLOCK_SIZE, KV_BLOCK_SIZE, mask_mod)``; 2.11 has no ``dq_*`` entries (13 in all) and older releases
no lengths (11). Both ends are fixed: the eight index tensors follow the lengths when there are any,
the block sizes and the mask_mod close the tuple. The logsumexp the ops exchange is in base 2.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from kiln.codegen.ir.loops import Unsupported

MASK_NAMES = ("kv_num", "kv_idx", "full_kv_num", "full_kv_idx", "q_num", "q_idx", "full_q_num", "full_q_idx")
FORWARD = "flex_attention"
BACKWARD = "flex_attention_backward"


def hop_name(node) -> str:
    """'flex_attention', 'flex_attention_backward' or '' for any other node."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return ""
    name = node.target.name()
    return name if name in (FORWARD, BACKWARD) else ""


@dataclass
class FlexCall:
    """One FlexAttention op of a graph, its operands named by role (graph nodes, or None)."""
    node: fx.Node
    backward: bool
    q: fx.Node
    k: fx.Node
    v: fx.Node
    score: fx.GraphModule
    mask: fx.GraphModule
    masks: dict            # MASK_NAMES -> node or None
    q_bs: int
    kv_bs: int
    scale: float
    options: dict
    score_bufs: tuple      # nodes (tensors or SymInts) or ints
    mask_bufs: tuple
    joint: fx.GraphModule = None
    out: fx.Node = None
    lse: fx.Node = None
    grad_out: fx.Node = None
    grad_lse: fx.Node = None
    used: set = field(default_factory=set)   # output positions the graph reads (nested: (3, j))

    def val(self, n):
        return n.meta["val"]

    @property
    def dtype(self):
        return self.val(self.q).dtype

    def dims(self):
        """(B, Hq, Hkv, Lq, Lkv, D, Dv, Bkv): ints, or SymInts where dynamic (head counts and head dims are
        always static: Dynamo marks them so)."""
        q, k, v = self.val(self.q), self.val(self.k), self.val(self.v)
        return q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3], k.shape[0]


def _module(gm, node):
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        raise Unsupported(f"flex: a subgraph operand that is not a get_attr ({node})")
    obj = gm
    for part in node.target.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, fx.GraphModule):
        raise Unsupported(f"flex: subgraph {node.target} is a {type(obj).__name__}, not a GraphModule")
    return obj


def _block_mask(gm, bm):
    if not isinstance(bm, (tuple, list)) or len(bm) < 11:
        raise Unsupported(f"flex: a block mask of {len(bm) if isinstance(bm, (tuple, list)) else '?'} entries")
    first = 2 if len(bm) >= 13 else 0
    tensors = bm[first:first + 8]
    q_bs, kv_bs, mask = bm[-3], bm[-2], bm[-1]
    if not all(isinstance(x, int) for x in (q_bs, kv_bs)):
        raise Unsupported("flex: block sizes that are not Python ints")
    for name, t in zip(MASK_NAMES, tensors):
        if t is not None and not (isinstance(t, fx.Node) and isinstance(t.meta.get("val"), torch.Tensor)):
            raise Unsupported(f"flex: block mask entry {name} is {type(t).__name__}")
    return dict(zip(MASK_NAMES, tensors)), q_bs, kv_bs, _module(gm, mask)


def _used(node) -> set:
    used = set()
    for u in node.users:
        if u.op != "call_function" or u.target is not operator.getitem:
            raise Unsupported(f"flex: output read by {u.op} {u.target}, not by getitem")
        i = u.args[1]
        if i == 3 and u.users:
            for w in u.users:
                if w.target is not operator.getitem:
                    raise Unsupported("flex: captured gradients read as a tuple")
                if w.users:
                    used.add((3, w.args[1]))
        elif u.users:
            used.add(i)
    return used


def parse(gm, node) -> FlexCall:
    """The ``FlexCall`` of HOP ``node`` (``Unsupported`` when its operands are not as expected)."""
    if node.kwargs:
        raise Unsupported(f"flex: keyword arguments {sorted(node.kwargs)}")
    a = list(node.args)
    backward = hop_name(node) == BACKWARD
    if backward:
        if len(a) < 12:
            raise Unsupported(f"flex: flex_attention_backward with {len(a)} arguments")
        a += [()] * (14 - len(a))
        q, k, v, out, lse, dout, dlse, fw, joint, bm, scale, ko, sbufs, mbufs = a[:14]
    else:
        if len(a) < 7:
            raise Unsupported(f"flex: flex_attention with {len(a)} arguments")
        a += [()] * (9 - len(a))
        q, k, v, fw, bm, scale, ko, sbufs, mbufs = a[:9]
    masks, q_bs, kv_bs, mask = _block_mask(gm, bm)
    if not isinstance(scale, (int, float)):
        raise Unsupported(f"flex: a scale of type {type(scale).__name__}")
    call = FlexCall(node, backward, q, k, v, _module(gm, fw), mask, masks, q_bs, kv_bs, float(scale), dict(ko or {}),
                    tuple(sbufs or ()), tuple(mbufs or ()))
    if backward:
        call.joint, call.out, call.lse, call.grad_out, call.grad_lse = _module(gm, joint), out, lse, dout, dlse
    call.used = _used(node)
    _check(call)
    return call


def _check(call: FlexCall):
    for name in ("q", "k", "v"):
        t = getattr(call, name).meta.get("val")
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise Unsupported(f"flex: {name} is not a 4-d tensor")
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            raise Unsupported(f"flex: {name} has dtype {t.dtype}")
    q, k, v = (call.val(n) for n in (call.q, call.k, call.v))
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise Unsupported(f"flex: mixed dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}")
    B, Hq, Hkv, _, _, D, Dv, Bkv = call.dims()
    for s in (Hq, Hkv, D, Dv):
        if not isinstance(s, int):
            raise Unsupported("flex: a dynamic head count or head dim")
    if Hq % Hkv:
        raise Unsupported(f"flex: {Hq} query heads over {Hkv} kv heads")
    if D > 256 or Dv > 256:
        raise Unsupported(f"flex: head dim {max(D, Dv)} (kiln's kernels take up to 256)")
    if call.masks["kv_num"] is None or call.masks["kv_idx"] is None:
        raise Unsupported("flex: a block mask without kv_num_blocks/kv_indices")
    if call.backward and (call.masks["q_num"] is None or call.masks["q_idx"] is None):
        raise Unsupported("flex: a backward without q_num_blocks/q_indices")
    for b in call.score_bufs + call.mask_bufs:
        if isinstance(b, fx.Node):
            v = b.meta.get("val")
            if isinstance(v, torch.Tensor):
                if v.device != q.device:
                    raise Unsupported(f"flex: a captured tensor on {v.device}")
                if v.is_complex() or v.dim() > 4:
                    raise Unsupported("flex: a complex or 5-d captured tensor")
            elif not isinstance(v, (int, torch.SymInt)):
                raise Unsupported(f"flex: a captured {type(v).__name__}")
        elif not isinstance(b, int):
            raise Unsupported(f"flex: a captured {type(b).__name__}")
    if call.options.get("BACKEND") == "FLASH":
        raise Unsupported("flex: kernel_options BACKEND='FLASH' (the CuTe kernels' conventions: a natural-log lse)")
    if q.device.type not in ("cuda", "cpu"):
        raise Unsupported(f"flex: tensors on {q.device.type}")
    if any(not isinstance(call.val(m), torch.Tensor) or call.val(m).dtype != torch.int32
           for m in call.masks.values() if m is not None):
        raise Unsupported("flex: block mask tensors that are not int32")


def buffer_kind(b):
    """'tensor' or 'int' for a captured operand."""
    if isinstance(b, fx.Node) and isinstance(b.meta.get("val"), torch.Tensor):
        return "tensor"
    return "int"


__all__ = ["FlexCall", "parse", "hop_name", "buffer_kind", "MASK_NAMES", "FORWARD", "BACKWARD"]
