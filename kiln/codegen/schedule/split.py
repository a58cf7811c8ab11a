"""How reductions split, decided once, before fusion (the scheduler's first step: ``split_reductions``).

A splittable reduction (sum, max, min, prod) over few long rows, or many rows of few columns, would leave
most of a GPU idle as one kernel. It is left whole, or cut in two: the classic split (``split_count``
chunks per row: ``split_partial``, then ``split_final`` over the partials), or a fold (``fold_split``): a
column reduction of short rows cut into chunks of whole rows, whose partials run inside the row kernel
reading those rows (role 'colpart'). A fold pays only where a row reduction over the same rows reads a
buffer the column reduction reads, or makes it (a norm backward, a bias gradient of its input gradient);
elsewhere the classic split measured faster on an H200 (GELU backward with its bias gradient, 8192x3072
bf16: 0.058 ms against 0.083). ``tuning.fold``: 'shared' (that rule), 'always', 'never'. On the GPU a fold
needs the rows of a split (``split_min_r``, ``split_min_numel``); the C++ target folds at any size.
"""
import sympy
import torch

from kiln.codegen.ir.indexing import next_pow2, numel, prod, unflatten
from kiln.codegen.ir.loops import Pointwise, Reduction, contiguous_buffer, neutral_value, ops
from kiln.codegen.schedule.domain import body, loads, node_dims
from kiln.options import Tuning

SPLITTABLE = {"sum": "sum", "max": "max", "min": "min", "prod": "prod"}


def split_reductions(lowering, tuning: Tuning) -> int:
    """Split the lowering's splittable reductions in place (a partial goes into ``lowering.computed``
    before its final, which keeps its buffer and name); returns how many were split."""
    folds, n = [], 0
    for buf in list(lowering.computed):
        c = buf.compute
        if isinstance(c, Reduction) and c.kind in SPLITTABLE:
            if tuning.fold != "never" and fold_split(c.ranges, c.reduced, tuning) > 1:
                folds.append(buf)
            else:
                n += _split(lowering, buf, split_count(c.ranges, c.reduced, tuning))
    shared = _read_by_rows(lowering, set(folds), tuning.fold_min_r > 0) if tuning.fold == "shared" and folds else None
    for buf in folds:
        c = buf.compute
        k = len(c.reduced)
        if shared is None or _reads(buf) & shared.get(_key(c.ranges[:k], c.ranges[k:]), set()):
            n += _split(lowering, buf, fold_split(c.ranges, c.reduced, tuning), fold=True)
        else:
            n += _split(lowering, buf, split_count(c.ranges, c.reduced, tuning))
    return n


def _key(rows, cols):
    return sympy.expand(prod(list(rows))), sympy.expand(prod(list(cols)))


def _reads(buf) -> set:
    return {name for name, _ in loads(body(buf, node_dims(buf)))}


def _read_by_rows(lowering, skip, made: bool) -> dict:
    """(rows, columns) -> the buffers row reductions over them read and (``made``: where ``fold_min_r`` is set, as
    on C++; not measured on the GPU) the values over those rows made from their results, in their kernel (a norm
    backward's input gradient) (``skip``: the fold candidates)."""
    out, rows = {}, {}
    for b in lowering.computed:
        c = b.compute
        if isinstance(c, Reduction) and b not in skip and not c.split and c.reduced:
            kept = len(c.ranges) - len(c.reduced)
            if list(c.reduced) == list(range(kept, len(c.ranges))):
                rows[b.name] = key = _key(c.ranges[:kept], c.ranges[kept:])
                out.setdefault(key, set()).update(_reads(b))
        elif isinstance(c, Pointwise) and made:
            for key in {rows[n] for n in _reads(b) if n in rows}:
                if sympy.expand(b.numel - key[0] * key[1]) == 0:
                    out[key].add(b.name)
    return out


def _split(lowering, buf, splits: int, fold: bool = False) -> int:
    """Cut ``buf``'s reduction in ``splits`` chunks (if 2 or more): a new partial buffer, then ``buf``."""
    if splits <= 1:
        return 0
    c = buf.compute
    part_red = split_partial(c.kind, list(c.ranges), list(c.reduced), c.fn, c.acc_dtype, splits, fold)
    part = contiguous_buffer(part_red.out_shape, c.acc_dtype, buf.device, "reduction", part_red)
    lowering.buffers[part.name] = part
    lowering.computed.insert(lowering.computed.index(buf), part)
    buf.compute = split_final(c.kind, Pointwise.of_buffer(part), part_red, c.acc_dtype, c.dtype, c.out_shape)
    return 1


