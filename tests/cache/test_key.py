"""The compile cache's key covers everything a trace reads (#32 items 1, 5 and 6): programs that differ only
inside a subgraph (``torch.cond``, ``while_loop``, a checkpointed region, an ``autograd.Function``), inside
an ``allow_in_graph`` function or in a custom op's autograd formula, or in the global state (default dtype,
an input's negative bit, ``torch.backends`` flags) get keys of their own, in one process and across
processes; a custom pass without ``uuid()`` bypasses the cache."""
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.utils.checkpoint as cp
from torch._higher_order_ops.while_loop import while_loop

import kiln
from kiln.cache import key

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _counters():
    kiln.counters["cache"].clear()
    yield


def _count(name):
    return kiln.counters["cache"][name]


def _run(fn, x, tmp_path, grad=True, **options):
    """Outputs (and input gradients) of ``fn(x)`` compiled afresh with the cache on."""
    torch._dynamo.reset()
    f = kiln.compile(fn, cache=True, cache_dir=str(tmp_path / "cache"), **{"codegen": "aten", **options})
    x = x.detach().clone().requires_grad_() if grad else x   # (a clone would drop a negative bit)
    out = f(x)
    if not grad:
        return [out]
    out.sum().backward()
    return [out.detach(), x.grad]


def _eager(fn, x, grad=True):
    x = x.detach().clone().requires_grad_() if grad else x
    out = fn(x)
    if not grad:
        return [out]
    out.sum().backward()
    return [out.detach(), x.grad]


def _cond(op):
    return lambda x: torch.cond(x.sum() > -1e9, lambda t: op(t), lambda t: t.cos(), (x,))


def _loop(op):
    return lambda x: while_loop(lambda i, t: i < 3, lambda i, t: (i + 1, op(t)), (torch.tensor(0), x))[1]


def _checkpoint(op):
    return lambda x: cp.checkpoint(lambda t: op(t) * 2, x, use_reentrant=False)


def _function(op, scale):
    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return op(x)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * scale * x
    return lambda x: Fn.apply(x) + 1


def _in_graph(op):
    def inner(x):   # one name for both programs: Dynamo's code names it, not its body
        return op(x)
    torch._dynamo.allow_in_graph(inner)
    return lambda x: inner(x) * 3


