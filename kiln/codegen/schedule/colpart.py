"""Where a folded column partial (role 'colpart', ``split.fold_split``) sits in a row kernel: one program
per chunk of whole rows (``XPID``) walks its rows, accumulating per column.
"""
import sympy

from kiln.codegen.ir.indexing import RINDEX, XINDEX, ZERO, FloorDiv, ModIdx, prod, same_sizes, unflatten
from kiln.codegen.ir.loops import Reduction

XPID = sympy.Symbol("xpid", integer=True, nonnegative=True)   # the program id (a colpart's row chunk)


def colpart_shape(buf):
    """(programs, rows per program) of a folded column partial, else None."""
    c = buf.compute
    return (c.ranges[0], c.ranges[1]) if isinstance(c, Reduction) and c.fold else None


def colpart_dims(c: Reduction) -> tuple:
    """A folded partial's own kernel domain: its rows, then its columns (reduced in the row kernel's sense)."""
    return tuple((s, False) for s in c.fold if s != 1) + tuple((s, True) for s in c.ranges[2:] if s != 1)


def colpart_body(c: Reduction, dims):
    """The element a folded partial reduces at row ``xindex``, column ``rindex`` of a kernel over ``dims``
    (None when the kernel's rows or columns are not its own)."""
    cols = [s for s, r in dims if r]
    if not (same_sizes([prod([s for s, r in dims if not r])], [prod(list(c.fold))]) and
            same_sizes(cols, [s for s in c.ranges[2:] if s != 1])):
        return None
    chunk = c.ranges[1]
    rs = iter(unflatten(RINDEX, cols))
    return c.fn([FloorDiv(XINDEX, chunk), ModIdx(XINDEX, 1, chunk)] + [ZERO if s == 1 else next(rs)
                                                                        for s in c.ranges[2:]])


def colpart_index(buf, dims):
    """Where a program stores its chunk's partial: (program ``XPID``, column ``rindex``)."""
    rs = iter(unflatten(RINDEX, [s for s, r in dims if r]))
    return buf.index([XPID] + [ZERO if s == 1 else next(rs) for s in buf.shape[1:]])
