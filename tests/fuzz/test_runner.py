"""The fuzz runner's machinery: crash attribution and restart, mismatch detection through a deliberately
broken pass, the comparison rules, shrinking."""
from __future__ import annotations

import json
import math
import signal
import subprocess
import sys

import pytest
import torch

from kiln_bench.fuzz import harness, reduce, runner
from kiln_bench.fuzz.compare import compare_tensor
from kiln_bench.fuzz.program import Input, Op, Program
from tests.fuzz import hooks


def test_crash_hang_and_mismatch_are_attributed(tmp_path):
    """Program 1 segfaults its child, program 2 is miscompiled, program 3 hangs: each is reported against
    its program, the dead or stuck child is replaced and program 4 still runs."""
    cfg = runner.Config(targets=("aten",), programs=5, seed=0, workers=1, out=str(tmp_path), quiet=True,
                        hook="tests.fuzz.hooks:crash_and_mul",
                        options={"post_grad_custom_post_pass": hooks.add_for_mul},
                        shrink_tries=0, timeout=8)   # counted from the program's start (not the child's)
    summary = runner.main(cfg)
    s = summary["targets"]["aten"]
    assert s["programs"] == 5 and s["crashes"] == 1 and s["timeouts"] == 1 and s["failed"] == 3, s
    assert s["passed"] + s["discarded"] == 2, s
    by_index = {g["programs"][0]: g for g in summary["groups"]}
    assert by_index[hooks.CRASH]["key"][1] == "crash" and "SIGSEGV" in by_index[hooks.CRASH]["key"][2]
    assert by_index[hooks.WRONG]["key"][1:3] == ["wrong", "value"] and not by_index[hooks.WRONG]["upstream"]
    crash_repro = open(by_index[hooks.CRASH]["repro"]).read()
    assert "string_at(0)" in crash_repro and "check_program(" in crash_repro
    assert "add_for_mul" in open(by_index[hooks.WRONG]["repro"]).read()
    assert by_index[hooks.HANG]["key"][1] == "timeout"
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == 5


def _t(*vals, dtype=torch.float32):
    return torch.tensor(vals, dtype=dtype)


