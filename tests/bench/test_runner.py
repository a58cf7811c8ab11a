"""The runner: one row per backend and budget; failures become rows and never stop the run."""
import os

import pytest
import torch

from kiln_bench import backends as B
from kiln_bench import runner
from kiln_bench.case import Case, FnWorkload
from kiln_bench.suites import micro

CFG = runner.RunConfig(device="cpu", size="tiny", warmup=0, min_iters=2, max_iters=2, min_time=0.0,
                       warm_compile=False)


def _case(**kw):
    return Case("swish", "micro", lambda d, dt, s: FnWorkload(micro.swish, [torch.randn(64, requires_grad=True)], dt),
                **kw)


def test_variants_sweep_only_compiled_training():
    train, infer = _case(), _case(train=False)
    assert runner.variants(train, ["eager", "inductor", "kiln"], [1.0, 0.5]) == [
        ("eager", None), ("inductor", 1.0), ("inductor", 0.5), ("kiln", 1.0), ("kiln", 0.5)]
    assert runner.variants(infer, ["eager", "kiln"], [1.0, 0.5]) == [("eager", None), ("kiln", None)]


def test_backend_failure_is_a_row():
    def broken(backend, model, options=None, budget=None):
        if backend == "kiln":
            raise RuntimeError("lowering failed\nmore")
        return B.compile_model(backend, model, options, budget)

    rows = list(runner.run_case(_case(), "fp32", ["kiln", "eager"], None, CFG, compile_model=broken))
    assert [r["backend"] for r in rows] == ["kiln", "eager"]
    assert rows[0]["status"] == "error" and rows[0]["stage"] == "compile"
    assert rows[0]["error"] == "RuntimeError: lowering failed ... more"
    assert rows[1]["status"] == "ok" and rows[1]["iters"] == 2


def test_build_failure_gives_error_rows():
    def build(device, dtype, size):
        raise MemoryError("too big")
    rows = list(runner.run_case(Case("big", "micro", build), "fp32", ["eager", "kiln"], [0.5], CFG))
    assert [(r["backend"], r["budget"], r["stage"]) for r in rows] == [("eager", None, "build"), ("kiln", 0.5, "build")]


def test_wrong_result_fails_check():
    def wrong(backend, model, options=None, budget=None):
        if backend == "kiln":
            return lambda x: model(x) * 1.01
        return B.compile_model(backend, model, options, budget)

    rows = {r["backend"]: r for r in runner.run_case(_case(), "fp32", ["eager", "kiln"], None, CFG,
                                                     compile_model=wrong)}
    assert rows["eager"]["check"] == "ref"
    assert rows["kiln"]["status"] == "ok" and rows["kiln"]["ok"] is False


def test_reference64_runs_in_float64():
    wl = micro.CASES[7].build("cpu", "bf16", "tiny")        # t5_rmsnorm, a module with a weight
    ref, truth = wl.check(wl.model), wl.reference64()
    assert [t.dtype for t in truth] == [torch.float64] * len(ref)
    assert all(t.shape == r.shape for t, r in zip(truth, ref))
    assert wl.model.weight.dtype == torch.bfloat16          # the pristine workload is untouched
    torch.testing.assert_close(truth[0].to(torch.bfloat16), ref[0], atol=0.05, rtol=0.05)


def test_micro_cases_build_tiny_and_match_eager_copy():
    for case in micro.CASES:
        for dtype in ("fp32", "bf16"):
            wl = case.build("cpu", dtype, "tiny")
            a, b = wl.fresh(), wl.fresh()
            ra, rb = a.check(a.model), b.check(b.model)
            assert len(ra) >= 2, case.name  # output and at least one grad
            assert B.check_names(["eager"]) == ["eager"]
            assert all(torch.equal(x, y) for x, y in zip(ra, rb)), case.name
            assert wl.min_bytes > 0



def _broken_graph(x):
    y = torch.sin(x) * 2
    torch._dynamo.graph_break()
    return torch.cos(y) + 1


