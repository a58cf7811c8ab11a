"""``kiln bench --suite dynamic`` at size tiny on the CPU (2 sizes per case, 1 step): rows carry compile counts
and times, kiln compiles at most 2 graphs per case (static, then dynamic), its values match eager's, and a
fresh-mode row comes back from its own process into the shared/fresh table."""
import time

import pytest
import torch._dynamo.config

import kiln
from kiln_bench import report
from kiln_bench.cli import main
from kiln_bench.suites import dynamic


@pytest.fixture(autouse=True)
def _pgo_restored():
    """The suite turns Dynamo's profile-guided automatic-dynamic state off for the rest of its process
    (``dynamic.no_pgo``); the tests after these get the values back (through Dynamo's own ``config.patch``:
    pytest's monkeypatch deletes a config entry on undo)."""
    config = torch._dynamo.config
    with config.patch({name: getattr(config, name) for name in dynamic.PGO if hasattr(config, name)}):
        yield


def test_tiny_shared_run_counts_compiles_and_times(tmp_path):
    out, md = tmp_path / "dyn.json", tmp_path / "dyn.md"
    t0 = time.process_time()   # this process's CPU time: the run's own work, whatever else the machine runs
    # codegen="aten": the compiles counted are Dynamo's graphs, the same with kiln's C++ kernels, whose builds
    # would take minutes here (the CPU run of the suite uses them)
    with kiln.config.patch(codegen="aten"):
        rc = main(["--suite", "dynamic", "--device", "cpu", "--size", "tiny", "--iters", "1", "--backends",
                   "eager,kiln", "--dynamic-mode", "shared", "--json", str(out), "--md", str(md), "--no-guard"])
    took = time.process_time() - t0
    meta, rows = report.read_json(out)
    assert rc == 0, [r.get("error") or r.get("check") for r in rows]
    assert meta["suite"] == "dynamic" and meta["modes"] == ["shared"] and "partial" not in meta
    assert sorted((r["case"], r["backend"]) for r in rows) == sorted((c, b) for c in dynamic.CASES
                                                                     for b in ("eager", "kiln"))
    for r in rows:
        assert r["status"] == "ok" and r["mode"] == "shared", r
        assert len(r["sizes"]) == len(r["ms_per_size"]) == len(r["first_s"]) == 2, r
        assert all(x > 0 for x in r["ms_per_size"] + r["first_s"]), r
        assert r["mean_ms"] == sum(r["ms_per_size"]) / 2 and r["worst_ms"] == max(r["ms_per_size"])
        assert r["worst_size"] == r["sizes"][r["ms_per_size"].index(r["worst_ms"])]
        assert abs(r["compile_s"] - (sum(r["first_s"]) - sum(r["ms_per_size"]) / 1e3)) < 1e-9
        assert r["peak_bytes"] is None   # no CUDA peak on the CPU
        if r["backend"] == "eager":
            assert r["compiles"] == 0 and "check" not in r
        else:
            assert 1 <= r["compiles"] <= 2 and r["late_compiles"] == 0, r   # no recompile once both sizes ran
            assert r["ok"] is True and r["err"] < 1e-3, r["check"]
            assert r["compile_s"] > 0
    text = md.read_text()
    assert "automatic_dynamic_local_pgo=False" in text and "| decode_kvcache | kiln | " in text
    # about 45 s alone on the 2-core machine, 77 s beside other work (shared caches); its wall time was 150 s
    # there (half a core), past the bound this had on the wall clock
    assert took < 120, took


def test_fresh_row_comes_from_its_own_process_and_feeds_the_ratio():
    shared = dynamic.measure("decode_kvcache", "eager", "cpu", "tiny", 1, "shared")
    fresh = dynamic._fresh("decode_kvcache", "eager", "cpu", "tiny", 1)
    assert fresh["status"] == "ok" and fresh["mode"] == "fresh", fresh.get("error")
    assert fresh["sizes"] == shared["sizes"] == ["16", "17"] and fresh["compiles"] == 0
    meta = {"date": "d", "device_name": "cpu", "torch": "t", "triton": "-", "kiln": "k", "command": "c", "size": "tiny",
            "caches": "keep", "threads": 1, "modes": ["shared", "fresh"], "pgo_off": dynamic.no_pgo(), "steps": 1,
            "cases": ["decode_kvcache"], "backends": ["eager"]}
    line = [ln for ln in dynamic.markdown(meta, [shared, fresh]).splitlines() if ln.startswith("| decode_kvcache")]
    assert len(line) == 1 and line[0].endswith(f"| {dynamic._n(shared['mean_ms'] / fresh['mean_ms'])} |"), line
    assert f"| {dynamic._n(shared['mean_ms'])} / {dynamic._n(fresh['mean_ms'])} |" in line[0]