PROGRAMS = {   # name: (first program, second program, with a backward)
    "cond": (_cond(torch.sin), _cond(torch.exp), True),
    "while_loop": (_loop(torch.sin), _loop(torch.cos), False),
    "checkpoint": (_checkpoint(torch.sin), _checkpoint(torch.cos), True),
    "autograd_function": (_function(torch.sin, 2.0), _function(torch.cos, 5.0), True),
    "allow_in_graph": (_in_graph(torch.exp), _in_graph(torch.sin), True),
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_programs_differing_inside_what_the_graph_calls_miss(tmp_path, name):
    """#32 item 1, in one process: the second program got the first's compiled code (values, gradients)."""
    first, second, grad = PROGRAMS[name]
    x = torch.linspace(-1, 1, 8)
    _run(first, x, tmp_path, grad)
    got = _run(second, x, tmp_path, grad)
    assert (_count("miss"), _count("hit")) == (2, 0), dict(kiln.counters["cache"])
    for a, b in zip(got, _eager(second, x, grad)):
        torch.testing.assert_close(a, b)
    _run(first, x, tmp_path, grad)   # the key is stable: the first program hits its own entry
    assert _count("hit") == 1


_OP = {}


def test_a_custom_ops_new_autograd_formula_misses(tmp_path):
    """#32 item 1: fixing a custom op's registered backward kept the old gradient."""
    if not _OP:
        @torch.library.custom_op("kiln_test_key::op", mutates_args=())
        def op(x: torch.Tensor) -> torch.Tensor:
            return x.sin()
        op.register_fake(lambda x: torch.empty_like(x))
        _OP["op"] = op
    op = _OP["op"]
    x = torch.linspace(-1, 1, 8)
    for scale in (2.0, 5.0):
        op.register_autograd(lambda ctx, g, s=scale: g * s, setup_context=lambda ctx, inputs, output: None)
        out, grad = _run(lambda t: op(t) * 1, x, tmp_path)
        torch.testing.assert_close(grad, torch.full_like(x, scale))
    assert (_count("miss"), _count("hit")) == (2, 0)


def test_checkpointed_dropout_stops_after_eval(tmp_path):
    """#32 item 1: after ``model.eval()`` a checkpointed block with dropout kept dropping (Dynamo traces the
    eval body into the checkpoint's subgraph; the top-level code is the same)."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = torch.nn.Dropout(0.5)

        def forward(self, x):
            return cp.checkpoint(lambda t: self.drop(t.sin()), x, use_reentrant=False)
    m, x = Block(), torch.randn(256)
    _run(m, x, tmp_path)
    m.eval()
    out, grad = _run(m, x, tmp_path)
    torch.testing.assert_close(out, x.sin())
    torch.testing.assert_close(grad, x.cos())
    assert _count("hit") == 0


def test_default_dtype_is_in_the_key(tmp_path):
    """#32 item 5: after ``torch.set_default_dtype(torch.float64)`` the float32 graph was returned."""
    def f(x):
        return x + torch.ones(4)
    x = torch.randn(4)
    saved = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        (wide,) = _run(f, x, tmp_path, grad=False, codegen="cpp")
    finally:
        torch.set_default_dtype(saved)
    (narrow,) = _run(f, x, tmp_path, grad=False, codegen="cpp")
    assert (wide.dtype, narrow.dtype) == (torch.float64, torch.float32)
    assert _count("hit") == 0


def test_an_inputs_negative_bit_is_in_the_key(tmp_path):
    """#32 item 5: an input ``z.conj().imag`` (negative bit set) got the graph cached for ``z.imag``."""
    z = torch.randn(6, dtype=torch.complex64)
    assert z.conj().imag.is_neg()
    _run(lambda t: t * 2 + 1, z.imag, tmp_path, grad=False, codegen="cpp")
    (out,) = _run(lambda t: t * 2 + 1, z.conj().imag, tmp_path, grad=False, codegen="cpp")
    torch.testing.assert_close(out, -z.imag * 2 + 1)
    assert _count("hit") == 0


def test_numerics_flags_are_in_the_key():
    """#32 item 5: the state a trace reads, as Dynamo's, AOTAutograd's and Inductor's keys have it (flags
    whose setters restore exactly; the TF32 and matmul-precision ones rewrite torch's fp32_precision
    settings, read by the same code)."""
    before = key._state()
    for module, flag in ((torch.backends.mkldnn, "enabled"), (torch.backends.cudnn, "deterministic")):
        value = getattr(module, flag)
        setattr(module, flag, not value)
        try:
            assert key._state() != before, flag
        finally:
            setattr(module, flag, value)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert key._state() != before
    with torch.device("meta"):
        assert key._state() != before
    det = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(not det)
    try:
        assert key._state() != before
    finally:
        torch.use_deterministic_algorithms(det)
    assert key._state() == before
    assert f"matmul={torch.get_float32_matmul_precision()}" in before and "cudnn.allow_tf32=" in before


def test_unkeyable_callables_bypass_with_a_reason(tmp_path):
    """What has no identity across processes (an object without uuid()) compiles without the cache."""
    class Scale:
        def __call__(self, t):
            return t * 2
    obj = Scale()

    def inner(x):
        return obj(x)
    torch._dynamo.allow_in_graph(inner)
    x = torch.randn(4)
    (out,) = _run(lambda t: inner(t) + 1, x, tmp_path, grad=False)
    torch.testing.assert_close(out, x * 2 + 1)
    assert (_count("bypass"), _count("miss")) == (1, 0)
    from kiln.cache import identity
    with pytest.raises(identity.Unkeyable, match="uuid"):
        identity._Ids().value(obj, "obj")


_HELPER = "import torch\ndef rewrite(graph):\n    for n in graph.nodes:\n" \
          "        if n.target is torch.ops.aten.sin.default:\n            n.target = torch.ops.aten.{op}.default\n"
_PASS = "import kiln_test_helper\ndef my_pass(graph):\n    kiln_test_helper.rewrite(graph)\n"


def test_a_custom_pass_without_uuid_bypasses(tmp_path, monkeypatch):
    """#32 item 6: a ``post_grad_custom_post_pass`` (a plain function) calling a helper in another module
    kept its stale compiled graph after the helper was edited (the key hashed the pass's own source);
    without ``uuid()`` such a pass now bypasses the cache, as under Inductor."""
    def module(name, text):
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        mod = sys.modules.get(name)
        if mod is None:
            mod = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path))
            monkeypatch.setitem(sys.modules, name, mod)
        exec(compile(text, str(path), "exec"), mod.__dict__)   # an edit, as importlib.reload makes it
        return mod
    module("kiln_test_helper", _HELPER.format(op="cos"))
    my_pass = module("kiln_test_pass", _PASS).my_pass
    x = torch.randn(8)
    (out,) = _run(torch.sin, x, tmp_path, grad=False, post_grad_custom_post_pass=my_pass)
    torch.testing.assert_close(out, x.cos())
    module("kiln_test_helper", _HELPER.format(op="exp"))
    (out,) = _run(torch.sin, x, tmp_path, grad=False, post_grad_custom_post_pass=my_pass)
    torch.testing.assert_close(out, x.exp())
    assert (_count("bypass"), _count("hit"), _count("saved")) == (2, 0, 0)


