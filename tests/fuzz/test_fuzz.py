"""Random programs through kiln against eager (kiln_bench.fuzz): a short run of every target in the
default suite (in this process), a long one marked slow (child processes), and the generator as a
hypothesis strategy."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from kiln_bench.fuzz import generate, runner
from kiln_bench.fuzz.child import namespace
from kiln_bench.fuzz.program import Program


def _run(tmp_path, programs: int, workers: int, start: int = 0, inline: bool = False,
         targets=("aten", "triton", "cpp")) -> dict:
    cfg = runner.Config(targets=targets, programs=programs, seed=0, start=start, workers=workers,
                        out=str(tmp_path), shrink=False, quiet=True, timeout=240, inline=inline)
    return runner.main(cfg)


def _assert_clean(summary: dict, programs: int) -> None:
    for target, s in summary["targets"].items():
        assert s["programs"] == programs, (target, s)
        assert s["harness_errors"] == 0, (target, s)
        assert s["passed"] + s["discarded"] >= programs // 2, (target, s)   # the generator makes real programs
    bad = [g for g in summary["groups"] if not g["upstream"]]
    assert not bad, "kiln failed (reproducers listed):\n" + "\n".join(
        f"{' | '.join(g['key'])}: programs {g['programs']}\n  {g['repro']}\n  {g['detail']}" for g in bad)


@pytest.mark.parametrize("targets,programs", [(("aten", "triton"), 16), (("cpp",), 10)])
def test_short_run_every_target(tmp_path, targets, programs):
    """16 programs on aten and triton, the first 10 of them on cpp (each builds a library with g++), in
    this process (``test_runner`` covers the child processes)."""
    summary = _run(tmp_path, programs=programs, workers=1, inline=True, targets=targets)
    assert set(summary["targets"]) == set(targets)
    _assert_clean(summary, programs)
    assert (tmp_path / "summary.md").exists() and (tmp_path / "results.jsonl").exists()


@pytest.mark.slow
def test_long_run_every_target(tmp_path):
    summary = _run(tmp_path, programs=300, workers=2, start=1000)
    _assert_clean(summary, 300)


@settings(max_examples=15, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(generate.programs(max_ops=6))
def test_programs_strategy_runs_eagerly(prog):
    """Every drawn program renders, survives JSON, and runs eagerly (each statement was checked), or, tagged
    'raises', raises eager's error for an out-of-range index at its last statement."""
    assert Program.from_dict(prog.to_dict()) == prog
    ns = namespace(prog)
    if "raises" in prog.tags:
        import torch
        with pytest.raises((IndexError, RuntimeError), match="out of (bounds|range)"), torch.no_grad():
            ns["program"](*ns["make_inputs"]())
        return
    if prog.train:
        out = ns["program"](*ns["make_inputs"]())
    else:
        import torch
        with torch.no_grad():
            out = ns["program"](*ns["make_inputs"]())
    assert len(out) == len(prog.returns)


def test_program_for_is_deterministic(tmp_path, monkeypatch):
    """Program i is the same whatever the process imported before: Hypothesis draws integers from the
    constants of the local modules loaded so far now and then (before ``generate._fixed_provider``, 25 of
    300 programs of seed 2 differed between the runner's aten and triton children)."""
    a, b = generate.program_for(3, 11), generate.program_for(3, 11)
    assert a.source() == b.source() and a != generate.program_for(3, 12)
    before = [generate.program_for(2, i).source() for i in range(40)]
    (tmp_path / "fuzz_constants_probe.py").write_text("A, B, C, D = 271828, 314159, 4242, 777777\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__("fuzz_constants_probe")
    assert [generate.program_for(2, i).source() for i in range(40)] == before
