"""The user suite (``kiln bench --suite user``): the workloads issue #37 names, their tiny builds, dropout on
in the steps and off in the check, and two rows through the bench's runner with kiln."""
import pytest
import torch

from kiln_bench import runner
from kiln_bench.dropout import random_sites
from kiln_bench.measure import compare
from kiln_bench.suites import all_cases, select, user

CFG = runner.RunConfig(device="cpu", size="tiny", warmup=1, min_iters=2, max_iters=2, min_time=0.0,
                       warm_compile=False, kernels=False)


def _case(name):
    (case,) = [c for c in user.CASES if c.name == name]
    return case


def test_the_suite_holds_the_issues_workloads():
    names = {c.name for c in user.CASES}
    assert len(user.CASES) == len(names) == 11
    assert {"user_encoder_train", "user_encoder_infer", "user_encoder_infer_bf16", "user_mlp_dropout",
            "user_audio_conv1d", "user_cnn_infer", "user_cnn_infer_freezing", "user_checkpointed",
            "user_small_lm", "user_adamw_step"} <= names
    assert _case("user_cnn_infer_freezing").options == {"freezing": True}
    assert not _case("user_cnn_infer").options
    assert select("user", "cpu")[0] == user.CASES   # every case runs on the CPU, nothing to install
    assert not any(c.suite == "user" for c in all_cases("all"))   # `--suite all` stays micro + models
    assert len({c.name for c in all_cases("every")}) == len(all_cases("every"))


def test_every_case_builds_tiny_and_checks_deterministically():
    """Each tiny build runs eager's check twice with the same values; training rows with dropout keep it on
    for the steps (sites found) and the check turns it off."""
    with_dropout = set()
    for case in user.CASES:
        wl = case.build("cpu", "auto", "tiny")
        a, b = wl.check(wl.model), wl.check(wl.model)
        assert a and all(torch.isfinite(t).all() for t in a), case.name
        assert compare(a, b, 0.0)["ok"], case.name
        assert wl.train == case.train, case.name
        if isinstance(wl.model, torch.nn.Module) and random_sites(wl.model):
            with_dropout.add(case.name)
    assert {"user_encoder_train", "user_mlp_dropout", "user_checkpointed", "user_small_lm"} <= with_dropout
    assert _case("user_encoder_infer_bf16").build("cpu", "auto", "tiny").dtype == "amp_bf16"


def test_the_steps_draw_dropout():
    """Two steps of the MLP without its optimizer give different outputs: dropout is on in the steps."""
    wl = _case("user_mlp_dropout").build("cpu", "auto", "tiny")
    x = wl.inputs[0]
    assert not torch.equal(wl.model(x), wl.model(x))


def test_adamw_step_check_restarts_from_the_same_state():
    """The compiled-optimizer row: ``check`` restores parameters and moments, so it returns one step's result
    every time, and that result is AdamW's (parameters moved against the gradient); the steps keep moving."""
    wl = _case("user_adamw_step").build("cpu", "auto", "tiny")
    first = wl.check(wl.model)
    wl.step(wl.model)
    wl.step(wl.model)
    assert compare(first, wl.check(wl.model), 0.0)["ok"]
    p0, g = wl.initial[0], wl.grads[0]
    moved = first[0] - p0
    assert moved.abs().max() > 0 and (torch.sign(moved) == -torch.sign(g))[g.abs() > 1e-3].float().mean() > 0.99
    fresh = wl.fresh()
    assert fresh.opt is not wl.opt and fresh.net.parameters().__next__() is not wl.net.parameters().__next__()


@pytest.mark.parametrize("name", ["user_adamw_step", "user_checkpointed"])
def test_rows_through_kiln(name):
    """The runner measures the case under eager and kiln (tiny): both rows ok, kiln's check passes."""
    rows = list(runner.run_case(_case(name), "auto", ["eager", "kiln"], None, CFG))
    assert [r["backend"] for r in rows] == ["eager", "kiln"]
    for r in rows:
        assert r["status"] == "ok", r.get("error")
        assert r["ms"] > 0 and r["iters"] == 2
    assert rows[1]["ok"] is True, rows[1]["check"]
