"""Seed 001 (PyTorch's test/functorch/test_ac.py) re-expressed for kiln's activation_memory_budget.

Every function is compiled with ``kiln.compile(fn, activation_memory_budget=b)``.

The seed runs on CUDA with 512-wide blocks and measures memory as the change in the allocator's
requested bytes (1 unit = one 512x512 fp32 block = 1 MiB) and FLOPs of the backward in units of one
512^3 matmul. Its expectations are scale-free, and every variant here asserts the seed's exact numbers
in those units:
- ``cpu`` (default suite, every case): blocks are UNIT=16 wide (128 for attention, see
  ``test_attention_vs_linear``); memory is the bytes of the distinct storages saved for backward that
  are not graph inputs (``saved_tensors_hooks``), FLOPs are ``FlopCounterMode`` over the backward (the
  seed's ``get_bw_flops``), with kiln's formulas for the CPU attention kernel (PyTorch has none for it);
- ``cpu128`` (``-m slow``): the same at UNIT=128, the scale these tests used to run at;
- ``cuda`` (``-m gpu``): the seed's 512 blocks and CUDA ``requested_bytes`` measurement.

A budget sweep of one function (the even chain's 11 budgets, each uneven chain's exact sums) compiles
once (``Env.sweep``): the first budget is compiled and measured end to end, and the joint graph that
compile partitioned is partitioned again for every budget (``kiln.partition.partition_joint``, what
the compile runs), its forward and backward graphs run on random inputs and measured the same way;
both measurements of the first budget must agree. The uneven chain also runs written as one sum over
its matmuls (mm, cos and sum of each branch interleaved), where a backward hold once dropped saved
values (budget 19/50 saved 3 units). tests/partition/test_budget_property.py checks the exact subset
sums in random node orders, on the partitioner alone.
"""
import random

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import kiln
from kiln.debug import observe
from kiln.options import current
from kiln.partition import partition_joint
from kiln.partition.estimate import EXTRA_FLOPS

ENVS = [pytest.param(("cpu", 16), id="cpu"), pytest.param(("cpu", 128), id="cpu128", marks=pytest.mark.slow),
        pytest.param(("cuda", 512), id="cuda", marks=pytest.mark.gpu)]


class Env:
    def __init__(self, device, unit):
        self.device = device
        self.unit = unit
        self.mem_unit = self.unit * self.unit * 4
        self.flop_unit = self.unit ** 3 * 2

    def at_least(self, unit):
        return self if self.unit >= unit else Env(self.device, unit)

    def randn(self, *shape):
        return torch.randn(*shape, device=self.device, requires_grad=True)

    # --- the seed's measurements -------------------------------------------------------------
    def act_mem(self, f, inputs):
        out = f()
        out.backward()
        if self.device == "cuda":
            start = torch.cuda.memory_stats()["requested_bytes.all.current"]
            out = f()
            cur = torch.cuda.memory_stats()["requested_bytes.all.current"]
            out.backward()
            return (cur - start) / self.mem_unit
        skip = {t.untyped_storage().data_ptr() for t in inputs}
        storages = {}

        def pack(t):
            s = t.untyped_storage()
            if s.data_ptr() not in skip:
                storages[s.data_ptr()] = s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = f()
        out.backward()
        return sum(storages.values()) / self.mem_unit

    def bw_flops(self, f):
        f().backward()
        out = f()
        with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOPS) as mode:
            out.backward()
        return mode.get_total_flops() / self.flop_unit

    def mem_and_flops(self, f, inputs, budget=None):
        torch._dynamo.reset()
        if budget is not None:
            f = kiln.compile(f, activation_memory_budget=budget)
        return round(self.act_mem(f, inputs), 1), self.bw_flops(f)

    # --- one compile, many budgets ---------------------------------------------------------------
    def sweep(self, f, inputs, budgets):
        """``[(mem, flops)]`` per budget; see the module docstring."""
        joints = []
        with observe(lambda event, data: joints.append(data) if event == "partition" else None):
            first = self.mem_and_flops(f, inputs, budget=budgets[0])
        assert len(joints) == 1, f"{len(joints)} graphs were partitioned; the sweep needs one"
        joint, n = joints[0]["joint"], joints[0]["num_fwd_outputs"]
        rows = [self.partitioned(joint, n, b) for b in budgets]
        assert rows[0] == first, (rows[0], first)
        return rows

    def partitioned(self, joint, n, budget):
        """(mem, flops) of kiln's partition of ``joint`` at ``budget``, measured by running its graphs."""
        fw, bw = partition_joint(joint, None, num_fwd_outputs=n, opts=current(activation_memory_budget=budget))
        inputs = [self.like(p.meta["val"]) for p in fw.graph.nodes if p.op == "placeholder"]
        outs = fw(*inputs)
        skip = {t.untyped_storage().data_ptr() for t in inputs}
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in outs[n:] if isinstance(t, torch.Tensor)}
        mem = sum(b for p, b in storages.items() if p not in skip) / self.mem_unit
        saved = dict(zip([o.name for o in fw.graph.output_node().args[0][n:]], outs[n:]))
        args = [saved[p.name] if p.name in saved else torch.ones_like(self.like(p.meta["val"]))
                for p in bw.graph.nodes if p.op == "placeholder"]
        with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOPS) as mode:
            bw(*args)
        return round(mem, 1), mode.get_total_flops() / self.flop_unit

    def like(self, val):
        return torch.randn(val.shape, dtype=val.dtype, device=self.device)

    def pair(self, b_i, o):
        return self.randn(b_i * self.unit, b_i * self.unit), self.randn(b_i * self.unit, o * self.unit)


