"""mode="reduce-overhead": CUDA-graph replay of compiled graphs (runtime/cudagraph.py).

The CPU tests cover the decisions (which inputs a graph mutates, what refuses capture, that the mode is
harmless off the GPU); the GPU tests train and infer with replayed graphs and compare with eager.
"""
import copy
import gc

import pytest
import torch
import torch.nn as nn

import kiln
from kiln.debug import counters
from kiln.partition.ops import mutated_inputs
from kiln.runtime import cudagraph


def _graph(fn, *args):
    from torch.fx.experimental.proxy_tensor import make_fx
    return make_fx(fn)(*args)


def test_mutated_inputs_through_views():
    def f(a, b, c):
        a.add_(1)
        b[0].mul_(2)
        return c + 1

    gm = _graph(f, torch.ones(3), torch.ones(2, 3), torch.ones(3))
    assert mutated_inputs(gm) == {0, 1}


def test_refusals():
    assert "non-tensor" in cudagraph.refusal([3])
    assert "cpu" in cudagraph.refusal([torch.ones(1)])
    assert cudagraph.refusal([None]) is None


@pytest.mark.parametrize("asked", [dict(mode="reduce-overhead"), dict(cuda_graphs="auto"), dict(cuda_graphs="always")])
def test_cuda_graphs_asked_on_cpu_run_normally(asked):
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    ref = m(x)
    for _ in range(3):
        torch.testing.assert_close(kiln.compile(copy.deepcopy(m), **asked)(x), ref)


# ----------------------------------------------------------------------------------------- GPU
gpu = pytest.mark.gpu


def _train(model, steps, mode, make_batch):
    model = copy.deepcopy(model)
    f = kiln.compile(model, mode=mode) if mode != "eager" else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for i in range(steps):
        x, y = make_batch(i)
        opt.zero_grad()
        loss = nn.functional.mse_loss(f(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    return model, losses


@gpu
def test_training_replays_and_matches_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 8)).cuda()
    batches = [(torch.randn(32, 64, device="cuda"), torch.randn(32, 8, device="cuda")) for _ in range(6)]
    counters.clear()
    ref, ref_losses = _train(model, 6, "eager", lambda i: batches[i])
    got, losses = _train(model, 6, "reduce-overhead", lambda i: batches[i])
    assert counters["cudagraph"]["captured"] == 2          # forward and backward
    assert counters["cudagraph"]["replays"] >= 8           # steps 3..6, both graphs
    for a, b in zip(ref_losses, losses):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    for p, q in zip(ref.parameters(), got.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)


@gpu
def test_batchnorm_buffers_update_in_place():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.LazyLinear(4)).cuda()
    model(torch.randn(2, 3, 10, 10, device="cuda"))
    batches = [(torch.randn(4, 3, 10, 10, device="cuda"), torch.randn(4, 4, device="cuda")) for _ in range(5)]
    ref, _ = _train(model, 5, "eager", lambda i: batches[i])
    got, _ = _train(model, 5, "reduce-overhead", lambda i: batches[i])
    for (n, a), (_, b) in zip(ref.state_dict().items(), got.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=n)


@gpu
def test_inference_outputs_survive_the_next_replay():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh()).cuda().eval()
    f = kiln.compile(copy.deepcopy(model), mode="reduce-overhead")
    xs = [torch.randn(8, 16, device="cuda") for _ in range(5)]
    with torch.no_grad():
        outs = [f(x) for x in xs]                            # every output is kept
        for x, o in zip(xs, outs):
            torch.testing.assert_close(o, model(x))


