"""Random ops in training (#31): every form a model uses draws its numbers inside a fused kernel, on the C++
target and in Triton kernels (the interpreter here, the GPU in the ``gpu`` tests), from seeds the graph draws
on the device once per call (``codegen.rewrite.seed_nodes``), with no host work per kernel."""
from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln
from kiln.debug import counters

TARGETS = ["cpp", "triton"]
N = 1 << 14   # elements per draw: the statistics below hold within about 5 standard errors


def _compile(fn, target, **opts):
    torch._dynamo.reset()
    with kiln.config.patch(codegen=target, **opts):
        return torch.compile(fn, backend="kiln")


@pytest.fixture(autouse=True)
def _counters():
    counters.clear()


def _draws(x, p):
    """One output per random op a model meets: (name, value)."""
    z = torch.empty_like(x)
    return {
        "dropout": F.dropout(x, 0.2, True),
        "dropout2d": F.dropout2d(x.view(64, 16, 4, 4), 0.3, True).reshape(-1),
        "alpha_dropout": F.alpha_dropout(x, 0.2, True),
        "drop_path": x * x.new_empty((64, 1)).bernoulli_(0.75).div_(0.75).expand(64, N // 64).reshape(-1),
        "bernoulli_tensor": torch.bernoulli(p),
        "bernoulli_inplace_tensor": z.bernoulli_(p),
        "bernoulli_p": torch.bernoulli(x, p=0.3),
        "rand": torch.rand(N),
        "rand_like": torch.rand_like(x),
        "randn_like": torch.randn_like(x),
        "randint": torch.randint(3, 10, (N,)),
        "randint_like": torch.randint_like(x, 7),
        "uniform_": torch.empty_like(x).uniform_(-2, 3),
        "normal_": torch.empty_like(x).normal_(1, 2),
        "normal_tensor": torch.normal(torch.full_like(x, 4.0), 0.5),
        "exponential_": torch.empty_like(x).exponential_(2.0),
    }


def _mean_std(name, v):
    return v.double().mean().item(), v.double().std().item()


# the expected mean and standard deviation of each draw over x = 1 and p = 0.25
EXPECTED = {
    "dropout": (1.0, math.sqrt(0.2 / 0.8)), "dropout2d": (1.0, math.sqrt(0.3 / 0.7)),
    "alpha_dropout": (None, None), "drop_path": (1.0, math.sqrt(0.25 / 0.75)),
    "bernoulli_tensor": (0.25, math.sqrt(0.25 * 0.75)), "bernoulli_inplace_tensor": (0.25, math.sqrt(0.25 * 0.75)),
    "bernoulli_p": (0.3, math.sqrt(0.3 * 0.7)), "rand": (0.5, math.sqrt(1 / 12)), "rand_like": (0.5, math.sqrt(1 / 12)),
    "randn_like": (0.0, 1.0), "randint": (6.0, math.sqrt((7 ** 2 - 1) / 12)), "randint_like": (3.0, math.sqrt(48 / 12)),
    "uniform_": (0.5, 5 / math.sqrt(12)), "normal_": (1.0, 2.0), "normal_tensor": (4.0, 0.5),
    "exponential_": (0.5, 0.5),
}


@pytest.mark.parametrize("target", TARGETS)
def test_every_random_op_draws_in_a_kernel_with_its_distribution(target):
    fn = _compile(lambda x, p: _draws(x, p), target, on_error="raise")
    x, p = torch.ones(N), torch.full((N,), 0.25)
    out = fn(x, p)
    assert counters["random"]["aten"] == 0, dict(counters["random"])
    assert counters["random"]["fused"] == len(out)   # one draw per op
    for name, v in out.items():
        mean, std = EXPECTED[name]
        if mean is None:
            continue
        m, s = _mean_std(name, v)
        assert abs(m - mean) < 5 * std / math.sqrt(v.numel() if name not in ("dropout2d", "drop_path") else 64) + 1e-9, \
            (name, m, mean)
        assert abs(s - std) < 0.1 * std, (name, s, std)
    r = out["randint"]
    assert r.dtype == torch.int64 and r.min() == 3 and r.max() == 9
    assert out["randint_like"].dtype == torch.float32 and set(out["randint_like"].unique().tolist()) == set(range(7))
    assert 0 <= out["rand"].min() and out["rand"].max() < 1
    assert set(out["bernoulli_tensor"].unique().tolist()) == {0.0, 1.0}
    assert (out["exponential_"] > 0).all() and torch.isfinite(out["exponential_"]).all()


@pytest.mark.parametrize("target", TARGETS)
def test_seeds_differ_per_call_and_per_op_and_repeat_under_manual_seed(target):
    fn = _compile(lambda x: (F.dropout(x, 0.5, True), F.dropout(x, 0.5, True)), target)
    x = torch.ones(4096)
    torch.manual_seed(7)
    a1, a2 = fn(x)
    b1, b2 = fn(x)
    torch.manual_seed(7)
    c1, c2 = fn(x)
    assert not torch.equal(a1, a2), "two dropouts of one graph drew the same mask"
    assert not torch.equal(a1, b1), "a second call drew the same mask"
    assert torch.equal(a1, c1) and torch.equal(a2, c2), "manual_seed does not repeat the masks"


class _DropPath(nn.Module):
    """Stochastic depth as timm writes it: a per-sample mask of ``bernoulli_`` on ``new_empty``."""

    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        keep = 1 - self.p
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask.div_(keep)


class _Block(nn.Module):
    def __init__(self, d=32, p=0.1, path=0.2):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop, self.path = nn.Dropout(p), _DropPath(path)

    def forward(self, x):
        return x + self.path(self.drop(self.fc2(self.drop(F.gelu(self.fc1(self.norm(x)))))))


def _tiny_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Dropout(0.1), _Block(), _Block(), nn.LayerNorm(32))


