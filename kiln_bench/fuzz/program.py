"""A fuzz program as plain data: its inputs, its straight-line statements, what it returns.

A ``Program`` renders to Python source (``source()``): a ``make_inputs(up=False)`` function that builds
the inputs (``up=True`` builds them in float64/complex128 for the arbiter, keeping views and aliases) and
a ``program(a0, a1, ...)`` function. It round-trips through JSON (``to_dict``/``from_dict``) so the
runner's parent, which never imports torch, can ship programs to its children and shrink them.

Statements are ``Op``s: ``text`` is a format string over the names in ``args`` (``"torch.add({0}, {1})"``);
``out`` is the new value's name, or None for a statement run for its effect (``{0}.add_({1})``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Input:
    """One input tensor. ``values``: 'grid' (multiples of 1/4, exact in fp32 sums and products), 'index:N'
    (integers in [0, N)), 'sindex:N' ([-N, N)), 'perm:N' (distinct integers in [0, N)), 'mask' (bools);
    'oobindex:N', 'oobsindex:N': the same with one index out of range (eager raises, or wraps it).
    ``layout``: 'contiguous', 'transposed', 'sliced', 'offset', 'expanded', 'overlapping', 'channels_last'.
    ``alias``: (index of an earlier input, view text such as '[1:]'): this input is that view of it."""
    shape: tuple
    dtype: str = "float32"
    layout: str = "contiguous"
    seed: int = 0
    values: str = "grid"
    special: bool = False      # sprinkle nan, inf, -inf, -0.0 among the values
    grad: bool = False
    alias: tuple | None = None

    def call(self) -> str:
        if self.alias is not None:
            return f"leaf(a{self.alias[0]}{self.alias[1]}, grad={self.grad})"
        extra = "".join(f", {k}={v!r}" for k, v in (("layout", self.layout), ("values", self.values),
                                                     ("special", self.special), ("grad", self.grad))
                        if v != getattr(Input, k))
        dense = ", dense=dense" if self.layout == "overlapping" else ""
        return f"make_input({tuple(self.shape)!r}, {self.dtype!r}, seed={self.seed}{extra}, up=up{dense})"


@dataclass(frozen=True)
class Op:
    """One statement: ``out = text.format(*args)``, or ``text.format(*args)`` when ``out`` is None."""
    text: str
    args: tuple = ()
    out: str | None = None
    family: str = ""

    def line(self) -> str:
        expr = self.text.format(*self.args)
        return f"{self.out} = {expr}" if self.out else expr


@dataclass
class Spec:
    """A proposed statement: ``text`` over ``args`` (names); ``exact``: 'select' (keeps exactness),
    'add' (keeps it in float32), 'mul' (one level), 'discrete' (needs exact floats in), or 'inexact'.
    ``inplace``: the name of the value it mutates (no new value unless ``out``)."""
    text: str
    args: tuple
    exact: str = "inexact"
    inplace: str | None = None
    out: bool = True


@dataclass(frozen=True)
class Program:
    """Inputs ``a0..``, statements, returned names; ``train``: gradients of the inputs with ``grad``
    are checked (else the program runs under no_grad); ``dynamic``: ``torch.compile(dynamic=True)``."""
    inputs: tuple = ()
    ops: tuple = ()
    returns: tuple = ()
    train: bool = False
    dynamic: bool = False
    note: str = ""
    tags: tuple = field(default=(), compare=False)

    # -- rendering -------------------------------------------------------------------------------------
    def source(self) -> str:
        """Python text defining ``make_inputs(up=False, dense=False)`` and ``program(...)``; needs the names of
        ``kiln_bench.fuzz.harness`` (``make_input``, ``leaf``) and ``torch``, ``F`` in scope."""
        names = [f"a{i}" for i in range(len(self.inputs))]
        lines = ["def make_inputs(up=False, dense=False):"]
        lines += [f"    a{i} = {x.call()}" for i, x in enumerate(self.inputs)]
        lines += [f"    return [{', '.join(names)}]", "", "", f"def program({', '.join(names)}):"]
        lines += [f"    {op.line()}" for op in self.ops]
        lines.append(f"    return ({''.join(r + ', ' for r in self.returns)})")
        return "\n".join(lines) + "\n"

    def describe(self) -> str:
        return (f"{len(self.inputs)} inputs, {len(self.ops)} ops "
                f"({', '.join(sorted({op.family for op in self.ops}))}), "
                f"{'train' if self.train else 'no_grad'}, {'dynamic' if self.dynamic else 'static'}")

    # -- JSON ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "Program":
        inputs = tuple(Input(**{**x, "shape": tuple(x["shape"]),
                                "alias": tuple(x["alias"]) if x.get("alias") else None}) for x in d["inputs"])
        ops = tuple(Op(**{**o, "args": tuple(o["args"])}) for o in d["ops"])
        return Program(inputs, ops, tuple(d["returns"]), d["train"], d["dynamic"], d.get("note", ""),
                       tuple(d.get("tags", ())))

    # -- edits (for shrinking; each returns a new program, perhaps one eager rejects) ------------------------
    def without_op(self, i: int) -> "Program":
        """Drop statement ``i``; later uses of its value read its first operand instead."""
        op = self.ops[i]
        sub = {op.out: op.args[0]} if op.out and op.args else {}   # no operand: later uses dangle, eager rejects
        ops = self.ops[:i] + tuple(_rename(o, sub) for o in self.ops[i + 1:])
        rets = _dedup(sub.get(r, r) for r in self.returns)
        return dataclasses.replace(self, ops=ops, returns=rets).pruned()

    def simplified(self) -> "Program":
        """Without statements whose value nothing reads (in-place ones stay) and unread inputs."""
        ops = list(self.ops)
        changed = True
        while changed:
            changed = False
            for i in reversed(range(len(ops))):
                op = ops[i]
                read = any(op.out in o.args for o in ops[i + 1:]) or op.out in self.returns
                if op.out and op.family not in ("inplace", "hook") and not read:
                    del ops[i]
                    changed = True
        return dataclasses.replace(self, ops=tuple(ops)).pruned()

    def uses(self, name: str, after: int = -1) -> bool:
        return any(name in o.args for o in self.ops[after + 1:]) or name in self.returns

    def pruned(self) -> "Program":
        """Drop inputs nothing reads (renumbering the rest) and aliases of dropped inputs."""
        used = {a for o in self.ops for a in o.args} | set(self.returns)
        keep = [i for i, x in enumerate(self.inputs) if f"a{i}" in used]
        keep = sorted(set(keep) | {x.alias[0] for i, x in enumerate(self.inputs) if i in keep and x.alias})
        if len(keep) == len(self.inputs):
            return self
        new = {f"a{old}": f"a{k}" for k, old in enumerate(keep)}
        inputs = tuple(dataclasses.replace(self.inputs[old], alias=(keep.index(self.inputs[old].alias[0]),
                                                                     self.inputs[old].alias[1]))
                       if self.inputs[old].alias else self.inputs[old] for old in keep)
        return dataclasses.replace(self, inputs=inputs, ops=tuple(_rename(o, new) for o in self.ops),
                                   returns=tuple(new.get(r, r) for r in self.returns))

    def with_input(self, i: int, **changes) -> "Program":
        inputs = list(self.inputs)
        inputs[i] = dataclasses.replace(inputs[i], **changes)
        return dataclasses.replace(self, inputs=tuple(inputs))


def _rename(op: Op, sub: dict) -> Op:
    return dataclasses.replace(op, args=tuple(sub.get(a, a) for a in op.args)) if sub else op


def _dedup(names) -> tuple:
    out = []
    for n in names:
        if n not in out:
            out.append(n)
    return tuple(out)
