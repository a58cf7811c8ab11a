"""FlexAttention's higher-order ops as kiln finds them in a post-grad graph: ``parse(gm, node) -> FlexCall``.

``flex_attention(q, k, v, score_mod, block_mask, scale, kernel_options, score_bufs, mask_bufs)`` and
``flex_attention_backward(q, k, v, out, lse, grad_out, grad_lse, fw_graph, joint_graph, block_mask, ...)``.
The block mask tuple: the lengths, eight index tensors, ``dq_*`` (torch 2.13), the block sizes and the
mask_mod. The lse the ops exchange is in base 2. ``Mods(call, dialect, index)``: the op's subgraphs
translated for one kernel, ``index`` naming its ``b, h, q_idx, kv_idx``; captured operands are ``BUF<i>``.
"""
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from kiln.codegen.flex.translate import Ref, Scatter, Unsupported, Val, is_identity, is_true, translate

MASK_NAMES = ("kv_num", "kv_idx", "full_kv_num", "full_kv_idx", "q_num", "q_idx", "full_q_num", "full_q_idx")


def hop_name(node) -> str:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return ""
    name = node.target.name()
    return name if name in ("flex_attention", "flex_attention_backward") else ""


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
        """(B, Hq, Hkv, Lq, Lkv, D, Dv, Bkv): ints, or SymInts where dynamic (never head counts and dims)."""
        q, k, v = self.val(self.q), self.val(self.k), self.val(self.v)
        return q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3], k.shape[0]


def _module(gm, node):
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        raise Unsupported(f"flex: a subgraph operand that is not a get_attr ({node})")
    obj = operator.attrgetter(node.target)(gm)
    if not isinstance(obj, fx.GraphModule):
        raise Unsupported(f"flex: subgraph {node.target} is a {type(obj).__name__}, not a GraphModule")
    return obj


def _block_mask(gm, bm):
    if not isinstance(bm, (tuple, list)) or len(bm) < 13:
        raise Unsupported(f"flex: a block mask of {len(bm) if isinstance(bm, (tuple, list)) else '?'} entries")
    tensors, (q_bs, kv_bs, mask) = bm[2:10], bm[-3:]
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
    a, backward = list(node.args), hop_name(node) == "flex_attention_backward"
    n, least = (14, 12) if backward else (9, 7)
    if len(a) < least:
        raise Unsupported(f"flex: {hop_name(node)} with {len(a)} arguments")
    a += [()] * (n - len(a))
    if backward:
        q, k, v, out, lse, dout, dlse, fw, joint, bm, scale, ko, sbufs, mbufs = a[:14]
    else:
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
    _, Hq, Hkv, _, _, D, Dv, _ = call.dims()
    if not all(isinstance(s, int) for s in (Hq, Hkv, D, Dv)):
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
    return "tensor" if isinstance(b, fx.Node) and isinstance(b.meta.get("val"), torch.Tensor) else "int"


def indices(b: str, h: str, q: str, kv: str, h_rows: bool = False) -> dict:
    """The ``index`` of a kernel whose values of b, h, q_idx and kv_idx are named so (int32, not negative);
    ``h_rows``: h varies along the query axis (rows of several heads)."""
    i32 = torch.int32
    return {"b": Val(b, i32, nonneg=True), "h": Val(h, i32, frozenset({"q"}) if h_rows else frozenset(), nonneg=True),
            "q": Val(q, i32, frozenset({"q"}), nonneg=True), "kv": Val(kv, i32, frozenset({"kv"}), nonneg=True)}


def buffer_names(call: FlexCall) -> list:
    return [f"BUF{i}" for i in range(len(call.score_bufs) + len(call.mask_bufs))]


def _inputs(bufs, first: int) -> list:
    return [Ref(i, b.meta["val"].dim(), b.meta["val"].dtype) if buffer_kind(b) == "tensor"
            else Val(f"BUF{i}", torch.int64) for i, b in enumerate(bufs, first)]


class Mods:
    """Statements for the score_mod, mask_mod and joint graph of ``call`` (see the module docstring)."""

    def __init__(self, call: FlexCall, dialect, index: dict):
        self.call, self.d, self.index = call, dialect, index
        self.names = buffer_names(call)
        self.identity = is_identity(call.score)

    def _idx(self):
        return [self.index[k] for k in ("b", "h", "q", "kv")]

    def score(self, src: Val, tag: str):
        """(lines, Val): the score after score_mod of pre-mod score ``src`` (float)."""
        if self.identity:
            return [], src
        lines, out = translate(self.call.score, [src] + self._idx() + _inputs(self.call.score_bufs, 0), self.d,
                               f"sc{tag}_", self.names)
        return lines, self._float(out, lines)

    def _float(self, v, lines):
        if not isinstance(v, Val):
            raise Unsupported("flex: score_mod returns no value")
        if v.dtype == self.d.compute:
            return v
        name = f"scf_{len(lines)}"
        lines.append(self.d.assign(name, self.d.cast(v.code, v.dtype, self.d.compute), self.d.compute))
        return Val(name, self.d.compute, v.axes)

    def mask(self, tag: str):
        """(lines, Val or None): mask_mod's verdict (bool), None where it is constant True."""
        n = len(self.call.score_bufs)
        lines, out = translate(self.call.mask, self._idx() + _inputs(self.call.mask_bufs, n), self.d, f"mk{tag}_",
                               self.names)
        if is_true(out):
            return [], None
        if not isinstance(out, Val):
            raise Unsupported("flex: mask_mod returns no value")
        if out.dtype != torch.bool:
            name = f"mkb{tag}"
            lines.append(self.d.assign(name, self.d.cast(out.code, out.dtype, torch.bool), torch.bool))
            out = Val(name, torch.bool, out.axes)
        return lines, out

    def joint(self, score: Val, grad: Val, tag: str):
        """(lines, dscore Val or None, {buffer index: Scatter}): the joint graph at pre-mod ``score`` with the
        gradient ``grad`` of the post-mod score."""
        if self.identity and not self.call.score_bufs:
            return [], grad, {}
        lines, outs = translate(self.call.joint, [score] + self._idx() + [grad] + _inputs(self.call.score_bufs, 0),
                                self.d, f"jt{tag}_", self.names)
        if not isinstance(outs, list) or len(outs) < 5:
            raise Unsupported("flex: a joint graph without its five leading gradients")
        dscore = outs[0]
        if dscore is not None and not isinstance(dscore, Val):
            raise Unsupported("flex: the joint graph's score gradient is not a value")
        if dscore is not None:
            dscore = self._float(dscore, lines)
        scatters = {}
        for j, g in enumerate(outs[5:]):
            if g is None:
                continue
            b = self.call.score_bufs[j]
            if buffer_kind(b) != "tensor":
                raise Unsupported("flex: a gradient of a captured integer")
            shape = tuple(int(s) for s in b.meta["val"].shape)
            if isinstance(g, Val) and shape == ():
                g = Scatter((), [([], g)])
            if not isinstance(g, Scatter) or g.shape != shape:
                raise Unsupported("flex: a captured-tensor gradient other than scatters of the score's gradient")
            scatters[j] = g
        return lines, dscore, scatters
