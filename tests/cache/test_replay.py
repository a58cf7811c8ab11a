"""A compile cache hit is as inspectable as the compile that stored it (kiln/debug.py ``Record``, ``Trace.replay``):
two processes run the same inspection tools on one cache directory, the first compiling, the second hitting, and
print and write the same things: TORCH_LOGS=+kiln (stage lines, graphs, remat decisions, kernels) and
output_code, KILN_DUMP's files, TORCH_TRACE's entries, kiln.explain's stages, run_and_get_code's sources;
the second run's texts say they came from the cache. A hit with nothing inspecting decompresses nothing."""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import kiln
from tests.cache.test_cache import ROOT, _cache, _count, _counters, _model, _train_step  # noqa: F401

_TOOLS = textwrap.dedent("""
    import json, sys, torch, kiln
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(4, 8)
    kiln.compile(m)(x).sum().backward()                               # a training graph: forward and backward
    explained = kiln.explain(lambda x: torch.tanh(x) * 2 + x.sum(), torch.randn(6))
    _, sources = kiln.run_and_get_code(kiln.compile(lambda x: torch.sigmoid(x) * x - 1), torch.randn(5))
    c = kiln.counters["cache"]
    print("RESULT" + json.dumps({"explain": explained, "sources": sources, "hit": c["hit"], "miss": c["miss"]}))
""")

HEADER = re.compile(r"^(#|//) from the compile cache \(entry kiln_[0-9a-f]+\)\n", re.M)


def _run(tmp_path, i: int) -> dict:
    """One process of the tools on the shared cache: what it printed, dumped and traced."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_", "TORCH_"))}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", KILN_CACHE="1", KILN_CACHE_DIR=str(tmp_path / "cache"),
               KILN_KERNEL_DIR=str(tmp_path / f"kernels{i}"), KILN_DUMP=str(tmp_path / f"dump{i}"),
               TORCH_TRACE=str(tmp_path / f"trace{i}"), TORCH_LOGS="+kiln,output_code")
    r = subprocess.run([sys.executable, "-c", _TOOLS], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.split("RESULT", 1)[1])
    dump = tmp_path / f"dump{i}"
    out["dump"] = sorted(str(p.relative_to(dump)) for p in dump.rglob("*") if p.is_file())
    out["dumped"] = {f: (dump / f).read_text() for f in out["dump"] if f.endswith((".py", ".cpp", ".txt"))}
    trace = "".join(p.read_text() for p in (tmp_path / f"trace{i}").iterdir())
    out["trace"] = sorted(re.findall(r'"artifact": \{"name": "(kiln_\w+)"', trace))
    out["traced"] = trace
    lines = [re.sub(r"^[IVWE]\d{4} [\d:.]+ \d+ \S+\] (\[[^]]*\] )?", "", ln) for ln in r.stderr.splitlines()]
    out["stages"] = re.findall(r"^(graph_\d+) stage (\w+): [\d.]+ ms", "\n".join(lines), re.M)
    code = "\n".join(ln.removeprefix("[__output_code] ") for ln in lines if ln.startswith("[__output_code] "))
    out["output_code"] = code
    out["log"] = "\n".join(lines)
    return out


def test_a_hit_in_a_new_process_shows_what_the_compile_showed(tmp_path):
    cold, hit = _run(tmp_path, 0), _run(tmp_path, 1)
    assert (cold["miss"], cold["hit"], hit["miss"], hit["hit"]) == (3, 0, 0, 3), "the second process hits"
    # TORCH_LOGS=+kiln: the same stage lines, graphs, remat decisions and kernels
    assert len(cold["stages"]) >= 10 and hit["stages"] == cold["stages"], (cold["stages"], hit["stages"])
    for text in ("# after: partition_fw", "remat[budget=1]: save ", "# after: post_grad_inference"):
        assert cold["log"].count(text) == hit["log"].count(text) > 0, text
    assert "compile cache hit (entry kiln_" in hit["log"] and "compile cache hit" not in cold["log"]
    # TORCH_LOGS=output_code: the same wrappers and kernels, under the cache's header
    assert "def call(args)" in cold["output_code"] and HEADER.search(hit["output_code"])
    assert HEADER.sub("", hit["output_code"]) == cold["output_code"]
    # KILN_DUMP: the same files with the same text (the cache's header aside)
    assert len(cold["dump"]) >= 25 and hit["dump"] == cold["dump"], set(cold["dump"]) ^ set(hit["dump"])
    assert any(f.endswith("_post_grad_forward.py") for f in cold["dump"]) and any("wrapper" in f for f in cold["dump"])
    for f, text in cold["dumped"].items():
        if f.endswith("repro.py"):
            continue   # names this process's paths
        assert HEADER.sub("", hit["dumped"][f], count=1) == text, f
        assert bool(HEADER.match(hit["dumped"][f])) == ("00_capture" not in f), f
    # TORCH_TRACE: the same kiln_* entries; the payloads say where they came from
    assert "kiln_partition_fw" in cold["trace"] and "kiln_stage_times_backward" in cold["trace"]
    assert hit["trace"] == cold["trace"]
    assert '"from_cache": "entry kiln_' in hit["traced"] and "from the compile cache" not in cold["traced"]
    # kiln.explain: the same stages and graphs
    stages = [s for s, _ in cold["explain"]]
    assert stages[:2] == ["capture", "pre_grad"] and len(stages) >= 6 and [s for s, _ in hit["explain"]] == stages
    assert [HEADER.sub("", t) for _, t in hit["explain"]] == [t for _, t in cold["explain"]]
    # kiln.run_and_get_code: the same sources
    assert cold["sources"] and hit["sources"] == cold["sources"]


def test_a_hit_with_nothing_inspecting_reads_no_record(tmp_path):
    """Replaying costs nothing when nobody looks: the stored record is not even decompressed."""
    m, x = _model(), torch.randn(8, 16)
    _train_step(m, x, codegen="aten", **_cache(tmp_path))
    _train_step(m, x, codegen="aten", **_cache(tmp_path))
    assert _count("hit") == 1 and _count("replayed") == 0
    with kiln.config.patch(debug=1):
        _train_step(m, x, codegen="aten", **_cache(tmp_path))
    assert _count("hit") == 2 and _count("replayed") == 1


@pytest.mark.gpu
def test_a_triton_hit_explains_and_returns_the_same_code(tmp_path):
    """On the GPU (Triton kernels): a hit after ``torch._dynamo.reset()`` gives ``kiln.explain`` the same stages
    and graphs, and ``run_and_get_code`` the same wrapper and kernel sources, as the compile that stored it."""
    def f(x):
        return torch.nn.functional.gelu(x @ x.T).sum(-1) + 1
    x = torch.randn(32, 16, device="cuda")
    with kiln.config.patch(**_cache(tmp_path / "explain")):
        cold = kiln.explain(f, x)
        hit = kiln.explain(f, x)
    assert (_count("miss"), _count("hit")) == (1, 1)
    assert [s for s, _ in hit] == [s for s, _ in cold] and "fuse_inference" in [s for s, _ in cold]
    assert [HEADER.sub("", t) for _, t in hit] == [t for _, t in cold]
    with kiln.config.patch(**_cache(tmp_path / "code")):
        _, cold_code = kiln.run_and_get_code(kiln.compile(f), x)
        _, hit_code = kiln.run_and_get_code(kiln.compile(f), x)
    assert (_count("miss"), _count("hit")) == (2, 2)
    assert hit_code == cold_code and any("@triton.jit" in c for c in cold_code), cold_code
