"""activation_memory_budget: exact knapsack, budget semantics on traced joint graphs, estimators."""
import itertools
import random

import pytest
import torch
from torch._functorch.aot_autograd import aot_function, make_boxed_func

import kiln.config
from kiln.debug import counters
from kiln.options import OptionError, current
from kiln.partition import budget as B
from kiln.partition import choose_saved, partition_joint
from kiln.partition.estimate import EstimatorError, node_flops, node_profile, runtime_estimator, size_bytes
from kiln.partition.joint_info import JointInfo
from kiln.partition.mincut import activation_bytes


def _brute(sizes, values, cap):
    best = -1.0
    for r in range(len(sizes) + 1):
        for combo in itertools.combinations(range(len(sizes)), r):
            if sum(sizes[i] for i in combo) <= cap:
                v = sum(values[i] for i in combo)
                if v > best + 1e-12:
                    best = v
    return best


@pytest.mark.parametrize("solver", ["dp", "milp"])
def test_knapsack_is_exact(solver):
    """Both solvers against brute force; ``tuning.knapsack_dp_cells=0`` sends every solve to HiGHS."""
    cells = {"dp": {}, "milp": {"tuning.knapsack_dp_cells": 0}}[solver]
    rng = random.Random(0)
    before = counters["partition"]["knapsack_" + solver]
    solves = 0
    with kiln.config.patch(**cells):
        for _ in range(30):
            n = rng.randint(1, 9)
            sizes = [rng.randint(0, 40) * 4096 for _ in range(n)]
            values = [rng.choice([0.0, rng.random() * 100]) for _ in range(n)]
            cap = rng.randint(0, sum(sizes) + 1)
            keep = B.knapsack(sizes, values, cap)
            solves += solver == "dp" or any(sizes)  # no positive size: the (empty) DP answers
            assert sum(sizes[i] for i in keep) <= cap
            assert sum(values[i] for i in keep) == pytest.approx(_brute(sizes, values, cap), rel=1e-9, abs=1e-9)
    assert counters["partition"]["knapsack_" + solver] - before == solves > 0


def test_knapsack_dp_cells_from_options():
    """Passed Options pick the solver: the same items go to HiGHS with no DP cells, else to the DP."""
    sizes, values = [4096, 8192, 12288], [1.0, 3.0, 2.0]
    for cells, solver in ((0, "milp"), (10 ** 6, "dp")):
        before = counters["partition"]["knapsack_" + solver]
        assert B.knapsack(sizes, values, 16384, current(**{"tuning.knapsack_dp_cells": cells})) == {0, 1}
        assert counters["partition"]["knapsack_" + solver] == before + 1


def _joint(fn, *args):
    """Trace ``fn`` once and return (joint_gm, num_fwd_outputs) for direct partition calls."""
    box = {}

    def part(joint, joint_inputs, **kw):
        box["gm"], box["n"] = joint, kw["num_fwd_outputs"]
        return partition_joint(joint, joint_inputs, opts=current(partitioner="default"), **kw)

    compiled = aot_function(fn, fw_compiler=lambda g, i: make_boxed_func(g.forward), partition_fn=part)
    compiled(*args)
    return box["gm"], box["n"]


def _act(gm, n, **opts):
    info = JointInfo(gm, n)
    return activation_bytes(info, choose_saved(gm, num_fwd_outputs=n, opts=current(**opts)))


def test_uneven_chain_budgets_are_exact_subset_sums():
    """Seed 001's uneven chain without running it: saved bytes are the exact best subset sums."""
    U = 16
    shapes = [11, 3, 4, 2]

    def f(x, *ws):
        return sum(torch.mm(x, w).cos().sum() for w in ws)
    x = torch.randn(U, U, requires_grad=True)
    ws = [torch.randn(U, d * U, requires_grad=True) for d in shapes]
    gm, n = _joint(f, x, *ws)
    unit = U * U * 4
    assert _act(gm, n) == sum(shapes) * unit
    for want in [18, 17, 16, 15, 14, 13, 11, 7, 6, 5, 0]:
        assert _act(gm, n, activation_memory_budget=want / sum(shapes)) == want * unit, want


def test_budget_zero_saves_only_inputs_and_random():
    def f(x, w):
        return torch.nn.functional.dropout(torch.mm(x, w).cos(), 0.5).sum()
    gm, n = _joint(f, torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True))
    saved = choose_saved(gm, num_fwd_outputs=n, opts=current(activation_memory_budget=0.0))
    kinds = {s.name.rstrip("_0123456789") for s in saved}
    assert kinds <= {"primals", "getitem"}, kinds  # inputs and dropout's mask/output
    assert any(s.name.startswith("getitem") for s in saved)


def test_graph_memory_budget_meta_overrides_option():
    def f(x, w):
        return torch.mm(x, w).cos().sum()
    gm, n = _joint(f, torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True))
    assert _act(gm, n) > 0
    next(iter(gm.graph.nodes)).meta["memory_budget"] = 0.0
    assert _act(gm, n) == 0


def test_estimators():
    def f(x, w):
        return torch.mm(x, w).cos().sum()
    gm, _ = _joint(f, torch.randn(4, 16, requires_grad=True), torch.randn(16, 32, requires_grad=True))
    mm = next(x for x in gm.graph.nodes if x.target is torch.ops.aten.mm.default)
    cos = next(x for x in gm.graph.nodes if x.target is torch.ops.aten.cos.default)
    assert node_flops(mm) == 2 * 4 * 16 * 32 and node_flops(cos) == 0
    assert node_profile(mm) > 0
    assert size_bytes(mm) == 4 * 32 * 4
    assert runtime_estimator(lambda node: 7.0)(mm) == 7.0
    with pytest.raises(EstimatorError, match="non-negative"):
        runtime_estimator(lambda node: -1)(mm)
    with pytest.raises(OptionError):
        current(activation_memory_budget_runtime_estimator="bogus")


def test_callable_estimator_steers_the_knapsack():
    """Two equal-size matmuls, room for one: the one the estimator calls costlier is kept."""
    U = 16

    def f(x, w1, w2):
        return torch.mm(x, w1).cos().sum() + torch.mm(x, w2).sin().sum()
    gm, n = _joint(f, *(torch.randn(U, U, requires_grad=True) for _ in range(3)))
    mms = [x for x in gm.graph.nodes if x.target is torch.ops.aten.mm.default and "tangents" not in str(x.args)]
    for costly in mms[:2]:
        est = lambda node, c=costly: 10.0 if node is c else 1.0  # noqa: E731
        saved = choose_saved(gm, num_fwd_outputs=n, opts=current(
            activation_memory_budget=0.5, activation_memory_budget_runtime_estimator=est))
        assert costly in saved and not (set(mms[:2]) - {costly}) & set(saved)


def test_budget_out_of_range_is_an_option_error():
    with pytest.raises(OptionError, match=r"\[0, 1\]"):
        current(activation_memory_budget=1.5)
