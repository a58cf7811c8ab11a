"""Options: validation, scoping, entry point, and torch.compile(options=...)."""
import os
import subprocess
import sys

import pytest
import torch

import kiln
from kiln.options import OptionError, current


def test_unknown_option_names_valid_ones():
    with pytest.raises(OptionError, match="unknown kiln option 'freezng'.*freezing"):
        kiln.compile(lambda x: x, freezng=True)


def test_bad_value_lists_choices():
    with pytest.raises(OptionError, match="codegen='cuda'.*'aten'"):
        current(codegen="cuda")
    with pytest.raises(OptionError, match=r"outside the valid range \[0, 1\]"):
        kiln.config.patch(activation_memory_budget=1.5)
    with pytest.raises(OptionError, match="must be True or False"):
        current(freezing="yes")


def test_integer_options_are_checked():
    with pytest.raises(OptionError, match="compile_workers='many' must be an integer"):
        current(compile_workers="many")
    with pytest.raises(OptionError, match="compile_workers=-2"):
        current(compile_workers=-2)
    assert current(compile_workers=4).compile_workers == 4


def test_patch_is_scoped_and_a_decorator():
    assert current().activation_memory_budget == 1.0
    with kiln.config.patch(activation_memory_budget=0.5):
        assert current().activation_memory_budget == 0.5
        with kiln.config.patch(freezing=True):
            assert current().freezing and current().activation_memory_budget == 0.5
        assert not current().freezing
    assert current().activation_memory_budget == 1.0

    @kiln.config.patch(pattern_matcher=False)
    def inner():
        return current().pattern_matcher

    assert inner() is False and current().pattern_matcher is True


def test_env_var(monkeypatch):
    monkeypatch.setenv("KILN_ACTIVATION_MEMORY_BUDGET", "0.25")
    assert current().activation_memory_budget == 0.25


def test_functorch_budget_is_honoured(monkeypatch):
    """``torch._functorch.config.activation_memory_budget``, inductor users' knob, is kiln's budget unless
    kiln's environment, patches or explicit options set one; a bad value names where it came from."""
    import torch._functorch.config as fconfig
    assert current().activation_memory_budget == 1.0
    with fconfig.patch(activation_memory_budget=0.4):
        assert current().activation_memory_budget == 0.4
        assert current(activation_memory_budget=0.7).activation_memory_budget == 0.7
        with kiln.config.patch(activation_memory_budget=0.2):
            assert current().activation_memory_budget == 0.2
        monkeypatch.setenv("KILN_ACTIVATION_MEMORY_BUDGET", "0.3")
        assert current().activation_memory_budget == 0.3
        monkeypatch.delenv("KILN_ACTIVATION_MEMORY_BUDGET")
    with fconfig.patch(activation_memory_budget=1.5):
        with pytest.raises(OptionError, match="torch._functorch.config: activation_memory_budget=1.5"):
            current()


def test_cache_key_changes_with_output_affecting_options():
    a = current().cache_key()
    assert current(debug=3).cache_key() == a
    assert current(activation_memory_budget=0.5).cache_key() != a


def test_torch_compile_options_reach_kiln():
    seen = []

    def hook(graph):
        seen.append(len(graph.nodes))

    f = torch.compile(lambda x: x.cos() + 1, backend="kiln", options={"joint_custom_pre_pass": hook})
    with torch.no_grad():
        f(torch.randn(3))
    assert seen


def test_entry_point_without_importing_kiln():
    from importlib.metadata import entry_points
    if "kiln" not in entry_points(group="torch_dynamo_backends").names:
        pytest.skip("kiln is not pip-installed here (make install registers the entry point)")
    code = ("import sys, torch\n"
            "f = torch.compile(lambda x: x.sin() * 2, backend='kiln')\n"
            "x = torch.randn(4)\n"
            "assert torch.allclose(f(x), x.sin() * 2)\n"
            "assert 'kiln' in sys.modules\n"
            "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd="/", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ok" in r.stdout


def test_tuning_fields_scope_and_merge():
    """Tuning constants are options: dotted names or a dict, merged into the tuning in force."""
    from kiln.options import Tuning
    assert current().tuning == Tuning()
    with kiln.config.patch(**{"tuning.persistent_max": 1024}):
        with kiln.config.patch(tuning={"chain": False}):
            t = current().tuning
            assert (t.persistent_max, t.chain, t.online_softmax) == (1024, False, True)
        assert current().tuning.chain is True
    assert current().tuning.persistent_max == Tuning().persistent_max
    opts = current().replace(tuning={"outer_max": 64})
    assert opts.tuning.outer_max == 64 and opts.replace(codegen="aten").tuning.outer_max == 64


def test_tuning_values_are_checked():
    with pytest.raises(OptionError, match="tuning.pw_xblock=1000 must be a power of two"):
        current(**{"tuning.pw_xblock": 1000})
    with pytest.raises(OptionError, match="tuning.pw_warps=64: a kernel has at most 32 warps"):
        current(tuning={"pw_warps": 64})
    with pytest.raises(OptionError, match="tuning.chain='no' must be True or False"):
        current(tuning={"chain": "no"})
    with pytest.raises(OptionError, match="tuning.fold='no' is not valid; choose one of"):
        current(tuning={"fold": "no"})
    with pytest.raises(OptionError, match="unknown kiln option 'tuning.persistnt_max'.*tuning.persistent_max"):
        current(tuning={"persistnt_max": 4})
    with pytest.raises(OptionError, match="tuning=3 must be a dict"):
        current(tuning=3)


def test_tuning_from_the_environment(monkeypatch):
    monkeypatch.setenv("KILN_TUNING_PERSISTENT_MAX", "2048")
    monkeypatch.setenv("KILN_TUNING_ONLINE_SOFTMAX", "off")
    t = current().tuning
    assert t.persistent_max == 2048 and t.online_softmax is False
    monkeypatch.setenv("KILN_TUNING_CHAIN", "maybe")
    with pytest.raises(OptionError, match="KILN_TUNING_CHAIN='maybe': tuning.chain must be True or False; cannot read"):
        current()


def test_tuning_is_listed_and_keyed():
    from kiln.options import describe
    text = describe()
    assert "tuning.persistent_max" in text and "KILN_TUNING_PERSISTENT_MAX" in text
    base = current().cache_key()
    assert current(**{"tuning.online_softmax": False}).cache_key() != base
    assert current(**{"tuning.precompile_timeout_s": 5.0}).cache_key() == base   # changes no kernel
