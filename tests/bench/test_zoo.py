"""The zoo suite: its cases, their tiny builds, and the summary lines its report adds."""
import importlib.util

import pytest
import torch

from kiln_bench import report
from kiln_bench.suites import all_cases, select, zoo

META = {"date": "2026-01-01 00:00 UTC", "device": "cuda", "device_name": "GPU", "torch": "2.x", "triton": "3.6",
        "kiln": "0.1", "command": "kiln bench --suite zoo", "suite": "zoo", "size": "gpu", "caches": "fresh",
        "threads": 1, "elapsed_s": 1.0, "mem_kind": "peak", "backends": ["eager", "inductor", "kiln"]}


def _row(case, backend, ms, train, peak, ok=True):
    return {"case": case, "dtype": "amp_bf16", "backend": backend, "budget": 1.0 if train and backend != "eager"
            else None, "status": "ok", "ms": ms, "p25": ms, "p75": ms, "mem_bytes": peak, "peak_bytes": peak,
            "ok": ok, "err": 0.0, "check": "ok" if backend != "eager" else "ref", "train": train, "compile_s": 1.0}


def test_zoo_is_wide():
    """At least 24 distinct architectures from the three libraries, training and inference rows both."""
    models = {c.name.removeprefix("zoo_").removesuffix("_infer").removesuffix("_full") for c in zoo.CASES}
    assert len(models) >= 24, sorted(models)
    assert {m for c in zoo.CASES for m in c.needs} == {"transformers", "timm", "torchvision"}
    assert sum(c.train for c in zoo.CASES) >= 12 and sum(not c.train for c in zoo.CASES) >= 12
    assert len({c.name for c in all_cases("every")}) == len(all_cases("every"))
    assert not any(c.suite == "zoo" for c in all_cases("all"))   # `--suite all` stays micro + models


def test_full_size_rows_and_no_regularization_overrides():
    """The models at full depth are rows of their own, and no case turns its model's dropout off: the
    timed steps train as users train (the check turns it off in a pass of its own)."""
    import inspect
    import re

    from kiln_bench.suites import models
    full = {c.name for c in zoo.CASES if c.name.endswith("_full") and c.train}
    assert full >= {"zoo_swin_full", "zoo_vit_full", "zoo_convnext_full", "zoo_bert_full", "zoo_gpt2_full"}
    for mod in (zoo, models):
        src = inspect.getsource(mod)
        assert not re.findall(r"(drop\w*|pdrop)\s*=\s*0\.0", src), mod.__name__


def test_zoo_cases_build_tiny():
    """Every zoo case whose libraries are installed builds at the tiny size and runs its eager check."""
    cases, skipped = select("zoo", "cpu")
    assert len(cases) + len(skipped) == len(zoo.CASES)
    if not cases:
        pytest.skip("transformers, timm and torchvision are not installed here")
    for case in cases[:: max(1, len(cases) // 6)]:
        wl = case.build("cpu", "auto", "tiny")
        got = wl.check(wl.model)
        assert got and all(torch.isfinite(t).all() for t in got), case.name


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_zoo_decoder_through_kiln():
    """A rotary, parallel-residual decoder trains under kiln with eager's loss and gradients (tiny)."""
    import kiln
    (case,) = [c for c in zoo.CASES if c.name == "zoo_neox"]
    wl = case.build("cpu", "auto", "tiny")
    ref = wl.fresh()
    want = ref.check(ref.model)
    mine = wl.fresh()
    got = mine.check(kiln.compile(mine.model))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-4)


def test_summary_lines():
    rows = [_row("a", "eager", 10, True, 100), _row("a", "inductor", 8, True, 90), _row("a", "kiln", 4, True, 95),
            _row("b", "eager", 10, False, 100), _row("b", "inductor", 5, False, 90),
            _row("b", "kiln", 10, False, 120, ok=False)]
    text = report.markdown(META, rows)
    assert "geomean kiln/inductor, training: **0.50** over 1 rows" in text
    assert "geomean kiln/inductor, inference: **2.00** over 1 rows" in text
    assert "pass rate kiln: 1/2" in text and "pass rate inductor: 2/2" in text
    assert "kiln's peak memory above eager's: b (1.20)" in text
    assert "kiln's peak memory above inductor's: a (1.06), b (1.33)" in text
