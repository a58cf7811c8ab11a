"""run_and_get_code, KILN_DEBUG, KILN_DUMP and the repro script."""
import os
import subprocess
import sys

import torch

import kiln


def test_run_and_get_code_returns_wrapper_source():
    f = kiln.compile(lambda x, y: (x @ y).relu())
    with torch.no_grad():
        out, code = kiln.run_and_get_code(f, torch.randn(3, 4), torch.randn(4, 5))
    assert out.shape == (3, 5)
    assert any("def call(args)" in c and "aten_mm_default" in c for c in code)


def test_run_and_get_code_of_a_function_that_already_ran():
    """Dynamo is reset first, as inductor's run_and_get_code does: the sources come back although the
    compiled function ran before (they were empty), from a compile-cache hit too."""
    f = lambda x: torch.relu(x) * 2  # noqa: E731
    x = torch.randn(64)
    for opts in ({"cache": False}, {"cache": True}):
        compiled = kiln.compile(f, **opts)
        compiled(x)
        out, sources = kiln.run_and_get_code(compiled, x)
        assert torch.equal(out, f(x)) and any("kiln wrapper" in s for s in sources), sources


def test_run_and_get_code_returns_the_kernels_of_both_targets(tmp_path):
    """The C++ unit (its kernels' text, not only the launchers; the shared prelude as a header it includes)
    and the Triton kernels come back, on a compile-cache hit too (the entry's units shown as it loads them)."""
    f = lambda x: (x.sin() + 1).sum(-1)  # noqa: E731
    x = torch.randn(8, 16)
    for codegen, marker in (("cpp", 'extern "C"'), ("triton", "@triton.jit")):
        for _ in range(2):   # the second run hits the cache
            compiled = kiln.compile(f, codegen=codegen, cache=True, cache_dir=str(tmp_path / codegen))
            out, sources = kiln.run_and_get_code(compiled, x)
            torch.testing.assert_close(out, f(x))
            assert any(marker in s and "kiln_" in s for s in sources), (codegen, sources)
        # the prelude (math, philox, vectors) is a header the unit includes: the unit shows its kernels only
        unit = next(s for s in sources if 'extern "C"' in s) if codegen == "cpp" else ""
        assert codegen != "cpp" or (unit.startswith('#include "kiln_prelude_') and "kiln_philox" not in unit)


def test_backward_wrapper_is_collected():
    f = kiln.compile(lambda x: (x.sin() * x).sum())
    x = torch.randn(5, requires_grad=True)

    def step():
        f(x).backward()

    _, code = kiln.run_and_get_code(step)
    assert any("backward" in c for c in code) and any("forward" in c for c in code)


def test_debug_levels(capfd):
    f = kiln.compile(lambda x: x.cos() + 1)
    with kiln.config.patch(debug=2), torch.no_grad():
        f(torch.randn(3))
    err = capfd.readouterr().err
    assert "stage pre_grad" in err and "# after: capture" in err


def test_explain_lists_stages():
    stages = kiln.explain(lambda x: (x * 2).sin(), torch.randn(3, requires_grad=True))
    names = [s for s, _ in stages]
    assert names[0] == "capture" and "partition_fw" in names


def test_dump_and_repro(tmp_path, capfd):
    f = kiln.compile(lambda x, w: (x @ w).tanh().sum(), dump_dir=str(tmp_path))
    x, w = torch.randn(4, 3, requires_grad=True), torch.randn(3, 2, requires_grad=True)
    f(x, w).backward()
    (region,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    assert f"KILN_DUMP: writing graph stages to {region}" in capfd.readouterr().err   # says where it writes
    files = sorted(p.name for p in region.iterdir())
    assert "repro.py" in files and any(n.endswith("wrapper_forward.py") for n in files)
    assert any(n.endswith("wrapper_backward.py") for n in files)
    stage_file = next(p for p in region.iterdir() if p.name.endswith("capture.py"))
    module = kiln.resume(str(stage_file))
    torch.testing.assert_close(module(x.detach(), w.detach())[0], (x @ w).tanh().sum())
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    r = subprocess.run([sys.executable, str(region / "repro.py")], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0 and "repro OK" in r.stdout, r.stdout + r.stderr[-2000:]


def test_no_banned_imports():
    root = os.path.join(os.path.dirname(__file__), "..", "..", "kiln")
    banned = ("torch._inductor", "_functorch.partitioners", "_functorch.compile_utils",
              "_activation_checkpointing")
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                text = open(os.path.join(dirpath, name)).read()
                for b in banned:
                    assert b not in text, f"{name} mentions {b}"
