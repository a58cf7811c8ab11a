"""Peak-memory model, activation_memory_limit, and explain_memory."""
import os

import pytest
import torch

from kiln import explain_memory
from kiln.options import current
from kiln.partition import choose_saved
from kiln.partition.extract import Saved
from kiln.partition.limit import MemoryLimitError
from kiln.partition.peak import model_peak
from tests.partition.helpers import check_grads
from tests.partition.test_budget import _joint

U = 32
MB = U * U * 4  # one (U x U) fp32 block


def chain(x, *ws):
    x = x.cos()
    for w in ws:
        x = torch.mm(x, w).cos()
    return x.sum()


def _args(k=4):
    """x is (4U x U): each activation is 4 blocks, each weight (and its gradient) 1 block."""
    return [torch.randn(4 * U, U, requires_grad=True)] + [torch.randn(U, U, requires_grad=True) for _ in range(k)]


def _peak(gm, n, **opts):
    saved = choose_saved(gm, num_fwd_outputs=n, opts=current(**opts))
    return model_peak(gm, saved, n)


def test_peak_model_tracks_budget():
    gm, n = _joint(chain, *_args())
    p1, p5, p0 = (_peak(gm, n, activation_memory_budget=b) for b in (1.0, 0.5, 0.0))
    assert p1.saved == 32 * MB and p5.saved == 16 * MB and p0.saved == 0
    assert p1.peak > p5.peak
    assert p1.forward > p5.forward > p0.forward
    # budget 0 recomputes the whole chain at the first backward step; holding all of it (PyTorch
    # #197838) would put the peak above budget 0.5's, so the backward rebuilds a smaller hold set (budget.py)
    assert p0.peak <= p5.peak <= p1.peak
    assert p0.backward < p5.backward
    assert p1.recompute_flops == 0 < p0.recompute_flops
    mm = 2 * 4 * U ** 3
    saved0 = choose_saved(gm, num_fwd_outputs=n, opts=current(activation_memory_budget=0.0))
    assert saved0.hold is not None
    plain0 = model_peak(gm, Saved.of(saved0), n)  # no hold: the four forward matmuls run again once
    assert plain0.recompute_flops == 4 * mm and plain0.backward > p5.backward
    assert p0.recompute_flops == 5 * mm  # rebuilding the hold set costs one matmul more
    # the forward holds everything it saves, plus the block in flight
    assert p1.forward >= p1.saved + 4 * MB


def test_activation_memory_limit_is_met():
    gm, n = _joint(chain, *_args())
    hi, lo = _peak(gm, n).peak, _peak(gm, n, activation_memory_budget=0.5).peak
    limit = (hi + lo) // 2
    p = _peak(gm, n, activation_memory_limit=limit)
    assert lo <= p.peak <= limit < hi
    assert _peak(gm, n, activation_memory_limit="4GiB").peak == hi
    check_grads(chain, _args(), activation_memory_limit=limit)


def test_activation_memory_limit_unreachable():
    gm, n = _joint(chain, *_args())
    with pytest.raises(MemoryLimitError, match="unreachable"):
        choose_saved(gm, num_fwd_outputs=n, opts=current(activation_memory_limit=16))
    assert _peak(gm, n, activation_memory_budget=0.5, activation_memory_limit="1GiB").saved == 16 * MB


def test_budget_one_not_above_plain_partition():
    gm, n = _joint(chain, *_args())
    plain = model_peak(gm, choose_saved(gm, num_fwd_outputs=n, opts=current(partitioner="default")), n)
    assert _peak(gm, n).saved <= plain.saved


def test_explain_memory(tmp_path):
    png = str(tmp_path / "sweep.png")
    rep = explain_memory(chain, *_args(), png=png)
    names = {r.name for r in rep.saved}
    assert {"cos", "mm"} <= names
    cos = next(r for r in rep.saved if r.name == "cos")
    assert cos.bytes == 4 * MB and "x.cos()" in cos.source and "test_peak.py" in cos.source
    assert rep.activation_bytes == 32 * MB
    assert len(rep.sweep) == 11 and rep.sweep[0][1] > min(p for _, p, _ in rep.sweep)
    assert rep.sweep[0][2] == 0 < rep.sweep[-1][2]
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(png) > 1000
    text = str(rep)
    assert "saved (" in text and "x.cos()" in text
    low = explain_memory(chain, *_args(), activation_memory_budget=0.0)
    assert low.activation_bytes == 0 and {r.name for r in low.recomputed} >= {"mm", "cos"}
