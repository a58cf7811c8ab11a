"""The OpInfo sweep (``kiln_bench.opinfo``): a fast shard of representative ops through the sweep's own
code path on the kiln targets (ATen, Triton, some on C++), the judging of values, the worker pool's crash and
timeout handling, the report, and (``-m slow``) the full sweep against inductor."""
from __future__ import annotations

import json
import math
import os
import sys
import textwrap

import pytest
import torch

from kiln import cli
from kiln_bench import opinfo, opinfo_cases, opinfo_report, opinfo_sample
from kiln_bench.opinfo_pool import Pool

# one or two ops per family; one sample each (the first), forward and backward
FAST_OPS = [
    "add", "sigmoid", "where", "nn.functional.gelu",                  # pointwise
    "sum", "var_mean", "softmax", "max.reduction_with_dim",          # reductions
    "nn.functional.layer_norm",
    "transpose", "expand", "narrow",                                  # views
    "gather", "index_select", "scatter_add", "scatter_reduce.mean",   # indexing
    "bfloat16",                                                       # conversion (rounds as eager)
    "linalg.inv",                                                     # linalg (a higher-order op in the graph)
    "fft.rfft",                                                       # fft (complex intermediates)
    "cond.simple",                                                    # torch.cond (hop_db)
]
# units of the fast shard whose graph may stay ATen on the Triton (and C++) target, and why (a gap, not a failure:
# the values are ATen's); remove an entry when code generation covers it
ATEN_GRAPHS_ALLOWED = {
    ("index_select", "forward"): "index_select: lowering IndexError (list index out of range)",
    ("index_select", "backward"): "index_select: lowering IndexError (list index out of range)",
}


# some ops of the fast shard also run on the C++ target (each unit builds a library with g++: a few, to keep
# make test short); scatter_add, gather's and max's backward run its scatter kernels
FAST_CPP = ["add", "nn.functional.gelu", "sum", "var_mean", "softmax", "max.reduction_with_dim",
            "nn.functional.layer_norm", "transpose", "gather", "scatter_add", "bfloat16", "fft.rfft"]
CPP_DECLINES = set()   # (op, mode) units where the C++ emitter may decline a kernel (none today)


@pytest.fixture(scope="module")
def db():
    return opinfo_cases.op_db()


@pytest.mark.parametrize("name,backend", [(n, b) for b in ("kiln-aten", "kiln-triton") for n in FAST_OPS]
                         + [(n, "kiln-cpp") for n in FAST_CPP])
def test_fast_shard(db, name, backend):
    """Every unit passes (values and gradients within the op's tolerance), was compiled by kiln (a
    Dynamo graph, no exception that made Dynamo run it eagerly), and ran kiln's kernels (no run-time
    fallback; on the Triton and C++ targets no graph left ATen unless allowed above with its reason: a
    C++ build failure leaves the graph ATen too)."""
    op = opinfo_cases.find(name)
    samples = opinfo_cases.samples(op, torch.float32, 1)
    assert samples, f"{name}: no sample"
    for i, sample in enumerate(samples):
        for mode in opinfo_sample.modes(sample):
            rec = opinfo_sample.run(op, sample, torch.float32, backend, i, mode)
            unit = f"{name} #{i} {mode} on {backend}: {rec}"
            assert rec["status"] == "pass", unit
            assert rec["graphs"] >= 1 and not rec.get("backend_exception"), unit
            assert rec["runtime_fallback"] == 0, unit
            if backend != "kiln-aten" and (name, mode) not in ATEN_GRAPHS_ALLOWED:
                assert rec["fallback"] == 0, unit
            if backend == "kiln-cpp":   # the record counts the kernels the C++ emitter declined
                assert (rec["declined"] > 0) == ((name, mode) in CPP_DECLINES), unit


# bf16 on the Triton target, whose interpreter truncates fp32 to bf16 and builds no bf16 constant
FAST_BF16 = ["softmax", "nn.functional.layer_norm", "tanh", "ones_like", "sum"]


@pytest.mark.parametrize("name", FAST_BF16)
def test_fast_shard_bf16(db, name):
    """The first sample in bf16 on the Triton target: passes (judged against eager and the fp64 arbiter)
    with kiln's kernels (no graph left ATen, no run-time fallback)."""
    op = opinfo_cases.find(name)
    sample = opinfo_cases.samples(op, torch.bfloat16, 1)[0]
    for mode in opinfo_sample.modes(sample):
        rec = opinfo_sample.run(op, sample, torch.bfloat16, "kiln-triton", 0, mode)
        assert rec["status"] == "pass" and rec["graphs"] >= 1, rec
        assert rec["fallback"] == 0 and rec["runtime_fallback"] == 0, rec


