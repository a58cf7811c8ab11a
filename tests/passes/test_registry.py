"""User pass registry: stages, composition order, scoping, cache keys, run_stage."""
import contextlib
import contextvars
import io
import threading
import warnings

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import kiln
import kiln.config
from kiln.passes import registry
from kiln.passes.registry import RegistryError, cache_key, passes_for, register, run_stage

aten = torch.ops.aten


def cos_to_sin(graph):
    for node in graph.nodes:
        if node.target == aten.cos.default:
            node.target = aten.sin.default


def sin_to_tanh(graph):
    for node in graph.nodes:
        if node.target == aten.sin.default:
            node.target = aten.tanh.default


def gm_cos():
    return make_fx(lambda x: x.cos() + 1)(torch.randn(3))


def test_plain_call_and_remove():
    h = register("joint_post", cos_to_sin)
    try:
        assert passes_for("joint_post") == [("cos_to_sin", cos_to_sin)]
        assert passes_for("joint_pre") == []
    finally:
        h.remove()
    assert passes_for("joint_post") == []


def test_context_manager_scope_and_nesting():
    with register("post_grad_pre", cos_to_sin):
        with register("post_grad_pre", sin_to_tanh, name="second"):
            assert [n for n, _ in passes_for("post_grad_pre")] == ["cos_to_sin", "second"]
        assert [n for n, _ in passes_for("post_grad_pre")] == ["cos_to_sin"]
    assert passes_for("post_grad_pre") == []


def test_composition_in_registration_order():
    x = torch.randn(3)
    with register("joint_pre", cos_to_sin), register("joint_pre", sin_to_tanh):
        gm = gm_cos()
        run_stage("joint_pre", gm, None)
    torch.testing.assert_close(gm(x), x.tanh() + 1)  # cos -> sin -> tanh
    with register("joint_pre", sin_to_tanh), register("joint_pre", cos_to_sin):
        gm = gm_cos()
        run_stage("joint_pre", gm, None)
    torch.testing.assert_close(gm(x), x.sin() + 1)  # sin_to_tanh ran before any sin existed


@pytest.mark.parametrize("stage,hook_first", [("pre_grad", True), ("joint_pre", True), ("post_grad_pre", True),
                                              ("joint_post", False), ("post_grad_post", False)])
def test_options_hook_position(stage, hook_first):
    order = []
    with register(stage, lambda g: order.append("registered"), name="registered"):
        run_stage(stage, gm_cos(), lambda g: order.append("hook"))
    assert order == (["hook", "registered"] if hook_first else ["registered", "hook"])


def test_run_stage_recompiles_and_logs():
    gm = gm_cos()
    err = io.StringIO()
    with kiln.config.patch(debug=2), contextlib.redirect_stderr(err):
        run_stage("post_grad_post", gm, cos_to_sin)
    x = torch.randn(3)
    torch.testing.assert_close(gm(x), x.sin() + 1)  # the generated code changed
    assert "post_grad_post: pass options.post_grad_custom_post_pass" in err.getvalue()
    assert "nodes (+0)" in err.getvalue()


def test_scoping_does_not_leak_to_other_contexts_or_threads():
    with register("pre_grad", cos_to_sin):
        seen = []
        t = threading.Thread(target=lambda: seen.append(passes_for("pre_grad")))
        t.start()
        t.join()
        assert seen == [[]]
        ctx = contextvars.copy_context()
        assert ctx.run(passes_for, "pre_grad") == [("cos_to_sin", cos_to_sin)]
        ctx.run(register, "pre_grad", sin_to_tanh)  # registered inside the copied context only
        assert len(passes_for("pre_grad")) == 1


def test_cache_key_changes_with_passes():
    base = cache_key()
    with register("joint_post", cos_to_sin):
        k1 = cache_key()
        assert k1 != base
        with register("joint_post", sin_to_tanh):
            assert cache_key() not in (base, k1)
        assert cache_key() == k1
    assert cache_key() == base


def test_cache_key_uses_uuid():
    class P:
        def __init__(self, v):
            self.v = v

        def __call__(self, graph):
            pass

        def uuid(self):
            return f"p-{self.v}"

    with register("joint_pre", P(1)):
        k1 = cache_key()
    with register("joint_pre", P(2)):
        k2 = cache_key()
    with register("joint_pre", P(1)):
        assert cache_key() == k1
    assert k1 != k2


def test_bad_stage_and_bad_pass():
    with pytest.raises(RegistryError, match="joint_post"):
        register("post_grad", cos_to_sin)
    with pytest.raises(RegistryError):
        register("joint_post", 42)
    assert registry.STAGES == ("pre_grad", "joint_pre", "joint_post", "post_grad_pre", "post_grad_post")


def _failing_pass(graph):
    raise RuntimeError("a bug in the user's pass")


def _sin2(x):
    return (x.sin() * 2).sum()


@pytest.mark.parametrize("how", ["registered", "option"])
def test_a_failing_pass_warns_at_the_users_function(how):
    """The eager fallback's warning points at the line of the user's pass that raised (issue #37: it pointed
    at kiln/passes/registry.py), so warning filters on the user's module apply to it."""
    x = torch.randn(4)
    with contextlib.ExitStack() as stack:
        options = {"cache": False, "on_error": "eager"}
        if how == "registered":
            stack.enter_context(register("post_grad_pre", _failing_pass))
        else:
            options["post_grad_custom_pre_pass"] = _failing_pass
        with pytest.warns(UserWarning, match="could not compile") as record:
            got = kiln.compile(_sin2, **options)(x)
        torch.testing.assert_close(got, _sin2(x))
        w = next(w for w in record if "could not compile" in str(w.message))
        assert (w.filename, w.lineno) == (__file__, _failing_pass.__code__.co_firstlineno + 1), (w.filename, w.lineno)
        assert "in _failing_pass" in str(w.message) and "a bug in the user's pass" in str(w.message)
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as seen:   # a filter on this module silences it ...
            warnings.simplefilter("always")
            warnings.filterwarnings("ignore", message="kiln could not compile", module=__name__)
            kiln.compile(_sin2, **options)(x)
        assert not [s for s in seen if "could not compile" in str(s.message)], [str(s.message) for s in seen]
        torch._dynamo.reset()
        with warnings.catch_warnings():   # ... and one that makes it an error raises
            warnings.filterwarnings("error", message="kiln could not compile", module=__name__)
            with pytest.raises(Exception, match="could not compile"):
                kiln.compile(_sin2, **options)(x)


def test_a_failing_pass_is_named_in_its_traceback():
    gm = gm_cos()
    with register("joint_post", _failing_pass), pytest.raises(RuntimeError) as info:
        run_stage("joint_post", gm)
    assert "custom pass '_failing_pass' of stage 'joint_post'" in "".join(getattr(info.value, "__notes__", [])), info