def test_compare_rules():
    nan, inf = math.nan, math.inf
    assert compare_tensor(_t(1.0, nan), _t(1.0, nan)) is None
    assert compare_tensor(_t(1.0, nan), _t(1.0, inf))[0] == "nan"
    assert compare_tensor(_t(1.0, 2.0), _t(1.0, 2.1))[0] == "value"
    assert compare_tensor(_t(1.0, 2.0), _t(1.0, 2.0 + 1e-6)) is None
    assert compare_tensor(_t(-0.0), _t(0.0))[0] == "signed_zero"
    # the arbiter: eager's zero is -0.0 but the exact result is +0.0: the sign is not eager's to define
    assert compare_tensor(_t(-0.0), _t(0.0), _t(0.0, dtype=torch.float64)) is None
    # low precision: kiln may be as far from the fp64 arbiter as eager is (times WORSE)
    e, k = _t(1.0, dtype=torch.bfloat16), _t(1.0078125, dtype=torch.bfloat16)
    assert compare_tensor(e, k, _t(1.004, dtype=torch.float64)) is None
    assert compare_tensor(e, _t(1.25, dtype=torch.bfloat16), _t(1.004, dtype=torch.float64))[0] == "value"
    assert compare_tensor(_t(1, 2, dtype=torch.int64), _t(1, 3, dtype=torch.int64))[0] == "value"
    assert compare_tensor(_t(1, 2, dtype=torch.int64), _t(1, 2, dtype=torch.int32))[0] == "meta"
    z = torch.tensor([1 + 2j], dtype=torch.complex64)
    assert compare_tensor(z, z.conj().resolve_conj())[0] == "value"
    # eager's float16 prod rounded its partial products to inf and 0 (NaN); kiln gives the arbiter's value
    # rounded to float16 (seed 11 #9256): fine; another value, or a NaN the arbiter has too, is not
    h = lambda *v: _t(*v, dtype=torch.float16)  # noqa: E731
    assert compare_tensor(h(nan, 2.0), h(0.0, 2.0), _t(1e-30, 2.0, dtype=torch.float64)) is None
    assert compare_tensor(h(nan, 2.0), h(5.0, 2.0), _t(1e-30, 2.0, dtype=torch.float64))[0] == "nan"
    assert compare_tensor(h(nan, 2.0), h(0.0, 2.0), _t(nan, 2.0, dtype=torch.float64))[0] == "nan"
    assert compare_tensor(_t(nan), _t(0.0), _t(1e-30, dtype=torch.float64))[0] == "nan"   # float32: no
    # kiln's NaN or infinity where the arbiter has it too (seed 11 #7896: a bf16 log_softmax rounded to 0)
    b = lambda *v: _t(*v, dtype=torch.bfloat16)  # noqa: E731
    assert compare_tensor(b(-inf, 1.0), b(nan, 1.0), _t(nan, 1.0, dtype=torch.float64)) is None
    assert compare_tensor(b(-inf, 1.0), b(nan, 1.0), _t(-inf, 1.0, dtype=torch.float64))[0] == "nan"
    assert compare_tensor(b(0.0, 1.0), b(inf, 1.0), _t(inf, 1.0, dtype=torch.float64)) is None
    assert compare_tensor(b(0.0, 1.0), b(inf, 1.0), _t(0.5, 1.0, dtype=torch.float64))[0] == "value"
    # a float32 value computed through float16 (seed 1 program 155): one half-precision ulp apart is fine
    e, k = _t(-1.1533203125), _t(-1.154296875)
    assert compare_tensor(e, k)[0] == "value" and compare_tensor(e, k, low=torch.float16) is None


def test_watch_records_the_precision_of_each_value():
    x = torch.tensor([[-1.25, 3.0]], requires_grad=True)
    run = harness.execute(lambda a: (torch.linalg.vector_norm(a.half(), dim=1), a * 2), [x], True, track=True)
    assert run.low == {"outs": [torch.float16, torch.float32], "grads": [torch.float16], "inputs": [None]}
    # a float64 value computed through float32 (seed 10 #5401: cos of an integer tensor is float32)
    i = torch.tensor([3, -7])
    run = harness.execute(lambda a: (torch.cos(a).double() ** 200 * 1e3, a.double() * 3), [i], False, track=True)
    assert run.low["outs"] == [torch.float32, None]
    e = run.outs[0]
    k = torch.cos(i.double()) ** 200 * 1e3   # without cos's float32 rounding: about 5e-7 apart
    assert compare_tensor(e, k)[0] == "value" and compare_tensor(e, k, low=torch.float32) is None


def test_make_input_layouts_and_arbiter():
    for layout in ("transposed", "sliced", "offset", "expanded", "overlapping", "channels_last"):
        x = harness.make_input((2, 3, 4, 5), "bfloat16", seed=3, layout=layout)
        up = harness.make_input((2, 3, 4, 5), "bfloat16", seed=3, layout=layout, up=True)
        assert up.dtype == torch.float64 and up.stride() == x.stride(), layout
        assert torch.equal(up.to(torch.bfloat16), x), layout
    assert not harness.make_input((3, 4), "float32", layout="transposed").is_contiguous()
    assert harness.make_input((3, 4), "float32", layout="expanded").stride()[0] == 0


