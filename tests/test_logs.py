"""kiln in torch's logging (kiln/logs.py): the ``kiln`` log and its artifacts, structured-trace entries,
``TORCH_COMPILE_DEBUG`` and the compile-time report."""
import json
import logging
import os
import re
import subprocess
import sys

import pytest
import torch
from torch._logging._internal import trace_log

import kiln
from kiln.options import current
from kiln.runtime import cpp_build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_CXX = bool(cpp_build.find_compiler(current()))


@pytest.fixture
def set_logs():
    """``torch._logging.set_logs`` for one test, back to torch's defaults after it."""
    if "TORCH_LOGS" in os.environ:
        pytest.skip("TORCH_LOGS is set: torch ignores set_logs")
    yield torch._logging.set_logs
    torch._logging.set_logs()


def _train(**options):
    """Compile and run forward and backward of a small matmul graph (a forward, a backward, remat)."""
    f = kiln.compile(lambda x, w: (x.sin() @ w).tanh().sum(), **options)
    x, w = torch.randn(4, 3, requires_grad=True), torch.randn(3, 2, requires_grad=True)
    f(x, w).backward()
    torch.testing.assert_close(x.grad, torch.func.grad(lambda x: (x.sin() @ w).tanh().sum())(x.detach()))


def test_the_kiln_log_shows_kiln_messages_in_torch_format(set_logs, capfd):
    with torch.no_grad():
        kiln.compile(lambda x: x.cos() + 1)(torch.randn(3))
    assert "stage pre_grad" not in capfd.readouterr().err   # nothing asked for, nothing shown
    set_logs(modules={"kiln": logging.INFO})
    torch._dynamo.reset()
    with torch.no_grad():
        kiln.compile(lambda x: x.cos() + 1)(torch.randn(3))
    err = capfd.readouterr().err
    assert re.search(r"^I\d{4} .*\] .*graph_\d+ stage pre_grad: ", err, re.M), err   # torch's format
    assert "[kiln]" not in err and "# after: capture" not in err   # graphs are DEBUG messages
    set_logs(modules={"kiln": logging.DEBUG})   # TORCH_LOGS=+kiln
    torch._dynamo.reset()
    with torch.no_grad():
        kiln.compile(lambda x: x.cos() + 1)(torch.randn(3))
    assert re.search(r"^V\d{4} .*\] .*# after: capture", capfd.readouterr().err, re.M)


@pytest.mark.skipif(not HAS_CXX, reason="kernel plans need the C++ target (no C++ compiler)")
def test_artifacts_show_what_is_named(set_logs, capfd):
    set_logs(output_code=True, modules={"kiln_plans": True})
    _train(codegen="cpp")
    err = capfd.readouterr().err
    assert re.search(r"\[__output_code\] def call\(args\)", err), err[-3000:]   # wrappers
    assert re.search(r"\[__output_code\] .*extern \"C\" void kiln_cpp_", err)    # C++ kernels
    assert re.search(r"\[__kiln_plans\] .*kernel plans", err)
    assert "remat[" not in err and "stage pre_grad" not in err   # neither asked for
    set_logs(modules={"kiln_remat": True})
    torch._dynamo.reset()
    _train(codegen="cpp")
    err = capfd.readouterr().err
    assert re.search(r"\[__kiln_remat\] remat\[budget=1\]: save ", err) and "__output_code" not in err


class _Entries(logging.Handler):
    """Collects structured-trace records as tlparse reads them (metadata and payload)."""

    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append((record.metadata, record.payload))

    def artifacts(self) -> dict:
        return {m["artifact"]["name"]: (m, p) for m, p in self.records if "artifact" in m}

    def __enter__(self):
        trace_log.addHandler(self)
        return self

    def __exit__(self, *exc):
        trace_log.removeHandler(self)


