"""Lowering of a post-grad ATen graph to the loop IR: the driver and the helpers lowerings share.

``Lowering(gm, opts).run()`` walks the graph once. A node with an entry in ``LOWERINGS`` (registered by
the modules beside this one) becomes a ``Pointwise`` (inlined into its users) or a buffer-backed value; any
other node, or one whose lowering fails, stays an ATen call ("extern") with materialized tensor arguments.
"""
import functools
import operator

import sympy
import torch
import torch.fx

from kiln.codegen.ir.indexing import ZERO, own_floor_divs, size_expr
from kiln.codegen.ir.loops import (Buffer, Pointwise, Reduction, Seeds, Unsupported, contiguous_buffer, meta_layout,
                                   ops)
from kiln.debug import log
from kiln.options import Options

aten = torch.ops.aten
LOWERINGS: dict = {}
VIEW_OPS = set()     # filled by lower/view.py: ops whose output may alias their input
KEEP = object()      # a lowering's answer for "leave this node as an ATen view"


def register(*targets, view=False):
    """Register ``fn(ctx, *args, **kwargs) -> value`` for ATen overloads (or whole packets)."""
    def deco(fn):
        for t in targets:
            overloads = [getattr(t, o) for o in t.overloads()] if isinstance(t, torch._ops.OpOverloadPacket) else [t]
            for o in overloads:
                LOWERINGS[o] = fn
                if view:
                    VIEW_OPS.add(o)
        return fn
    return deco


def is_tensor(v):
    return isinstance(v, torch.Tensor)


class ExternTuple(tuple):
    """The multi-tensor result of an extern node; its getitem users stay ATen too."""