def test_shrinker_keeps_the_failing_statement():
    """With an oracle that fails while a program has a 'torch.exp' statement, the shrinker ends at that
    statement alone over one plain input."""
    ops = (Op("torch.sin({0})", ("a0",), "v0"), Op("torch.exp({0})", ("v0",), "v1"),
           Op("{0} + {1}", ("v1", "a1"), "v2"), Op("torch.cos({0})", ("a1",), "v3"))
    prog = Program((Input((4, 3), layout="transposed", grad=True), Input((3,), special=True)), ops, ("v2", "v3"),
                   train=True, dynamic=True)
    gen = reduce.shrinker(prog, ("wrong", "value"), max_tries=100)
    cand, tries = next(gen), 0
    try:
        while True:
            tries += 1
            cand = gen.send(("wrong", "value") if any("exp" in o.text for o in cand.ops) else ("pass",))
    except StopIteration as stop:
        best = stop.value
    assert [o.text for o in best.ops] == ["torch.exp({0})"], best.source()
    assert len(best.inputs) == 1 and best.inputs[0].layout == "contiguous" and not best.train and not best.dynamic
    assert tries < 60


def test_eager_aliasing_through_an_overlapping_input_is_discarded():
    """select_scatter clones an overlapping input with its strides and writes the clone: eager's values
    then depend on the aliasing, so the program is discarded, not held against kiln."""
    from kiln_bench.fuzz.child import namespace
    prog = Program((Input((7, 3, 1), "int32", seed=2308, layout="overlapping"), Input((3, 1), "int32", seed=59)),
                   (Op("torch.select_scatter({0}, {1}, 0, 6)", ("a0", "a1"), "v0"),), ("v0",))
    ns = namespace(prog)
    res = harness.check_program(ns["make_inputs"], ns["program"], "aten", baseline=False)
    assert res.status == "discard" and "overlap" in res.error, res
    plain = Program(prog.inputs[:1], (Op("{0} * 2", ("a0",), "v0"),), ("v0",))
    ns = namespace(plain)
    assert harness.check_program(ns["make_inputs"], ns["program"], "aten", baseline=False).status == "pass"


def test_a_difference_eager_scalar_loops_share_is_excused():
    """hardtanh's backward at NaN differs between eager's vectorized and scalar loops on this CPU; a kiln
    result equal to the scalar loops' is excused, another one is not."""
    from kiln_bench.fuzz.child import namespace
    prog = Program((Input((4, 7), seed=887, special=True, grad=True),),
                   (Op("F.hardtanh({0}, -1.5, 2.0)", ("a0",), "v0"),), ("v0",), train=True)
    ns = namespace(prog)
    mk, fn = ns["make_inputs"], ns["program"]
    scalar = harness.execute(fn, [harness._strided(x) for x in mk()], True, strided=True)
    assert harness._eager_alternative(mk, fn, True, scalar, None, True)
    scalar.grads[0][0, 0] += 1.0
    assert not harness._eager_alternative(mk, fn, True, scalar, None, True)


def test_a_difference_eager_on_contiguous_inputs_shares_is_excused():
    """relu6's backward at NaN: eager gives the gradient for a channels-last input and 0 for a contiguous
    one (fuzz seed 13 #82, torch 2.11 and 2.13); kiln's 0 is excused, another value is not."""
    from kiln_bench.fuzz.child import namespace
    prog = Program((Input((8, 7, 2, 3), seed=8540, layout="channels_last", special=True, grad=True),),
                   (Op("F.relu6({0})", ("a0",), "v0"),), ("v0",), train=True)
    ns = namespace(prog)
    mk, fn = ns["make_inputs"], ns["program"]
    dense = harness.execute(fn, [harness._dense(x) for x in mk()], True)
    eager = harness.execute(fn, mk(), True)
    assert not torch.equal(dense.grads[0], eager.grads[0])   # else this test shows nothing
    assert harness._eager_alternative(mk, fn, True, dense, None, True)
    dense.grads[0].view(-1)[0] += 1.0
    assert not harness._eager_alternative(mk, fn, True, dense, None, True)


