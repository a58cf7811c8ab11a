"""What both emitters' expression writers share: a kernel's temporaries, its pointer and size parameters,
its reduction results, its philox seeds and bounds checks, and how it prints an index (``printer``)."""
import sympy

from kiln.codegen.ir.bounds import parts, proof
from kiln.codegen.schedule.plan import KernelPlan
from kiln.codegen.text.printer import source
from kiln.debug import counters


class ExprWriter:
    """Per kernel: its parameters (``inputs``, ``sizes``, ``out_args``), seed variables, reduction results and
    bounds checks. A subclass names its loop symbols (``LOOP_NAMES``) and writes integers and division."""
    LOOP_NAMES: dict = {}
    DIV = "//"
    WHAT = "index"

    def __init__(self, plan: KernelPlan, tuning):
        self.plan, self.tuning = plan, tuning
        self.xnumel, self.rnumel, self.ranges = plan.xnumel, plan.rnumel, plan.ranges
        self.red = plan.reduction
        self.level = plan.levels
        self.inputs, self.sizes, self.seeds, self.red_vars = {}, {}, {}, {}
        self.out_args = {b.name: f"out_ptr{i}" for i, b in enumerate(plan.stored)}
        self.count = 0
        self.checks, self.proofs = {}, {}

    def tmp(self, prefix="tmp"):
        self.count += 1
        return f"{prefix}{self.count}"

    def arg_for(self, name):
        return self.inputs.setdefault(name, f"in_ptr{len(self.inputs)}")

    def size_arg(self, sym):
        return self.sizes.setdefault(sym, f"ks_{sym.name}")

    def seed(self, slot) -> str:
        """The variable holding the philox seed of random op ``slot``."""
        return self.seeds.setdefault(slot, f"seed{len(self.seeds)}")

    def integer(self, n: int) -> str:
        return str(n)

    def pexpr(self, e, sub=None) -> str:
        """An index expression as source (``sub``: names of indirect symbols)."""
        sub = sub or {}

        def leaf(s):
            if s in self.LOOP_NAMES:
                return self.LOOP_NAMES[s]
            return sub[s] if s in sub else self.size_arg(s)
        return source(sympy.sympify(e), leaf, self.integer, self.DIV, self.WHAT)

    def proven(self, e):
        """``(raw, size, info, how)``: ``how`` 'in' or 'wrap' where proven in range, else None (a check)."""
        raw, size, info = parts(e)
        how = proof(e, self.plan.ranges, self.plan.buffers, self.proofs)
        if how is not None:
            counters["codegen"]["index_proven"] += 1
        if how is None and e not in self.checks:
            counters["codegen"]["index_checks"] += 1
        return raw, size, info, how