class Lowering:
    """Lower one FX graph. After ``run()``: ``values`` (node -> value), ``buffers`` (name ->
    Buffer), ``computed`` (kernel-filled buffers in topological order), ``kept`` (nodes that stay
    in the graph as ATen calls), ``seeds``. ``opts``: the compile's options (``tuning`` is read)."""

    def __init__(self, gm: torch.fx.GraphModule, opts: Options):
        self.gm, self.opts, self.tuning = gm, opts, opts.tuning
        self.values, self.buffers, self.computed, self.kept = {}, {}, [], set()
        self.seeds = Seeds()
        self.node = None

    # -- driver -------------------------------------------------------------------------
    def run(self):
        for node in self.gm.graph.nodes:
            self.node = node
            if node.op == "placeholder":
                self._keep(node, "input")
            elif node.op == "output":
                self._realize_args(node.args)
            elif node.op == "call_function" and self._lowerable(node):
                try:
                    value = self._lower(node)
                except Unsupported as e:
                    log(5, f"codegen: {node.name} ({node.target}) stays ATen: {e}")
                    node.meta["kiln_why"] = str(e)   # read by the random-op count (``codegen.rewrite``)
                    self._extern(node)
                else:
                    if value is KEEP:
                        self._keep(node, "view")
                        continue
                    self.values[node] = value
                    self._finish(node, value)
            else:
                self._extern(node)
        self.node = None
        return self

    def _lowerable(self, node):
        if _touches(node, lambda t: t.is_complex() or _empty(t)):   # no kernel computes complex numbers;
            return False                                              # nothing to compute: ATen knows
        if node.target is operator.getitem:
            return not isinstance(self.values.get(node.args[0]), ExternTuple)
        return "val" in node.meta and (node.target in LOWERINGS or self._functional(node) is not None)

    def _functional(self, node):
        """The out-of-place twin of an in-place op whose mutated input is a private temporary (used by
        nothing else), so mutating it equals returning a new value."""
        t = node.target
        if not isinstance(t, torch._ops.OpOverload) or not t._opname.endswith("_") or not node.args:
            return None
        packet = getattr(aten, t._opname[:-1], None)
        fn = getattr(packet, t._overloadname, None) if packet is not None else None
        arg = node.args[0]
        if fn not in LOWERINGS or not isinstance(arg, torch.fx.Node) or arg in self.kept or len(arg.users) != 1:
            return None
        return fn

    def _lower(self, node):
        args = self.arg(node.args)
        kwargs = {k: self.arg(v) for k, v in node.kwargs.items()}
        if node.target is operator.getitem:
            return args[0][args[1]]
        target = node.target if node.target in LOWERINGS else self._functional(node)
        return LOWERINGS[target](self, *args, **kwargs)

    def arg(self, a):
        if isinstance(a, torch.fx.Node):
            val = a.meta.get("val")
            if a in self.kept and is_tensor(val) and (val.is_neg() or val.is_conj()):   # _neg_view, _conj
                # kernels read storage as it is; ATen applies the bit (the reader stays ATen)
                raise Unsupported(f"{a.name} is a tensor with its negative or conjugate bit set")
            if a in self.values:
                return self.values[a]
            if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                return sympy.sympify(val.node.expr)
            raise Unsupported(f"argument {a.name} has no lowered value")
        return type(a)(self.arg(x) for x in a) if isinstance(a, (list, tuple)) else a

    @property
    def meta(self):
        return self.node.meta["val"]

    # -- externs and kept nodes ---------------------------------------------------------
    def _keep(self, node, kind):
        self.kept.add(node)
        val = node.meta.get("val")
        if is_tensor(val):
            buf = self._node_buffer(node, kind, val)
            self.values[node] = Pointwise.of_buffer(buf)
        elif isinstance(val, (tuple, list)) and node.op != "placeholder":
            self.values[node] = ExternTuple(val)
        else:
            sym = isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool))
            self.values[node] = sympy.sympify(val.node.expr) if sym else val

    def _node_buffer(self, node, kind, val):
        shape, stride = meta_layout(val)
        buf = Buffer(node.name, shape, stride, val.dtype, val.device, kind, node, None, val)
        self.buffers[buf.name] = buf
        return buf

    def _extern(self, node):
        self._realize_args((node.args, node.kwargs))
        self._keep(node, "extern")

    def _realize_args(self, args):
        nodes = []
        torch.fx.node.map_arg(args, nodes.append)
        for n in nodes:
            v = self.values.get(n)
            for p in (v if isinstance(v, tuple) and not isinstance(v, ExternTuple) else (v,)):
                if isinstance(p, Pointwise):
                    self.realize(p, n if p is v else None)

    # -- materialization ----------------------------------------------------------------
    def realize(self, value: Pointwise, node=None) -> Buffer:
        """Give ``value`` a buffer (filled by a kernel); later reads load from it."""
        if value.buffer is not None:
            return value.buffer
        val = node.meta.get("val") if node is not None else None
        base = getattr(value, "view_base", None)
        if base is not None and node is not None and base.buffer is None \
                and getattr(base, "view_base", None) is not None and isinstance(node.args[0], torch.fx.Node):
            self.realize(base, node.args[0])   # a view of a view: the inner one becomes an ATen view first
        if base is not None and node is not None and is_tensor(val) and base.buffer is not None \
                and base.buffer.node is node.args[0]:
            buf = self._node_buffer(node, "view", val)   # keep the ATen view of the stored base
            self.kept.add(node)
        else:
            if is_tensor(val) and tuple(size_expr(s) for s in val.shape) == value.shape:
                shape, stride = meta_layout(val)
                buf = Buffer(node.name, shape, stride, val.dtype, val.device, "pointwise", node, value, val)
            else:
                buf = contiguous_buffer(value.shape, value.dtype, value.device, "pointwise", value)
            self.add_buffer(buf)
        value.buffer = buf
        value._memo = {k: v for k, v in value._memo.items() if k and k[0] == "compute"}
        return buf

    def _finish(self, node, value):
        """Adopt internal buffers as the node's value and materialize where users need it."""
        if isinstance(value, Pointwise):
            buf = value.buffer
            if buf is not None and buf.node is None and buf.kind != "view":
                val = node.meta.get("val")
                if is_tensor(val) and _same_layout(buf, val):
                    buf.node, buf.fake = node, val
            if self._must_realize(node, value):
                self.realize(value, node)

    def _must_realize(self, node, value):
        for u in node.users:
            lowered = u.target is operator.getitem or u.target in LOWERINGS or self._functional(u) is not None
            if u.op == "output" or (u.op == "call_function" and not lowered):
                return True
        if value.buffer is None and len(node.users) > 1:
            return not cheap(value, self.tuning.cheap_ops, self.tuning.cheap_loads)
        return False

    # -- helpers used by lowerings ------------------------------------------------------
    def pointwise(self, fn, shape=None, dtype=None, device=None):
        meta = self.meta if is_tensor(self.node.meta.get("val")) else None
        shape = meta.shape if shape is None else shape
        dtype = meta.dtype if dtype is None else dtype
        if self.opts.round_low_precision and dtype in (torch.float16, torch.bfloat16):
            fn = functools.partial(_rounded, fn, dtype)
        return Pointwise(shape, dtype, device or self.device, fn)

    @property
    def device(self):
        val = self.node.meta.get("val")
        for v in (val if isinstance(val, (tuple, list)) else (val,)):
            if is_tensor(v):
                return v.device
        return torch.device("cpu")

    def reduction(self, red: Reduction, device) -> Pointwise:
        """A reduction always owns a buffer; returns the value reading it."""
        return self.add_buffer(contiguous_buffer(red.out_shape, red.dtype, device, "reduction", red))

    def add_buffer(self, buf: Buffer) -> Pointwise:
        self.buffers[buf.name] = buf
        self.computed.append(buf)
        return Pointwise.of_buffer(buf)


