"""The README's "When to use kiln" and "Limitations", and the summary that opens benchmarks/RESULTS.md: every
figure names the run it comes from, and the README, the summary and the logged sections agree."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIGURE = re.compile(r"\d\.\d|\d+ of (?:the )?\d+|\d ?(?:ms|s|%)\b")   # 0.74, 0.1-0.15x, 4.1 s, 12 of 14
VERSION = re.compile(r"\b(?:torch|Triton) \d+\.\d+(?: to \d+\.\d+)?")  # not a figure: "torch 2.11 to 2.14"
RATIO = re.compile(r"(?:kiln/inductor|kiln/eager|inference) (\d\.\d\d)\b")   # a headline geomean
DEVICES = ("H100", "H200", "CPU", "EPYC")
SUMMARY_ROWS = ("CPU micro+models", "GPU zoo training", "GPU zoo inference")


def _read(*path):
    with open(os.path.join(ROOT, *path)) as fh:
        return fh.read()


def _section(text, heading):
    """From ``heading`` up to the next ``## `` heading."""
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start + 1:end if end >= 0 else len(text)]


def _items(section):
    """The section's paragraphs and bullets (one string each, wrapped lines joined), heading left out."""
    items, cur = [], []
    for line in section.splitlines()[1:] + [""]:
        if (not line.strip() or line.startswith("- ")) and cur:
            items.append(" ".join(cur))
            cur = []
        if line.strip():
            cur.append(line.strip())
    return items


def _summary():
    """``{what: {column: cell}}`` from the table under RESULTS.md's first ``## `` heading, and that heading."""
    text = _read("benchmarks", "RESULTS.md")
    first = next(ln for ln in text.splitlines() if ln.startswith("## "))
    lines = [ln for ln in _section(text, first).splitlines() if ln.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(head, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]
    return first, {r["what"]: r for r in rows}


def _row(rows, prefix):
    (row,) = [r for what, r in rows.items() if what.startswith(prefix)]
    return row


def test_readme_has_when_to_use_and_limitations_after_quick_start():
    text = _read("README.md")
    heads = [ln for ln in text.splitlines() if ln.startswith("## ")]
    i = heads.index("## Quick start")
    assert heads[i + 1:i + 3] == ["## When to use kiln", "## Limitations"]
    when, limits = _section(text, "## When to use kiln"), _section(text, "## Limitations")
    assert "Use kiln for:" in when and "Prefer TorchInductor for:" in when
    assert len([i for i in _items(limits) if i.startswith("- ")]) >= 8


def test_every_figure_names_its_date_and_device():
    text = _read("README.md")
    figured = 0
    for heading in ("## When to use kiln", "## Limitations"):
        for item in _items(_section(text, heading)):
            if FIGURE.search(VERSION.sub("", item)):
                figured += 1
                assert "2026-" in item and any(d in item for d in DEVICES), f"{heading}: {item}"
    assert figured >= 4   # the CPU and GPU runs, the CPU rows kiln wins, the memory figures


def test_results_opens_with_a_summary_of_sections_below_it():
    text = _read("benchmarks", "RESULTS.md")
    first, rows = _summary()
    assert first == "## Summary (current)"
    assert text.startswith("# kiln bench results\n") and text.index(first) < text.index("\n## 2026-")
    assert [next(w for w in rows if w.startswith(p)) for p in SUMMARY_ROWS] == list(rows)
    later = [ln for ln in text[text.index(first) + len(first):].splitlines() if ln.startswith("## ")]
    for what, row in rows.items():
        assert row["date"].startswith("2026-") and row["torch"].startswith("2.") and row["pass rate"]
        assert len([h for h in later if h.startswith("## " + row["section"] + " ·")]) == 1, (what, row["section"])


def test_summary_matches_the_geomeans_of_its_sections():
    text = _read("benchmarks", "RESULTS.md")
    _, rows = _summary()
    for what, row in rows.items():
        heading = next(ln for ln in text.splitlines() if ln.startswith("## " + row["section"] + " ·"))
        section = _section(text, heading)
        mode = ", training" if "training" in what else ", inference" if "inference" in what else ""
        for other in ("inductor", "eager"):
            line = f"- geomean kiln/{other}{mode}: **{row[f'geomean kiln/{other}']}** over {row['rows']} rows"
            assert line in section, (what, line)


def test_readme_headline_agrees_with_the_results_summary():
    when = _items(_section(_read("README.md"), "## When to use kiln"))
    cpu = next(i for i in when if i.startswith("- CPU"))
    gpu = next(i for i in when if i.startswith("- GPU"))
    _, rows = _summary()
    c, t, inf = (_row(rows, p) for p in SUMMARY_ROWS)
    assert RATIO.findall(cpu) == [c["geomean kiln/inductor"], c["geomean kiln/eager"]]
    assert RATIO.findall(gpu) == [t["geomean kiln/inductor"], t["geomean kiln/eager"], inf["geomean kiln/inductor"]]
    assert f"{c['rows']} rows" in cpu and f"over {t['rows']} models" in gpu and f"over {inf['rows']} models" in gpu
    for item, row in ((cpu, c), (gpu, t)):
        assert row["date"] in item and row["torch"] in item
