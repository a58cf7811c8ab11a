"""FlexAttention's ``score_mod``/``mask_mod`` subgraphs as Triton or C++ statements: ``translate``.

Each node becomes one statement from kiln's op templates; a value knows the tile axes it varies along (a
load is masked by its own axes' masks only). Floats compute in float32 (float64 for C++ float64 inputs),
as eager's dense FlexAttention does; gradients of captured tensors become ``Scatter`` values.
"""
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from kiln.codegen.ir.loops import Unsupported
from kiln.codegen.to_cpp import ops as cpp_ops
from kiln.codegen.to_triton import ops as tl_ops

aten = torch.ops.aten


@dataclass(frozen=True)
class Val:
    """A translated value: ``code`` (a name or a literal), dtype, the tile axes it varies along, ``const``
    (a literal's Python value), ``nonneg`` (an integer known not negative: an index needing no wrapping)."""
    code: str
    dtype: torch.dtype
    axes: frozenset = frozenset()
    const: object = None
    nonneg: bool = False


class Line(str):
    """A statement and the tile axes of its value (C++ hoists those without ``'kv'`` out of its key loop)."""
    axes = frozenset({"q", "kv"})


@dataclass(frozen=True)
class Ref:
    """A captured tensor (kernel operand ``buf``), indexed by ``index`` so far (``dims`` dims in all)."""
    buf: int
    dims: int
    dtype: torch.dtype
    index: tuple = ()


@dataclass
class Scatter:
    """Gradient contributions to a captured tensor of ``shape``: parts ``(index vals, value val)``."""
    shape: tuple
    parts: list = field(default_factory=list)


class Dialect:
    """How statements are written for one target; ``masks``: each tile axis's mask expression (Triton)."""

    def __init__(self, compute=torch.float32, masks=None, interpret=False):
        self.compute, self.masks, self.interpret = compute, masks or {}, interpret
        self.helpers, self.libdevice = set(), False

    def ctype(self, dtype):
        """The dtype a value of ``dtype`` computes in."""
        return self.compute if dtype.is_floating_point else dtype


class TritonDialect(Dialect):
    def assign(self, name, code, dtype):
        return f"{name} = {code}"

    def literal(self, v, dtype):
        if dtype == torch.bool:
            return "True" if v else "False"
        if dtype.is_floating_point:
            v = float(v)
            return f"float('{v}')" if v != v or v in (float("inf"), float("-inf")) else repr(v)
        return str(int(v))

    def cast(self, code, src, dst):
        return f"({code} != 0)" if dst == torch.bool else f"({code}).to({tl_ops.TL_DTYPE[dst]})"

    def op(self, op, dtype, args):
        t = tl_ops.template(op, dtype, self.interpret, len(args))
        if t is None:
            raise Unsupported(f"flex: no Triton template for {op} on {dtype}")
        code = t.format(*args, d=tl_ops.TL_DTYPE[dtype])
        self.helpers |= tl_ops.helpers_in(code)
        self.libdevice |= "libdevice." in code
        return code

    def where(self, c, a, b):
        return f"tl.where({c}, {a}, {b})"

    def load(self, ptr, offset, axes, dtype):
        masks = [self.masks[a] for a in sorted(axes) if a in self.masks]
        mask = f", mask={' & '.join(masks)}, other=0" if masks else ""
        code = f"tl.load({ptr} + {offset}{mask})"
        return f"({code} != 0)" if dtype == torch.bool else code

    def wrap(self, idx, size):   # eager's index: a negative one counts from the end
        return f"tl.where({idx} < 0, {idx} + {size}, {idx})"


class CppDialect(Dialect):
    def assign(self, name, code, dtype):
        return f"const {cpp_ops.VALUE[dtype]} {name} = {code};"

    def literal(self, v, dtype):
        return cpp_ops.literal(v, dtype)

    def cast(self, code, src, dst):
        if dst == torch.bool:
            return f"({code} != 0)"
        if src.is_floating_point and not dst.is_floating_point:
            return f"(({cpp_ops.VALUE[dst]})kiln_f2i{'32' if dst == torch.int32 else '64'}({code}))"
        return f"(({cpp_ops.VALUE[dst]})({code}))"

    def op(self, op, dtype, args):
        t = cpp_ops.template(op, dtype, len(args))
        return t.format(*args, f="f" if dtype == torch.float32 else "", t=cpp_ops.VALUE.get(dtype, "float"))

    def where(self, c, a, b):
        return f"({c} ? {a} : {b})"

    def load(self, ptr, offset, axes, dtype):
        if dtype == torch.bfloat16:
            return f"kiln_bf16_load({ptr}[{offset}])"
        code = f"{ptr}[{offset}]"
        return f"({code} != 0)" if dtype == torch.bool else code

    def wrap(self, idx, size):
        return f"({idx} < 0 ? {idx} + {size} : {idx})"


