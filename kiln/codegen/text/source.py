"""Kernel sources as values: what an emitter returns, how a kernel is named, what a graph node calls.

An emitter turns a plan into a ``KernelSource`` (a module's text with its kernel named ``PLACEHOLDER``);
``named`` names it by a hash of that text (equal text, equal kernel: twelve identical layers share one)
and makes the ``KernelRef`` a fused graph's node calls: plain data (name, text, flags, the call site's
ATen fallback) until ``kiln.runtime`` binds it to a loaded kernel. The C++ emitter also returns the
graph's translation unit (``Unit``), which the runtime builds, and the wrapper emitter a ``Wrapper``
(``codegen/wrapper.py``), which the runtime loads.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from kiln.codegen.schedule.plan import ScatterPlan

PLACEHOLDER = "__KILN_KERNEL__"   # a kernel's name in an emitter's text, until ``named`` names it

# libm functions a C++ unit declares ``omp declare simd`` when glibc's vector math library has them all
# (the emitter's preamble and the runtime's build both read this list)
VECTOR_MATH = ("exp", "log", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh",
               "acosh", "atanh", "erf", "erfc", "exp2", "expm1", "log10", "log1p", "log2")


@dataclass(frozen=True)
class KernelSource:
    """What an emitter makes of a plan: a module's ``text`` (its kernel named by a placeholder), the
    buffers its ``call`` takes (``inputs``, in order) and returns (``outputs``), the size symbols passed
    as extra arguments (``scalars``), the kind of kernel, the inputs its output may be written into
    (``reuse``, positions), whether it runs in Triton's interpreter, and how many philox seeds its ``call``
    takes after the scalars (``seeds``: one-element int64 tensors the graph draws on the device). A plan
    the emitter declines has no text: its ATen nodes run instead (``declined``)."""
    text: str
    inputs: tuple
    outputs: tuple
    scalars: tuple
    kind: str
    reuse: tuple = ()
    interpret: bool = False
    seeds: int = 0


@dataclass(frozen=True)
class Unit:
    """A graph's C++ translation unit: its source and the names of its ``extern "C"`` functions."""
    source: str
    functions: tuple


@dataclass(frozen=True, eq=False)
class KernelRef:
    """The target of a fused graph's kernel node: kernel ``name``, its module ``source``, whether it runs in
    Triton's interpreter, the inputs its output may be written into (``reuse``) and the call site's ATen
    ``fallback`` (``codegen.fallback``; None: the graph's). Data until ``kiln.runtime.load`` binds it to a
    loaded kernel."""
    name: str
    source: str
    interpret: bool
    reuse: tuple = ()
    fallback: Any = None

    @property
    def __name__(self) -> str:   # how torch.fx names the node's target
        return self.name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"kernel {self.name} is not bound: kiln.runtime.load binds a fused graph's kernels "
                           "(load, or bind_graph for a GraphModule) before it runs")


@dataclass
class Wrapper:
    """A generated Python wrapper's source plus the globals it needs (``codegen/wrapper.py``)."""
    name: str
    source: str
    globals: dict = field(default_factory=dict)
    kernels: list = field(default_factory=list)  # the KernelRefs it calls, one per kernel
    handles: dict = field(default_factory=dict)  # global name -> the OpOverload whose C++ handle it binds
    known_outputs: list = field(default_factory=list)  # per output: strides at run time = example's


_PREFIX = {"reduction": "red", "scatter": "scatter", "flex": "flex", "flex_decode": "flex", "flex_backward": "flex",
           "flex_cpp": "flex"}


def named(src: KernelSource, fallback=None) -> KernelRef:
    """``src`` named by a hash of its text: ``kiln_pw_``, ``kiln_red_``, ``kiln_scatter_`` or ``kiln_flex_`` and 12
    hex digits."""
    digest = hashlib.sha256(src.text.encode()).hexdigest()[:12]
    name = f"kiln_{_PREFIX.get(src.kind, 'pw')}_{digest}"
    return KernelRef(name, src.text.replace(PLACEHOLDER, name), src.interpret, src.reuse, fallback)


def declined(plan) -> KernelSource:
    """The source of a plan left to ATen: what it reads and writes, no text."""
    if isinstance(plan, ScatterPlan):
        reads, symbols = plan.copy.reads | plan.write.reads, plan.copy.symbols | plan.write.symbols
    else:
        head = {b.name for b in plan.stored}
        reads, symbols = set(plan.reads), set(plan.symbols)
        if plan.tail is not None:
            reads |= plan.tail.reads - head
            symbols |= plan.tail.symbols
    outputs = [b.name for b in plan.outputs()]
    return KernelSource("", tuple(sorted(reads)), tuple(outputs), tuple(sorted(symbols, key=str)), "aten", (), None)


__all__ = ["PLACEHOLDER", "VECTOR_MATH", "KernelSource", "Unit", "KernelRef", "Wrapper", "named", "declined"]