def test_a_case_leaves_no_compiled_function_alive():
    """Dynamo installs compiled graphs as ``__compiled_fn_*`` in the traced module's globals, and after a
    graph break ``torch._dynamo.reset()`` leaves some there, holding the graph and its tensors: a later case's
    memory counted an earlier case's leftovers. The runner releases them after each row."""
    import gc
    import weakref

    case = Case("broken", "micro", lambda d, dt, s: FnWorkload(_broken_graph, [torch.randn(64, requires_grad=True)],
                                                                dt))
    seen = []

    def compile_model(backend, model, options=None, budget=None):
        f = B.compile_model(backend, model, options, budget)

        def run(*args):
            out = f(*args)
            seen.extend(weakref.ref(v) for k, v in globals().items() if k.startswith("__compiled_fn") and v)
            return out
        return run
    rows = list(runner.run_case(case, "fp32", ["kiln"], None, CFG, compile_model=compile_model))
    assert rows[0]["status"] == "ok" and seen
    gc.collect()
    assert all(r() is None for r in seen)


def test_dropout_case_checks_without_and_times_with_random_ops():
    """A zoo-like model with dropout, drop path, stochastic depth and HF-style attention dropout: the check
    pass compiles with every probability at 0 and matches eager; the steps compile again with them on; every
    backend's row has host time and kernels per step. (aot_eager stands in for inductor, whose C++ compile
    takes minutes on this test machine; the slow test below runs inductor.)"""
    from kiln_bench.dropout import random_sites
    from tests.bench import dropnet

    calls = []

    def compile_model(backend, model, options=None, budget=None):
        f = B.compile_model(backend, model, options, budget)

        def run(*args):
            calls.append((backend, len(random_sites(model))))
            return f(*args)
        return run
    rows = {r["backend"]: r for r in runner.run_case(dropnet.case(), "auto", ["eager", "aot_eager", "kiln"], None,
                                                     CFG, compile_model=compile_model)}
    for b, r in rows.items():
        assert r["status"] == "ok", (b, r.get("error"))
        assert r["random_sites"] == 5 and r["ok"] and r["iters"] == 2
        assert r["host_ms"] == r["ms"] > 0                     # the CPU: host time is step time
        assert r["kernels"] > 0 and r["kernels_kind"].startswith("top-level ATen ops")
    assert rows["eager"]["check"] == "ref" and "steps_compile_s" not in rows["eager"]
    for b in ("aot_eager", "kiln"):
        assert rows[b]["steps_compile_s"] > 0 and rows[b]["check"] == "ok"
        mine = [n for backend, n in calls if backend == b]
        assert mine[0] == 0 and mine[1:] and all(n == 5 for n in mine[1:])   # check off, then steps on
    assert rows["kiln"]["kernels"] < rows["eager"]["kernels"]  # kiln fuses what eager runs op by op


