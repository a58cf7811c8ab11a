"""The one printer of index and size expressions, for every emitter and launcher (Python and C++ alike)."""
import sympy

from kiln.codegen.ir.indexing import FloorDiv, ModIdx
from kiln.codegen.ir.loops import Unsupported


def source(e, leaf, integer=str, div: str = "//", what: str = "index") -> str:
    """``e`` (a sympy index expression) as source: ``leaf(symbol)`` names a symbol, ``integer(n)`` writes a
    constant, ``div`` divides non-negative operands ('//' or '/'). Unprintable: ``Unsupported``."""
    p = lambda x: source(x, leaf, integer, div, what)  # noqa: E731
    if e.is_Integer:
        return integer(int(e))
    if e.is_Symbol:
        return leaf(e)
    # a right operand of div or % that is a product needs parentheses: ``a // 32*s`` is (a // 32)*s
    q = lambda x: f"({p(x)})" if x.is_Mul or x.is_Pow else p(x)  # noqa: E731
    if isinstance(e, FloorDiv):
        return f"({p(e.args[0])} {div} {q(e.args[1])})"
    if isinstance(e, ModIdx):
        a, d, m = e.args
        return f"({p(a)} % {q(m)})" if d == 1 else f"(({p(a)} {div} {q(d)}) % {q(m)})"
    if e.is_Add:
        return "(" + " + ".join(p(t) for t in e.args) + ")"
    if e.is_Mul:
        return "*".join(p(t) for t in e.args)
    if e.is_Pow and e.exp.is_Integer and e.exp > 0:
        return "(" + "*".join([p(e.base)] * int(e.exp)) + ")"
    raise Unsupported(f"cannot print {what} {e}")


def py(e, names: dict) -> str:
    """A size expression as Python over a launcher's local ``names`` (size symbol -> name)."""
    return source(sympy.sympify(e), names.__getitem__, what="size")
