"""``kiln bench-compile``'s table: medians, ratios against inductor, errors shown in their row."""
from kiln_bench import compile_times as C


def test_rows_and_ratios():
    samples = [{"cold_s": c, "warm_s": w, "recompile_s": 0.5, "step_s": 0.1, "warm_process_s": 2.0,
                "cold_process_s": 5.0} for c, w in ((4.0, 1.0), (6.0, 3.0), (5.0, 2.0))]
    kiln = {**C._median_rows(samples), "case": "gpt", "backend": "kiln"}
    assert (kiln["cold_s"], kiln["warm_s"]) == (5.0, 2.0) and kiln["spread"]["cold_s"] == [4.0, 6.0]
    ind = {"cold_s": 40.0, "warm_s": 4.0, "recompile_s": 1.0, "step_s": 0.1, "warm_process_s": 6.0,
           "cold_process_s": 42.0, "case": "gpt", "backend": "inductor"}
    bad = {"error": "exit 1: boom", "case": "cnn", "backend": "kiln"}
    md = C.markdown({"date": "d", "device_name": "cpu", "torch": "t", "threads": "2", "command": "c", "repeat": 3},
                    [kiln, ind, bad])
    row = next(ln for ln in md.splitlines() if ln.startswith("| gpt | kiln"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:5] == ["5.00", "2.00", "0.50"] and cells[6] == "0.40"   # warm/cold
    assert cells[-3:] == ["0.12", "0.50", ""]   # cold and warm against inductor's; no aot_eager row
    assert "| cnn | kiln | error: exit 1: boom" in md
    floor = {**ind, "cold_s": 3.0, "backend": "aot_eager"}
    md = C.markdown({"date": "d", "device_name": "cpu", "torch": "t", "threads": "2", "command": "c", "repeat": 3},
                    [kiln, ind, floor])
    row = next(ln for ln in md.splitlines() if ln.startswith("| gpt | kiln"))
    assert row.strip("|").split("|")[-1].strip() == f"{(5.0 - 3.0) / (40.0 - 3.0):.2f}"   # above the floor
    assert C._median_rows([bad]) == bad
