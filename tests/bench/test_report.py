"""Markdown pivot, ratios, RESULTS.md recording and budget plots from synthetic rows."""
import os

from kiln_bench import plot, report

META = {"date": "2026-01-01 00:00 UTC", "device": "cpu", "device_name": "x86_64", "torch": "2.x", "triton": "3.6",
        "kiln": "0.1", "command": "kiln bench", "suite": "micro", "size": "tiny", "caches": "fresh", "threads": 1,
        "elapsed_s": 1.0, "mem_kind": "saved", "backends": ["eager", "inductor", "kiln"], "skipped": [("bert", "gpu only")]}


def _row(case, backend, ms, budget=None, mem=100 * 2**20, status="ok", **kw):
    return {"case": case, "dtype": "fp32", "backend": backend, "budget": budget, "status": status, "ms": ms,
            "p25": ms * 0.9, "p75": ms * 1.1, "mem_bytes": mem, "ok": True, "err": 0.0, "check": "ok",
            "compile_s": 1.0, "warm_compile_s": 0.1, **kw}


ROWS = [_row("gpt", "eager", 10.0), _row("gpt", "inductor", 4.0, 1.0), _row("gpt", "kiln", 5.0, 1.0),
        _row("gpt", "inductor", 6.0, 0.5, mem=50 * 2**20), _row("gpt", "kiln", 3.0, 0.5, mem=40 * 2**20),
        _row("swish", "eager", 2.0), _row("swish", "inductor", 1.0),
        {"case": "swish", "dtype": "fp32", "backend": "kiln", "budget": None, "status": "error",
         "stage": "compile", "error": "KeyError: x"}]


def test_markdown_ratios_and_errors():
    text = report.markdown(META, ROWS)
    lines = [ln for ln in text.splitlines() if ln.startswith("| gpt")]
    assert len(lines) == 2
    cells = [c.strip() for c in lines[0].split("|")]
    assert cells[3] == "1" and cells[4:7] == ["10 ±10%", "4 ±10%", "5 ±10%"]
    assert cells[7:9] == ["0.50", "1.25"]           # kiln/eager, kiln/inductor at budget 1
    assert "| 0.5 |" in lines[1] and "0.30 | 0.50" in lines[1]
    assert "error: swish fp32 kiln in compile: KeyError: x" in text
    assert "skipped: bert: gpu only" in text
    assert "geomean kiln/eager: **0.39** over 2 rows" in text


def test_record_appends(tmp_path):
    md1, js1 = report.record(META, ROWS, str(tmp_path))
    md2, _ = report.record(META, ROWS, str(tmp_path))
    text = open(md1).read()
    assert md1 == md2 and text.count("## 2026-01-01") == 2 and text.startswith("# kiln bench results")
    meta, rows = report.read_json(js1)
    assert rows[0]["case"] == "gpt" and meta["device"] == "cpu"


def test_record_appends_below_a_summary(tmp_path):
    """A RESULTS.md that opens with a hand-kept summary keeps it first: record only appends, and writes
    the file's header only when it creates the file."""
    head = ("# kiln bench results\n\nAppended by `kiln bench` (newest last).\n\n## Summary (current)\n\n"
            "| what | section |\n|---|---|\n| CPU | old run |\n\n## old run\n\ntext\n")
    (tmp_path / "RESULTS.md").write_text(head)
    md, _ = report.record(META, ROWS, str(tmp_path))
    text = open(md).read()
    assert text.startswith(head) and text.count("# kiln bench results") == 1
    assert text.index("## Summary (current)") < text.index("## old run") < text.index("## 2026-01-01")


def test_budget_plot(tmp_path):
    paths = plot.plot_budgets(ROWS, str(tmp_path), "cpu", "saved")
    assert [os.path.basename(p) for p in paths] == ["budget_gpt_cpu.png"]
    with open(paths[0], "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_from_json_records_and_plots(tmp_path):
    from kiln_bench.cli import main
    saved = report.write_json(str(tmp_path / "run.json"), META, ROWS)
    rec = tmp_path / "rec"
    # ROWS hold a kiln row that errored: the guard fails the run, --no-guard only reports it
    assert main(["--from-json", saved, "--no-record", "--md", str(tmp_path / "g.md")]) == 1
    assert "| swish | fp32 | - |" in (tmp_path / "g.md").read_text() and "**FAIL** kiln error" in \
        (tmp_path / "g.md").read_text()
    assert main(["--from-json", saved, "--no-guard", "--record-dir", str(rec), "--md", str(tmp_path / "x.md")]) == 0
    text = (rec / "RESULTS.md").read_text()
    assert "(recorded from " in text and "| gpt | fp32 | 0.5 |" in text
    assert (rec / "budget_gpt_cpu.png").exists()
    assert len(os.listdir(rec / "results")) == 1
    assert (tmp_path / "x.md").read_text().startswith("## 2026-01-01")