@pytest.mark.parametrize("backend", ["kiln-aten", "kiln-triton"])
def test_batch_norm_eval_statistics_in_bf16(db, backend):
    """native_batch_norm in eval mode, bf16: its empty statistics outputs have the input's dtype, as eager's
    (kiln's decomposition for the Triton target made them float32)."""
    op = opinfo_cases.find("native_batch_norm")
    sample = opinfo_cases.samples(op, torch.bfloat16, 2)[1]
    assert sample.args[4] is False   # training=False
    rec = opinfo_sample.run(op, sample, torch.bfloat16, backend, 1, "forward")
    assert rec["status"] == "pass" and rec["graphs"] == 1, rec


def test_fast_shard_has_backward(db):
    """The fast shard checks gradients: its ops make samples with inputs requiring grad."""
    with_grad = [n for n in FAST_OPS
                 if "backward" in opinfo_sample.modes(opinfo_cases.samples(opinfo_cases.find(n), torch.float32, 1)[0])]
    assert len(with_grad) >= len(FAST_OPS) - 1, with_grad


# -- judging -----------------------------------------------------------------------------------
def _wrong(gm, example_inputs):
    """A Dynamo backend that adds 1e-3 to every float output."""
    def run(*args):
        out = gm(*args)
        return type(out)(o + 1e-3 if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in out)
    return run


def _raises(gm, example_inputs):
    raise RuntimeError("boom: the backend failed\nsecond line")


@pytest.mark.parametrize("mode", ["forward", "backward"])
def test_wrong_values_are_a_mismatch(db, mode):
    op = opinfo_cases.find("mul")
    sample = opinfo_cases.samples(op, torch.float32, 1)[0]
    rec = opinfo_sample.run(op, sample, torch.float32, "wrong", 0, mode, spec=(_wrong, None))
    assert rec["status"] == "mismatch" and rec["where"] == "forward", rec
    assert rec["max_err"] == pytest.approx(1e-3, rel=1e-2)
    assert rec["fp64_ok"] is False


def test_backend_exception_is_an_error(db):
    op = opinfo_cases.find("mul")
    sample = opinfo_cases.samples(op, torch.float32, 1)[0]
    rec = opinfo_sample.run(op, sample, torch.float32, "raises", 0, "forward", spec=(_raises, None))
    assert rec["status"] == "error" and rec["error"] == "RuntimeError: boom: the backend failed", rec


def test_unknown_backend_names_the_choices(db):
    op = opinfo_cases.find("mul")
    with pytest.raises(opinfo_sample.UnknownBackend, match="kiln-aten, kiln-triton"):
        opinfo_sample.run(op, None, torch.float32, "kiln-fortran")


def test_compare_tolerance_nan_inf_and_structure():
    e = torch.tensor([1.0, float("nan"), float("inf"), 0.0])
    ok, err, _ = opinfo_sample.compare((e + torch.tensor([1e-6, 0, 0, 0]),), (e,), 1e-5, 1.3e-6)
    assert ok and err == pytest.approx(1e-6, rel=0.1)
    ok, err, why = opinfo_sample.compare((e + torch.tensor([1e-3, 0, 0, 0]),), (e,), 1e-5, 1.3e-6)
    assert not ok and "output 0" in why and err == pytest.approx(1e-3, rel=1e-2)
    ok, err, _ = opinfo_sample.compare((torch.tensor([1.0, 0.0, -math.inf, 0.0]),), (e,), 1e-5, 1.3e-6)
    assert not ok and err == math.inf                     # NaN and inf where eager has others
    assert not opinfo_sample.compare((torch.ones(2),), (torch.ones(3),), 1, 1)[0]
    assert not opinfo_sample.compare((torch.ones(2, dtype=torch.float64),), (torch.ones(2),), 1, 1)[0]
    assert not opinfo_sample.compare(torch.tensor([1, 2]), torch.tensor([1, 3]), 10, 10)[0]   # integers: exact


def test_fp64_arbiter():
    """Low precision: an element passes when it is within tolerance of eager or no more than twice as far
    from the fp64 reference as eager."""
    ref64 = torch.tensor([1.0, 1.0], dtype=torch.float64)
    eager = torch.tensor([1.0 + 2 ** -7, 1.0], dtype=torch.bfloat16)   # eager off by one bf16 ulp
    close = torch.tensor([1.0 - 2 ** -7, 1.0], dtype=torch.bfloat16)   # as far on the other side
    far = torch.tensor([1.0 - 2 ** -5, 1.0], dtype=torch.bfloat16)
    tol = (1e-5, 1e-3)
    assert not opinfo_sample.compare(close, eager, *tol)[0]
    assert opinfo_sample.compare(close, eager, *tol, ref64=ref64)[0]
    assert not opinfo_sample.compare(far, eager, *tol, ref64=ref64)[0]


