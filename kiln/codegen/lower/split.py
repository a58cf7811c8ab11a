"""Long reductions split in two: partial results over chunks, then a short reduction of the partials.

A reduction over few long rows (a full sum) or over many rows of few columns (a bias gradient) leaves
most of a GPU idle as one kernel. ``split_count`` picks how many chunks each row is cut into; the
partials (``split_partial``) reduce a chunk each, and ``split_final`` reduces the partials.

A column reduction of short rows (a norm's weight and bias gradients) is cut instead into chunks of
whole rows (``fold_split``): its partials can then be computed inside the kernel that reads those rows
(``schedule/fold.py``, role 'colpart'). ``SplitSource`` keeps what the classic split would need when
the scheduler finds no such kernel (``schedule.fold.rebuild_split``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import sympy
import torch

from kiln.codegen.ir.indexing import ONE, next_pow2, unflatten
from kiln.codegen.ir.loops import Pointwise, Reduction, neutral_value, ops
from kiln.options import Tuning

SPLITTABLE = {"sum": "sum", "max": "max", "min": "min", "prod": "prod"}


@dataclass(frozen=True)
class SplitSource:
    """A reduction as it was before ``fold_split`` cut it (the arguments of ``split_reduction``), and
    the name of the buffer holding its final result."""
    kind: str
    shape: tuple
    dims: tuple
    fn: Callable
    acc: torch.dtype
    dtype: torch.dtype
    out_shape: tuple
    final: str


def numel(shape, dims):
    out = ONE
    for d in dims:
        out = out * shape[d]
    return out


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
    """Row chunks for a column reduction computed inside a row kernel (1: not one).

    A reduction over the leading dims of ``shape`` that keeps a short static tail (at most
    ``tuning.persistent_max`` elements: a row of a persistent row kernel) and many rows (a norm's weight
    and bias gradients, a bias gradient) is split into ``S`` chunks of rows, ``S`` dividing the row count.
    Its partial results are computed by a kernel over (rows, columns) whose ``S`` programs each walk
    one chunk, reading each row once, coalesced along the columns; it joins the kernel that computes
    the rows (a norm backward's row kernel, a pointwise producer) when the scheduler can place it
    there (role 'colpart'), and the short reduction over the ``S`` partials follows."""
    if not tuning.fold:
        return 1
    n = len(shape)
    if not dims or list(dims) != list(range(len(dims))) or len(dims) == n:
        return 1
    r, c = numel(shape, dims), numel(shape, range(len(dims), n))
    if not (r.is_Integer and c.is_Integer) or int(c) > tuning.persistent_max:
        return 1
    r, c = int(r), int(c)
    if r < tuning.split_min_r or r * c < tuning.split_min_numel:
        return 1
    s = tuning.fold_programs
    while s > 1 and (r % s or r // s < tuning.fold_min_chunk):
        s //= 2
    return s


def split_partial(kind, shape, dims, fn, acc, splits, fold=False) -> Reduction:
    """The first half of a split reduction: the reduced dims become (splits, chunk) at the first
    reduced position, and chunk is reduced."""
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