def _touches(node, test) -> bool:
    """Whether ``test`` holds for a tensor ``node`` reads or makes."""
    vals = [node.meta.get("val")] + [a.meta.get("val") for a in node.all_input_nodes]
    return any(is_tensor(v) and test(v) for v in vals) or any(
        isinstance(v, (tuple, list)) and any(is_tensor(t) and test(t) for t in v) for v in vals)


def _empty(t) -> bool:
    """A tensor statically without elements: its indices degenerate, and a load hoisted out of an empty loop
    read past the storage (fuzz seed 10 #3264: the sum of an expanded (2, 0) tensor crashed Triton)."""
    return any(isinstance(n, int) and n == 0 for n in t.shape)


def _same_layout(buf, val):
    shape, stride = meta_layout(val)
    if shape != buf.shape:
        return False
    return all(a == b for s, a, b in zip(shape, stride, buf.stride) if s != 1)


def cheap(value: Pointwise, limit: int, loads: int = 1 << 30) -> bool:
    """At most ``limit`` ops that read something (and no RNG), and at most ``loads`` buffers read at every
    element: recomputed in each user instead of stored (a residual stream summed over many layers is few ops
    but would read every layer's output in each user and keep them alive)."""
    idx = [sympy.Symbol(f"c{i}", integer=True, nonnegative=True) for i in range(len(value.shape))]
    n, indices = 0, {}   # indices: buffer -> the index expressions it is loaded at
    reads: dict = {}
    for e in value(idx).walk():
        if e.op == "rand":
            return False
        if e.op == "load":
            indices.setdefault(e.args[0], []).append(e.args[1])
        if e.op not in ("load", "const", "index", "cast", "checked") and _reads(e, reads):
            n += 1
    if n > limit or len(indices) <= loads:   # (no index is looked at while few buffers are read)
        return n <= limit
    varying = {s for s, size in zip(idx, value.shape) if size != 1}
    full = [b for b, exprs in indices.items() if any(varying <= sympy.sympify(x).free_symbols for x in exprs)]
    return len(full) <= loads


def _reads(e, memo) -> bool:
    """Whether ``e`` loads anything (memoized by node: expressions share subtrees)."""
    hit = memo.get(id(e))
    if hit is None:
        hit = e.op in ("load", "rand") or any(_reads(c, memo) for c in e.children())
        memo[id(e)] = hit
    return hit


# -- shared helpers for lowerings ---------------------------------------------------------
def shape_of(meta) -> list:
    return [size_expr(s) for s in meta.shape]


