"""Column reductions folded into row kernels (role 'colpart').

A reduction over the leading dims of a tensor that keeps a short row (a norm's weight and bias
gradients, a bias gradient) would otherwise read its input a second time in column tiles. Here it is
split into ``S`` chunks of rows (``lower.split.fold_split``, at lowering); the partial results run in a kernel
over (rows, columns) whose ``S`` programs each walk one chunk, reading each row once along its
columns, accumulating in registers, and storing at (program, column). The scheduler places such a
partial in the row kernel that reads the same rows (``colpart.py`` says where it sits there); the
reduction over the ``S`` partials follows, chained or on its own.

Where no row reduction over the same rows reads what the partial reads, the classic split measured
faster, and ``unfold`` (the scheduler's first step) rebuilds it (``rebuild_split``).
"""
from __future__ import annotations

import sympy

from kiln.codegen.ir.indexing import contiguous_strides, prod, size_expr
from kiln.codegen.ir.loops import Buffer, Pointwise, Reduction, new_name
from kiln.codegen.lower.split import split_count, split_final, split_partial
from kiln.codegen.schedule.colpart import colpart_shape
from kiln.codegen.schedule.domain import body, loads, node_dims
from kiln.options import Tuning


def unfold(lowering, tuning: Tuning) -> None:
    """Keep a folded column partial only where a row reduction over the same rows and columns
    reads one of the buffers it reads (a norm backward's row kernel, which it joins): there it
    costs no extra reads. Elsewhere (a bias gradient, a pointwise producer's column sums) the
    classic split measured faster on an H200 (GELU backward with its bias gradient, 8192x3072
    bf16: 0.058 ms against 0.083 folded) and is rebuilt (``rebuild_split``)."""
    if not tuning.unfold:
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
            rebuild_split(lowering, b, tuning)


def rebuild_split(lowering, buf, tuning: Tuning) -> None:
    """Replace folded column partial ``buf`` (in ``lowering.computed``) by the classic split of its
    reduction (``split_count`` chunks, reduced in column tiles), or by no split: the final's buffer
    keeps its name and gets the new reduction of the new partials (``unfold``)."""
    src = buf.compute.fold_src
    kind, shape, dims, fn, acc, dtype, oshape = src.kind, src.shape, src.dims, src.fn, src.acc, src.dtype, src.out_shape
    final = lowering.buffers[src.final]
    at = lowering.computed.index(buf)
    splits = split_count(shape, list(dims), tuning)
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