@pytest.fixture(params=ENVS)
def env(request):
    device, unit = request.param
    if device == "cuda" and not torch.cuda.is_available():
        pytest.fail("the gpu variant needs a CUDA device")
    return Env(device, unit)


def test_rematerializes_cheap(env):
    def f(x, w):
        return torch.mm(x.cos(), w).sum()
    x, w = env.randn(env.unit, env.unit), env.randn(env.unit, env.unit)
    call = lambda: f(x, w)  # noqa: E731
    eager_mem, eager_flops = env.mem_and_flops(call, [x, w])
    assert eager_mem == 1.0
    mem_10, flops_10 = env.mem_and_flops(call, [x, w], budget=1.0)
    assert mem_10 == 1.0 and flops_10 == eager_flops
    mem_5, flops_5 = env.mem_and_flops(call, [x, w], budget=0.5)
    assert mem_5 == 0.0 and flops_5 == eager_flops


def _chain(x, ws):
    x = x.cos()
    for w in ws:
        x = torch.mm(x, w).cos()
    return x.sum()


def test_matmul_even_chain(env):
    x = env.randn(env.unit, env.unit)
    ws = [env.randn(env.unit, env.unit) for _ in range(5)]
    call = lambda: _chain(x, ws)  # noqa: E731
    _, eager_flops = env.mem_and_flops(call, [x, *ws])
    budgets = list(range(10, -1, -1))
    for budget, (mem, flops) in zip(budgets, env.sweep(call, [x, *ws], [b / 10 for b in budgets])):
        if budget <= 5:  # start saving matmuls
            assert (mem, flops) == (budget, eager_flops + (5 - budget)), budget
        elif budget < 10:  # only the cos are recomputed
            assert (mem, flops) == (5.0, eager_flops), budget
        else:
            assert (mem, flops) == (10.0, eager_flops), budget


def _uneven_configs():
    configs = [([11, 3, 4, 2], [18, 17, 16, 15, 14, 13, 11, 7, 6, 5]),
               ([3, 5, 11, 17, 14], [42, 30, 19, 8, 3])]
    random.seed(0)
    arr = [random.randint(0, 50) for _ in range(10)]
    sums = []
    for i in range(10):
        random.shuffle(arr)
        sums.append(sum(arr[:i]))
    configs.append((arr, sums))
    return configs


def _uneven_seed(x, ws):  # the seed's form: every mm and cos, then the sums
    xs = [torch.mm(x, w).cos() for w in ws]
    return sum([x.sum() for x in xs])


def _uneven_interleaved(x, ws):  # one sum over the branches: mm, cos, sum, add of each in turn
    return sum(torch.mm(x, w).cos().sum() for w in ws)


