"""Index arithmetic: unflatten/flatten round trips, view index maps, range-aware simplification."""
import sympy

from kiln.codegen.ir.indexing import (XINDEX, FloorDiv, ModIdx, Ranges, contiguous_strides, equal, flat_index,
                                   own_floor_divs, simplify, unflatten)
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


# -- symbolic sizes of a fully dynamic CNN (#35): a conv's output size a = (s - 1)//2 + 1 ----------------------
S = sympy.Symbol("s0", integer=True, positive=True)
R = sympy.Symbol("r", integer=True, nonnegative=True)


def _at(e, values):
    """``e`` evaluated at integer values of its symbols (FloorDiv and ModIdx fold on integers)."""
    return int(e.xreplace({k: sympy.Integer(v) for k, v in values.items()}))


def _divides_an_index(e, r):
    return [a for a in e.atoms(FloorDiv, ModIdx) if r.varies(a)]


def test_a_conv_output_size_is_one_atom():
    """torch's ``(s - 1)//2 + 1`` is ``(s + 1)//2``: its square stays one term through expansion, so strides
    and moduli by it match (three terms F**2 + 2F + 1 matched nothing and left a division per element)."""
    from torch.utils._sympy.functions import FloorDiv as TorchFloorDiv
    a = own_floor_divs(TorchFloorDiv(S - 1, 2) + 1)
    assert a == FloorDiv(S + 1, 2) and a.is_positive
    assert len(sympy.Add.make_args(sympy.expand(64 * a**2))) == 1
    assert own_floor_divs(TorchFloorDiv(S - 1, 4) + 1 + S) == FloorDiv(S + 3, 4) + S
    assert own_floor_divs(TorchFloorDiv(S, 2) - 1) == FloorDiv(S, 2) - 1   # c < 0 would floor a negative
    for s in range(1, 60):
        assert _at(a, {S: s}) == (s - 1) // 2 + 1


def test_digits_of_a_square_join_into_one_modulo():
    """``a*((r//a) % a) + r % a`` is ``r % a**2`` for every a > 0 (a row over N, H, W read as pieces of H*W)."""
    for a in (S, FloorDiv(S + 1, 2), FloorDiv(S + 3, 4)):
        r = Ranges({R: 8 * a**2})
        e = a * ModIdx(R, a, a) + ModIdx(R, 1, a) + 64 * a**2 * FloorDiv(R, a**2)
        got = simplify(e, r)
        assert got == ModIdx(R, 1, a**2) + 64 * a**2 * FloorDiv(R, a**2), got
    a = FloorDiv(S + 1, 2)
    e = a * ModIdx(R, a, a) + ModIdx(R, 1, a)
    got = simplify(e, Ranges({R: 8 * a**2}))
    for s in range(1, 30):
        for r in range(0, 8 * ((s + 1) // 2) ** 2, 7):
            assert _at(e, {S: s, R: r}) == _at(got, {S: s, R: r}) == r % ((s + 1) // 2) ** 2


def test_quotients_by_a_symbolic_square():
    """Inner positions xi < a**2 (a kernel's x = xo * a**2 + xi): ``x // a**2`` is xo, the channel
    ``(x // a**2) % 32`` is ``xo % 32``, and ``(a*y + z) // a**2`` is ``y // a`` when z < a: no division by a
    size along the vectorized loop."""
    xo, xi, y, z = sympy.symbols("xo xi y z", integer=True, nonnegative=True)
    for a in (S, FloorDiv(S + 1, 2)):
        r = Ranges({xo: 32 * 4, xi: a**2, y: 4 * a, z: a})
        assert simplify(ModIdx(xo * a**2 + xi, a**2, 32), r) == ModIdx(xo, 1, 32)
        assert simplify(FloorDiv(xo * a**2 + xi, a**2), r) == xo
        got = simplify(FloorDiv(a * y + z, a**2), r)
        assert got == FloorDiv(y, a), got
        for s in range(1, 25):
            n = _at(a, {S: s})
            for yv, zv in ((0, 0), (n, n - 1), (3 * n - 1, n // 2), (4 * n - 1, n - 1)):
                assert _at(got, {S: s, y: yv}) == (n * yv + zv) // (n * n)
    # not provable (z may reach a): unchanged
    r = Ranges({y: 4 * S, z: S + 1})
    assert _divides_an_index(simplify(FloorDiv(S * y + z, S**2), r), r)


def test_a_contiguous_roundtrip_over_conv_output_sizes():
    """A [n, 64, a, a] tensor read back at its own strides is xindex, a = (s - 1)//2 + 1 from torch."""
    from torch.utils._sympy.functions import FloorDiv as TorchFloorDiv
    n = sympy.Symbol("s1", integer=True, positive=True)
    a = own_floor_divs(TorchFloorDiv(S - 1, 2) + 1)
    shape = [n, 64, a, a]
    r = Ranges({XINDEX: n * 64 * a * a})
    assert simplify(flat_index(unflatten(XINDEX, shape), contiguous_strides(shape)), r) == XINDEX