@gpu
def test_frozen_inference_replays_with_parameters_in_place():
    """Freezing and reduce-overhead together: the frozen region's CUDA graph reads the inputs it kept
    (AOTAutograd's static inputs found through the kept positions), values as eager's, replayed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 10 * 10, 4)).cuda().eval()
    f = kiln.compile(copy.deepcopy(model), mode="reduce-overhead", freezing=True)
    counters.clear()
    with torch.no_grad():
        for _ in range(5):   # each output checked and dropped before the next call: every call replays
            x = torch.randn(2, 3, 10, 10, device="cuda")
            torch.testing.assert_close(f(x), model(x), rtol=1e-3, atol=1e-3)
    assert counters["kiln"]["frozen_params"] > 0
    assert counters["cudagraph"]["captured"] == 1 and counters["cudagraph"]["replays"] == 3


@gpu
def test_input_mutation_reaches_the_caller():
    def f(x, y):
        x.mul_(2)
        return (x + y).sum()

    g = kiln.compile(f, mode="reduce-overhead")
    for _ in range(4):
        a, b = torch.randn(64, device="cuda"), torch.randn(64, device="cuda")
        a0 = a.clone()
        out = g(a, b)
        torch.testing.assert_close(a, a0 * 2)
        torch.testing.assert_close(out, (a0 * 2 + b).sum())


@gpu
def test_two_forwards_before_backward_fall_back_correctly():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)).cuda()
    ref = copy.deepcopy(model)
    f = kiln.compile(model, mode="reduce-overhead")
    for _ in range(4):
        x1, x2 = torch.randn(8, 32, device="cuda"), torch.randn(8, 32, device="cuda")
        for m in (ref, model):
            m.zero_grad()
        l1, l2 = f(x1).sum(), f(x2).sum()                   # both graphs alive at once
        (l1 + l2).backward()
        (ref(x1).sum() + ref(x2).sum()).backward()
        for p, q in zip(ref.parameters(), model.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5)


@gpu
def test_dropout_is_captured_and_draws_fresh_masks_each_replay():
    """The graph draws its philox seeds on the device (one randint, which torch's CUDA generator advances
    at every replay), so random ops are captured (#31; they were refused when seeds came from the host)."""
    counters.clear()
    model = nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.5)).cuda()
    f = kiln.compile(model, mode="reduce-overhead")
    x = torch.ones(64, 32, device="cuda")
    outs = [f(x).detach().clone() for _ in range(5)]
    assert counters["cudagraph"]["refused"] == 0, dict(counters["cudagraph_refused"])
    assert counters["cudagraph"]["captured"] >= 1 and counters["cudagraph"]["replays"] >= 2
    assert not torch.equal(outs[3], outs[4]) and not torch.equal(outs[2], outs[3])   # fresh masks every replay
    assert 0.4 < (outs[4] != 0).float().mean().item() < 0.6


def test_pool_holds_graphs_weakly():
    """A pool does not keep a dead compiled function's graph (and its reserved memory) alive."""
    pool = cudagraph.Pool()
    g = cudagraph.Graphed(lambda args: args, name="g", pool=pool, static=set(), mutated=set(), n_user=0)
    pool.add(g)
    assert pool.graphs == [g]
    del g
    gc.collect()
    assert pool.graphs == []


def test_a_pool_whose_graphs_all_died_takes_a_new_handle(monkeypatch):
    """A capture never reuses the id of a private pool the allocator freed with its last graph."""
    handles = iter(range(1, 100))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(handles))
    pool = cudagraph.Pool()
    first = pool.ensure()
    g = cudagraph.Graphed(lambda args: args, name="g", pool=pool, static=set(), mutated=set(), n_user=0)
    pool.add(g)
    assert pool.ensure() == first   # shared while a graph lives in it (a forward and its backward)
    del g
    gc.collect()
    assert pool.ensure() != first


@torch.library.custom_op("kiln_test::host_sync", mutates_args=())
def _host_sync(x: torch.Tensor) -> torch.Tensor:
    return x * float(x.sum().item() != 12345.0)   # .item() syncs with the host: a capture fails on it


@_host_sync.register_fake
def _(x):
    return torch.empty_like(x)