@pytest.mark.parametrize("target", TARGETS)
def test_a_tiny_model_trains_with_dropout_and_drop_path_without_aten_random_ops(target):
    """The cliff guard in ``make test``: dropout and stochastic depth on, forward and backward compiled;
    no random op runs outside a fused kernel, gradients agree with the forward's masks, and with the random
    ops off (eval) the values equal eager's."""
    model = _tiny_model()
    fn = _compile(model, target, on_error="raise")
    x = torch.randn(8, 16, 32, requires_grad=True)
    out = fn(x)
    out.sum().backward()
    assert counters["random"]["aten"] == 0, dict(counters["random"])
    assert counters["random"]["fused"] >= 4 + 2   # input dropout, 2 x (2 dropouts + 1 drop path)
    assert x.grad is not None and torch.isfinite(x.grad).all()
    model.eval()
    with torch.no_grad():
        ref = model(x)
        got = _compile(model, target)(x)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("target", TARGETS)
def test_dropout_gradient_uses_the_forward_mask(target):
    fn = _compile(lambda x: F.dropout(x, 0.4, True) * 3, target)
    x = torch.rand(4096) + 0.5
    x.requires_grad_(True)
    y = fn(x)
    y.backward(torch.ones_like(y))
    kept = y != 0
    assert 0.5 < kept.double().mean().item() < 0.7
    torch.testing.assert_close(x.grad, kept.to(x.dtype) * 3 / 0.6)


@pytest.mark.parametrize("target", TARGETS)
def test_one_seed_draw_per_graph_call_and_none_on_the_host(target):
    fn = _compile(lambda x: F.dropout(x, 0.1, True) + torch.rand_like(x) + F.dropout(x * 2, 0.3, True), target)
    _, sources = kiln.run_and_get_code(fn, torch.randn(64, 64))
    wrapper = next(s for s in sources if s.startswith("# kiln wrapper"))
    assert wrapper.count("= aten_randint_low(") == 1, wrapper
    for s in sources:
        assert "launch.seed" not in s and ".item()" not in s and "_seed()" not in s


def test_bernoulli_p_outside_the_unit_interval_raises_as_eager():
    fn = _compile(lambda x: torch.bernoulli(x, p=1.5), "cpp")
    with pytest.raises(RuntimeError, match="bernoulli"):
        torch.bernoulli(torch.ones(4), p=1.5)
    with pytest.raises(RuntimeError, match="bernoulli"):
        fn(torch.ones(4))


# -- GPU --------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_random_kernels_cost_no_host_time_in_steady_state():
    """Swin-T with stochastic depth trained 6x slower than inductor: each random kernel drew a host seed
    that Triton specialized on (a seed divisible by 16 compiled a new variant). 24 drop paths, 60 steps
    after warm-up: no step's host time may be near a compile's."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_Block(64, 0.1, 0.2) for _ in range(12)]).cuda()
    fn = torch.compile(model, backend="kiln")
    x = torch.randn(8, 32, 64, device="cuda", requires_grad=True)
    for _ in range(5):
        fn(x).sum().backward()
    torch.cuda.synchronize()
    worst = 0.0
    for _ in range(60):
        t0 = time.perf_counter()
        fn(x).sum().backward()
        worst = max(worst, time.perf_counter() - t0)
        torch.cuda.synchronize()
    assert counters["random"]["aten"] == 0
    assert worst < 0.05, f"a step took {worst * 1e3:.1f} ms of host time"


def test_a_cache_hit_counts_the_random_ops_its_compile_fused(tmp_path):
    """counters['random'] after a compile-cache hit: what the compile that stored the entry counted."""
    def run():
        torch._dynamo.reset()
        fn = kiln.compile(_tiny_model(), codegen="cpp", on_error="raise", cache=True, cache_dir=str(tmp_path / "c"))
        fn(torch.randn(8, 16, 32, requires_grad=True)).sum().backward()
        return dict(counters["random"]), counters["cache"]["hit"]
    first, hits = run()
    assert first["fused"] >= 6 and hits == 0
    counters.clear()
    again, hits = run()
    assert hits >= 1 and again == first