def test_tolerance_comes_from_the_op(db):
    atol, rtol, src = opinfo_cases.tolerance(opinfo_cases.find("nn.functional.cross_entropy"), torch.float32)
    assert (atol, rtol, src) == (3e-3, 1e-3, "op")
    assert opinfo_cases.tolerance(opinfo_cases.find("add"), torch.float32) == (1e-5, 1.3e-6, "default")
    assert opinfo_cases.tolerance(opinfo_cases.find("add"), torch.bfloat16)[:2] == (1e-5, 1.6e-2)


def test_select_and_shard(db):
    every = opinfo_cases.select()
    shards = [opinfo_cases.select(shard=(i, 4)) for i in range(4)]
    assert sorted(sum(([opinfo_cases.full_name(o) for o in s] for s in shards), [])) == \
        sorted(opinfo_cases.full_name(o) for o in every)
    assert [opinfo_cases.full_name(o) for o in opinfo_cases.select("^softmax")] == ["softmax", "softmax.with_dtype"]
    assert "cond.simple" in [opinfo_cases.full_name(o) for o in opinfo_cases.select(dbs=("op", "hop"))]
    with pytest.raises(opinfo_cases.OpNotFound, match="--list"):
        opinfo_cases.select(names=["no_such_op"])
    with pytest.raises(ValueError, match="0/8"):
        opinfo_cases.parse_shard("8")


# -- the worker pool ---------------------------------------------------------------------------
FAKE_WORKER = textwrap.dedent('''
    import json, os, signal, sys, time
    out = os.fdopen(os.dup(1), "w", buffering=1)
    out.write(json.dumps({"ready": True}) + "\\n")
    for line in sys.stdin:
        task = json.loads(line)
        skip = {tuple(u) for u in task.get("skip", ())}
        for i in range(3):
            unit = [i, "forward", "b"]
            if tuple(unit) in skip:
                continue
            out.write(json.dumps({"unit": unit}) + "\\n")
            if i == 1 and task["op"] == "crash":
                print("about to fail", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGSEGV)
            if i == 1 and task["op"] == "hang":
                time.sleep(60)
            rec = dict(op=task["op"], dtype=task["dtype"], backend="b", sample=i, mode="forward", status="pass")
            out.write(json.dumps({"record": rec}) + "\\n")
        out.write(json.dumps({"done": True}) + "\\n")
''')


