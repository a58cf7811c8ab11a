"""Measurement helpers: saved-tensor bytes, the eager comparison, quantiles and step counting."""
import torch

from kiln_bench import measure as M


def test_saved_bytes_dedups_storage_and_skips_inputs():
    x = torch.randn(256, requires_grad=True)

    def forward():
        y = torch.sigmoid(x)          # saves y (1 KiB)
        z = y.view(16, 16)            # a view of y: same storage
        return (z * z).sum() + (x * x).sum()   # saves z twice (same storage) and x (an input)

    res = M.saved_bytes(forward, lambda out: out.backward(), [x])
    assert res["saved_bytes"] == 256 * 4
    assert res["saved_tensors"] == 1


def test_saved_bytes_counts_distinct_storages():
    x = torch.randn(128, requires_grad=True)

    def forward():
        a, b = torch.exp(x), torch.tanh(x)  # two new storages
        return (a * b).sum()

    res = M.saved_bytes(forward, lambda out: out.backward(), [x])
    assert res["saved_bytes"] == 2 * 128 * 4


def test_compare_flags_mismatch_and_nan():
    ref = [torch.ones(4), torch.arange(4.0)]
    assert M.compare(ref, [t.clone() for t in ref], 1e-3)["ok"]
    bad = M.compare(ref, [torch.ones(4), torch.arange(4.0) + 0.1], 1e-3)
    assert not bad["ok"] and abs(bad["err"] - 0.1 / 3) < 1e-6 and "tensor 1" in bad["check"]
    assert "(4/4 elements)" in bad["check"]
    one = M.compare([torch.zeros(100)], [torch.zeros(100).index_fill(0, torch.tensor([7]), 1.0)], 1e-3)
    assert not one["ok"] and "(1/100 elements)" in one["check"]
    nan = M.compare(ref, [torch.full((4,), float("nan")), ref[1]], 1.0)
    assert not nan["ok"]
    assert not M.compare(ref, ref[:1], 1.0)["ok"]
    assert not M.compare(ref, [torch.ones(5), ref[1]], 1.0)["ok"]


def test_summarize_quantiles():
    s = M.summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s["ms"], s["p25"], s["p75"], s["min"], s["max"], s["iters"]) == (3.0, 2.0, 4.0, 1.0, 5.0, 5)


def test_step_times_excludes_warmup_and_respects_bounds():
    calls = []
    times = M.step_times(lambda: calls.append(1), "cpu", warmup=2, min_iters=4, max_iters=4, min_time=10.0)
    assert len(times) == 4 and len(calls) == 6
    times = M.step_times(lambda: None, "cpu", warmup=0, min_iters=3, max_iters=50, min_time=0.0)
    assert len(times) == 3


def test_steady_times_stops_at_a_small_spread_or_the_cap():
    """Batches of steps until half the IQR is under the target; a noisy step runs until the time cap."""
    import time
    steady = M.steady_times(lambda: time.sleep(0.01), "cpu", batch=5, target=0.2, max_seconds=5.0)
    assert len(steady) == 5 and M.spread(M.summarize(steady)) < 0.2
    delays = iter([0.001, 0.02] * 1000)
    t0 = time.perf_counter()
    noisy = M.steady_times(lambda: time.sleep(next(delays)), "cpu", batch=4, target=0.05, max_seconds=0.3,
                           warmup=0)
    assert 0.3 <= time.perf_counter() - t0 < 1.0
    assert len(noisy) % 4 == 0 and len(noisy) > 4 and M.spread(M.summarize(noisy)) > 0.05
    assert M.spread({"ms": 10.0, "p25": 9.0, "p75": 11.0}) == 0.1


def test_compare_float64_referee():
    truth = [torch.tensor([1.0, 2.5, 3.0], dtype=torch.float64)]
    eager_off = [torch.tensor([1.0, 2.0, 3.0])]          # eager rounds badly at one element
    close = [torch.tensor([1.0, 2.5, 3.0])]
    res = M.compare(eager_off, close, 1e-3, lambda: truth)
    assert res["ok"] and res["check"].startswith("ok vs fp64")
    worse = M.compare(close, eager_off, 1e-3, lambda: truth)  # now the backend is the one that is off
    assert not worse["ok"] and "vs fp64 tensor 0" in worse["check"]
    assert not M.compare(close, eager_off, 1e-3)["ok"]       # without a referee it simply fails


def test_compare_float64_compile_referee():
    """A float32 gap that float64 cannot excuse (the backend flipped a ReLU mask that eager did not) passes
    only when the backend's own float64 compile computes eager's float64 function."""
    truth = [torch.tensor([1.0, 2.5, 3.0], dtype=torch.float64)]
    eager = [torch.tensor([1.0, 2.5, 3.0])]
    flipped = [torch.tensor([1.0, 2.0, 3.0])]
    assert not M.compare(eager, flipped, 1e-3, lambda: truth)["ok"]
    same = M.compare(eager, flipped, 1e-3, lambda: truth, lambda: [truth[0].clone()])
    assert same["ok"] and same["check"].startswith("ok in fp64")
    wrong = M.compare(eager, flipped, 1e-3, lambda: truth, lambda: [flipped[0].double()])
    assert not wrong["ok"] and "its fp64 compile too" in wrong["check"]


def test_peak_blocks_of_a_memory_trace():
    """peak_sweep.peak_blocks replays a CUDA allocator trace: the peak above the start and the blocks
    alive there (a block allocated before the trace and freed during it lowers the running total)."""
    from kiln_bench.peak_sweep import peak_blocks
    fr = lambda n: [{"filename": "/x/torch/nn/f.py", "line": 1, "name": "t"},   # noqa: E731
                    {"filename": "/k/wrapper_ab.py", "line": n, "name": "call"}]
    ev = [{"action": "alloc", "addr": 1, "size": 100, "frames": fr(10)},
          {"action": "free_completed", "addr": 99, "size": 50},                 # allocated before
          {"action": "alloc", "addr": 2, "size": 200, "frames": fr(11)},
          {"action": "alloc", "addr": 3, "size": 30, "frames": fr(12)},        # peak: 280
          {"action": "free_completed", "addr": 2, "size": 200},
          {"action": "alloc", "addr": 4, "size": 150, "frames": fr(13)}]       # 230 < 280
    pb = peak_blocks(ev)
    assert pb["peak"] == 280 and pb["at"] == 3 and pb["n_live"] == 3
    assert [b[0] for b in pb["blocks"]] == [200, 100, 30]
    assert pb["blocks"][0][1] == "wrapper_ab.py:11 call" and pb["at_where"] == "wrapper_ab.py:12 call"


def test_kernels_per_step_counts_top_level_aten_ops_on_the_cpu():
    """On the CPU the count is the ATen ops not called from another ATen op (a composite op counts once)."""
    x = torch.randn(64)

    def step():
        torch.add(torch.sin(x), torch.cos(x))
        torch.nn.functional.softmax(x, 0)          # one top-level op, whatever it calls inside
    res = M.kernels_per_step(step, "cpu", steps=3)
    assert res == {"kernels": 4.0, "kernels_kind": "top-level ATen ops (profiler)"}


def test_step_times_report_host_time():
    host = []
    times = M.step_times(lambda: None, "cpu", warmup=1, min_iters=3, max_iters=3, min_time=0.0, host=host)
    assert host == times and len(host) == 3