def test_scalar_loops_of_backward_ops_inside_the_graph():
    """elu's backward at NaN is NaN in eager's vectorized loop and the gradient in its scalar loop; inside
    the graph (on ``a0 * 2``, a contiguous 64-element tensor) strided inputs do not reach it, the
    ``SCALAR_LOOP_OPS`` dispatch does. A kiln gradient equal to the scalar loop's is excused, no other."""
    from kiln_bench.fuzz.child import namespace
    prog = Program((Input((64,), seed=5, special=True, grad=True),), (Op("{0} * 2", ("a0",), "v0"),
                   Op("F.elu({0})", ("v0",), "v1")), ("v1",), train=True)
    ns = namespace(prog)
    mk, fn = ns["make_inputs"], ns["program"]
    nan = mk()[0].isnan()
    assert nan.any()
    eager = harness.execute(fn, mk(), True)
    scalar = harness.execute(fn, mk(), True)
    scalar.grads[0][nan] = 2 * harness.cotangent(eager.outs[0], 1000)[nan]   # the positive branch's gradient
    assert harness.compare(eager, scalar, None)[0].what == "nan"
    assert harness._eager_alternative(mk, fn, True, scalar, None, True)
    scalar.grads[0][nan] = 3.0
    assert not harness._eager_alternative(mk, fn, True, scalar, None, True)


def test_gelu_at_inf_follows_the_scalar_loop():
    """gelu (erf form) forward at +inf: NaN in eager's vectorized loop (oneDNN's AVX-512 kernel), inf in its
    scalar loop and in fp64; kiln's C++ and Triton kernels give inf. Inside the graph (on a ``torch.cat``) the
    ``SCALAR_LOOP_OPS`` dispatch reaches it, so inf is excused and nothing else (the cpp fuzz run of seed 10,
    program 16). oneDNN's AVX2 kernel gives inf (an AMD host; ``ONEDNN_MAX_CPU_ISA=AVX2`` here): there the
    AVX-512 host's NaN is put in eager's result, the case being the same."""
    from kiln_bench.fuzz.child import namespace
    prog = Program((Input((1, 4), seed=12569), Input((3, 4), seed=213044, special=True)),
                   (Op("torch.cat([{0}, {1}], 0)", ("a0", "a1"), "v0"), Op("F.gelu({0})", ("v0",), "v1")), ("v1",))
    ns = namespace(prog)
    mk, fn = ns["make_inputs"], ns["program"]
    eager = harness.execute(fn, mk(), False)
    pos_inf = torch.cat(mk()).isposinf()
    assert pos_inf.any() and (eager.outs[0][pos_inf].isnan() | eager.outs[0][pos_inf].isposinf()).all()
    eager.outs[0][pos_inf] = math.nan   # what the vectorized loop gives on an AVX-512 host
    kiln_like = harness.execute(fn, mk(), False)
    kiln_like.outs[0][pos_inf] = math.inf
    assert harness.compare(eager, kiln_like, None)[0].what == "nan"
    assert harness._eager_alternative(mk, fn, False, kiln_like, None, True)
    kiln_like.outs[0][pos_inf] = 1.0
    assert not harness._eager_alternative(mk, fn, False, kiln_like, None, True)


def test_var_mean_of_a_row_holding_an_infinity():
    """Eager's Welford var_mean gives the mean of [1, -inf, 2] as NaN (-inf - -inf in its update); kiln's
    two-pass mean is -inf: excused as a two-pass var_mean's result (seed 10 #4054), a wrong finite mean
    is not; and the real check on the fusing targets passes."""
    from kiln_bench.fuzz.child import namespace
    prog = Program((Input((2, 3), seed=1),), (Op("torch.var_mean({0}, dim=(1,))[1]", ("a0",), "v0"),), ("v0",))
    ns = namespace(prog)
    fn = ns["program"]
    mk = lambda up=False, dense=False: [torch.tensor([[1.0, -math.inf, 2.0], [1.0, 2.0, 3.0]],  # noqa: E731
                                                     dtype=torch.float64 if up else torch.float32)]
    eager = harness.execute(fn, mk(), False)
    assert eager.outs[0][0].isnan()
    two_pass = harness.execute(fn, mk(), False)
    two_pass.outs[0][0] = -math.inf
    assert harness._eager_alternative(mk, fn, False, two_pass, None, True) == \
        "eager with a two-pass var_mean/std_mean"
    two_pass.outs[0][1] = 7.0
    assert not harness._eager_alternative(mk, fn, False, two_pass, None, True)
    for target in ("triton", "cpp"):
        res = harness.check_program(mk, fn, target, baseline=False)
        assert res.status == "pass", (target, res.problems, res.error)


