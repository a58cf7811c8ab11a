"""The compile-time shortcuts (index memo, pruned cycle walk, frozen GC) never change what kiln emits."""

import sympy
import torch
import torch.nn.functional as F

from torch.fx.experimental.proxy_tensor import make_fx

from kiln.codegen.ir import indexing
from kiln.codegen.ir.indexing import RINDEX, XINDEX, FloorDiv, ModIdx, Ranges, equal, flat_index, simplify, unflatten
from kiln.codegen.lower import Lowering
from kiln.codegen.schedule import domain
from kiln.codegen.schedule import fuse as schedule
from kiln.options import current
from tests.codegen.util import check, decompositions


def blocks(x, w1, w2, w3, g, b):
    """Three pre-norm MLP blocks: matmuls (ATen) between fused norms and epilogues, the shape
    where a merge across a matmul would be a cycle."""
    for w in (w1, w2, w3):
        h = F.layer_norm(x, (x.shape[-1],), g, b)
        x = x + torch.relu(h @ w) * h.sum(-1, keepdim=True)
    return x


def _args():
    torch.manual_seed(0)
    return [torch.randn(6, 16)] + [torch.randn(16, 16) / 4 for _ in range(3)] + [torch.randn(16), torch.randn(16)]


def test_pruned_cycle_walk_groups_as_the_full_walk():
    """The scheduler's cycle check skips units ranked above every grouped one; without that pruning
    (every rank -1: the walk visits everything) the same groups come out."""
    gm = make_fx(blocks, decomposition_table=decompositions(), tracing_mode="fake")(*_args())
    opts = current(codegen="triton")

    class Unpruned(schedule.Scheduler):
        def _build_graph(self):
            super()._build_graph()
            self._rank = {u: -1 for u in self._rank}

    def groups(cls):
        lw = Lowering(gm, opts).run()
        position = {id(b): i for i, b in enumerate(lw.computed)}   # names differ between lowerings
        return [[position.get(id(b)) for b in g.nodes] for g in cls(lw, opts.tuning).run()]
    fast = groups(schedule.Scheduler)
    assert len(fast) >= 3 and fast == groups(Unpruned)


def test_memos_hold_what_a_cold_call_computes():
    """After a compile, every entry of the index memo is what its function computes afresh (a memo
    keyed too coarsely would hand one index's answer to another)."""
    indexing._MEMO.clear()
    check(blocks, *_args(), atol=1e-4, rtol=1e-4)
    entries = list(indexing._MEMO.items())
    kinds = {key[0] for key, _ in entries}
    assert {"u", "f", "s", "e", "pl", "dv"} <= kinds, kinds
    for key, value in entries:
        kind = key[0]
        if kind == "u":
            fresh = tuple(indexing._unflatten(key[1], list(key[2])))
        elif kind == "f":
            _, index, strides, offset = key
            fresh = offset + sum((i * st for i, st in zip(index, strides) if st != 0), sympy.Integer(0))
        elif kind == "s":
            fresh = indexing._simplify(sympy.expand(key[1]), Ranges(dict(key[2])))
        elif kind == "e":
            fresh = indexing._equal(key[1], key[2], Ranges(dict(key[3])), key[4])
        elif kind == "pl":
            fresh = domain._place(list(key[1]), key[2], None if key[3] is None else list(key[3]))   # or False
        elif kind == "dv":
            fresh = tuple(domain._domain_vars(key[1]))
        else:
            continue
        assert fresh == value, (key, value, fresh)


def test_topological_rank_orders_every_edge():
    succ = {"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set(), "e": {"a"}}
    rank = schedule._topological_rank(succ)
    assert all(rank[u] < rank[s] for u, ss in succ.items() for s in ss)
    assert schedule._topological_rank({"a": {"b"}, "b": {"a"}}) == {"a": -1, "b": -1}   # no DAG: no pruning


def test_index_memo_returns_what_a_cold_call_computes():
    s = sympy.Symbol("s0", integer=True, positive=True)
    r = Ranges({XINDEX: 4 * 6 * 8, RINDEX: 8})
    exprs = [FloorDiv(XINDEX, 8) * 8 + ModIdx(XINDEX, 1, 8), ModIdx(XINDEX, 8, 6) * 8 + ModIdx(XINDEX, 1, 8),
             FloorDiv(XINDEX * 8 + RINDEX, 64), XINDEX * s + 3]
    indexing._MEMO.clear()
    cold = [simplify(e, r) for e in exprs]
    warm = [simplify(e, Ranges({XINDEX: 192, RINDEX: 8})) for e in exprs]
    assert cold == warm and all(c is w for c, w in zip(cold, warm))
    assert cold[0] == XINDEX and cold[1] == ModIdx(XINDEX, 1, 48)
    # other ranges are another key: FloorDiv(xindex, 8) is 0 only while xindex < 8
    assert simplify(FloorDiv(XINDEX, 8), Ranges({XINDEX: 8})) == 0
    assert simplify(FloorDiv(XINDEX, 8), Ranges({XINDEX: 16})) == FloorDiv(XINDEX, 8)
    assert equal(FloorDiv(XINDEX, 8) * 8 + ModIdx(XINDEX, 1, 8), XINDEX, r)
    assert not equal(FloorDiv(XINDEX, 8), XINDEX, r)
    # callers may edit the lists they get back
    u = unflatten(XINDEX, [4, 6])
    u.append(None)
    assert unflatten(XINDEX, [4, 6]) == [FloorDiv(XINDEX, 6), ModIdx(XINDEX, 1, 6)]
    assert flat_index([XINDEX, 2], [3, 1]) == 3 * XINDEX + 2
    assert flat_index([XINDEX, 2], [3, 0], offset=sympy.Integer(5)) == 3 * XINDEX + 5