def _named(names: str) -> dict:
    return {getattr(aten, n): n for n in names.split()}


# aten op -> the op name of kiln's templates
UNARY = _named("neg abs exp exp2 log log2 sqrt rsqrt sin cos tanh sigmoid erf floor ceil trunc round "
               "reciprocal sign log1p expm1 logical_not bitwise_not isnan")
ARITH = {**_named("add sub mul maximum minimum remainder fmod pow atan2"), aten.div: "truediv",
         aten.floor_divide: "floordiv"}
COMPARE = _named("eq ne lt le gt ge")
LOGICAL = _named("logical_and logical_or logical_xor bitwise_and bitwise_or bitwise_xor")
PYTHON = {getattr(operator, n): getattr(aten, n) for n in "add sub mul eq ne lt le gt ge neg".split()}
PYTHON.update({operator.truediv: aten.div, operator.and_: aten.bitwise_and, operator.or_: aten.bitwise_or,
               operator.floordiv: aten.floor_divide})
IDENTITY = set(_named("clone alias detach lift_fresh_copy contiguous view reshape expand squeeze unsqueeze "
                      "_unsafe_view"))
CONSTANT = set(_named("full scalar_tensor new_ones new_zeros new_full ones_like zeros_like full_like ones "
                      "zeros"))


def _packet(target):
    return target.overloadpacket if isinstance(target, torch._ops.OpOverload) else PYTHON.get(target, target)


def _out_dtype(node) -> torch.dtype:
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return v.dtype
    raise Unsupported(f"flex: {node.name} has no tensor value")


