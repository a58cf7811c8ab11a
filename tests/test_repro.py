"""Dumps you can hand to someone (kiln/repro.py, ``Trace.fail``): a failing compile's dump holds the stages
before the failure, the error and a repro that fails the same way; what a repro cannot carry is named.
(One folder per compile, never reused: tests/e2e/test_reliability.py::test_dumps_of_two_processes_never_share_a_folder.)"""
import runpy
import warnings

import pytest
import torch

import kiln


def _region(root):
    (region,) = [d for d in root.iterdir() if d.is_dir()]
    return region


def _run_repro(region):
    """Run ``region``'s repro.py as ``python repro.py`` would (its ``main()``); returns its exit status."""
    torch._dynamo.reset()
    return runpy.run_path(str(region / "repro.py"))["main"]()


def _inputs():
    return torch.randn(4, 3, requires_grad=True), torch.randn(3, 2, requires_grad=True)


def test_a_failing_compile_dumps_its_stages_its_error_and_a_repro_that_fails(tmp_path, capsys):
    f = kiln.compile(lambda x, w: (x.sin() @ w).tanh().sum(), dump_dir=str(tmp_path), activation_memory_limit=1)
    with pytest.raises(Exception, match="activation_memory_limit=1"):
        f(*_inputs())
    region = _region(tmp_path)
    names = sorted(p.name for p in region.iterdir())
    assert [n for n in names if n[:2].isdigit()] == ["00_capture.py", "01_pre_grad.py", "02_joint.py"], names
    error = (region / "error.txt").read_text()
    assert error.startswith("kiln: graph_") and "failed in stage partition" in error
    assert "MemoryLimitError: partition: activation_memory_limit=1" in error and "Traceback" in error
    capsys.readouterr()
    with pytest.raises(Exception, match="MemoryLimitError: partition: activation_memory_limit=1"):   # not "repro OK"
        _run_repro(region)
    assert "repro OK" not in capsys.readouterr().out


def _no_op_pass(graph):
    return None


def _failing_pass(graph):
    raise ZeroDivisionError("a custom pass failed")


def test_the_repro_names_options_and_passes_it_cannot_save(tmp_path, capsys):
    with kiln.passes.register("joint_post", _no_op_pass):
        f = kiln.compile(lambda x, w: (x @ w).relu().sum(), dump_dir=str(tmp_path),
                         post_grad_custom_post_pass=_no_op_pass)
        f(*_inputs()).backward()
    region = _region(tmp_path)
    text = (region / "repro.py").read_text()
    assert "#   post_grad_custom_post_pass = tests.test_repro._no_op_pass (" in text
    assert "#   kiln.passes.register('joint_post', _no_op_pass) = tests.test_repro._no_op_pass" in text
    capsys.readouterr()
    assert _run_repro(region) == 0
    out, err = capsys.readouterr()
    assert "repro OK" in out
    assert "omits" in err and "post_grad_custom_post_pass" in err and "'joint_post'" in err   # a printed warning


def test_a_failure_the_repro_cannot_carry_is_not_reported_as_reproduced(tmp_path, capsys):
    f = kiln.compile(lambda x, w: (x @ w).relu().sum(), dump_dir=str(tmp_path), on_error="eager",
                     pre_grad_custom_pass=_failing_pass)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x, w = _inputs()
        torch.testing.assert_close(f(x, w), (x @ w).relu().sum())   # the eager fallback
    assert any("runs it as eager does" in str(c.message) for c in caught)
    region = _region(tmp_path)
    error = (region / "error.txt").read_text()
    assert "failed in stage pre_grad" in error and "ZeroDivisionError: a custom pass failed" in error
    capsys.readouterr()
    assert _run_repro(region) == 2
    out, err = capsys.readouterr()
    assert "NOT REPRODUCED" in out and "repro OK" not in out and "pre_grad_custom_pass" in err