class _Hidden(torch.nn.Module):
    """Random noise under a name the bench cannot know."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.noise = 0.5

    def forward(self, x):
        return self.lin(x) * (torch.rand_like(x) > self.noise)


def test_random_op_left_in_the_check_fails_every_row():
    from kiln_bench.case import ModelWorkload
    build = lambda d, dt, s: ModelWorkload(_Hidden(), (torch.randn(4, 8),), "fp32", loss=lambda out, b: out.sum())
    rows = list(runner.run_case(Case("hidden", "zoo", build, ("auto",)), "auto", ["eager", "kiln"], None, CFG))
    assert [(r["backend"], r["status"], r["stage"]) for r in rows] == [("eager", "error", "reference"),
                                                                      ("kiln", "error", "reference")]
    assert "RandomCheckError" in rows[1]["error"] and "differs from itself" in rows[1]["error"]


class _Atomics(torch.nn.Module):
    """Run-to-run noise only while nondeterministic kernels are allowed, as GPU atomics give a bf16 backward."""

    def __init__(self):
        super().__init__()
        self.lin, self.calls = torch.nn.Linear(8, 8), 0   # the check seeds the RNG: count calls instead

    def forward(self, x):
        out = self.lin(x)
        self.calls += 1
        if not torch.are_deterministic_algorithms_enabled():
            out = out + self.calls   # differs from run to run, unlike a deterministic kernel
        return out


def test_nondeterministic_kernels_are_not_random_ops():
    from kiln_bench.runner import _reference
    from kiln_bench.case import ModelWorkload
    w = ModelWorkload(_Atomics(), (torch.randn(4, 8),), "fp32", loss=lambda out, b: out.sum())
    assert _reference(w)   # equal with deterministic kernels: no random op left, the check stands
    assert not torch.are_deterministic_algorithms_enabled()   # restored


class _GradNoise(torch.autograd.Function):
    """Identity whose backward adds ``noise`` (times the gradient's largest magnitude) to the gradient."""

    @staticmethod
    def forward(ctx, w, noise):
        ctx.save_for_backward(noise)
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        (noise,) = ctx.saved_tensors
        return g + noise * g.abs().max(), None


class _Rounding(torch.nn.Module):
    """Run-to-run noise in one weight-gradient element of 4096 (summation order that deterministic kernels
    do not fix: flash attention's backward), or in every element (``big``: a random op left on)."""

    def __init__(self, tol, big=False, scale=5):
        super().__init__()
        self.lin, self.tol, self.big, self.calls, self.scale = torch.nn.Linear(64, 64), tol, big, 0, scale

    def forward(self, x):
        self.calls += 1   # the check seeds the RNG: the noise follows the call count
        w = self.lin.weight
        if w.dtype == torch.float64:   # the float64 referee computes without the noise
            noise = torch.zeros_like(w)
        elif self.big:
            noise = torch.randn(w.shape, generator=torch.Generator().manual_seed(self.calls)).to(w.dtype)
        else:
            noise = torch.zeros_like(w)
            noise.view(-1)[0] = self.scale * self.tol * (self.calls % 2 + 1)   # beyond tol (5: not beyond the RMSE)
        return torch.nn.functional.linear(x, _GradNoise.apply(w, noise), self.lin.bias)


def test_rounding_noise_passes_and_random_noise_fails():
    from kiln_bench.case import ModelWorkload
    from kiln_bench.runner import RandomCheckError, _reference
    x = torch.randn(16, 64)
    tol = ModelWorkload(torch.nn.Linear(1, 1), (x,), "fp32").tol
    loss = lambda out, b: (out * out).sum()   # noqa: E731
    assert _reference(ModelWorkload(_Rounding(tol), (x,), "fp32", loss=loss))
    # one element of 4096 far off, its RMSE beyond the float64 referee's reach: scattered, still no random op
    assert _reference(ModelWorkload(_Rounding(tol, scale=200), (x,), "fp32", loss=loss))
    with pytest.raises(RandomCheckError, match="also with deterministic kernels"):
        _reference(ModelWorkload(_Rounding(tol, big=True), (x,), "fp32", loss=loss))


@pytest.mark.slow
def test_dropout_case_through_inductor():
    """The same case through the three backends of the table (inductor's CPU compile takes minutes here)."""
    from tests.bench import dropnet
    rows = {r["backend"]: r for r in runner.run_case(dropnet.case(), "auto", ["eager", "inductor", "kiln"], None,
                                                     CFG)}
    for b, r in rows.items():
        assert r["status"] == "ok" and r["ok"] and r["host_ms"] > 0 and r["kernels"] > 0, (b, r.get("error"))
    assert rows["inductor"]["steps_compile_s"] > 0


@pytest.mark.gpu
def test_dropout_case_on_the_gpu():
    """On CUDA: GPU time from events, host time without a sync inside the step, CUDA kernels counted by the
    profiler, for the three backends; the check passes with dropout off and the steps run with it on."""
    from tests.bench import dropnet
    cfg = runner.RunConfig(device="cuda", size="tiny", warmup=2, min_iters=5, max_iters=5, min_time=0.0,
                           warm_compile=False)
    case = dropnet.case()
    case.devices = ("cuda",)
    rows = {r["backend"]: r for r in runner.run_case(case, "auto", ["eager", "inductor", "kiln"], None, cfg)}
    assert all("_later" in r and "kernels" not in r for r in rows.values())   # counted after every timed step
    runner.count_kernels(case, "auto", list(rows.values()), cfg)
    for b, r in rows.items():
        assert r["status"] == "ok" and r["ok"] and "_later" not in r, (b, r.get("error"), r.get("check"))
        assert r["ms"] > 0 and 0 < r["host_ms"] and len(r["host_times_ms"]) == 5
        assert r["kernels_kind"] == "CUDA kernels (profiler)" and r["kernels"] >= 1, (b, r.get("kernels_error"))
        assert r["random_sites"] == 5
    assert rows["kiln"]["kernels"] < rows["eager"]["kernels"]


def test_kernels_counted_later_in_the_rows_cache_directories(tmp_path, monkeypatch):
    """``count_kernels`` (the GPU's deferred profiled pass, run here on the CPU) compiles each marked row again
    in the directories its timed pass used and counts what ``run_case`` counts in place."""
    monkeypatch.setenv(B.FRESH_ROOT, str(tmp_path))
    inline = {r["backend"]: r for r in runner.run_case(_case(), "fp32", ["eager", "kiln"], None, CFG)}
    seen = []

    def compile_model(backend, model, options=None, budget=None):
        seen.append((backend, os.environ.get("KILN_KERNEL_DIR")))
        return B.compile_model(backend, model, options, budget)
    dirs = {"TRITON_CACHE_DIR": str(tmp_path / "t"), "KILN_KERNEL_DIR": str(tmp_path / "k")}
    later = [{"backend": b, "budget": None, "status": "ok", "_later": {"dirs": dirs if b == "kiln" else None}}
             for b in ("eager", "kiln")]
    runner.count_kernels(_case(), "fp32", later, CFG, compile_model=compile_model)
    for r in later:
        assert "_later" not in r and r["kernels"] == inline[r["backend"]]["kernels"] > 0, r
    assert ("kiln", dirs["KILN_KERNEL_DIR"]) in seen


def _with_a_break(x):
    y = x.sin()
    torch._dynamo.graph_break()
    return y.cos()


def _compiled_names() -> dict:
    return {k: v for k, v in globals().items() if k.startswith(("__compiled_fn", "__resume_at"))}


def test_compiled_globals_are_dropped_and_a_scan_without_a_compile_is_skipped():
    """Dynamo installs the compiled graphs and a graph break's resume function in this module's globals;
    ``_drop_compiled_globals`` sets them to None, a call with nothing compiled since finds nothing to scan, and
    the next compile's names are found again."""
    runner._drop_compiled_globals()
    torch.compile(_with_a_break, backend="eager")(torch.randn(4))
    made = {k for k, v in _compiled_names().items() if v is not None}
    assert any(k.startswith("__compiled_fn") for k in made) and any(k.startswith("__resume_at") for k in made), made
    assert runner._drop_compiled_globals() >= len(made)
    assert all(_compiled_names()[k] is None for k in made if k in _compiled_names())
    assert runner._drop_compiled_globals() == 0
    if runner._dynamo_names_made() is not None:
        globals()["__compiled_fn_planted"] = object()   # not made by Dynamo: a skipped call leaves it
        assert runner._drop_compiled_globals() == 0 and globals().pop("__compiled_fn_planted") is not None
    torch._dynamo.reset()
    torch.compile(_with_a_break, backend="eager")(torch.randn(4))
    again = {k for k, v in _compiled_names().items() if v is not None}
    assert again and runner._drop_compiled_globals() >= len(again)
    assert not any(v is not None for v in _compiled_names().values())


def test_interleaved_rounds_time_every_backend_in_alternating_order(tmp_path, monkeypatch):
    """``interleave`` compiles each row again in its cache directories, keeps them all, and times them in
    rounds whose order alternates (A B, B A, A B); the rows get medians over the rounds, the markdown an
    interleaved geomean. A failure leaves the row's own timings."""
    import dataclasses
    from kiln_bench import report
    monkeypatch.setenv(B.FRESH_ROOT, str(tmp_path))
    cfg = dataclasses.replace(CFG, rounds=3)
    rows = list(runner.run_case(_case(), "fp32", ["eager", "aot_eager", "kiln"], None, cfg))
    assert all("_dirs" in r for r in rows), [(r["backend"], r["status"], r.get("error")) for r in rows]
    order = []

    def compile_model(backend, model, options=None, budget=None):
        f = B.compile_model(backend, model, options, budget)

        def step(*a, **k):
            order.append(backend)
            return f(*a, **k)
        return step
    runner.interleave(_case(), "fp32", rows, cfg, compile_model=compile_model)
    for r in rows:
        assert "_dirs" not in r and r["rounds"] == 3 and r["ms_rounds"] > 0 and "rounds_error" not in r, r
    runs = [b for i, b in enumerate(order) if i == 0 or order[i - 1] != b]   # blocks of steps (repeats merged)
    # warm-up E I K, then rounds E I K | K I E | E I K: the repeats at the rounds' joins merge
    assert runs == ["eager", "aot_eager", "kiln", "eager", "aot_eager", "kiln", "aot_eager", "eager", "aot_eager", "kiln"]
    assert any("interleaved (3 rounds" in line for line in report.summary(rows, ["eager", "aot_eager", "kiln"],
                                                                             [("kiln", "aot_eager")]))

    def broken(backend, model, options=None, budget=None):
        raise RuntimeError("no")
    rows = list(runner.run_case(_case(), "fp32", ["eager", "kiln"], None, cfg))
    runner.interleave(_case(), "fp32", rows, cfg, compile_model=broken)
    assert all("rounds_error" in r and "ms_rounds" not in r and r["ms"] > 0 for r in rows)