@pytest.mark.parametrize("form", [_uneven_seed, _uneven_interleaved], ids=["seed", "interleaved"])
@pytest.mark.parametrize("config", range(3), ids=["fixed1", "fixed2", "random"])
def test_matmul_uneven_chain(env, config, form):
    shapes, exact = _uneven_configs()[config]
    x = env.randn(env.unit, env.unit)
    ws = [env.randn(env.unit, d * env.unit) for d in shapes]
    call = lambda: form(x, ws)  # noqa: E731
    eager_mem, _ = env.mem_and_flops(call, [x, *ws])
    total = sum(shapes)
    assert eager_mem == total
    got = [mem for mem, _ in env.sweep(call, [x, *ws], [want / total for want in exact])]
    assert got == exact, (shapes, exact, got)


def _pairs(xs, ws):
    xs = [torch.mm(x, w).cos() for x, w in zip(xs, ws)]
    return sum([x.sum() for x in xs])


def test_prioritize_cheaper_matmul(env):
    (x1, w1), (x2, w2) = env.pair(1, 4), env.pair(2, 2)
    call = lambda: _pairs([x1, x2], [w1, w2])  # noqa: E731
    inputs = [x1, w1, x2, w2]
    eager_mem, eager_flops = env.mem_and_flops(call, inputs)
    assert (eager_mem, eager_flops) == (8, 24)
    mem, flops = env.mem_and_flops(call, inputs, budget=0.5)
    assert (mem, flops) == (4, eager_flops + 4)


def test_prioritize_cheaper_matmul2(env):
    xs, ws = zip(*[env.pair(a, b) for a, b in [(4, 4), (6, 2), (2, 6)]])
    call = lambda: _pairs(xs, ws)  # noqa: E731
    inputs = [*xs, *ws]
    eager_mem, eager_flops = env.mem_and_flops(call, inputs)
    assert (eager_mem, eager_flops) == (40, 320)
    (mem28, flops28), (mem16, flops16) = env.sweep(call, inputs, [28 / eager_mem, 16 / eager_mem])
    assert (mem28, flops28 - eager_flops) == (28, 2 * 2 * 6)
    assert (mem16, flops16 - eager_flops) == (12, 2 * 2 * 6 + 4 * 4 * 4)


@pytest.mark.parametrize("S,D,expected", [(1, 1, "mm"), (1, 3, "attn"), (2, 2, "mm"), (2, 1, "mm"),
                                          (2, 5, "attn"), (4, 7, "mm"), (4, 9, "attn")])
def test_attention_vs_linear(env, S, D, expected):
    """The CPU attention kernel also saves a logsumexp of S x unit floats beside the S x D blocks: it
    weighs under 0.05 block (and rounds away, as at the seed's 512) only from UNIT=128 on."""
    env = env.at_least(128)

    def f(x, w):
        shape = x.shape
        x = x.reshape(1, 1, x.shape[0], x.shape[1])
        x = torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=False).reshape(*shape)
        return torch.mm(x, w).cos().sum()
    x, w = env.randn(S * env.unit, D * env.unit), env.randn(D * env.unit, D * env.unit)
    call = lambda: f(x, w)  # noqa: E731
    with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOPS) as mode:
        call()
    mm_flops = mode.get_flop_counts()["Global"][torch.ops.aten.mm]
    attn_flops = (mode.get_total_flops() - mm_flops) / env.flop_unit
    mm_flops /= env.flop_unit
    assert attn_flops > 0, "attention FLOPs must be counted for this test to mean anything"
    eager_mem, eager_flops = env.mem_and_flops(call, [x, w])
    assert eager_mem == S * D * 2
    mem, flops = env.mem_and_flops(call, [x, w], budget=0.6)  # forces recomputing mm or attention
    assert mem == S * D
    assert flops - eager_flops == (attn_flops if expected == "attn" else mm_flops)


def test_profile_estimator(env):
    x = env.randn(env.unit, env.unit)
    ws = [env.randn(env.unit, env.unit) for _ in range(5)]
    call = lambda: _chain(x, ws)  # noqa: E731
    _, eager_flops = env.mem_and_flops(call, [x, *ws])
    with kiln.config.patch(activation_memory_budget_runtime_estimator="profile"):
        mem, flops = env.mem_and_flops(call, [x, *ws], budget=0.2)
    assert (mem, flops) == (2, eager_flops + 3)