class Translator:
    """Translate one subgraph (see the module docstring); ``lines`` collects its statements."""

    def __init__(self, gm: fx.GraphModule, dialect: Dialect, prefix: str, buffers):
        self.gm, self.d, self.prefix, self.buffers = gm, dialect, prefix, buffers   # buffers: kernel operand names
        self.lines: list = []

    # -- values -----------------------------------------------------------------------------------
    def const(self, v, dtype) -> Val:
        dtype = self.d.ctype(dtype)
        return Val(self.d.literal(v, dtype), dtype, frozenset(), v)

    def emit(self, code, dtype, axes, nonneg=False) -> Val:
        name = f"{self.prefix}{len(self.lines)}"
        line = Line(self.d.assign(name, code, dtype))
        line.axes = frozenset(axes)
        self.lines.append(line)
        return Val(name, dtype, frozenset(axes), None, nonneg)

    def as_(self, v: Val, dtype) -> str:
        if v.dtype == dtype:
            return v.code
        if v.const is not None:
            return self.d.literal(v.const, dtype)
        return self.d.cast(v.code, v.dtype, dtype)

    def value(self, a, like=None):
        if isinstance(a, fx.Node):
            v = self.env[a]
            if isinstance(v, (Ref, Scatter)):
                raise Unsupported(f"flex: {a.name} is a captured tensor used as a value")
            return v
        if isinstance(a, bool):
            return self.const(a, torch.bool)
        if isinstance(a, int):
            return self.const(a, torch.int64 if like is None or like.is_floating_point else like)
        if isinstance(a, float):
            return self.const(a, torch.float32)
        raise Unsupported(f"flex: argument {a!r} of a subgraph op")

    # -- the walk ---------------------------------------------------------------------------------
    def run(self, inputs: list):
        phs = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        if len(phs) != len(inputs):
            raise Unsupported(f"flex: subgraph takes {len(phs)} inputs, {len(inputs)} given")
        self.env = dict(zip(phs, inputs))
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                out = node.args[0]
                return [self.env[o] if isinstance(o, fx.Node) else o for o in out] \
                    if isinstance(out, (list, tuple)) else self.env[out] if isinstance(out, fx.Node) else \
                    self.value(out)
            if node.op == "get_attr":
                self.env[node] = self._constant(node)
            elif node.op == "call_function":
                self.env[node] = self._call(node)
            else:
                raise Unsupported(f"flex: subgraph node {node.op} {node.target}")
        raise Unsupported("flex: subgraph without output")

    def _constant(self, node):
        t = operator.attrgetter(node.target)(self.gm)
        if not isinstance(t, torch.Tensor) or t.numel() != 1 or t.dim() != 0:
            raise Unsupported(f"flex: the subgraph holds a constant tensor {node.target} (not a 0-dim one)")
        return self.const(t.item(), t.dtype)

    def _call(self, node):
        target, args = node.target, node.args
        p = _packet(target)
        if str(target) == "flex_lib.zeros_and_scatter.default":
            return self._scatter(node)
        if p is aten.add and len(args) == 2 and all(isinstance(self.env.get(a), Scatter) for a in args):
            a, b = self.env[args[0]], self.env[args[1]]
            return Scatter(a.shape, a.parts + b.parts)
        if p in IDENTITY:
            return self.env[args[0]] if isinstance(args[0], fx.Node) else self.value(args[0])
        if p is aten.index:
            return self._index(node)
        if p in CONSTANT:
            return self._fill(node)
        if p in (aten._to_copy, aten.to) or target is torch.ops.prims.convert_element_type.default:
            v, dst = self.value(args[0]), self.d.ctype(_out_dtype(node))
            keep = v.nonneg and not dst.is_floating_point and dst != torch.bool
            return v if v.dtype == dst else self.emit(self.as_(v, dst), dst, v.axes, keep)
        if p in ARITH or p is aten.rsub:
            return self._arith(node, p)
        if p in COMPARE:
            a, b = self.value(args[0]), self.value(args[1], self._dtype_of(args[0]))
            ct = self.d.ctype(torch.promote_types(a.dtype, b.dtype))
            code = self.d.op(COMPARE[p], ct, [self.as_(a, ct), self.as_(b, ct)])
            return self.emit(code, torch.bool, a.axes | b.axes)
        if p in (aten.clamp, aten.clamp_min, aten.clamp_max):
            return self._clamp(node, p)
        if p in UNARY or p in LOGICAL or p in (aten.where, aten.tanh_backward):
            out = self.d.ctype(_out_dtype(node))   # these compute in their output's dtype
        if p in UNARY:
            v = self.value(args[0])
            return self.emit(self.d.op(UNARY[p], out, [self.as_(v, out)]), out, v.axes)
        if p in LOGICAL:
            a, b = self.value(args[0]), self.value(args[1])
            op = LOGICAL[p].replace("bitwise", "logical") if out == torch.bool else LOGICAL[p]
            return self.emit(self.d.op(op, out, [self.as_(a, out), self.as_(b, out)]), out, a.axes | b.axes)
        if p is aten.where:
            c, a, b = (self.value(x) for x in args[:3])
            code = self.d.where(self.as_(c, torch.bool), self.as_(a, out), self.as_(b, out))
            return self.emit(code, out, c.axes | a.axes | b.axes)
        if p is aten.tanh_backward:   # grad * (1 - y * y)
            g, y = self.value(args[0]), self.value(args[1])
            gy, yy = self.as_(g, out), self.as_(y, out)
            return self.emit(f"({gy} * ({self.d.literal(1.0, out)} - {yy} * {yy}))", out, g.axes | y.axes)
        raise Unsupported(f"flex: no translation of {target} in a score_mod/mask_mod")

    def _dtype_of(self, a):
        return self.env[a].dtype if isinstance(a, fx.Node) and isinstance(self.env.get(a), Val) else None

    def _arith(self, node, p):
        args = node.args
        out = self.d.ctype(_out_dtype(node))
        a, b = self.value(args[0], out), self.value(args[1], out)
        if p is aten.rsub:
            a, b = b, a
        alpha = node.kwargs.get("alpha", args[2] if len(args) > 2 else 1)
        bc = self.as_(b, out)
        if alpha != 1:
            bc = self.d.op("mul", out, [bc, self.d.literal(alpha, out)])
        op = ARITH.get(p, "sub")
        if op == "pow" and b.const == 2:
            op, bc = "mul", self.as_(a, out)
        if op in ("floordiv", "remainder", "truediv") and not out.is_floating_point and b.const == 0:
            raise Unsupported("flex: an integer division by zero in a subgraph")
        if op == "truediv" and node.target is aten.div.Tensor_mode:
            mode = node.kwargs.get("rounding_mode")
            op = {"floor": "floordiv", "trunc": "truncdiv" if not out.is_floating_point else "truediv"}.get(mode, op)
            if mode == "trunc" and out.is_floating_point:
                code = self.d.op("trunc", out, [self.d.op("truediv", out, [self.as_(a, out), bc])])
                return self.emit(code, out, a.axes | b.axes)
        pos = lambda v: v.nonneg or (v.const is not None and v.const >= 0)  # noqa: E731
        nonneg = not out.is_floating_point and pos(a) and pos(b) and op in ("add", "mul", "floordiv", "remainder",
                                                                           "maximum", "minimum")
        return self.emit(self.d.op(op, out, [self.as_(a, out), bc]), out, a.axes | b.axes, nonneg)

    def _clamp(self, node, p):
        out = self.d.ctype(_out_dtype(node))
        v = self.value(node.args[0])
        lo = node.args[1] if p in (aten.clamp, aten.clamp_min) and len(node.args) > 1 else node.kwargs.get("min")
        hi = node.args[1] if p is aten.clamp_max else (node.args[2] if p is aten.clamp and len(node.args) > 2
                                                        else node.kwargs.get("max"))
        code, axes = self.as_(v, out), set(v.axes)
        for bound, op in ((lo, "maximum"), (hi, "minimum")):
            if bound is not None:
                bv = self.value(bound, out)
                code, axes = self.d.op(op, out, [code, self.as_(bv, out)]), axes | bv.axes
        return self.emit(code, out, axes)

    def _fill(self, node):
        p, args = _packet(node.target), node.args
        out = _out_dtype(node)
        fixed = {aten.ones: 1, aten.ones_like: 1, aten.new_ones: 1, aten.zeros: 0, aten.zeros_like: 0,
                 aten.new_zeros: 0}
        v = fixed[p] if p in fixed else args[0] if p is aten.scalar_tensor else \
            args[-1] if p in (aten.full, aten.full_like) else args[2]
        if not isinstance(v, (int, float, bool)):
            raise Unsupported(f"flex: a {node.target} of a non-constant value")
        if tuple(node.meta["val"].shape) != ():
            raise Unsupported(f"flex: {node.target} makes a tensor of shape {tuple(node.meta['val'].shape)}")
        return self.const(v, out)

    def _index(self, node):
        ref, idx = self.env[node.args[0]], node.args[1]
        if not isinstance(ref, Ref):
            raise Unsupported("flex: indexing a computed value")
        if any(i is None for i in idx):
            raise Unsupported("flex: index with None (a full slice)")
        vals = self._ints(idx, "a captured tensor indexed by a float or bool value")
        ref = Ref(ref.buf, ref.dims, ref.dtype, ref.index + tuple(vals))
        if len(ref.index) > ref.dims:
            raise Unsupported("flex: more indices than dims")
        return ref if len(ref.index) < ref.dims else self._load(ref)

    def _ints(self, idx, what: str) -> list:
        vals = [self.value(i) for i in idx]
        if any(v.dtype.is_floating_point or v.dtype == torch.bool for v in vals):
            raise Unsupported(f"flex: {what}")
        return vals

    def _offset(self, ref: Ref):
        name = self.buffers[ref.buf]
        terms = []
        for d, v in enumerate(ref.index):
            i = v.code if v.const is None else self.d.literal(v.const, v.dtype)
            if (v.const is None and not v.nonneg) or (v.const is not None and v.const < 0):
                i = self.emit(self.d.wrap(i, f"{name}_size{d}"), v.dtype, v.axes, True).code
            terms.append(f"{i} * {name}_stride{d}")
        return " + ".join(terms) or "0", frozenset().union(*[v.axes for v in ref.index])

    def _load(self, ref: Ref):
        off, axes = self._offset(ref)
        code = self.d.load(self.buffers[ref.buf], off, axes, ref.dtype)
        dt = self.d.ctype(ref.dtype)
        if ref.dtype != dt and ref.dtype != torch.bool:
            code = self.d.cast(code, ref.dtype, dt)
        return self.emit(code, dt, axes)

    def _scatter(self, node):
        shape, idx, val = node.args[0], node.args[1], node.args[2]
        if len(idx) != len(shape) or any(i is None for i in idx):
            raise Unsupported("flex: a captured-tensor gradient scattered along part of its dims")
        vals = self._ints(idx, "a captured-tensor gradient scattered at a float or bool index")
        return Scatter(tuple(int(s) for s in shape), [(vals, self.value(val))])


def translate(gm, inputs, dialect: Dialect, prefix: str, buffers):
    """``(lines, output)`` of subgraph ``gm`` on ``inputs`` (``Val``/``Ref`` per placeholder); ``buffers``:
    the kernel operand name of each captured tensor (``<name>_stride<d>``, ``<name>_size<d>`` beside it)."""
    t = Translator(gm, dialect, prefix, buffers)
    out = t.run(inputs)
    return t.lines, out


def is_identity(gm) -> bool:
    """Whether a score_mod returns its score unchanged."""
    out = gm.graph.output_node().args[0]
    if isinstance(out, (list, tuple)):
        out = out[0]
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return bool(phs) and out is phs[0]


def is_true(v) -> bool:
    """Whether a translated mask is the constant True (no mask)."""
    return isinstance(v, Val) and v.const is not None and bool(v.const) is True