def test_writes_through_overlapping_memory_are_discarded():
    """An op that writes a tensor two of whose elements share memory (a select_scatter output with an
    overlapping input's strides, masked_fill_ of an expanded view): eager's values depend on the order of
    its writes, the program is discarded. A view that overlaps (unfold, expand) writes nothing."""
    from kiln_bench.fuzz.watch import overlaps
    x = torch.arange(10.0)
    assert overlaps(x.as_strided((3, 3), (1, 1))) and overlaps(x[:1].expand(3))
    assert not overlaps(x.unfold(0, 3, 3)) and not overlaps(x[::2])
    track = lambda fn, *args: harness.execute(fn, list(args), False, track=True).overlap  # noqa: E731
    assert track(lambda a: (a.unfold(0, 3, 1) * 1, (a * 2).unfold(0, 3, 1), a[:1].expand(4)), x) == []
    assert track(lambda a: (torch.select_scatter(a, torch.zeros(3), 0, 1),), x.as_strided((3, 3), (1, 1))) \
        == ["select_scatter.default"]
    assert track(lambda a, m: (a.expand(2, 5).masked_fill_(m, 0),), x[:5].clone(), torch.rand(2, 5) > 0.5) \
        == ["masked_fill_.Scalar"]
    prog = Program((Input((8, 1, 16), "int32", seed=98), Input((1, 8, 1, 16), "bool", seed=3, values="mask")),
                   (Op("{0}.expand((2, 8, 1, 16))", ("a0",), "v0"), Op("{0}.masked_fill_({1}, 0)", ("v0", "a1"), "v1")),
                   ("v1",))   # seed 1 program 74, shrunk: eager 0 where kiln and aot_eager wrote -4
    from kiln_bench.fuzz.child import namespace
    ns = namespace(prog)
    res = harness.check_program(ns["make_inputs"], ns["program"], "aten", baseline=False)
    assert res.status == "discard" and "overlaps itself" in res.error, res


