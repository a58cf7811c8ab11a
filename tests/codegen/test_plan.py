"""Kernel plans: the data between fusion and kernel text (``codegen/schedule/plan.py``)."""
import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import kiln
from kiln.codegen.schedule.domain import Role
from kiln.codegen.schedule.plan import KernelPlan, Kind, Programs
from kiln.options import Tuning, current
from tests.codegen.util import decompositions, fuse_graph

LOOPED = Tuning().persistent_max + 904


def plans(fn, *args):
    """The plans of ``fn``'s kernels (Triton target, options in scope)."""
    gm = make_fx(fn, decomposition_table=decompositions(), tracing_mode="fake")(*args)
    return list(fuse_graph(gm, args, current(codegen="triton")).plans)


def test_layer_norm_is_one_persistent_row_plan():
    x, w, b = torch.randn(8, 64), torch.randn(64), torch.randn(64)
    (p,) = plans(lambda x, w, b: F.layer_norm(x, (64,), w, b), x, w, b)
    assert p.kind is Kind.REDUCTION and p.persistent and not p.looped and p.programs is Programs.BLOCKS
    assert all(m.role is Role.ROW for m in p.members)
    sums = [m for m in p.members if m.reduce == "sum"]
    assert len(sums) >= 2 and all(m.acc == torch.float32 for m in sums)   # mean, then squared deviations
    stored = [m for m in p.members if m.stored]
    assert [m.buffer for m in stored] == list(p.stored) and all(m.index is not None for m in stored)
    assert len(p.reads) == 3 and not p.random and not p.symbols and not p.wide_index
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.persistent = False


def test_looped_softmax_passes_and_what_each_reads():
    """Looped rows: the max and the sum of exponentials share one online pass; the output's pass reads
    the input again (so the first pass's loads keep it in L2: ``evict_last``)."""
    x = torch.randn(4, LOOPED)
    (p,) = plans(lambda x: torch.softmax(x, -1), x)
    assert p.looped and len(p.passes) == 2
    first, second = p.passes
    assert len(first.online) == 1 and len(first.reduce) == 1 and not first.stores
    assert second.stores and first.reads == second.reads and len(first.reads) == 1
    with kiln.config.patch(**{"tuning.online_softmax": False}):
        (q,) = plans(lambda x: torch.softmax(x, -1), x)
    assert len(q.passes) == 3 and not any(r.online for r in q.passes)


def test_programs_follow_the_roles():
    x = torch.randn(9, 13)
    (one,) = plans(lambda x: (x.amax(1), x.sum(1).max()), x)   # a reduction over all rows: one program
    assert one.outer and one.programs is Programs.ONE
    assert {m.role for m in one.members} >= {Role.ROW, Role.OUTER}
    with kiln.config.patch(**{"tuning.outer_max": 64}):
        (last,) = plans(lambda x: (x.amax(1), x.sum(1).max()), x)
    assert last.programs is Programs.LAST
    with kiln.config.patch(tuning=dict(split_min_r=32, split_min_numel=256, fold_programs=8, fold_min_chunk=4,
                                       fold="always")):
        (folded,) = plans(lambda x: x.sum(0), torch.randn(40, 48))
    assert folded.programs is Programs.CHUNKS and folded.chunks == (8, 5)
    assert any(m.role is Role.COLPART for m in folded.members)
    assert folded.tail is not None and folded.tail.chained and folded.tail.programs is Programs.ONE
    assert folded.tail.reads <= {b.name for b in folded.stored}


def test_plans_print_and_are_dumped(tmp_path):
    x = torch.randn(4, LOOPED, requires_grad=True)
    (p,) = plans(lambda x: torch.softmax(x, -1), x.detach())
    text = p.describe("softmax")
    assert text.startswith(f"softmax: reduction over [4 x {LOOPED}r]") and "looped rows, 2 pass(es)" in text
    assert "pass 0: reduce" in text and "online" in text and "pass 1:" in text
    f = kiln.compile(lambda x: torch.softmax(x, -1).sum(), codegen="triton", dump_dir=str(tmp_path))
    f(x).backward()
    (region,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    dumped = {n.split("_", 1)[1]: (region / n).read_text() for n in os.listdir(region) if "plans_" in n}
    assert set(dumped) == {"plans_forward.txt", "plans_backward.txt"}
    assert "kernel 0: reduction" in dumped["plans_forward.txt"]


def test_a_scatter_is_two_plans():
    (p,) = plans(lambda v, i: torch.zeros(8).index_add(0, i, v), torch.randn(4), torch.tensor([0, 2, 2, 5]))
    assert not isinstance(p, KernelPlan) and p.write.scatter.mode == "add"
    assert p.copy.kind is Kind.POINTWISE and "+=" in p.describe()
