"""Index arithmetic: unflatten/flatten round trips, view index maps, range-aware simplification."""
import sympy

from kiln.codegen.ir.indexing import (XINDEX, FloorDiv, ModIdx, Ranges, contiguous_strides, equal, flat_index,
                                   simplify, unflatten)
from kiln.codegen.lower.view import reshape_index


def test_contiguous_roundtrip_collapses_to_xindex():
    r = Ranges({XINDEX: 4 * 6 * 8})
    idx = unflatten(XINDEX, [4, 6, 8])
    assert simplify(flat_index(idx, contiguous_strides([4, 6, 8])), r) == XINDEX


def test_split_and_merge_views_collapse():
    r = Ranges({XINDEX: 192})
    idx = unflatten(XINDEX, [4, 6, 8])
    split = reshape_index(idx, [4, 48], [4, 6, 8])          # read [4, 48] as [4, 6, 8]
    assert simplify(flat_index(split, contiguous_strides([4, 48])), r) == XINDEX
    idx2 = unflatten(XINDEX, [4, 48])
    merged = reshape_index(idx2, [4, 6, 8], [4, 48])        # read [4, 6, 8] as [4, 48]
    assert simplify(flat_index(merged, contiguous_strides([4, 6, 8])), r) == XINDEX


def test_transpose_is_not_the_identity():
    r = Ranges({XINDEX: 192})
    idx = unflatten(XINDEX, [4, 6, 8])
    f = flat_index([idx[0], idx[2], idx[1]], contiguous_strides([4, 8, 6]))
    assert not equal(f, XINDEX, r)
    assert equal(f, f + 0, r)


def test_symbolic_sizes():
    s = sympy.Symbol("s0", integer=True, positive=True)
    r = Ranges({XINDEX: 4 * s})
    idx = unflatten(XINDEX, [4, s])
    assert simplify(flat_index(idx, contiguous_strides([4, s])), r) == XINDEX


def test_floordiv_range_rules():
    r = Ranges({XINDEX: 8})
    assert simplify(FloorDiv(XINDEX, 8), r) == 0
    assert simplify(ModIdx(XINDEX, 1, 8), r) == XINDEX
    assert simplify(FloorDiv(16 * XINDEX + 3, 16), r) == XINDEX


def test_numeric_equality_fallback():
    r = Ranges({XINDEX: 12})
    # (x // 3) * 3 + x % 3 == x, written in a form the rules do not see directly
    a = 3 * FloorDiv(XINDEX, 3) + ModIdx(XINDEX, 1, 3)
    assert equal(a, XINDEX, r)
    assert not equal(a, XINDEX + 1, r)
