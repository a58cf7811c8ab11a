"""Column reductions folded into row kernels (role 'colpart').

A reduction over the leading dims of a tensor that keeps a short row (a norm's weight and bias
gradients, a bias gradient) would otherwise read its input a second time in column tiles. Here it is
split into ``S`` chunks of rows (``fold_split``, at lowering); the partial results run in a kernel
over (rows, columns) whose ``S`` programs each walk one chunk, reading each row once along its
columns, accumulating in registers, and storing at (program, column). The scheduler places such a
partial in the row kernel that reads the same rows (``schedule``: ``colpart_dims``, ``colpart_body``,
``colpart_index``); the reduction over the ``S`` partials follows, chained or on its own.

Where no row reduction over the same rows reads what the partial reads, the classic split measured
faster, and ``unfold`` (the scheduler's first step) rebuilds it (``rebuild_split``).
"""
from __future__ import annotations

import sympy

from kiln.codegen.indexing import RINDEX, XINDEX, ZERO, FloorDiv, ModIdx, prod, same_sizes, size_expr, unflatten
from kiln.codegen.loops import Buffer, Pointwise, Reduction, contiguous_strides, new_name

FOLD = True             # column reductions of rows that fit a persistent row kernel fold into one
FOLD_PROGRAMS = 256     # programs (row chunks) of a folded column reduction, at most
FOLD_MIN_CHUNK = 16     # rows a program reduces, at least
UNFOLD = True           # a folded column partial with no row kernel to join is split the classic way
XPID = sympy.Symbol("xpid", integer=True, nonnegative=True)   # the program id (a colpart's row chunk)


def fold_split(shape, dims) -> int:
    """Row chunks for a column reduction computed inside a row kernel (1: not one).

    A reduction over the leading dims of ``shape`` that keeps a short static tail (at most
    ``PERSISTENT_MAX`` elements: a row of a persistent row kernel) and many rows (a norm's weight and
    bias gradients, a bias gradient) is split into ``S`` chunks of rows, ``S`` dividing the row count.
    Its partial results are computed by a kernel over (rows, columns) whose ``S`` programs each walk
    one chunk, reading each row once, coalesced along the columns; it joins the kernel that computes
    the rows (a norm backward's row kernel, a pointwise producer) when the scheduler can place it
    there (role 'colpart'), and the short reduction over the ``S`` partials follows."""
    from kiln.codegen import lower_reduce as lr
    from kiln.codegen.triton import PERSISTENT_MAX
    if not FOLD:
        return 1
    n = len(shape)
    if not dims or list(dims) != list(range(len(dims))) or len(dims) == n:
        return 1
    r, c = lr.numel(shape, dims), lr.numel(shape, range(len(dims), n))
    if not (r.is_Integer and c.is_Integer) or int(c) > PERSISTENT_MAX:
        return 1
    r, c = int(r), int(c)
    if r < lr.SPLIT_MIN_R or r * c < lr.SPLIT_MIN_NUMEL:
        return 1
    s = FOLD_PROGRAMS
    while s > 1 and (r % s or r // s < FOLD_MIN_CHUNK):
        s //= 2
    return s


def colpart_shape(buf):
    """(programs, rows per program) of a folded column partial, else None."""
    c = buf.compute
    return (c.ranges[0], c.ranges[1]) if isinstance(c, Reduction) and c.fold else None


def colpart_dims(c: Reduction) -> tuple:
    """A folded partial's own kernel domain: its rows, then its columns (reduced in the row kernel's sense)."""
    return tuple((s, False) for s in c.fold if s != 1) + tuple((s, True) for s in c.ranges[2:] if s != 1)


def colpart_body(c: Reduction, dims):
    """The element a folded partial reduces at row ``xindex`` (chunk ``xindex // chunk``), column
    ``rindex`` of a kernel over ``dims``; None when the kernel's rows or columns are not its own."""
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


def unfold(lowering) -> None:
    """Keep a folded column partial only where a row reduction over the same rows and columns
    reads one of the buffers it reads (a norm backward's row kernel, which it joins): there it
    costs no extra reads. Elsewhere (a bias gradient, a pointwise producer's column sums) the
    classic split measured faster on an H200 (GELU backward with its bias gradient, 8192x3072
    bf16: 0.058 ms against 0.083 folded) and is rebuilt (``rebuild_split``)."""
    from kiln.codegen.schedule import body, loads, node_dims
    if not UNFOLD:
        return
    folds = [b for b in lowering.computed if colpart_shape(b) is not None]
    if not folds:
        return
    def key(rows, cols):
        return sympy.expand(prod(list(rows))), sympy.expand(prod(list(cols)))
    read_by_rows = {}   # (rows, columns) -> the buffers row reductions over them read
    for b in lowering.computed:
        c = b.compute
        if isinstance(c, Reduction) and not c.fold and not c.split and c.reduced:
            kept = len(c.ranges) - len(c.reduced)
            if list(c.reduced) == list(range(kept, len(c.ranges))):
                names = {name for name, _ in loads(body(b, node_dims(b)))}
                read_by_rows.setdefault(key(c.ranges[:kept], c.ranges[kept:]), set()).update(names)
    for b in folds:
        c = b.compute
        mine = {name for name, _ in loads(body(b, node_dims(b)))}
        if not mine & read_by_rows.get(key(c.fold, c.ranges[2:]), set()):
            rebuild_split(lowering, b)


def rebuild_split(lowering, buf) -> None:
    """Replace folded column partial ``buf`` (in ``lowering.computed``) by the classic split of its
    reduction (``split_count`` chunks, reduced in column tiles), or by no split: the final's buffer
    keeps its name and gets the new reduction of the new partials (``unfold``)."""
    from kiln.codegen.lower_reduce import split_count, split_final, split_partial
    kind, shape, dims, fn, acc, dtype, oshape, final_name = buf.compute.fold_src
    final = lowering.buffers[final_name]
    at = lowering.computed.index(buf)
    splits = split_count(shape, list(dims))
    if splits <= 1:
        del lowering.computed[at]
        final.compute = Reduction(kind, shape, dims, fn, acc, dtype, oshape)
        return
    part_red = split_partial(kind, list(shape), list(dims), fn, acc, splits)
    pshape = tuple(size_expr(s) for s in part_red.out_shape)
    part = Buffer(new_name(), pshape, contiguous_strides(pshape), acc, buf.device, "reduction", None, part_red)
    lowering.buffers[part.name] = part
    lowering.computed[at] = part
    final.compute = split_final(kind, Pointwise.of_buffer(part), part_red, acc, dtype, oshape)