_PROGRAM = textwrap.dedent('''
    import torch, torch.utils.checkpoint as cp
    from torch._higher_order_ops.while_loop import while_loop

    def cond(x):
        return torch.cond(x.sum() > -1e9, lambda t: t.{a}(), lambda t: t.cos(), (x,))

    def loop(x):
        return while_loop(lambda i, t: i < 3, lambda i, t: (i + 1, t.{a}()), (torch.tensor(0), x))[1]

    def _body(t):
        return t.{a}() * 2

    def checkpointed(x):
        return cp.checkpoint(_body, x, use_reentrant=False)

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.{a}()

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * {k} * x

    def autograd_function(x):
        return Fn.apply(x) + 1

    def _inner(x):
        return x.{a}()
    torch._dynamo.allow_in_graph(_inner)

    def in_graph(x):
        return _inner(x) * 3

    @torch.library.custom_op("{ns}::op", mutates_args=())
    def op(x: torch.Tensor) -> torch.Tensor:
        return x.sin()
    op.register_fake(lambda x: torch.empty_like(x))
    op.register_autograd(lambda ctx, g: g * {k}, setup_context=lambda ctx, inputs, output: None)

    def custom_op(x):
        return op(x) * 1
''')

_DRIVER = textwrap.dedent('''
    import importlib, json, sys, torch, kiln
    res = {}
    for arg in sys.argv[2:]:   # module:function,function...
        name, fns = arg.split(":")
        mod = importlib.import_module(name)
        for fn in fns.split(","):
            grad = fn != "loop"
            outs = []
            for compiled in (True, False):
                torch._dynamo.reset()
                kiln.counters["cache"].clear()
                f = getattr(mod, fn)
                if compiled:
                    f = kiln.compile(f, codegen="aten", cache=True, cache_dir=sys.argv[1])
                x = torch.linspace(-1, 1, 8).requires_grad_(grad)
                out = f(x)
                if grad:
                    out.sum().backward()
                outs.append([out.detach()] + ([x.grad] if grad else []))
                if compiled:
                    counts = [kiln.counters["cache"][k] for k in ("hit", "miss")]
            same = all(torch.allclose(a, b) for a, b in zip(*outs))
            res[f"{name}.{fn}"] = [same] + counts
    print("RESULT" + json.dumps(res))
''')


def test_processes_key_what_the_graph_calls(tmp_path):
    """#32 items 1 across processes: a program edited between two runs (the bodies of a ``cond`` branch,
    a ``while_loop``, a checkpointed function, an ``autograd.Function``, an ``allow_in_graph`` function, a
    custom op's backward) compiles afresh in the second run, while an unchanged one (``stable``) hits: the
    identities of Python functions and custom ops are the same in every process."""
    (tmp_path / "driver.py").write_text(_DRIVER)
    (tmp_path / "stable.py").write_text(_PROGRAM.format(a="tanh", k=3, ns="kiln_test_stable"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, str(tmp_path)]), "OMP_NUM_THREADS": "1",
           "PYTHONDONTWRITEBYTECODE": "1"}

    def run(a, k):
        (tmp_path / "prog.py").write_text(_PROGRAM.format(a=a, k=k, ns="kiln_test_prog"))
        p = subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "cache"),
                            "prog:cond,loop,checkpointed,autograd_function,in_graph,custom_op",
                            "stable:in_graph,custom_op"], env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.split("RESULT")[1])
    first = run("sin", 2)
    assert all(ok and miss == 1 and hit == 0 for ok, hit, miss in first.values()), first
    second = run("exp", 5)
    assert len(second) == 8 and all(ok for ok, _, _ in second.values()), second
    assert all(hit == 0 for name, (_, hit, _) in second.items() if name.startswith("prog.")), second
    assert all(hit == 1 for name, (_, hit, _) in second.items() if name.startswith("stable.")), second
