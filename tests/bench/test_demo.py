"""``kiln demo`` on the CPU at small settings: eager, inductor and kiln rows for both cases, a spread on every
step time, the thread count, and exit code 0 when kiln matches eager."""
import re

import torch

from kiln_bench.demo import CASES, main, physical_cores

STEP = re.compile(r"\d+(?:\.\d+)? ±\d+%")


def _rows(out):
    """``{(case, backend): [cells]}`` from rich's table (box characters between cells)."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃|]", line)[1:-1]]
        if len(cells) == 7 and cells[0] in CASES:
            rows[(cells[0], cells[1])] = cells
    return rows


def test_demo_prints_three_backends_with_spreads_and_threads(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    before = torch.get_num_threads()
    assert main(["--device", "cpu", "--steps", "3", "--max-seconds", "0.3"]) == 0
    out = capsys.readouterr().out
    n = physical_cores()
    assert f"threads {n} (physical cores)" in out and 1 <= n
    rows = _rows(out)
    assert sorted(rows) == sorted((c, b) for c in CASES for b in ("eager", "inductor", "kiln"))
    for (case, backend), cells in rows.items():
        assert STEP.fullmatch(cells[2]), cells
        assert int(cells[3]) >= 3 and int(cells[3]) % 3 == 0   # whole batches of --steps
        if backend == "eager":
            assert cells[4] == "-" and cells[6] == ""
        else:
            assert float(cells[4]) > 0 and cells[6] == "ok"
        if case == "GPT train":
            assert float(cells[5]) > 0   # saved activations, MiB
    assert torch.get_num_threads() == before   # the demo restores the caller's thread count


def test_demo_threads_flag_and_no_inductor(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["--device", "cpu", "--steps", "3", "--max-seconds", "0.2", "--threads", "1",
                 "--no-inductor"]) == 0
    out = capsys.readouterr().out
    assert "threads 1 (--threads)" in out
    assert sorted(b for _, b in _rows(out)) == ["eager", "eager", "kiln", "kiln"]
