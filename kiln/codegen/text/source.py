"""Kernel sources as values: an emitter's ``KernelSource`` (its kernel named ``PLACEHOLDER``), named by a
hash of its text (``named``) into the ``KernelRef`` a graph node calls (data until ``kiln.runtime`` binds
it); a C++ ``Unit`` and the wrapper's ``Wrapper``, which the runtime builds and loads.
"""
import hashlib
from dataclasses import dataclass, field
from typing import Any

from kiln.codegen.schedule.plan import ScatterPlan

PLACEHOLDER = "__KILN_KERNEL__"   # a kernel's name in an emitter's text, until ``named`` names it

# libm functions a C++ unit declares ``omp declare simd`` when glibc's libmvec has them all
VECTOR_MATH = ("exp", "log", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh",
               "acosh", "atanh", "erf", "erfc", "exp2", "expm1", "log10", "log1p", "log2")


@dataclass(frozen=True)
class KernelSource:
    """What an emitter makes of a plan: a module's ``text``, the buffers ``call`` takes and returns, its extra
    size arguments (``scalars``), per output the positions of the inputs it may be written into (``reuse``:
    ``call``'s ``into``), how many philox seed tensors ``call`` takes last (``seeds``) and the input layouts
    it checks unless told they are ``known`` (``launcher.layouts``). A declined plan has no text (``declined``)."""
    text: str
    inputs: tuple
    outputs: tuple
    scalars: tuple
    kind: str
    reuse: tuple = ()
    interpret: bool = False
    seeds: int = 0
    layouts: tuple = ()


@dataclass(frozen=True)
class Unit:
    """A graph's C++ translation unit: its source, the names of its ``extern "C"`` functions and the
    ``prelude`` it includes (the shared definitions, a header written beside it at build time)."""
    source: str
    functions: tuple
    prelude: str = ""

    @staticmethod
    def of(prelude: str, body: str, functions: tuple) -> "Unit":
        """A unit whose source includes ``prelude`` by a name derived from its text, then ``body``."""
        return Unit(f'#include "{header_name(prelude)}"\n\n{body}', functions, prelude)


def header_name(prelude: str) -> str:
    return f"kiln_prelude_{hashlib.sha256(prelude.encode()).hexdigest()[:16]}.h"


@dataclass(frozen=True, eq=False)
class KernelRef:
    """A fused graph's kernel node target, with its call site's ATen ``fallback``; data until bound."""
    name: str
    source: str
    interpret: bool
    reuse: tuple = ()
    fallback: Any = None
    layouts: tuple = ()   # ``KernelSource.layouts``

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
    written: list = field(default_factory=list)  # positions of the inputs kernels may write in place


_PREFIX = {"reduction": "red", "scatter": "scatter", "group": "grp"}


def named(src: KernelSource, fallback=None) -> KernelRef:
    """``src`` named by a hash of its text: ``kiln_pw_``, ``kiln_red_``... and 12 hex digits."""
    digest = hashlib.sha256(src.text.encode()).hexdigest()[:12]
    name = f"kiln_{'flex' if src.kind.startswith('flex') else _PREFIX.get(src.kind, 'pw')}_{digest}"
    return KernelRef(name, src.text.replace(PLACEHOLDER, name), src.interpret, src.reuse, fallback, src.layouts)


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
