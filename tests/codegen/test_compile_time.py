"""The compile-time shortcuts (index memo, pruned cycle walk, frozen GC) never change what kiln emits."""

import sympy
import torch
import torch.nn.functional as F

from kiln.codegen import indexing, schedule
from kiln.codegen.indexing import RINDEX, XINDEX, FloorDiv, ModIdx, Ranges, equal, flat_index, simplify, unflatten
from tests.codegen.util import check, kernels


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


def _sources(gm):
    return [k.source for k in kernels(gm)]


def test_cycle_pruning_and_memos_change_no_kernel(monkeypatch):
    gm = check(blocks, *_args(), atol=1e-4, rtol=1e-4)
    fast = _sources(gm)
    assert len(fast) >= 3
    # the same compile without pruning (every rank -1) and with memos that never remember
    monkeypatch.setattr(schedule, "_topological_rank", lambda succ: {u: -1 for u in _units(succ)})
    monkeypatch.setattr(indexing, "_MEMO", _Forgetful())
    monkeypatch.setattr(schedule, "_LOADS", _Forgetful())
    indexing._is_multiple.cache_clear()
    slow = _sources(check(blocks, *_args(), atol=1e-4, rtol=1e-4))
    assert slow == fast
    assert len(indexing._MEMO) == 0


class _Forgetful(dict):
    def __setitem__(self, key, value):
        pass


def _units(succ):
    out = set(succ)
    for ss in succ.values():
        out |= set(ss)
    return out


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
