"""Errors that point at the fix (#20): where a bad option comes from, the option meant, the type expected,
the environment variable to change, and ``kiln`` (not a functools.partial repr) in Dynamo's headers."""
import re

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed

import kiln
from kiln.capture.dynamo import Bound, backend
from kiln.options import ENV_NAMES, FIELDS, OptionError, OptionTypeError, current, suggest


def _fn(x):
    return x.sin() * 2


# -- torch.compile(options=...) ----------------------------------------------------------------------
def test_torch_compile_options_are_checked_at_the_first_call_naming_their_origin():
    """torch 2.13's torch.compile calls no backend code for a string backend (``_TorchCompileWrapper`` only
    stores ``options``), so the first call is the earliest check; the message says where the option was."""
    f = torch.compile(_fn, backend="kiln", options={"activaton_memory_budget": 0.5})
    with pytest.raises(BackendCompilerFailed) as e:
        f(torch.randn(4))
    msg = str(e.value)
    assert msg.startswith("backend='kiln' raised:"), msg
    assert ("OptionError: torch.compile(backend='kiln', options={'activaton_memory_budget': 0.5}): unknown kiln "
            "option 'activaton_memory_budget'; did you mean activation_memory_budget?") in msg, msg


def test_the_backend_raises_option_errors_itself():
    gm = torch.fx.symbolic_trace(_fn)
    with pytest.raises(OptionError, match=r"options=\{'typo': 1\}\): unknown kiln option 'typo'; valid options"):
        backend(gm, [torch.randn(4)], options={"typo": 1})
    with pytest.raises(OptionTypeError, match="activation_memory_budget='half' must be a number"):
        backend(gm, [torch.randn(4)], options={"activation_memory_budget": "half"})


def test_kiln_compile_checks_options_before_any_call():
    with pytest.raises(OptionError, match="did you mean activation_memory_budget\\?"):
        kiln.compile(_fn, activaton_memory_budget=0.5)


# -- the backend's name ----------------------------------------------------------------------------
def _boom(graph):
    raise RuntimeError("boom in a user pass")


@pytest.mark.parametrize("how", ["kiln.compile", "torch.compile"])
def test_dynamo_headers_name_the_backend_kiln(how):
    if how == "kiln.compile":
        f = kiln.compile(_fn, pre_grad_custom_pass=_boom, on_error="raise")
    else:
        f = torch.compile(_fn, backend="kiln", options={"pre_grad_custom_pass": _boom, "on_error": "raise"})
    with pytest.raises(BackendCompilerFailed) as e:
        f(torch.randn(4))
    msg = str(e.value)
    assert msg.startswith("backend='kiln' raised:"), msg
    assert "boom in a user pass" in msg and "functools.partial" not in msg and "0x" not in msg.splitlines()[0]


def test_bound_backend_reads_as_kiln():
    assert Bound({}).__name__ == "kiln" and repr(Bound({})) == "kiln"
    assert repr(Bound({"freezing": True})) == "kiln(options={'freezing': True})"


# -- suggestions -----------------------------------------------------------------------------------
@pytest.mark.parametrize("typo,meant", [
    ("activaton_memory_budget", "activation_memory_budget"),    # a letter missing
    ("actvation_memroy_budget", "activation_memory_budget"),    # the first word misspelled, two letters swapped
    ("tunning.persistent_max", "tuning.persistent_max"),        # the group misspelled
    ("tuning.persistnt_max", "tuning.persistent_max"),          # a dotted name
    ("persistent_max", "tuning.persistent_max"),                # the group left out
    ("mod", "mode"),
])
def test_unknown_names_suggest_the_nearest_option(typo, meant):
    assert suggest(typo) == [meant]
    with pytest.raises(OptionError, match=re.escape(f"unknown kiln option {typo!r}; did you mean {meant}?")):
        current(**{typo: 1})


def test_a_name_near_nothing_lists_the_valid_ones():
    with pytest.raises(OptionError) as e:
        current(typo=1)
    assert "did you mean" not in str(e.value) and "'activation_memory_budget'" in str(e.value)
    assert suggest("activation_budget") == ["activation_memory_budget", "activation_memory_budget_runtime_estimator"]


# -- types -----------------------------------------------------------------------------------------
def test_a_wrong_type_is_a_type_error_not_a_range_error():
    with pytest.raises(OptionTypeError) as e:
        current(activation_memory_budget="half")
    assert isinstance(e.value, TypeError) and isinstance(e.value, OptionError)
    assert str(e.value) == "activation_memory_budget='half' must be a number (float), got str"
    with pytest.raises(OptionError, match=r"outside the valid range \[0, 1\]") as e:
        current(activation_memory_budget=1.5)
    assert not isinstance(e.value, TypeError)


WRONG = {"bool": "1", "int": "3", "float": "0.5", "str": 3, "Optional[str]": 3, "Any": [1]}


def test_every_option_checks_its_declared_type():
    for name, f in FIELDS.items():
        wrong = WRONG[f.type]
        with pytest.raises(OptionTypeError) as e:
            current(**{name: wrong})
        msg = str(e.value)
        assert msg.startswith(f"{name}={wrong!r} ") and msg.endswith(f"got {type(wrong).__name__}"), msg


# -- environment variables -------------------------------------------------------------------------
@pytest.mark.parametrize("raw,says", [("abc", r"must be a number \(float\); cannot read 'abc' as one"),
                                      ("2", r"activation_memory_budget=2.0 is outside the valid range \[0, 1\]")])
def test_environment_errors_name_the_variable_and_value(monkeypatch, raw, says):
    monkeypatch.setenv("KILN_ACTIVATION_MEMORY_BUDGET", raw)
    for attempt in (current, lambda: kiln.compile(_fn)):
        with pytest.raises(OptionError, match=f"^environment variable KILN_ACTIVATION_MEMORY_BUDGET='{raw}': .*{says}"
                           ) as e:
            attempt()
        assert "could not convert" not in str(e.value)


def test_every_typed_environment_variable_names_itself(monkeypatch):
    for name, f in FIELDS.items():
        if not f.metadata["env"] or f.type not in ("bool", "int", "float"):
            continue
        monkeypatch.setenv(ENV_NAMES[name], "bogus")
        with pytest.raises(OptionTypeError, match=f"^environment variable {ENV_NAMES[name]}='bogus': {name} must"):
            current()
        monkeypatch.delenv(ENV_NAMES[name])
