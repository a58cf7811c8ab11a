"""Pattern matcher: pattern expressions, counters, rewrites, mutation rejection."""
import contextlib
import io

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

import kiln.config
from kiln import debug
from kiln.pattern_matcher import (CACHE_STATS, MULTIPLE, Arg, CallFunction, CallMethod, CallModule,
                                  DuplicatePatternError, Ignored, KeywordArg, ListOf, MultiOutputPattern,
                                  PatternMatcherPass, fwd_only, joint_fwd_bwd, register_graph_pattern,
                                  register_lowering_pattern, register_replacement)
from kiln.pattern_matcher import lowerings as L

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _clear_counters():
    debug.counters.clear()
    yield


def counts():
    c = debug.counters["kiln"]
    return c["pattern_matcher_count"], c["pattern_matcher_nodes"]


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


MM_RELU = CallFunction(aten.relu, CallFunction(aten.mm, Arg(), Arg()))


def _clamp_lowering(pass_dict, pattern=MM_RELU):
    @register_lowering_pattern(pattern, pass_dict=pass_dict)
    def lower(match, a, b):
        return L[aten.clamp_min](L[aten.mm](a, b), 0.0)
    return lower


def test_lowering_pattern_counts_and_values():
    def f(x, w):
        return (x @ w).relu() * 2 + (x.cos() @ w).relu()

    x, w = torch.randn(3, 4), torch.randn(4, 5)
    gm = make_fx(f)(x, w)
    p = PatternMatcherPass()
    _clamp_lowering(p)
    assert p.apply(gm) == 2
    gm.recompile()
    assert counts() == (2, 4)
    assert aten.relu.default not in targets(gm)
    assert targets(gm).count(aten.clamp_min.default) == 2
    torch.testing.assert_close(gm(x, w), f(x, w))
    assert all("val" in n.meta for n in gm.graph.nodes if n.op == "call_function")
    assert p.apply(gm) == 0  # nothing left to match


def test_users_constraint():
    def f(x, w):
        y = x @ w
        return y.relu() + y  # mm has two users

    x, w = torch.randn(3, 4), torch.randn(4, 5)
    gm = make_fx(f)(x, w)
    p = PatternMatcherPass()
    _clamp_lowering(p)
    assert p.apply(gm) == 0
    p2 = PatternMatcherPass()
    _clamp_lowering(p2, CallFunction(aten.relu, CallFunction(aten.mm, Arg(), Arg(), _users=MULTIPLE)))
    assert p2.apply(gm) == 1
    gm.recompile()
    assert targets(gm).count(aten.mm.default) == 2  # the shared mm stays for its other user
    torch.testing.assert_close(gm(x, w), f(x, w))


def test_keyword_arg_binds_consistently():
    def f(x, y):
        return (x + x).neg() + (x + y).neg()

    gm = make_fx(f)(torch.randn(3), torch.randn(3))
    p = PatternMatcherPass()
    seen = []

    @register_graph_pattern(CallFunction(aten.neg, CallFunction(aten.add, KeywordArg("a"), KeywordArg("a"))),
                            pass_dict=p)
    def double(match, a):
        seen.append(a)
        node = match.output_node()
        with match.graph.inserting_before(node):
            new = match.graph.call_function(aten.mul.Tensor, (a, -2))
        node.replace_all_uses_with(new)
        match.erase_nodes()

    assert p.apply(gm) == 1
    assert [n.name for n in seen] == ["x_1"]
    gm.recompile()
    x, y = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(gm(x, y), f(x, y))


def test_constant_arguments_must_match():
    def f(x):
        return x.sum([0]).relu() + x.sum([1]).relu().sum()

    gm = make_fx(f)(torch.randn(3, 3))
    p = PatternMatcherPass()
    hits = []

    @register_graph_pattern(CallFunction(aten.relu, CallFunction(aten.sum.dim_IntList, Arg(), [1])), pass_dict=p)
    def h(match, x):
        hits.append(match.output_node())

    assert p.apply(gm) == 1 and len(hits) == 1
    assert hits[0].args[0].args[1] == [1]


