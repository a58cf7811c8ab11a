"""kiln's loop-level IR: values are indexed expressions over their output shape.

Opcodes of ``Expr`` (one scalar computation at one point of a kernel's iteration space):

    load(buf, index, binds)   element ``index`` (flat, in elements) of buffer ``buf``; ``binds``
                              maps ``ind*`` symbols in ``index`` to Exprs (indirect indexing)
    const(value)              a Python number
    index(expr)               an index expression used as a value (arange, iota, masks)
    checked(raw, size, info)  an indirect index into a dim of ``size``, checked in range (``ir/bounds.py``)
    cast(x)                   convert ``x`` to ``dtype``
    masked(cond, body, other) ``body`` where ``cond`` holds (its loads are masked), else ``other``
    rand(kind, offset, slot)  philox uniform/normal at flat ``offset`` with the kernel's seed ``slot``
    red(buf)                  (kernel-internal) the result of reduction ``buf`` at this row
    <math op>(args...)        see ``UNARY``/``BINARY``/``where``

Exprs are hash-consed (identity is structural equality; CSE in an emitter is a dict lookup). A lowered
value is a ``Pointwise`` (index -> Expr, memoized) or, once materialized, a ``Buffer`` read through loads; a
``Reduction`` always owns a buffer, and the scheduler decides which buffers are stored.
"""
import itertools
import math
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import sympy
import torch

from kiln.codegen.ir.indexing import contiguous_strides, flat_index, memo, size_expr

UNARY = {"neg", "abs", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt",
         "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh",
         "atanh", "sigmoid", "erf", "erfc", "floor", "ceil", "round", "trunc", "sign", "reciprocal",
         "logical_not", "bitwise_not", "isnan", "isinf", "signbit", "lgamma", "relu"}
BINARY = {"add", "sub", "mul", "truediv", "floordiv", "truncdiv", "remainder", "fmod", "pow", "maximum",
          "minimum", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor",
          "bitwise_and", "bitwise_or", "bitwise_xor", "atan2", "copysign", "hypot",
          "lshift", "rshift"}
COMPARE = {"eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor",
           "logical_not", "isnan", "isinf", "signbit"}


def _key(a):
    if isinstance(a, Expr):
        return ("E", id(a))
    if isinstance(a, float):
        return ("f", repr(a))
    if isinstance(a, (tuple, list)):
        return ("t",) + tuple(_key(x) for x in a)
    return a


class Expr:
    """A hash-consed scalar expression node (see the module docstring for opcodes)."""
    __slots__ = ("op", "args", "dtype", "__weakref__")
    _intern: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()

    def __new__(cls, op: str, args: tuple, dtype: torch.dtype):
        key = (op, _key(args), dtype)
        e = cls._intern.get(key)
        if e is None:
            e = object.__new__(cls)
            e.op, e.args, e.dtype = op, tuple(args), dtype
            cls._intern[key] = e
        return e

    def children(self):
        return [a for a in self.args if isinstance(a, Expr)] + \
            ([e for _, e in self.args[2]] if self.op in ("load", "index") else [])

    def __repr__(self):
        if self.op == "load":
            return f"load({self.args[0]}, {self.args[1]})"
        if self.op == "const":
            return repr(self.args[0])
        return f"{self.op}({', '.join(repr(a) for a in self.args)})"

    def walk(self):
        """Every node reachable from this one, each once, children first."""
        seen, order, stack = set(), [], [(self, False)]
        while stack:
            e, done = stack.pop()
            if done:
                order.append(e)
                continue
            if id(e) in seen:
                continue
            seen.add(id(e))
            stack.append((e, True))
            stack.extend((c, False) for c in e.children())
        return order


def neutral_value(kind: str, dtype: torch.dtype):
    """The identity element of reduction ``kind`` over ``dtype``, as a Python number."""
    if kind in ("sum", "any"):
        return 0
    if kind == "prod":
        return 1
    big = kind in ("min", "argmin", "all")
    if dtype.is_floating_point:
        return float("inf") if big else float("-inf")
    if dtype == torch.bool:
        return int(big)
    info = torch.iinfo(dtype)
    return info.max if big else info.min