def test_a_deadline_and_a_signal_still_write_the_summary(tmp_path):
    """Past ``deadline`` no program starts; SIGTERM (``timeout`` ending a run) stops the run: both write
    the summary, saying how many programs did not run."""
    cfg = runner.Config(targets=("aten",), programs=50, seed=0, out=str(tmp_path / "deadline"), quiet=True,
                        inline=True, deadline=0.0)
    s = runner.main(cfg)
    assert s["state"]["stopped"] == "deadline" and s["state"]["unstarted"] == 50 and s["targets"] == {}
    assert "stopped (deadline): 50 programs not started" in (tmp_path / "deadline" / "summary.md").read_text()
    out = tmp_path / "signal"
    proc = subprocess.Popen([sys.executable, "-m", "kiln_bench.fuzz", "--target", "aten", "--programs", "50",
                             "--inline", "--no-shrink", "--out", str(out)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith("[fuzz] aten 0:")
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    s = json.loads((out / "summary.json").read_text())
    assert s["state"]["stopped"].startswith("signal") and 1 <= s["targets"]["aten"]["programs"] < 50
    assert s["state"]["unstarted"] + s["state"]["unfinished"] == 50 - s["targets"]["aten"]["programs"]


def test_a_program_the_fuzzer_cannot_make_is_a_harness_error(tmp_path):
    """A child that fails before its program starts (an import, the generator) reports the fuzzer's
    failure, not a crash of kiln's; the next program still runs."""
    cfg = runner.Config(targets=("aten",), programs=2, seed=0, workers=1, out=str(tmp_path), quiet=True,
                        hook="tests.fuzz.hooks:broken_generator", shrink_tries=0, timeout=60)
    s = runner.main(cfg)["targets"]["aten"]
    assert s["harness_errors"] == 1 and s["crashes"] == 0 and s["failed"] == 0, s
    assert s["passed"] + s["discarded"] + s["upstream"] == 1, s


def test_command_line_targets():
    """``--target`` takes kiln's codegen targets, several at once; another name is an error naming them."""
    from kiln_bench.fuzz.__main__ import parse
    assert parse(["--target", "cpp"]).targets == ("cpp",)
    assert parse(["--target", "aten,triton,cpp"]).targets == ("aten", "triton", "cpp")
    with pytest.raises(SystemExit):
        parse(["--target", "fortran"])


def test_a_failed_cpp_build_is_a_fallback():
    """On the C++ target a graph whose build fails runs ATen (values right): the harness counts it with
    the run-time fallbacks, with the compiler's reason (``--strict`` then shrinks it as a failure)."""
    import warnings
    from kiln_bench.fuzz.child import fallback_kind, namespace
    prog = Program((Input((4, 7), seed=3),), (Op("torch.exp({0}) + 1", ("a0",), "v0"),), ("v0",))
    ns = namespace(prog)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = harness.check_program(ns["make_inputs"], ns["program"], "cpp", baseline=False,
                                    options={"cpp_flags": "-O1 -fno-such-flag-kiln"})
    assert res.status == "pass" and res.fallbacks == 1, res
    assert "C++ build failed" in res.fallback_reasons[0], res.fallback_reasons
    assert "exited with #" in fallback_kind(res.fallback_reasons)
    from kiln_bench.fuzz.report import _fallback_kinds
    kinds = list(_fallback_kinds([res.to_dict()]))
    assert len(kinds) == 1 and "exited with #" in kinds[0] and "/" not in kinds[0], kinds


def test_clamp_with_a_nan_bound_is_judged_by_what_this_torch_does():
    """torch 2.11's eager ``clamp(x, min=nan)`` returns x (its ``clamp_min(x, nan)`` and torch 2.13 give NaN,
    as kiln does): on such a torch a program clamping at a NaN scalar is discarded, not a failure."""
    from kiln_bench.fuzz import harness

    def program(a0):
        return (torch.clamp(a0, min=float('nan')),)

    def other(a0):
        return (torch.clamp(a0, min=-1.5),)
    probe = torch.clamp(torch.ones(1), min=float("nan")).isnan().item()
    assert harness.eager_clamp_ignores_nan_bounds() is (not probe)
    assert bool(harness._eager_inconsistent(program)) is (not probe)
    assert harness._eager_inconsistent(other) == ""


def test_zeros_of_matrix_products_and_min_max_are_unsigned():
    """A zero's sign is the implementation's after min/max and matrix products (fuzz seed 13 #9227: eager's
    matmul of a K=1 product gave -0.0, the bmm AOTAutograd traces +0.0); other programs check it."""
    from kiln_bench.fuzz.child import zero_sign
    prog = lambda text: Program(ops=(Op(text, ("a0", "a1"), "v0"),), returns=("v0",))  # noqa: E731
    assert not zero_sign(prog("torch.matmul({0}, {1})"))
    assert not zero_sign(prog("torch.addmm({0}, {0}, {1})"))
    assert not zero_sign(prog("torch.maximum({0}, {1})"))
    assert zero_sign(prog("torch.mul({0}, {1})"))
    assert zero_sign(prog("torch.add({0}, {1})"))