def test_extra_check_false_counts_nothing():
    gm = make_fx(lambda x, w: (x @ w).relu())(torch.randn(2, 2), torch.randn(2, 2))
    p = PatternMatcherPass()
    register_lowering_pattern(MM_RELU, lambda m: False, pass_dict=p)(lambda m, a, b: None)
    assert p.apply(gm) == 0 and counts() == (0, 0)


def test_listof():
    def f(a, b):
        return torch.cat([a.relu(), b.relu()], 0)

    gm = make_fx(f)(torch.randn(2, 3), torch.randn(4, 3))
    p = PatternMatcherPass()

    @register_graph_pattern(CallFunction(aten.cat, ListOf(CallFunction(aten.relu, Arg())), 0), pass_dict=p)
    def hoist(match, inputs):
        # as in PyTorch, each element's captured args come bundled: ((a,), (b,))
        assert len(inputs) == 2 and all(len(t) == 1 for t in inputs)
        match.replace_by_example(lambda *xs: torch.cat(xs, 0).relu(), [t[0] for t in inputs])

    assert p.apply(gm) == 1
    gm.recompile()
    assert targets(gm).count(aten.relu.default) == 1
    assert counts() == (1, 3)
    a, b = torch.randn(2, 3), torch.randn(4, 3)
    torch.testing.assert_close(gm(a, b), f(a, b))


def test_multi_output_pattern():
    def f(x, y):
        return x.sin() + y, x.cos() * y

    gm = make_fx(f)(torch.randn(3), torch.randn(3))
    p = PatternMatcherPass()
    pattern = MultiOutputPattern([CallFunction(aten.sin, KeywordArg("x")), CallFunction(aten.cos, KeywordArg("x"))])

    @register_graph_pattern(pattern, pass_dict=p)
    def both(match, x):
        sin, cos = match.output_nodes()
        assert sin.target == aten.sin.default and cos.target == aten.cos.default
        # sin(x) = cos(x - pi/2): compute both from one shifted input to prove the splice works
        match.replace_by_example(lambda t: (torch.cos(t - torch.pi / 2), torch.cos(t)), [x])

    assert p.apply(gm) == 1
    gm.recompile()
    assert aten.sin.default not in targets(gm)
    assert counts() == (1, 2)
    x, y = torch.randn(3), torch.randn(3)
    for got, want in zip(gm(x, y), f(x, y)):
        torch.testing.assert_close(got, want)


def test_register_replacement_fwd_only_and_cache():
    def search(a, b):
        return torch.mm(a, b).relu()

    def replace(a, b):
        return torch.clamp_min(torch.mm(a, b), 0)

    def f(x, w, v):
        return (x @ w).relu() + (x @ v).relu().sum()

    example = [torch.randn(2, 3), torch.randn(3, 2)]
    p = PatternMatcherPass()
    register_replacement(search, replace, example, fwd_only, p)
    x, w, v = torch.randn(5, 4), torch.randn(4, 6), torch.randn(4, 6)
    gm = make_fx(f)(x, w, v)
    assert p.apply(gm) == 2
    gm.recompile()
    assert aten.relu.default not in targets(gm)
    assert counts() == (2, 4)
    torch.testing.assert_close(gm(x, w, v), f(x, w, v))
    # registering again (a new pass, e.g. the next compile) traces nothing
    before = dict(CACHE_STATS)
    p2 = PatternMatcherPass()
    register_replacement(search, replace, example, fwd_only, p2)
    assert CACHE_STATS["traces"] == before["traces"]
    with pytest.raises(DuplicatePatternError):
        register_replacement(search, replace, example, fwd_only, p2)
    assert register_replacement(search, replace, example, fwd_only, p2, skip_duplicates=True) is False


def test_register_replacement_rechecks_shapes():
    """The loose pattern ignores shapes; the re-trace on real shapes must still agree."""
    def search(x):
        return x.view(-1).relu()

    def replace(x):
        return x.relu().view(-1)

    p = PatternMatcherPass()
    register_replacement(search, replace, [torch.randn(2, 3)], fwd_only, p)

    def f(x):
        return x.view(-1).relu() + x.view(6, 4).relu().sum()   # only the first is search(x)

    x = torch.randn(4, 6)
    gm = make_fx(f)(x)
    assert p.apply(gm) == 1
    gm.recompile()
    torch.testing.assert_close(gm(x), f(x))