def upcast(dtype):
    """The dtype arithmetic happens in: fp16/bf16 compute in fp32."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class ops:
    """Expr constructors. Callers cast operands to a common dtype first."""

    @staticmethod
    def const(value, dtype):
        if dtype == torch.bool:
            value = bool(value)
        elif dtype.is_floating_point:
            value = float(value)
        elif not (isinstance(value, float) and not math.isfinite(value)):
            value = int(value)
        return Expr("const", (value,), dtype)

    @staticmethod
    def index(expr, dtype=torch.int64):
        expr = sympy.sympify(expr)
        return Expr("index", (expr, None, binds_of(expr)), dtype)

    @staticmethod
    def cast(x, dtype):
        if x.dtype == dtype:
            return x
        if x.op == "const":
            return ops.const(x.args[0], dtype)
        narrow = _narrowed(x, dtype) if _RANK.get(x.dtype, 0) > _RANK.get(dtype, 9) else None
        return Expr("cast", (x,), dtype) if narrow is None else narrow

    @staticmethod
    def load(buf: "Buffer", index):
        index = sympy.sympify(index)
        return Expr("load", (buf.name, index, binds_of(index)), buf.dtype)

    @staticmethod
    def where(c, a, b):
        return Expr("where", (c, a, b), a.dtype)

    @staticmethod
    def masked(cond, body, other):
        return Expr("masked", (cond, body, ops.cast(other, body.dtype)), body.dtype)

    @staticmethod
    def unary(op, x):
        return Expr(op, (x,), torch.bool if op in COMPARE else x.dtype)

    @staticmethod
    def binary(op, a, b):
        if op in ("mul", "truediv") and a.dtype.is_floating_point and a.dtype == b.dtype:
            if _is_one(b):   # x * 1.0 and x / 1.0 are x exactly (NaN, infinities, -0.0 included): the
                return a     # expression of x stays one (mish's backward computed exp(x * 1.0) beside exp(x))
            if op == "mul" and _is_one(a):
                return b
        return Expr(op, (a, b), torch.bool if op in COMPARE else a.dtype)


_RANK = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}   # lower widens exactly


def _narrowed(x, dtype):
    """``x`` (a widened ``dtype`` value, or a selection of such) as ``dtype`` without a conversion, else None:
    a copy keeps a NaN's bits where a conversion would not (fuzz seed 12 #7722)."""
    if x.op == "cast" and x.args[0].dtype == dtype:
        return x.args[0]
    if x.op == "where":
        a, b = _narrowed(x.args[1], dtype), _narrowed(x.args[2], dtype)
        return None if a is None or b is None else Expr("where", (x.args[0], a, b), dtype)
    return None


def _is_one(e) -> bool:
    return e.op == "const" and e.args[0] == 1.0


_ind_names = itertools.count()
_local = threading.local()   # per compiling thread: symbol name -> Expr and Expr -> symbol


def _tables():
    if not hasattr(_local, "indirect"):
        _local.indirect, _local.symbol_of = {}, {}
    return _local.indirect, _local.symbol_of


def indirect_symbol(value: Expr) -> sympy.Symbol:
    """An index symbol standing for the (int64, non-negative) runtime value ``value``."""
    indirect, symbol_of = _tables()
    sym = symbol_of.get(value)
    if sym is None:
        sym = sympy.Symbol(f"ind{next(_ind_names)}", integer=True, nonnegative=True)
        symbol_of[value] = sym
        indirect[sym.name] = value
    return sym


def binds_of(index) -> tuple:
    """((symbol, Expr), ...) for the indirect symbols in an index expression."""
    syms = memo(("ind", index), lambda: tuple(s for s in sorted(getattr(index, "free_symbols", ()), key=str)
                                              if s.name.startswith("ind")))
    if not syms:
        return ()
    indirect, _ = _tables()
    return tuple((s, indirect[s.name]) for s in syms)


def release_indirect():
    """Forget this thread's indirect symbols (after a graph's kernels are emitted)."""
    _local.__dict__.pop("indirect", None)
    _local.__dict__.pop("symbol_of", None)


