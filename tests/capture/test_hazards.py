"""Graphs torch's capture computes wrongly run as eager does (kiln/capture/hazards.py)."""
import warnings

import pytest
import torch

import kiln
from tests.numerics import assert_sum_close


def _rows(x):
    v = x * 1
    v.unfold(0, 1, 2).diagonal().mul_(3)   # every other row of v is in no window
    return v


def _add(x):
    v = x + 0
    v.unfold(1, 2, 3)[:, 1] += 2
    return v


def _run(fn, x, codegen):
    torch._dynamo.reset()
    before = kiln.counters["fallback"]["eager_graphs"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = kiln.compile(fn, codegen=codegen, cache=False, on_error="raise")(*(x if isinstance(x, tuple) else (x,)))
    return got, kiln.counters["fallback"]["eager_graphs"] - before, [str(w.message) for w in caught]


@pytest.mark.parametrize("codegen", ["aten", "cpp"])
def test_writes_through_unfold_run_as_eager(codegen):
    """AOTAutograd writes a mutated unfold view back with unfold_backward, which zeroes the rows no window
    covers (fuzz seed 10 #4399, aot_eager alike): kiln runs such a graph as captured, whatever on_error."""
    x = torch.arange(56).reshape(7, 8)
    for fn in (_rows, _add):
        got, fell, said = _run(fn, x, codegen)
        assert torch.equal(got, fn(x))
        assert fell == 1 and any("through a view of unfold" in m for m in said), said
    wrong = torch.compile(_rows, backend="aot_eager")(x)   # if torch fixes it, the check can go
    assert not torch.equal(wrong, _rows(x))


def test_unfold_without_writes_compiles():
    f = lambda x: x.unfold(0, 2, 2).sum(-1) * 2  # noqa: E731
    g = lambda x: x.clone().diagonal().mul_(3)  # noqa: E731   a write through another view
    x = torch.randn(6, 6)
    for fn in (f, g):
        got, fell, _ = _run(fn, x, "aten")
        assert torch.equal(got, fn(x)) and fell == 0   # bit for bit: sums of two, products (any order is one)


def test_writes_into_inputs_sharing_memory_run_as_eager():
    """A write into an input whose memory another input shares takes AOTAutograd's synthetic-base path,
    which returned a flat int64[100] for a [2, 5, 5, 2] output (fuzz seed 13 #3204) and read a stale
    overlapping input (#603); kiln runs such graphs as captured."""
    def shape(a0, a1, a2):
        v0 = a0.sub_(a1)
        return v0, torch.bitwise_or(a2, v0)

    def stale(a0, a1, a2):
        a2.masked_fill_(a2 > 4, 3)
        return torch.select_scatter(a1, a1[0] * 0, 0, 3) * 2

    def inputs():
        a0 = torch.arange(100).reshape(2, 5, 5, 2)
        return a0, torch.arange(50).reshape(1, 5, 5, 2).expand(1, 5, 5, 2), a0[::2]

    def inputs2():
        a0 = torch.arange(10).reshape(5, 2)
        return a0, a0[1:], a0[..., :1]

    for fn, make in ((shape, inputs), (stale, inputs2)):
        want_in, got_in = make(), make()
        want = fn(*want_in)
        got, fell, said = _run(lambda *a: fn(*a), got_in, "cpp")
        for w, g in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
            assert w.shape == g.shape and torch.equal(w, g)
        assert torch.equal(want_in[0], got_in[0])
        assert fell == 1 and any("whose memory other inputs share" in m for m in said), said
    torch._dynamo.reset()   # torch 2.11 and 2.13 (the shape case: 2.11 only); if torch fixes it, the check can go
    assert not torch.equal(torch.compile(stale, backend="aot_eager")(*inputs2()), stale(*inputs2()))


def test_inputs_sharing_memory_without_writes_compile():
    a = torch.randn(6, 4)
    got, fell, _ = _run(lambda x, y: x * 2 + y.sum(), (a, a[2:]), "cpp")
    assert fell == 0
    # the C++ kernel sums the 16 elements in the host's vector width: against float64, 17 terms' rounding
    a64 = a.double()
    assert_sum_close(got, a64 * 2 + a64[2:].sum(), terms=17, scale=2 * a64.abs() + a64[2:].abs().sum())
