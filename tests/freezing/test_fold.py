"""Constant folding (kiln/passes/constant_fold.py) on small ATen graphs with get_attr constants."""
import torch

from kiln.passes.constant_fold import NEVER_FOLD, fold_constants, protect_outputs, refusal
from tests.freezing.helpers import aten_graph, ops

aten = torch.ops.aten


def _constants(gm):
    return [getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"]


def test_folds_constant_chain_into_one_constant():
    w, b = torch.randn(4, 3), torch.randn(4)
    x = torch.randn(2, 3)
    fn = lambda x: x @ (w.t() * 2 + 1) + b.relu()  # noqa: E731
    gm = aten_graph(fn, x)
    n = fold_constants(gm)
    assert n >= 4  # t, mul, add, relu
    assert not any(ops(gm, t) for t in (aten.t, aten.relu, aten.mul))
    assert len(_constants(gm)) == 2
    torch.testing.assert_close(gm(x), fn(x))


def test_random_ops_never_fold():
    w = torch.ones(4, 4)
    gm = aten_graph(lambda x: torch.rand_like(w) + w + x, torch.zeros(4, 4))
    fold_constants(gm)
    assert ops(gm, aten.rand_like) == 1
    x = torch.zeros(4, 4)
    assert not torch.equal(gm(x), gm(x))
    node = next(n for n in gm.graph.nodes if n.target is aten.rand_like.default)
    assert refusal(node) == "random"


def test_side_effects_never_fold():
    g = torch.fx.Graph()
    c = g.get_attr("c")
    add_ = g.call_function(aten.add_.Tensor, (c, 1))
    g.output(add_)
    assert refusal(add_) == "side effect"
    assert [r for r, _ in NEVER_FOLD][:2] == ["random", "side effect"]


def test_constructor_alone_is_not_folded():
    gm = aten_graph(lambda x: x + torch.ones(3), torch.zeros(3))
    assert fold_constants(gm) == 0
    assert ops(gm, aten.ones) == 1


def test_large_broadcast_is_not_materialized():
    c = torch.randn(1024)
    x = torch.randn(1024, 1024)
    fn = lambda x: x + c.expand(1024, 1024).contiguous() * 2  # noqa: E731
    gm = aten_graph(fn, x)
    fold_constants(gm)
    assert all(t.untyped_storage().nbytes() <= 2 * c.untyped_storage().nbytes() for t in _constants(gm))
    torch.testing.assert_close(gm(x), fn(x))


def test_small_results_fold_even_when_they_grow():
    a, b = torch.randn(8, 1), torch.randn(1, 8)
    gm = aten_graph(lambda x: x + a * b, torch.zeros(8, 8))
    assert fold_constants(gm) == 1
    torch.testing.assert_close(gm(torch.zeros(8, 8)), a * b)


def test_fold_keeps_eager_dtype():
    w = torch.randn(4, dtype=torch.bfloat16)
    fn = lambda x: x * (w * 3)  # noqa: E731
    gm = aten_graph(fn, torch.randn(4, dtype=torch.bfloat16))
    assert fold_constants(gm) == 1
    (const,) = _constants(gm)
    assert const.dtype == torch.bfloat16
    torch.testing.assert_close(const, w * 3)


def test_returned_constant_is_a_fresh_copy():
    w = torch.randn(3)
    gm = aten_graph(lambda x: (w * 2, x + 1), torch.zeros(3))
    fold_constants(gm)
    assert protect_outputs(gm) == 1
    out, _ = gm(torch.zeros(3))
    out.zero_()  # the caller edits its output...
    torch.testing.assert_close(gm(torch.zeros(3))[0], w * 2)  # ...and the constant is intact


def test_tuple_constants_fold_through_getitem():
    w = torch.randn(6, 4)
    fn = lambda x: x @ torch.split(w, 3)[1].t()  # noqa: E731
    gm = aten_graph(fn, torch.randn(2, 4))
    fold_constants(gm)
    assert ops(gm, aten.split) == 0
    torch.testing.assert_close(gm(torch.ones(2, 4)), fn(torch.ones(2, 4)))
