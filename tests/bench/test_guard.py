"""The cliff guard: kiln above 1.5x inductor's or above eager's step time, a failed check or a kiln error
fails the line, is printed as FAIL, and makes ``kiln bench`` exit 1 (unless ``--no-guard``)."""
import time

import torch

from kiln_bench import backends as B
from kiln_bench import report, runner
from kiln_bench.case import Case, FnWorkload
from kiln_bench.cli import main
from kiln_bench.suites import micro

CFG = runner.RunConfig(device="cpu", size="tiny", warmup=0, min_iters=3, max_iters=3, min_time=0.0,
                       warm_compile=False, kernels=False)
META = {"date": "2026-01-01 00:00 UTC", "device": "cuda", "device_name": "GPU", "torch": "2.x", "triton": "3.6",
        "kiln": "0.1", "command": "kiln bench --suite zoo", "suite": "zoo", "size": "gpu", "caches": "fresh",
        "threads": 1, "elapsed_s": 1.0, "mem_kind": "peak", "backends": ["eager", "inductor", "kiln"]}


def _row(case, backend, ms, budget=None, **kw):
    return {"case": case, "dtype": "amp_bf16", "backend": backend, "budget": budget, "status": "ok", "ms": ms,
            "p25": ms, "p75": ms, "host_ms": ms / 2, "kernels": 10, "ok": True, "err": 0.0,
            "check": "ok" if backend != "eager" else "ref", "train": True, **kw}


def _line(eager, inductor, kiln, budget=None, case="m"):
    return [_row(case, "eager", eager), _row(case, "inductor", inductor, budget), _row(case, "kiln", kiln, budget)]


def test_cliff_limits():
    def verdict(rows):
        (key, cells), = report.pivot(rows)
        return report.cliff(cells, key[2])
    assert verdict(_line(50, 35, 213)) == "kiln 6.09x inductor (limit 1.5x); kiln 4.26x eager (limit 1x)"
    assert verdict(_line(100, 35, 60)) == "kiln 1.71x inductor (limit 1.5x)"
    assert verdict(_line(40, 35, 45)) == "kiln 1.12x eager (limit 1x)"
    assert verdict(_line(50, 35, 50)) == ""                     # equal to eager, 1.43x inductor: passes
    assert verdict(_line(50, 35, 500, budget=0.5)) is None      # a budget sweep trades time for memory
    assert verdict(_line(50, 35, 40, budget=1.0)) == ""
    assert verdict([_row("m", "inductor", 10)]) is None          # no kiln row: nothing compared
    cg = _line(50, 35, 30) + [_row("m", "inductor-cg", 10), _row("m", "kiln-cg", 20)]
    assert verdict(cg) == "kiln-cg 2.00x inductor-cg (limit 1.5x)"  # kiln-cg is held against inductor-cg


def test_failures_and_markdown():
    rows = _line(50, 35, 213, case="swin") + _line(50, 35, 30, case="ok") + _line(10, 10, 9, case="bad")
    rows[-1].update(ok=False, check="tensor 0: rel err 1e-1 > 0.05")
    rows += [dict(_row("err", "eager", 5)), {"case": "err", "dtype": "amp_bf16", "backend": "kiln", "budget": None,
                                             "status": "error", "stage": "steps", "error": "RuntimeError: boom"}]
    bad = report.failures(rows)
    assert bad == ["cliff: swin amp_bf16: kiln 6.09x inductor (limit 1.5x); kiln 4.26x eager (limit 1x)",
                   "check failed: bad amp_bf16 kiln: tensor 0: rel err 1e-1 > 0.05",
                   "error: err amp_bf16 kiln in steps: RuntimeError: boom"]
    text = report.markdown(META, rows)
    table = [[c.strip() for c in ln.strip("|").split("|")] for ln in text.splitlines() if ln.startswith("| ")]
    head, lines = table[0], {t[0]: dict(zip(table[0], t)) for t in table[1:]}
    assert lines["swin"]["guard"].startswith("**FAIL** kiln 6.09x inductor") and lines["ok"]["guard"] == "ok"
    assert lines["bad"]["guard"] == "**FAIL** kiln check" and lines["err"]["guard"] == "**FAIL** kiln error"
    assert lines["swin"]["host ms eager/inductor/kiln"] == "25/17.5/106"
    assert lines["swin"]["kernels eager/inductor/kiln"] == "10/10/10"
    assert "- guard: **3 FAILED**" in text


def test_slow_kiln_row_is_a_cliff():
    """Timing injection: a 'kiln' that sleeps 20 ms per call is flagged against eager, however fast kiln is."""
    case = Case("swish", "micro", lambda d, dt, s: FnWorkload(micro.swish, [torch.randn(64, requires_grad=True)], dt))

    def slow(backend, model, options=None, budget=None):
        if backend != "kiln":
            return B.compile_model(backend, model, options, budget)

        def f(*args):
            time.sleep(0.02)
            return model(*args)
        return f
    rows = list(runner.run_case(case, "fp32", ["eager", "kiln"], None, CFG, compile_model=slow))
    assert rows[1]["ms"] >= 20 and rows[1]["host_ms"] >= 20
    (line,) = report.failures(rows)
    assert line.startswith("cliff: swish fp32: kiln ") and line.endswith("x eager (limit 1x)")


def test_cli_exit_status(tmp_path):
    def rc(rows, *flags):
        path = report.write_json(str(tmp_path / "run.json"), META, rows)
        return main(["--from-json", path, "--no-record", *flags])
    assert rc(_line(50, 35, 30)) == 0
    assert rc(_line(50, 35, 60)) == 1                             # above eager
    assert rc(_line(50, 35, 60), "--no-guard") == 0
    assert rc(_line(50, 35, 60), "--guard", "2,1.5") == 0
    bad = _line(50, 35, 30)
    bad[1].update(ok=False, check="tensor 1: rel err")            # inductor's check failed
    assert rc(bad) == 1


def test_cli_run_fails_a_cliff(tmp_path):
    """End to end: a limit kiln cannot meet (at most 0.001x eager's step time) fails the run and prints FAIL."""
    md = tmp_path / "out.md"
    args = ["--device", "cpu", "--size", "tiny", "--cases", "swish", "--dtype", "fp32", "--backends", "eager,kiln",
            "--no-record", "--md", str(md), "--iters", "2", "--warmup", "0", "--no-warm", "--no-stream",
            "--no-kernels"]
    assert main(args + ["--guard", "1.5,0.001"]) == 1
    assert "**FAIL** kiln" in md.read_text() and "- guard: **1 FAILED**" in md.read_text()
