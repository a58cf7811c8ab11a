"""Smoke test: ``kiln bench`` end to end on one tiny micro case, eager and kiln, JSON to a tmp path."""
import json
import time

from kiln_bench.cli import main


def _kiln_ready():
    try:
        import kiln
        return callable(getattr(kiln, "compile", None))
    except Exception:
        return False


def test_bench_one_case_to_json(tmp_path):
    backends = "eager,kiln" if _kiln_ready() else "eager"
    out, md = tmp_path / "out.json", tmp_path / "out.md"
    t0 = time.time()
    # --no-guard: at this size kiln's launch overhead may lose to eager; the guard has tests of its own
    rc = main(["--device", "cpu", "--size", "tiny", "--cases", "swish", "--dtype", "fp32", "--no-guard",
               "--backends", backends, "--no-record", "--json", str(out), "--md", str(md), "--iters", "3"])
    assert time.time() - t0 < 30
    assert rc == 0
    data = json.loads(out.read_text())
    rows = {r["backend"]: r for r in data["rows"]}
    assert sorted(rows) == sorted(backends.split(","))
    eager = rows["eager"]
    assert eager["status"] == "ok" and eager["iters"] == 3 and eager["ms"] > 0
    assert eager["host_ms"] == eager["ms"] and eager["kernels"] > 0     # on the CPU host time is step time
    # eager swish saves x (an input, not counted) and sigmoid(x): 4096 fp32 values
    assert eager["saved_bytes"] == 4096 * 4
    # minimal traffic: fwd reads x writes y, bwd reads dy and x writes dx: 5 tensors of 16 KiB
    assert eager["min_bytes"] == 5 * 4096 * 4 and eager["gbps"] > 0
    # the machine's STREAM-style bandwidth is measured and each memory-bound row is a fraction of it
    bw = data["meta"]["bandwidth"]
    assert 0 < bw["copy"] <= bw["peak"] and 0 < bw["triad"] <= bw["peak"]
    assert abs(eager["bw_frac"] - eager["gbps"] / bw["peak"]) < 1e-9
    assert "memory bandwidth (STREAM-style" in md.read_text()
    if "kiln" in rows:
        k = rows["kiln"]
        assert k["status"] == "ok", k.get("error")
        assert k["ok"] and k["err"] < 1e-5
        assert k["compile_s"] > 0 and k["warm_compile_s"] > 0
    assert "| swish | fp32 |" in md.read_text()


def test_list_describes_cases_at_the_devices_size(capsys):
    """``kiln bench --list`` describes each case at the size it would run here (the CPU's micro cases are 2**20
    elements: the list showed the GPU's 2**26 on the CPU), and at ``--size`` when given."""
    from kiln_bench.cli import main
    assert main(["--suite", "micro", "--device", "cpu", "--list"]) == 0
    out = capsys.readouterr().out
    assert "swish forward+backward on 1048576 elements" in out and "67108864" not in out, out
    assert main(["--suite", "micro", "--device", "cpu", "--size", "gpu", "--list"]) == 0
    assert "swish forward+backward on 67108864 elements" in capsys.readouterr().out