def split_count(shape, dims, tuning: Tuning) -> int:
    """How many chunks to split each row of a reduction into (1: do not split)."""
    r = numel(shape, dims)
    x = numel(shape, [d for d in range(len(shape)) if d not in dims])
    if not (r.is_Integer and x.is_Integer):
        return 1
    r, x = int(r), int(x)
    if r < tuning.split_min_r or r * x < tuning.split_min_numel:
        return 1
    inner = (len(shape) - 1) in dims
    # split only what cannot fill a GPU otherwise: a handful of rows (splitting a norm's rows
    # would cost its fusion), or fewer columns than an outer reduction needs
    if (inner and x > tuning.split_max_rows) or (not inner and x >= 8192):
        return 1
    target = tuning.split_target_inner if inner else tuning.split_target_outer
    s = min(next_pow2(-(-target // x)), r // (tuning.split_min_chunk if inner else tuning.split_min_chunk_outer))
    return s if s >= 2 else 1


def fold_split(shape, dims, tuning: Tuning) -> int:
    """Row chunks for a column reduction over the leading dims of ``shape`` with a short static tail (a
    persistent row) and many rows, computed inside a row kernel (1: not one). Chunks divide the row count
    where that keeps at least half of ``fold_programs``; else each has ceil(rows / chunks) rows, the
    last fewer, with at most ``tail_max / columns`` chunks (the final over their partials stays chained):
    ViT-B's LayerNorm backward over 32 x 197 rows of 768 runs 85 programs of 75 rows, not 32 of 197."""
    n = len(shape)
    if not dims or list(dims) != list(range(len(dims))) or len(dims) == n:
        return 1
    r, c = numel(shape, dims), numel(shape, range(len(dims), n))
    if not (r.is_Integer and c.is_Integer) or int(c) > tuning.persistent_max:
        return 1
    r, c = int(r), int(c)
    if (r < tuning.fold_min_r) if tuning.fold_min_r else (r < tuning.split_min_r or r * c < tuning.split_min_numel):
        return 1
    s = tuning.fold_programs
    while s > 1 and r // s < tuning.fold_min_chunk:
        s //= 2
    exact = s
    while exact > 1 and r % exact:
        exact //= 2
    if 2 * exact >= s:   # chunks that divide the rows (no row mask) unless that halves the programs or worse
        return exact
    s = min(s, max(exact, tuning.tail_max // c))   # few enough partials that their final chains into the kernel
    return -(-r // -(-r // s))   # chunks of ceil(r / s) rows, the last one short (its rows masked)


def split_partial(kind, shape, dims, fn, acc, splits, fold=False) -> Reduction:
    """The first half of a split reduction: the reduced dims become (splits, chunk), chunk reduced."""
    total = numel(shape, dims)
    chunk = -(-int(total) // splits)
    pos = dims[0]
    ranges = []
    for d, size in enumerate(shape):
        if d == pos:
            ranges += [sympy.Integer(splits), sympy.Integer(chunk)]
        elif d not in dims:
            ranges.append(size)
    red_sizes = [shape[d] for d in dims]
    pad = splits * chunk != int(total)
    fill = ops.const(neutral_value(kind, acc), acc)

    def partial_fn(idx):
        g = idx[pos] * chunk + idx[pos + 1]
        rid = iter(unflatten(g, red_sizes))
        rest = iter(idx[:pos] + idx[pos + 2:])
        full = [next(rid) if d in dims else next(rest) for d in range(len(shape))]
        v = fn(full)
        if pad:
            v = ops.masked(ops.binary("lt", ops.index(g), ops.const(int(total), torch.int64)), v, fill)
        return v
    pshape = ranges[:pos + 1] + ranges[pos + 2:]
    return Reduction(kind, tuple(ranges), (pos + 1,), partial_fn, acc, acc, tuple(pshape),
                     fold=tuple(red_sizes) if fold else ())


def split_final(kind, part: Pointwise, part_red: Reduction, acc, dtype, oshape) -> Reduction:
    """The second half: the reduction of the partials (value ``part``) over the chunks."""
    pos = part_red.reduced[0] - 1
    return Reduction(SPLITTABLE[kind], part_red.out_shape, (pos,), lambda idx: ops.cast(part(idx), acc), acc, dtype,
                     oshape, split=True)