def broadcast(idx, in_shape, out_shape):
    """Index into a value of ``in_shape`` broadcast (right-aligned) to ``out_shape``."""
    k = len(out_shape) - len(in_shape)
    return [ZERO if s == 1 and o != 1 else idx[k + i] for i, (s, o) in enumerate(zip(in_shape, out_shape[k:]))]


def _rounded(fn, dtype, idx):
    """``fn(idx)`` rounded to 16-bit ``dtype``, kept in float32, as eager rounds every op's result (fuzz seed
    11 #9879: ``cos(x ** 3)`` of bf16 ``x`` took ``x ** 3`` unrounded)."""
    e = fn(idx)
    return e if e.dtype == dtype or _exact_in(e, dtype) else ops.cast(ops.cast(e, dtype), e.dtype)


_SELECTS = {"where": (1, 2), "masked": (1, 2), "neg": (0,), "abs": (0,), "maximum": (0, 1), "minimum": (0, 1)}


def _exact_in(e, dtype) -> bool:
    """Whether float32 ``e`` is already a ``dtype`` value (widened, a constant, or a selection, negation or
    abs of such): rounding again would change only a NaN's sign bit (fuzz seed 12 #7722)."""
    if e.op == "cast":
        return e.args[0].dtype == dtype
    if e.op == "const":
        v = e.args[0]
        return isinstance(v, (bool, int, float)) and (v != v or float(torch.tensor(float(v), dtype=dtype)) == v)
    slots = _SELECTS.get(e.op)
    return slots is not None and all(_exact_in(e.args[i], dtype) for i in slots)


def value_at(v, idx, out_shape, dtype):
    """The Expr of value or Python scalar ``v`` at ``idx`` (broadcast), cast to ``dtype``."""
    if isinstance(v, Pointwise):
        return ops.cast(v(broadcast(idx, v.shape, out_shape)), dtype)
    if isinstance(v, sympy.Expr):
        return sym_value(v, dtype)
    if isinstance(v, (bool, int, float)):
        return ops.const(v, dtype)
    raise Unsupported(f"operand {type(v).__name__}")


def sym_value(v, dtype):
    """A SymInt/SymFloat expression (sizes, counts) as a value of ``dtype``: integer parts as index arithmetic,
    float parts (true divisions, ``ToFloat``, float constants) in float64, as Python computes them for eager
    (batch norm's unbiased variance scales by n / (n - 1) of a symbolic n)."""
    v = own_floor_divs(v)
    return ops.cast(ops.index(v) if _integral(v) else _float64(v), dtype)


def _integral(v) -> bool:
    return all(a.is_Integer or a.is_Symbol or type(a).__name__ in ("Add", "Mul", "FloorDiv")
               or a.is_Pow and a.exp.is_Integer and a.exp >= 0 for a in sympy.preorder_traversal(v))


_SYM_FLOAT = {"FloatTrueDiv": "truediv", "IntTrueDiv": "truediv", "Add": "add", "Mul": "mul"}


def _float64(v):
    if v.is_Number:
        return ops.const(float(v), torch.float64)
    if _integral(v):
        return ops.cast(ops.index(v), torch.float64)
    name = type(v).__name__
    if name == "ToFloat":
        return _float64(v.args[0])
    if name not in _SYM_FLOAT:
        raise Unsupported(f"symbolic value {v}")
    return functools.reduce(lambda a, b: ops.binary(_SYM_FLOAT[name], a, b), map(_float64, v.args))


def result_dtype(*vals):
    """torch's default type promotion over values and Python scalars."""
    from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes
    args = []
    for v in vals:
        if isinstance(v, Pointwise):
            args.append(torch.empty((1,) if len(v.shape) else (), dtype=v.dtype, device="meta"))
        elif isinstance(v, (bool, int, float)):
            args.append(v)
        elif isinstance(v, sympy.Expr):
            args.append(1.0 if type(v).__name__ == "ToFloat" or v.is_Float else 1)
    return elementwise_dtypes(*args, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)[1]