class Unsupported(Exception):
    """A lowering cannot express this node; the node stays an ATen call (never a user error)."""


_names = itertools.count()


@dataclass(eq=False)
class Buffer:
    """A materialized tensor: graph input, extern (ATen) output, kept view, or kernel result. ``compute``
    fills it (None for inputs and externs); ``node`` is its FX node (None for kernel-internal buffers)."""
    name: str
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    kind: str
    node: Any = None
    compute: Any = None
    fake: Any = None

    @property
    def numel(self):
        memo = self.__dict__.get("_numel")
        if memo is not None and memo[0] is self.shape:   # recomputed if shape is reassigned
            return memo[1]
        out = sympy.Integer(1)
        for s in self.shape:
            out = out * s
        self.__dict__["_numel"] = (self.shape, out)
        return out

    def index(self, idx):
        return flat_index(idx, self.stride)


def new_name(prefix="buf"):
    return f"{prefix}{next(_names)}"


def meta_layout(val):
    """(shape, stride) of a FakeTensor as sympy tuples."""
    return (tuple(size_expr(s) for s in val.shape), tuple(size_expr(s) for s in val.stride()))


class Pointwise:
    """A value defined at every index of ``shape``: ``fn(index) -> Expr`` (memoized); reads load from
    ``buffer`` once it is materialized."""

    def __init__(self, shape, dtype, device, fn: Callable, buffer: Optional[Buffer] = None):
        self.shape = tuple(size_expr(s) for s in shape)
        self.dtype, self.device, self.fn, self.buffer = dtype, device, fn, buffer
        self._memo = {}

    @classmethod
    def of_buffer(cls, buf: Buffer):
        return cls(buf.shape, buf.dtype, buf.device, lambda idx: ops.load(buf, buf.index(idx)), buf)

    def __call__(self, idx):
        key = tuple(sympy.sympify(i) for i in idx)
        e = self._memo.get(key)
        if e is None:
            e = ops.load(self.buffer, self.buffer.index(key)) if self.buffer is not None else self.fn(list(key))
            self._memo[key] = e
        return e

    def compute(self, idx):
        """The defining expression at ``idx`` (even once materialized)."""
        key = ("compute",) + tuple(sympy.sympify(i) for i in idx)
        e = self._memo.get(key)
        if e is None:
            e = self._memo[key] = self.fn(list(key[1:]))
        return e

    def __repr__(self):
        return f"Pointwise({list(self.shape)}, {self.dtype}, buffer={getattr(self.buffer, 'name', None)})"


@dataclass(eq=False)
class Reduction:
    """``kind`` over the dims ``reduced`` of the iteration space ``ranges``; ``fn(full_index)``
    gives the element to reduce (in ``acc_dtype``). The result has ``out_shape`` (keepdim or not)."""
    kind: str
    ranges: tuple
    reduced: tuple
    fn: Callable
    acc_dtype: torch.dtype
    dtype: torch.dtype
    out_shape: tuple
    split: bool = False   # the second half of a split reduction (never folded back into one program)
    fold: tuple = ()      # a column reduction's partial over row chunks, computed in a row kernel: the
                          # sizes of the rows it reduces (``schedule.split.fold_split``, role 'colpart')


@dataclass(eq=False)
class Scatter:
    """Write ``value(idx)`` at flat output index ``target(idx)`` for every ``idx`` of ``shape``,
    on top of a copy of ``base``; ``mode`` is 'add' (atomic) or 'set'."""
    base: Pointwise
    shape: tuple
    target: Callable
    value: Callable
    mode: str


@dataclass
class Seeds:
    """Philox seed slots a lowering asked for (one fresh seed per RNG op and kernel call)."""
    count: int = 0

    def new(self) -> int:
        self.count += 1
        return self.count - 1


def contiguous_buffer(shape, dtype, device, kind, compute=None, node=None) -> Buffer:
    shape = tuple(size_expr(s) for s in shape)
    return Buffer(new_name(), shape, contiguous_strides(shape), dtype, device, kind, node, compute)