def test_register_replacement_scalar_workaround_and_extra_check():
    def search(x, alpha):
        return (x * alpha).relu()

    def replace(x, alpha):
        return x.relu() * alpha

    p = PatternMatcherPass()
    register_replacement(search, replace, [torch.randn(4)], fwd_only, p,
                         extra_check=lambda m: m.kwargs["alpha"] >= 0, scalar_workaround={"alpha": 0.5})

    def f(x):
        return (x * 0.25).relu() + (x * -3.0).relu()

    x = torch.randn(8)
    gm = make_fx(f)(x)
    assert p.apply(gm) == 1  # the negative scale fails extra_check
    gm.recompile()
    torch.testing.assert_close(gm(x), f(x))
    muls = [n for n in gm.graph.nodes if n.target == aten.mul.Tensor]
    assert sorted(n.args[1] for n in muls) == [-3.0, 0.25]


def _joint(fn, *args):
    return joint_fwd_bwd(fn, list(args))


def test_register_replacement_joint_fwd_bwd():
    def search(x):
        return (x * 3).sin()

    def replace(x):
        return (x + x + x).sin()

    p = PatternMatcherPass()
    register_replacement(search, replace, [torch.randn(4, requires_grad=True)], joint_fwd_bwd, p)

    def user(x, y):
        return (x * 3).sin() * y

    x, y = torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)
    gm = _joint(user, x, y)
    inputs = [torch.randn(5) for _ in gm.graph.find_nodes(op="placeholder")]
    expected = gm(*inputs)
    assert p.apply(gm) == 1
    gm.recompile()
    assert all(n.target != aten.mul.Tensor or n.args[1] != 3 for n in gm.graph.nodes)
    for got, want in zip(gm(*inputs), expected):
        torch.testing.assert_close(got, want)


def test_match_across_mutation_rejected_but_unrelated_allowed():
    p = PatternMatcherPass()
    _clamp_lowering(p)

    def related(x, w):
        a = x @ w
        w.mul_(2)            # writes a value the match reads, between mm and relu
        return a.relu()

    def unrelated(x, w, z):
        a = x @ w
        z.add_(1)            # touches nothing the match reads
        return a.relu() + z

    gm = make_fx(related)(torch.randn(2, 3), torch.randn(3, 2))
    assert p.apply(gm) == 0
    gm2 = make_fx(unrelated)(torch.randn(2, 3), torch.randn(3, 2), torch.randn(2, 2))
    assert p.apply(gm2) == 1
    gm2.recompile()
    x, w, z = torch.randn(2, 3), torch.randn(3, 2), torch.randn(2, 2)
    torch.testing.assert_close(gm2(x, w, z.clone()), unrelated(x, w, z.clone()))


def test_lowering_on_symbolic_trace_graph_and_call_method():
    class M(torch.nn.Module):
        def forward(self, x, w):
            return torch.relu(torch.mm(x, w)) + x.view(-1).sum()

    gm = fx.symbolic_trace(M())
    p = PatternMatcherPass()

    @register_lowering_pattern(CallFunction(torch.relu, CallFunction(torch.mm, Arg(), Arg())), pass_dict=p)
    def lower(match, a, b):
        return L[torch.clamp](L[torch.mm](a, b), min=0.0)

    hits = []

    @register_graph_pattern(CallMethod("sum", CallMethod("view", Arg(), Ignored())), pass_dict=p)
    def views(match, x):
        hits.append(x)

    assert p.apply(gm) == 2 and len(hits) == 1
    gm.recompile()
    assert torch.relu not in targets(gm) and torch.clamp in targets(gm)
    x, w = torch.randn(3, 4), torch.randn(4, 2)
    torch.testing.assert_close(gm(x, w), M()(x, w))