def test_structured_trace_has_kiln_stages_plans_kernels_and_times():
    entries = _Entries()
    trace_log.addHandler(entries)
    try:
        _train()
    finally:
        trace_log.removeHandler(entries)
    found = entries.artifacts()
    for name in ["kiln_capture", "kiln_pre_grad", "kiln_joint", "kiln_partition_fw", "kiln_partition_bw",
                 "kiln_post_grad_forward", "kiln_post_grad_backward", "kiln_wrapper_forward", "kiln_wrapper_backward",
                 "kiln_remat_budget_1", "kiln_stage_times", "kiln_stage_times_backward"]:
        assert name in found, (name, sorted(found))
    if HAS_CXX:
        assert {"kiln_plans_forward", "kiln_kernels_forward_cpp"} <= set(found), sorted(found)
    assert "def call(args)" in found["kiln_wrapper_forward"][1]
    assert "# after: joint" in found["kiln_joint"][1] and "save " in found["kiln_remat_budget_1"][1]
    meta, payload = found["kiln_stage_times"]
    assert "frame_id" in meta   # written at the first call, filed under the compile that made it
    times = json.loads(payload)
    assert times["total_s"] == pytest.approx(times["dynamo_s"] + times["aot_autograd_s"] + times["kiln_s"], abs=1e-6)
    assert "partition" in times["stages_s"] and min(times["dynamo_s"], times["aot_autograd_s"], times["kiln_s"]) > 0


def test_kiln_debug_reports_dynamo_aot_autograd_and_the_total(capfd):
    _train(debug=1)   # the options reach the report made at the first call, outside the compile
    err = capfd.readouterr().err
    m = re.search(r"graph_\d+ compiled in ([\d.]+) s: Dynamo ([\d.]+) s, AOTAutograd ([\d.]+) s, kiln ([\d.]+) s "
                  r"\(stages ([\d.]+) s: .*partition [\d.]+ ms", err)
    assert m, err
    total, dynamo, aot, ours, stages = map(float, m.groups())
    assert total == pytest.approx(dynamo + aot + ours, abs=0.02) and min(dynamo, aot, ours) > 0 and stages <= ours
    assert re.search(r"graph_\d+ backward compiled by kiln in [\d.]+ s \(stages .*fuse_backward", err)


def test_torch_environment_variables_reach_kiln(tmp_path):
    """TORCH_LOGS (+kiln, output_code), TORCH_TRACE and TORCH_COMPILE_DEBUG as a user sets them."""
    env = {k: v for k, v in os.environ.items() if k not in ("KILN_DUMP", "KILN_DEBUG", "TORCH_LOGS_OUT")}
    env.update(TORCH_LOGS="+kiln,output_code", TORCH_TRACE=str(tmp_path / "trace"), TORCH_COMPILE_DEBUG="1",
               TORCH_COMPILE_DEBUG_DIR=str(tmp_path), PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    code = ("import torch, kiln\n"
            "f = torch.compile(lambda x: (x.sin() * 2).sum(), backend='kiln')\n"
            "f(torch.randn(8, requires_grad=True)).backward()\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"^I\d{4} .*\] .*graph_1 stage pre_grad", r.stderr, re.M)          # +kiln, INFO
    assert re.search(r"^V\d{4} .*\] .*# after: capture", r.stderr, re.M)               # +kiln, DEBUG
    assert re.search(r"\[__output_code\] def call\(args\)", r.stderr)                   # output_code
    assert re.search(r"graph_1 compiled in [\d.]+ s: Dynamo [\d.]+ s, AOTAutograd", r.stderr)
    (log,) = (tmp_path / "trace").iterdir()
    text = log.read_text()
    assert '"name": "kiln_wrapper_forward"' in text and '"name": "kiln_stage_times"' in text
    (run,) = (tmp_path / "torch_compile_debug").glob("run_*")   # the run folder Dynamo writes to
    assert (run / "torchdynamo").is_dir() and (run / "kiln" / "graph_001" / "00_capture.py").is_file()
    assert (run / "kiln" / "graph_001" / "repro.py").is_file()


def test_a_failing_compile_leaves_a_kiln_error_entry():
    entries = _Entries()
    trace_log.addHandler(entries)
    try:
        with pytest.raises(Exception, match="activation_memory_limit=1"):
            _train(activation_memory_limit=1)
    finally:
        trace_log.removeHandler(entries)
    found = entries.artifacts()
    assert "kiln_joint" in found and "kiln_partition_fw" not in found   # the stages before the failure
    meta, text = found["kiln_error"]
    assert "failed in stage partition" in text and "MemoryLimitError" in text and "frame_id" in meta