def test_pool_records_crashes_and_timeouts_and_goes_on(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(FAKE_WORKER)
    records = []
    tasks = [dict(op=name, dtype="fp32", backends=["b"], samples=3) for name in ("crash", "hang", "fine")]
    Pool(workers=2, timeout=3, cmd=[sys.executable, str(script)]).run(tasks, records.append)
    got = {(r["op"], r["sample"]): r for r in records}
    assert len(records) == 9 and len(got) == 9, records
    assert got[("crash", 1)]["status"] == "crash"
    assert "SIGSEGV" in got[("crash", 1)]["error"] and "about to fail" in got[("crash", 1)]["error"]
    assert got[("hang", 1)]["status"] == "timeout"
    assert all(got[(op, i)]["status"] == "pass" for op in ("crash", "hang", "fine") for i in (0, 2))
    assert all(got[("fine", i)]["status"] == "pass" for i in range(3))


def test_cli_end_to_end(tmp_path):
    """``kiln check-ops`` through a real worker: JSON, the streamed records, the report. The op casts fp32 to
    bf16 on the Triton target, which Triton's interpreter truncates: kiln's kernels round to nearest even
    as eager does (``to_triton.ops.convert``)."""
    out, md = tmp_path / "out.json", tmp_path / "REPORT.md"
    assert cli.main(["check-ops", "--ops", "^bfloat16$", "--backends", "kiln-triton", "--samples", "1",
                     "--workers", "1", "--json", str(out), "--report", str(md)]) == 0
    data = json.loads(out.read_text())
    assert {r["mode"] for r in data["records"]} == {"forward", "backward"}
    assert all(r["status"] == "pass" and r["backend"] == "kiln-triton" for r in data["records"]), data
    assert data["meta"]["torch"] == torch.__version__ and "cores" in data["meta"]["machine"]
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2
    text = md.read_text()
    assert "| kiln-triton | 2 | 2 | 0 | 0 | 0 | 0 | 0 | 100.00% |" in text and "| bfloat16 | fp32 |" in text
    merged = tmp_path / "merged.md"   # --from-json makes the report again without running
    assert opinfo.main(["--from-json", str(out), "--report", str(merged)]) == 0
    assert "| bfloat16 | fp32 |" in merged.read_text()


def test_merge_takes_each_op_from_its_last_run(tmp_path):
    """``--from-json``: a later run's records of an op in a dtype on a backend replace an earlier run's (all
    its samples, op-level records too); records keep their run's number through a second merge."""
    old = [_rec("kiln-triton", "mismatch", 0), _rec("kiln-triton", "pass", 1), _rec("inductor", "pass", 0),
           dict(_rec("*", "crash"), op="abs"), _rec("kiln-triton", "pass", 0, op="abs")]
    new = [_rec("kiln-triton", "pass", 0), dict(_rec("kiln-triton", "pass", 0), op="abs")]
    paths = []
    for i, recs in enumerate((old, new)):
        paths.append(str(tmp_path / f"run{i}.json"))
        opinfo.write(recs, {"date": f"day {i}", "command": f"run {i}"}, paths[-1], None)
    records, sources = opinfo.merge(paths)
    got = sorted((r["op"], r["backend"], r["sample"], r["status"], r["src"]) for r in records)
    assert got == [("abs", "kiln-triton", 0, "pass", 2), ("neg", "inductor", 0, "pass", 1),
                   ("neg", "kiln-triton", 0, "pass", 2)]
    assert [(m["date"], m["records"]) for m in sources] == [("day 0", 1), ("day 1", 2)]
    merged = str(tmp_path / "merged.json")
    assert opinfo.main(["--from-json", *paths, "--json", merged]) == 0
    again, sources2 = opinfo.merge([merged])
    assert sorted((r["op"], r["backend"], r["src"]) for r in again) == sorted(
        (r["op"], r["backend"], r["src"]) for r in records) and len(sources2) == 2


# -- the report --------------------------------------------------------------------------------
def _rec(backend, status, sample=0, **kw):
    return dict(dict(op="neg", dtype="fp32", backend=backend, sample=sample, mode="forward", status=status,
                     graphs=1), **kw)


def test_report_lists_what_inductor_passes_and_kiln_fails(tmp_path):
    records = [_rec("inductor", "pass", 0), _rec("kiln-aten", "mismatch", 0, where="forward", max_err=0.5,
                                                  error="output 0: max abs error 0.5"),
               _rec("inductor", "error", 1, error="E: x"), _rec("kiln-aten", "crash", 1, error="killed by SIGSEGV"),
               _rec("inductor", "pass", 2), _rec("kiln-aten", "pass", 2, graphs=0,
                                                 backend_exception="Backend compiler `kiln` failed with X"),
               _rec("kiln-aten", "skip", 3, error="eager: E"), _rec("inductor", "skip", 3, error="eager: E")]
    regs = opinfo_report.regressions(records, "kiln-aten")
    assert [(k["sample"], k["status"]) for _, k in regs] == [(0, "mismatch")]
    assert [r["sample"] for r in opinfo_report.eager_fallbacks(records, "kiln-aten")] == [2]
    text = opinfo_report.write(records, {"date": "today", "torch": "x"}, str(tmp_path / "r.md"))
    assert "| kiln-aten | 4 | 1 | 1 | 0 | 1 | 0 | 1 | 33.33% | 1 | 1 |" in text
    assert "units inductor passes and kiln-aten fails (1)" in text and "max err 0.5" in text
    assert "other failing units (inductor fails or did not run them too) (1)" in text
    assert "| neg | fp32 | **1/1/0/1/0/1** | **2/0/1/0/0/1** |" in text   # failures in bold


def test_report_counts_fallbacks_of_each_kind():
    """The summary counts units with a graph left ATen (on the C++ target also a failed build), a
    run-time fallback, and a kernel the C++ emitter declined (its ATen nodes ran), each apart."""
    records = [_rec("kiln-cpp", "pass", 0, declined=2), _rec("kiln-cpp", "pass", 1, fallback=1),
               _rec("kiln-cpp", "pass", 2, runtime_fallback=1, declined=1)]
    text = opinfo_report.write(records, {})
    assert "| kiln-cpp | 3 | 3 | 0 | 0 | 0 | 0 | 0 | 100.00% | 0 | 0 | 0 | 1 | 1 | 2 |" in text


# -- the full sweep ----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("shard", range(8))
def test_full_sweep_matches_inductor(tmp_path, shard):
    """All ops, two samples each, fp32 forward and backward, the kiln targets beside inductor: no unit
    inductor passes may fail under kiln (``benchmarks/opinfo/REPORT.md`` lists the current ones)."""
    out = tmp_path / "sweep.json"
    opinfo.main(["--shard", f"{shard}/8", "--backends", "kiln-aten,kiln-triton,kiln-cpp,inductor",
                 "--json", str(out), "--report", str(tmp_path / "REPORT.md")])
    records = json.loads(out.read_text())["records"]
    bad = {b: [(opinfo_report._unit(k), opinfo_report._failure(k)) for _, k in opinfo_report.regressions(records, b)]
           for b in ("kiln-aten", "kiln-triton", "kiln-cpp")}
    assert not any(bad.values()), json.dumps(bad, indent=1)
