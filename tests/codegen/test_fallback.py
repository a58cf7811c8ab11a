"""Runtime fallback: a kernel that fails on its first call runs its group's ATen nodes instead."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from kiln import options
from kiln.runtime.kernels import KernelCall
from kiln.debug import counters
from tests.codegen.util import assert_close, fused


def _sites(gm):
    return [n.target for n in gm.graph.nodes if isinstance(n.target, KernelCall)]


def _break(monkeypatch, site, exc=None):
    """Make ``site``'s kernel raise on every call as if it were fresh; returns a call counter."""
    calls = []

    def boom(*args):
        calls.append(1)
        raise exc or OutOfResources(300000, 232448, "shared memory")
    k = site.kernel
    monkeypatch.setattr(k, "_call", boom)
    monkeypatch.setattr(k, "ran", False)
    monkeypatch.setattr(k, "failed", None)
    return calls


def _fresh(monkeypatch, site):
    monkeypatch.setattr(site.kernel, "ran", False)
    monkeypatch.setattr(site.kernel, "failed", None)


def _ln_block(x, w, b):
    y = F.layer_norm(x * 2 + 1, (x.shape[-1],), w, b)
    return torch.relu(y).view(-1), y.sum(-1), torch.softmax(y, -1).transpose(0, 1)


ARGS = lambda: (torch.randn(6, 32), torch.randn(32), torch.randn(32))  # noqa: E731


def test_all_kernels_fail_results_match_eager(monkeypatch, capsys):
    args = ARGS()
    gm, n = fused(_ln_block, *args)
    sites = _sites(gm)
    assert n == len(sites) > 0
    assert all(s.fallback is not None for s in sites)
    calls = [_break(monkeypatch, s) for s in sites]
    before = counters["codegen"]["runtime_fallback"]
    with options.patch(debug=1):
        out = gm(*args)
    assert_close(out, _ln_block(*args))
    assert counters["codegen"]["runtime_fallback"] - before == len({s.kernel.name for s in sites})
    err = capsys.readouterr().err
    for s in sites:
        assert f"kernel {s.kernel.name} failed on its first call" in err
    assert "OutOfResources: out of resource: shared memory" in err
    # later calls go straight to the ATen nodes: the kernel is not tried again
    out2 = gm(*args)
    assert_close(out2, _ln_block(*args))
    assert all(len(c) == 1 for c in calls)
    assert counters["codegen"]["runtime_fallback"] - before == len({s.kernel.name for s in sites})


def test_one_kernel_fails_others_run(monkeypatch):
    args = ARGS()
    gm, n = fused(_ln_block, *args)
    sites = _sites(gm)
    for s in sites:
        _fresh(monkeypatch, s)
    calls = _break(monkeypatch, sites[-1], RuntimeError("at 9:18:\nMask argument cannot be block type"))
    out = gm(*args)
    assert_close(out, _ln_block(*args))
    assert len(calls) == 1
    assert all(s.kernel.ran for s in sites[:-1])
    assert sites[-1].kernel.failed is not None


def test_multi_output_kernel_and_views(monkeypatch):
    def f(x):
        y = x.exp()
        return y.t(), (y * 2).view(4, -1), y.amax(-1), y.sum(0)[1:]
    x = torch.randn(8, 6)
    gm, _ = fused(f, x)
    sites = _sites(gm)
    multi = [n for n in gm.graph.nodes if hasattr(n.target, "kernel") and isinstance(n.meta["val"], tuple)]
    assert multi, "expected a kernel with several outputs"
    for s in sites:
        _break(monkeypatch, s)
    assert_close(gm(x), f(x))


def test_shared_kernel_two_call_sites(monkeypatch):
    def f(x, y):
        return torch.sigmoid(x) * 3 + 1, torch.sigmoid(y) * 3 + 1
    x, y = torch.randn(5, 7), torch.randn(5, 7)
    gm, _ = fused(f, x, y, tuning={"group_kernels": False})   # two calls of one kernel, not one grouped launch
    sites = _sites(gm)
    assert len(sites) == 2 and sites[0] is not sites[1] and sites[0].kernel is sites[1].kernel
    calls = _break(monkeypatch, sites[0])
    before = counters["codegen"]["runtime_fallback"]
    assert_close(gm(x, y), f(x, y))
    assert len(calls) == 1
    assert counters["codegen"]["runtime_fallback"] - before == 1


def test_error_after_a_good_call_propagates(monkeypatch):
    args = ARGS()
    gm, _ = fused(_ln_block, *args)
    sites = _sites(gm)
    for s in sites:
        _fresh(monkeypatch, s)
    assert_close(gm(*args), _ln_block(*args))
    assert all(s.kernel.ran for s in sites)

    def boom(*a):
        raise RuntimeError("illegal memory access")
    monkeypatch.setattr(sites[0].kernel, "_call", boom)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        gm(*args)


def test_real_broken_source_falls_back(monkeypatch):
    """A kernel module that does not compile (here: does not even import) takes the fallback."""
    from kiln.runtime.kernels import Kernel
    x = torch.randn(4, 9)
    gm, _ = fused(lambda x: torch.tanh(x) + x, x)
    site = _sites(gm)[0]
    bad = Kernel(site.kernel.name + "_bad", site.kernel.source.replace("@triton.jit", "@triton.jit\n)"), True)
    monkeypatch.setattr(site, "kernel", bad)
    before = counters["codegen"]["runtime_fallback"]
    assert_close(gm(x), torch.tanh(x) + x)
    assert counters["codegen"]["runtime_fallback"] - before == 1
    assert bad.failed is not None


