"""Random programs from hypothesis strategies, checked op by op against eager.

``programs()`` is a hypothesis strategy of ``Program``s (use it with ``@given``); ``program_for(seed, i)``
draws program ``i`` of a run deterministically (from a ``ConjectureData`` seeded by ``seed:i``), so the
runner can name and regenerate every program by its index.

A program is built statement by statement: a family (``ops.FAMILIES``) proposes a statement over the
values so far (and new inputs it asks for: broadcastable operands, indices in range, ...), which runs
eagerly at once on the real inputs; a statement eager rejects is redrawn, so every program eager runs
without error forward (its backward, or a nondeterminism, can still discard it later). Each value
carries its eager tensor and an exactness level (``Value.exact``): float values that are exact in
float32 (grid inputs, sums, single products, selections) may feed discrete ops (comparisons, argmax,
floor, casts to int), whose results would otherwise flip on the last bit of a rounding.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import random
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from kiln_bench.fuzz import harness, ops
from kiln_bench.fuzz.program import Input, Op, Program, Spec

MAIN_DTYPES = ["float32"] * 6 + ["bfloat16", "float16", "int64", "int32", "bool", "complex64"]
ALL_DTYPES = ["float32", "bfloat16", "float16", "int64", "int32", "bool", "complex64"]
SIZES = [1, 1, 2, 3, 4, 5, 7, 8, 16]
LAYOUTS = ["contiguous"] * 6 + ["transposed", "sliced", "offset", "expanded", "overlapping", "channels_last"]
ALIAS_VIEWS = ["[1:]", "[::2]", ".t()", ".view(-1)", ".transpose(0, -1)", "[..., :1]", ".unsqueeze(0)"]
MAX_NUMEL = 512
OOB = 0.03   # how often an index input holds one index out of range (eager raises, or wraps it: take_along_dim)
INEXACT = None   # Value.exact for a float that rounding may have touched


@dataclass
class Value:
    name: str
    t: torch.Tensor
    exact: int | None = 0     # 0: grid values, 1: one product of them, None: inexact
    input: int | None = None  # its index when the value is an input


class Gen:
    """The program under construction: a ``draw`` function, its inputs, statements and values."""

    def __init__(self, draw, train: bool, dynamic: bool, main: str, zero_ok: bool):
        self.draw, self.train, self.dynamic, self.main, self.zero_ok = draw, train, dynamic, main, zero_ok
        self.inputs: list[Input] = []
        self.ops: list[Op] = []
        self.pool: list[Value] = []
        self.env: dict = {}
        self.n_vals = 0
        self.raised = False   # the last statement raises eager's out-of-range index error (``try_spec``)

    # -- drawing helpers -----------------------------------------------------------------------------------
    def choice(self, seq):
        return self.draw(st.sampled_from(list(seq)))

    def int(self, lo: int, hi: int) -> int:
        return self.draw(st.integers(lo, hi))

    def chance(self, p: float) -> bool:
        return self.draw(st.integers(0, 99)) < int(p * 100)

    def const(self, dtype=None) -> str:
        """A literal operand: a grid float, or an int for integer and bool values."""
        if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
            return str(self.choice([0, 1, 2, -1, 3, -2]))
        return self.choice(["1.0", "2.0", "-1.0", "0.5", "-2.5", "0.0", "-0.0", "3", "0.25", "float('inf')",
                            "float('nan')", "-1.5"])

    def shape(self, ndim: int | None = None) -> tuple:
        ndim = self.choice([0, 1, 1, 2, 2, 2, 3, 3, 4]) if ndim is None else ndim
        sizes = SIZES + ([0] if self.zero_ok else [])
        out = [self.choice(sizes) for _ in range(ndim)]
        while math.prod(out) > MAX_NUMEL:
            out[out.index(max(out))] //= 2
        return tuple(out)

    def dim(self, t) -> int:
        d = self.int(0, max(t.dim() - 1, 0))
        return d - t.dim() if t.dim() and self.chance(0.2) else d

    # -- values --------------------------------------------------------------------------------------------
    def pick(self, pred=None):
        """A value of the pool satisfying ``pred`` (later ones likelier), or None."""
        vals = [v for v in self.pool if pred is None or pred(v.t)]
        if not vals:
            return None
        return vals[-1] if self.chance(0.4) else self.choice(vals)

    def new_input(self, shape=None, dtype=None, values="grid", plain=False) -> Value:
        """Add an input (``plain``: contiguous, no grad, no special values, no alias)."""
        shape = self.shape() if shape is None else tuple(shape)
        dtype = dtype or (self.main if self.chance(0.7) else self.choice(ALL_DTYPES))
        floaty = dtype in ("float32", "bfloat16", "float16", "complex64")
        alias = None
        cands = [v for v in self.pool if v.input is not None and self.inputs[v.input].alias is None
                 and v.t.dtype == harness.DTYPES[dtype] and v.t.dim() >= 1]
        if not plain and values == "grid" and cands and self.chance(0.1):
            alias = (cands[0].input if len(cands) == 1 else self.choice([v.input for v in cands]),
                     self.choice(ALIAS_VIEWS))
        layout = "contiguous" if plain else self.choice(LAYOUTS)
        nd = len(shape)
        fits = {"transposed": nd >= 2, "sliced": nd >= 1, "expanded": nd >= 1, "channels_last": nd == 4,
                "overlapping": nd >= 2 and min(shape) > 0}
        layout = layout if fits.get(layout, True) else "contiguous"
        x = Input(shape, dtype, layout=layout,
                  seed=self.int(0, 10 ** 6), values=values,
                  special=floaty and not plain and values == "grid" and self.chance(0.15),
                  grad=floaty and self.train and not plain and dtype != "complex64" and self.chance(0.6),
                  alias=alias)
        i = len(self.inputs)
        try:
            t = (harness.leaf(eval(f"a{alias[0]}{alias[1]}", {}, self.env), x.grad) if alias else
                 harness.make_input(x.shape, x.dtype, x.seed, x.layout, x.values, x.special, x.grad))
        except Exception:
            x = dataclasses.replace(x, alias=None)
            t = harness.make_input(x.shape, x.dtype, x.seed, x.layout, x.values, x.special, x.grad)
        if alias:
            x = dataclasses.replace(x, shape=tuple(t.shape), layout="contiguous", special=False, seed=0)
        self.inputs.append(x)
        v = Value(f"a{i}", t, 0, i)
        self.pool.append(v)
        self.env[v.name] = t
        return v

    def index(self, shape, n: int, kind="index") -> Value:
        """A new integer input of ``shape`` holding indices into a dim of size ``n``; now and then (``OOB``) one
        of them out of range ('index' and 'sindex' kinds: ``harness._values``), which eager may reject."""
        dtype = "int64" if self.chance(0.8) else "int32"
        if kind in ("index", "sindex") and self.chance(OOB):
            kind = "oob" + kind
        return self.new_input(shape, dtype, values=f"{kind}:{n}", plain=True)

    def mask(self, shape) -> Value:
        return self.new_input(shape, "bool", values="mask", plain=True)

    def operand(self, like, p_const=0.35, p_new=0.3):
        """A second operand for ``like`` (a Value): a literal, a new input of a shape that broadcasts
        with it, or any value (eager decides)."""
        if self.chance(p_const):
            return self.const(like.t.dtype), None
        if self.chance(p_new / (1 - p_const)) or len(self.pool) < 2:
            shape = list(like.t.shape)
            shape = [1 if self.chance(0.3) else s for s in shape]
            shape = shape[self.int(0, len(shape)):] if shape and self.chance(0.2) else shape
            dtype = None if self.chance(0.3) else str(like.t.dtype).replace("torch.", "")
            return None, self.new_input(shape, dtype if dtype in harness.DTYPES else None)
        return None, self.pick()

    # -- statements -----------------------------------------------------------------------------------------
    def try_spec(self, spec: Spec, family: str) -> bool:
        """Run ``spec`` eagerly; keep it (and its value) if eager accepts it and its result is small."""
        args = [self._value(a) for a in spec.args]
        floats_in = [v for v in args if v.t.is_floating_point() or v.t.is_complex()]
        if spec.exact == "discrete" and any(v.exact is None for v in floats_in):
            return False
        name = f"v{self.n_vals}"
        ns = {"torch": torch, "F": torch.nn.functional}
        line = spec.text.format(*spec.args)
        mode = torch.enable_grad() if self.train else torch.no_grad()
        try:
            with mode:
                if spec.out:
                    out = eval(line, ns, self.env)
                else:
                    exec(line, ns, self.env)
                    out = None
        except Exception as e:
            oob = any(self.inputs[v.input].values.startswith("oob") for v in args if v.input is not None)
            if oob and spec.out and harness.index_error(e):   # the program's last statement: kiln must raise too
                self.ops.append(Op(spec.text, tuple(spec.args), name, family))
                self.n_vals += 1
                self.raised = True
                return True
            return False
        if spec.out and (not isinstance(out, torch.Tensor) or out.numel() > 4 * MAX_NUMEL or out.dim() > 6):
            return False
        level = self._exact(spec.exact, [v.exact for v in floats_in],
                            out if out is not None else self._value(spec.inplace).t)
        if spec.inplace:
            target = self._value(spec.inplace).t
            for v in self.pool:   # everything sharing the storage may have changed
                if v.t.untyped_storage().data_ptr() == target.untyped_storage().data_ptr():
                    v.exact = None if level is None or v.exact is None else max(v.exact, level)
        self.ops.append(Op(spec.text, tuple(spec.args), name if spec.out else None, family))
        if spec.out:
            self.n_vals += 1
            self.env[name] = out
            self.pool.append(Value(name, out, level))
        return True

    def _value(self, name: str) -> Value:
        return next(v for v in reversed(self.pool) if v.name == name)

    @staticmethod
    def _exact(kind: str, levels: list, out) -> int | None:
        if not (out.is_floating_point() or out.is_complex()):
            return 0
        if any(x is None for x in levels) or kind == "inexact":
            return INEXACT
        low = out.dtype in (torch.bfloat16, torch.float16)
        top = max(levels, default=0)
        if kind in ("select", "discrete"):
            return top
        if kind == "add":
            return INEXACT if low else top
        return INEXACT if low or sum(levels) + 1 > 1 else sum(levels) + 1   # 'mul'


def build(draw, max_ops: int = 8, families=None) -> Program:
    """One program: inputs, 1..``max_ops`` statements from ``families`` (names in ``ops.FAMILIES``)."""
    g = Gen(draw, train=draw(st.booleans()), dynamic=draw(st.integers(0, 99)) < 30,
            main=draw(st.sampled_from(MAIN_DTYPES)), zero_ok=draw(st.integers(0, 99)) < 8)
    for _ in range(g.int(1, 2)):
        g.new_input()
    names = sorted(families or ops.FAMILIES)
    weights = [n for n in names for _ in range(ops.FAMILIES[n][1])]
    for _ in range(g.int(1, max_ops)):
        for _attempt in range(12):
            family = g.choice(weights)
            spec = ops.FAMILIES[family][0](g)
            if spec is not None and g.try_spec(spec, family):
                break
        if g.raised:
            break
    used = {a for op in g.ops for a in op.args}
    outs = [op.out for op in g.ops if op.out and (op.out not in used or g.chance(0.15))]
    if not outs and g.ops:
        outs = [op.out for op in g.ops if op.out][-1:]
    if g.raised:   # the raising statement is returned (kept by shrinking) and says so
        outs = [o for o in outs if o != g.ops[-1].out][-5:] + [g.ops[-1].out]
    return Program(tuple(g.inputs), tuple(g.ops), tuple(outs[-6:]), g.train, g.dynamic,
                   tags=("raises",) if g.raised else ()).pruned()


@st.composite
def programs(draw, max_ops: int = 8, families=None):
    """Hypothesis strategy of fuzz programs (each built op by op against eager)."""
    return build(draw, max_ops, families)


def program_for(seed: int, index: int, max_ops: int = 8, families=None) -> Program:
    """Program ``index`` of the run seeded ``seed``: the same in every process (``_Fixed``)."""
    from hypothesis.internal.conjecture.data import ConjectureData
    data = ConjectureData(random=random.Random(f"kiln-fuzz:{seed}:{index}"), provider=_fixed_provider())
    with torch.random.fork_rng():
        prog = build(data.draw, max_ops, families)
    return dataclasses.replace(prog, note=f"seed {seed} program {index}")


@functools.lru_cache(maxsize=None)
def _fixed_provider():
    """Hypothesis's provider without the integer constants it collects from the local modules imported so
    far (now and then a drawn integer is one of them): a program drawn after the Triton target's modules
    were imported, or in another process, would differ from the same index drawn elsewhere."""
    from hypothesis.internal.conjecture.providers import Constants, HypothesisProvider

    class Fixed(HypothesisProvider):
        _local_constants = Constants()
    return Fixed