def test_pass_is_callable_and_uuid_tracks_patterns():
    p = PatternMatcherPass("mine")
    empty = p.uuid()
    _clamp_lowering(p)
    assert p.uuid() != empty
    gm = make_fx(lambda x, w: (x @ w).relu())(torch.randn(2, 2), torch.randn(2, 2))
    assert p(gm.graph) == 1


def test_every_match_is_logged_at_level_5():
    gm = make_fx(lambda x, w: (x @ w).relu())(torch.randn(2, 2), torch.randn(2, 2))
    p = PatternMatcherPass("logged")
    _clamp_lowering(p)
    err = io.StringIO()
    with kiln.config.patch(debug=5), contextlib.redirect_stderr(err):
        assert p.apply(gm) == 1
    assert "logged: matched 2 nodes" in err.getvalue()


def test_register_replacement_on_graph_without_meta():
    """No fake values: only an exact match of the example trace is replaced."""
    def search(a, b):
        return torch.mm(a, b).relu()

    def replace(a, b):
        return torch.clamp_min(torch.mm(a, b), 0)

    p = PatternMatcherPass()
    register_replacement(search, replace, [torch.randn(2, 3), torch.randn(3, 2)], fwd_only, p)
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    g.output(g.call_function(aten.relu.default, (g.call_function(aten.mm.default, (a, b)),)))
    gm = fx.GraphModule({}, g)
    assert "val" not in a.meta
    assert p.apply(gm) == 1
    assert aten.clamp_min.default in targets(gm)
    x, w = torch.randn(4, 5), torch.randn(5, 3)
    torch.testing.assert_close(gm(x, w), torch.mm(x, w).relu())


def test_exclusive_arg_names():
    def search(a, b):
        return a * b + a

    def replace(a, b):
        return a * (b + 1)

    p = PatternMatcherPass()
    register_replacement(search, replace, [torch.randn(3), torch.randn(3)], fwd_only, p,
                         exclusive_arg_names=("a", "b"))

    def f(x, y):
        return (x * y + x) + (x * x + x)  # the second needs a == b: rejected

    x, y = torch.randn(3), torch.randn(3)
    gm = make_fx(f)(x, y)
    assert p.apply(gm) == 1
    torch.testing.assert_close(gm(x, y), f(x, y))
    shared = PatternMatcherPass()  # without exclusivity both sums match
    register_replacement(search, replace, [torch.randn(3), torch.randn(3)], fwd_only, shared)
    assert shared.apply(make_fx(f)(x, y)) == 2


def test_call_module_pattern():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.act = torch.nn.ReLU()

        def forward(self, x):
            return self.act(x.neg())

    gm = fx.symbolic_trace(M())
    p = PatternMatcherPass()

    @register_lowering_pattern(CallModule(torch.nn.ReLU, CallMethod("neg", Arg())), pass_dict=p)
    def lower(match, x):
        return L[torch.neg](L[torch.clamp_max](x, 0.0))  # relu(-x) == -min(x, 0)

    assert p.apply(gm) == 1
    assert not any(n.op == "call_module" for n in gm.graph.nodes)
    x = torch.randn(6)
    torch.testing.assert_close(gm(x), M()(x))


def test_lowerings_table():
    x = torch.randn(4)
    torch.testing.assert_close(L[aten.relu](x), x.relu())  # no graph in sight: runs eagerly
    gm = make_fx(lambda t: t.cos())(x)
    (cos,) = gm.graph.find_nodes(op="call_function", target=aten.cos.default)
    new = L[aten.relu](cos)  # no insertion point: right after its latest input
    assert new.target == aten.relu.default and cos.next is new
    assert new.meta["val"].shape == (4,)
    from kiln.pattern_matcher import lowerings, register_lowering

    @register_lowering(aten.hardtanh)
    def _hardtanh(t, lo=-1.0, hi=1.0):
        return L[aten.clamp_max](L[aten.clamp_min](t, lo), hi)

    try:
        out = L[aten.hardtanh.default](cos)  # the overload finds the packet's lowering
        assert out.target == aten.clamp_max.default
    finally:
        lowerings._table.pop(aten.hardtanh)