def test_training_graph_with_every_fallback_taken(monkeypatch):
    """Forward + backward of a small attention block: every kernel with a fallback fails, the
    others run; values and gradients still match eager."""
    def block(x, w, b, wq, y):
        x = x.detach().requires_grad_(True) if not x.requires_grad else x
        h = F.layer_norm(x, (16,), w, b)
        s = (h @ wq) @ h.transpose(-1, -2) / 4
        mask = torch.tril(torch.ones(8, 8, dtype=torch.bool))
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
        logits = F.gelu(p @ h, approximate="tanh")
        loss = F.cross_entropy(logits.reshape(-1, 16), y.reshape(-1), ignore_index=-100)
        return (loss,) + torch.autograd.grad(loss, (x, w, b, wq))

    args = (torch.randn(2, 8, 16, requires_grad=True), torch.randn(16, requires_grad=True),
            torch.randn(16, requires_grad=True), torch.randn(16, 16, requires_grad=True),
            torch.randint(0, 16, (2, 8)))
    args[4][0, 0] = -100
    gm, n = fused(block, *args)
    sites = _sites(gm)
    with_fb = [s for s in sites if s.fallback is not None]
    assert len(with_fb) >= n // 2, (len(with_fb), n)
    for s in sites:
        _fresh(monkeypatch, s)
    for s in with_fb:
        _break(monkeypatch, s)
    assert_close(gm(*args), block(*args), atol=1e-4, rtol=1e-4)
    assert all(s.kernel.failed is not None for s in with_fb)


def test_a_kernel_without_its_own_fallback_falls_back_with_its_graph(monkeypatch):
    """A split reduction's partial kernel stores a buffer no graph node computes, so it has no ATen
    fallback of its own; when it fails on its first call, the compiled graph reruns all its ATen nodes
    (from the inputs it kept) and keeps doing so: right values, no exception."""
    import re

    import kiln.runtime.kernels as K
    from kiln.options import current
    from kiln.pipeline import compile_graph
    from kiln.runtime.load import collect_sources

    def f(x):
        return (x * 2).sum(), x.amax()
    x = torch.randn(4096)
    opts = current(codegen="triton").replace(tuning=dict(split_min_r=64, split_min_numel=256, split_min_chunk=64,
                                                         chain=False))
    with collect_sources() as sources, torch.no_grad():
        compiled = compile_graph(torch.fx.symbolic_trace(f), [x], opts)
    wrapper = next(s for s in sources if s.startswith("# kiln wrapper"))
    kernels = [K._CACHE[n] for n in sorted(set(re.findall(r"kiln_(?:pw|red)_[0-9a-f]{12}", wrapper)))]
    assert len(kernels) >= 2   # the partials, then their final pass
    for k in kernels:
        _break(monkeypatch, KernelCall(k, None))
    before = dict(counters["codegen"])
    with torch.no_grad():
        out = compiled(x)
        again = compiled(x)
    for o, a, r in zip(out, again, f(x)):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4)
    assert counters["codegen"]["graph_fallback"] == before.get("graph_fallback", 0) + 1


def test_cpu_plans_of_a_gpu_graph_are_not_interpreted():
    """A CPU computation inside a graph with CUDA values (a number written into a CUDA tensor's slice is
    a CPU 0-dim constant) runs as ATen; graphs on the CPU throughout still use the interpreter, and
    compiling for CUDA offline (emit_for='cuda') emits real kernels."""
    from types import SimpleNamespace

    from kiln.codegen.target import TritonTarget
    from kiln.options import current
    cpu, cuda = SimpleNamespace(device=torch.device("cpu")), SimpleNamespace(device=torch.device("cuda", 0))
    target = TritonTarget(current(codegen="triton"))
    assert target.interpreted(cpu, graph_on_cuda=True)
    assert not target.interpreted(cpu, graph_on_cuda=False)
    assert not target.interpreted(cuda, graph_on_cuda=True)
    assert not TritonTarget(current(codegen="triton", emit_for="cuda")).interpreted(cpu, graph_on_cuda=True)


def test_a_graph_fallback_restores_the_inputs_its_kernels_wrote(monkeypatch):
    """A kernel writes a graph input's new value in place (a running statistic) while another kernel of the
    graph has no ATen fallback of its own; when that one fails on the first call, the graph's ATen nodes run
    from the inputs as they were: the input is updated once, not twice."""
    import re

    import kiln.runtime.kernels as K
    from kiln.options import current
    from kiln.pipeline import compile_graph
    from kiln.runtime.load import collect_sources

    def f(x, buf):
        buf.mul_(0.5).add_(1.0)
        return (x * 2).sum(), x.amax()
    x, buf = torch.randn(4096), torch.randn(64)
    opts = current(codegen="triton").replace(tuning=dict(split_min_r=64, split_min_numel=256, split_min_chunk=64,
                                                         chain=False))
    with collect_sources() as sources, torch.no_grad():
        compiled = compile_graph(torch.fx.symbolic_trace(f), [x, buf.clone()], opts)
    wrapper = next(s for s in sources if s.startswith("# kiln wrapper"))
    assert "into=(" in wrapper   # the update is written in place
    for name in sorted(set(re.findall(r"kiln_red_[0-9a-f]{12}", wrapper))):
        _break(monkeypatch, KernelCall(K._CACHE[name], None))
    before, want = counters["codegen"]["graph_fallback"], buf * 0.5 + 1.0
    with torch.no_grad():
        out = compiled(x, buf)
    assert counters["codegen"]["graph_fallback"] == before + 1
    torch.testing.assert_close(buf, want)
    for o, r in zip(out, f(x, torch.zeros(64))):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-4)
