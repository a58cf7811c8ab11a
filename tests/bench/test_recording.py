"""Where ``kiln bench`` and ``kiln bench-compile`` write: nothing unless asked (``--record`` into the checkout's
``benchmarks/``, ``--record-dir DIR`` elsewhere); ``bench-compile``'s help and table; the load note."""
import json
import os

import pytest

from kiln_bench import compile_times, report
from kiln_bench.cli import main as bench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
META = {"date": "2026-01-01 00:00 UTC", "device": "cpu", "device_name": "x86_64", "torch": "2.x", "triton": "3.6",
        "kiln": "0.1", "command": "kiln bench", "suite": "user", "size": "tiny", "caches": "fresh", "threads": 2,
        "elapsed_s": 1.0, "mem_kind": "saved", "backends": ["eager", "kiln"]}


def _row(backend, ms, **kw):
    return {"case": "mlp", "dtype": "fp32", "backend": backend, "budget": None, "status": "ok", "ms": ms,
            "p25": ms, "p75": ms, "mem_bytes": 0, "ok": True, "err": 0.0, "check": "ok", "compile_s": 1.0, **kw}


def test_bench_prints_only_by_default(tmp_path, monkeypatch, capsys):
    """Run from a directory holding a benchmarks/ folder (as the checkout's root does): nothing is written
    there, or anywhere, unless asked; the section is printed."""
    saved = report.write_json(str(tmp_path / "run.json"), META, [_row("eager", 2.0), _row("kiln", 1.0)])
    (tmp_path / "benchmarks").mkdir()
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    assert bench(["--from-json", saved]) == 0
    assert "| mlp | fp32 | - |" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == before and not os.listdir(tmp_path / "benchmarks")
    assert bench(["--from-json", saved, "--record-dir", str(tmp_path / "mine")]) == 0
    assert "| mlp | fp32 | - |" in (tmp_path / "mine" / "RESULTS.md").read_text()
    assert len(os.listdir(tmp_path / "mine" / "results")) == 1
    assert not os.listdir(tmp_path / "benchmarks")


def test_record_means_the_checkouts_benchmarks():
    assert report.record_dir(False, None) is None
    assert report.record_dir(True, None) == os.path.join(ROOT, "benchmarks") == report.checkout_benchmarks()
    assert report.record_dir(True, "/x") == report.record_dir(False, "/x") == "/x"
    with pytest.raises(report.RecordError, match="--no-record contradicts"):
        report.record_dir(True, None, no_record=True)


def test_record_contradicting_no_record_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench(["--from-json", str(tmp_path / "none.json"), "--record", "--no-record"])
    assert e.value.code == 2 and "--no-record contradicts" in capsys.readouterr().err


def test_load_note_marks_a_busy_run():
    """The section names the load average; when other work beside the run's threads asked for more than the
    cores, it says the timings are unreliable (the load samples are injected: no real load here)."""
    rows = [_row("eager", 2.0, load1=1.9), _row("kiln", 1.0, load1=2.1)]
    calm = dict(META, load={"load1": 0.3, "cores": 2, "own": 0}, load_end={"load1": 2.0, "cores": 2, "own": 2})
    text = report.markdown(calm, rows)
    assert "Load average 0.3 to 2.1 over the run on 2 cores." in text and "UNRELIABLE" not in text
    busy = dict(calm, load_end={"load1": 5.0, "cores": 2, "own": 2})
    text = report.markdown(busy, rows)
    assert ("Load average 0.3 to 5.0 over the run on 2 cores: UNRELIABLE timings, load average 5.0 on 2 cores: "
            "other processes ask for about 3.0 of them beside the 2 threads measured") in text
    assert "Load average" not in report.markdown(META, rows)   # older runs sampled nothing


def test_bench_compile_help_names_every_option(capsys):
    with pytest.raises(SystemExit):
        compile_times.main(["--help"])
    out = capsys.readouterr().out
    for flag in ("--cases", "--backends", "--device", "--repeat", "--json", "--md", "--record", "--record-dir"):
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(flag + " ") or ln.strip() == flag
                    or ln.strip().startswith(flag + ","))
        assert flag in line
    assert out.count("default") >= 3 and "benchmarks/RESULTS.md" in out


def test_bench_compile_prints_a_table_not_json(tmp_path, capsys):
    """One case that cannot build (a child process that fails): a header, a line per row, the table; the JSON
    goes to --json only, and nothing is recorded."""
    out_json = tmp_path / "rows.json"
    assert compile_times.main(["--cases", "no_such_case", "--backends", "kiln", "--device", "cpu",
                               "--json", str(out_json)]) == 1
    out = capsys.readouterr().out
    assert not [ln for ln in out.splitlines() if ln.lstrip().startswith("{")], out
    assert out.splitlines()[0].split()[:3] == ["case", "backend", "cold"]
    assert "no_such_case           kiln       error: exit" in out
    assert "| case | backend | cold s |" in out and "| no_such_case | kiln | error: " in out
    assert json.loads(out_json.read_text())["rows"][0]["case"] == "no_such_case"


def test_bench_compile_live_line():
    row = {"case": "gpt", "backend": "kiln", "cold_s": 4.123, "warm_s": 0.5, "recompile_s": 0.25, "step_s": 0.0123,
           "warm_process_s": 3.21}
    assert compile_times.live_line(row).split() == ["gpt", "kiln", "4.12", "0.50", "0.25", "0.012", "3.2"]