@gpu
def test_a_failed_capture_leaves_the_stream_and_the_random_generator_usable():
    """``torch.cuda.graph`` leaves its capture stream current and the CUDA generator marked as capturing when
    ``capture_end`` raises; random ops outside a capture then failed ("Offset increment outside graph capture
    encountered unexpectedly": test_two_forwards_before_backward_fall_back_correctly after such a test)."""
    counters.clear()
    f = kiln.compile(lambda x: torch.ops.kiln_test.host_sync(x * 2) + 1, mode="reduce-overhead")
    x = torch.randn(16, device="cuda")
    for _ in range(3):
        torch.testing.assert_close(f(x), x * 2 + 1)
    assert counters["cudagraph"]["refused"] >= 1
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    torch.randn(4, device="cuda")
    torch.nn.functional.dropout(torch.ones(8, device="cuda"), 0.5)


class _Wide(nn.Module):
    """A loss and a wide activation returned beside it (as an LM returns logits beside its loss)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(256, 16384)

    def forward(self, x):
        out = nn.functional.gelu(self.lin(x))
        return out.square().mean(), out.detach()


def _peak_reserved(model, mode, x):
    """Peak reserved bytes of training steps 3.. (captures done) in ``mode``, from an emptied cache, and the bytes
    its graphs copy into static inputs; the wide output is dropped at once, before the backward."""
    gc.collect()
    torch.cuda.empty_cache()
    earlier = {id(g) for g in cudagraph.device_pool().graphs}
    model = copy.deepcopy(model)
    f = kiln.compile(model, mode=mode)
    for i in range(6):
        if i == 2:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        f(x)[0].backward()
        model.zero_grad(set_to_none=True)
        x.grad = None
    torch.cuda.synchronize()
    graphs = [g for g in cudagraph.device_pool().graphs if id(g) not in earlier]
    return torch.cuda.max_memory_reserved(), sum(b.nbytes for g in graphs for b in getattr(g, "copies", {}).values())


@gpu
def test_training_graph_memory_stays_within_the_plain_paths():
    """A user output only kiln holds when the backward is captured (the wide activation: 64 MiB) gives its block
    back to the pool, where the backward's temporaries (its gradient, as wide) reuse it as the plain path's do;
    the backward reads the weight in place (no static copy). Held for good, the block added a step of its size
    to the peak (GPT-2: +400 MiB)."""
    torch.manual_seed(0)
    model = _Wide().cuda()
    x = torch.randn(1024, 256, device="cuda", requires_grad=True)
    counters.clear()
    graphed, copied = _peak_reserved(model, "reduce-overhead", x)
    assert counters["cudagraph"]["replays"] >= 6, dict(counters["cudagraph"])
    plain, _ = _peak_reserved(model, None, x)
    print(f"peak reserved: plain {plain / 2**20:.1f} MiB, graphed {graphed / 2**20:.1f} MiB; copied {copied} bytes")
    assert graphed <= plain * 1.05 + 2 ** 21, (plain, graphed)
    assert copied <= x.nbytes + 4096, copied


@gpu
def test_auto_captures_host_bound_graphs_only():
    """cuda_graphs='auto': a graph of many small kernels (host-bound: its timed call keeps the device waiting) is
    captured; one large matmul (GPU-bound) is not, and the reason is counted."""
    torch.manual_seed(0)
    small = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(20)]).cuda().eval()
    f = kiln.compile(copy.deepcopy(small), cuda_graphs="auto")
    x = torch.randn(8, 16, device="cuda")
    counters.clear()
    with torch.no_grad():
        for _ in range(4):
            torch.testing.assert_close(f(x), small(x), rtol=1e-4, atol=1e-5)
    assert counters["cudagraph"]["captured"] == 1 and counters["cudagraph"]["replays"] == 1, dict(counters["cudagraph"])
    w = torch.randn(8192, 8192, device="cuda")

    def big(y):   # a function of its own: no earlier frame makes Dynamo's sizes dynamic (dynamic graphs are refused)
        return y @ w
    g = kiln.compile(big, cuda_graphs="auto")
    y = torch.randn(8192, 8192, device="cuda")
    counters.clear()
    with torch.no_grad():
        for _ in range(4):
            g(y)
    assert counters["cudagraph"]["captured"] == 0
    assert any("GPU-bound" in k for k in counters["cudagraph_refused"]), dict(counters["cudagraph_refused"])
