"""Parallel precompile (runtime/precompile.py), checked on the CPU with a stand-in CUDA driver.

Triton's JIT needs an active driver only for the device, the stream and the target; a driver that
answers sm_90 lets ``JITFunction.warmup`` compile kiln's real kernels here (frontend, MLIR, ptxas).
The test warms every launch the way a worker does, then replays the launches the way the runtime's
first call does (real, 16-byte aligned tensors, through the JIT) and checks that Triton's cache
gained no entry: the runtime would load what the workers compiled.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from kiln.options import Options
from kiln.runtime import precompile
from tests.codegen.test_compile_sm90 import _grad, _to_cuda, _toolchain_missing
from tests.codegen.util import decompositions, fuse

MIN = "tuning.precompile_min_kernels"

pytestmark = pytest.mark.skipif(_toolchain_missing() is not None, reason=str(_toolchain_missing()))


@pytest.fixture
def sm90_driver(monkeypatch, tmp_path):
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    saved = driver._active
    driver.set_active(precompile.target_only_driver(GPUTarget("cuda", 90, 32)))
    yield tmp_path / "triton"
    driver._active = saved


def _fused_cuda_graph():
    def f(x, w, b):
        return F.gelu(F.layer_norm(x, (64,), w, b)) * 2
    cpu = [torch.randn(16, 64, requires_grad=True), torch.randn(64, requires_grad=True),
           torch.randn(64, requires_grad=True)]
    gm = _to_cuda(make_fx(_grad(f, 3), decomposition_table=decompositions(), tracing_mode="fake")(*cpu))
    with FakeTensorMode(allow_non_fake_inputs=True):
        args = [torch.empty(a.shape, device="cuda") for a in cpu]
        gm = make_fx(gm, decomposition_table=decompositions())(*args)
    fuse(gm, args, bind=False)   # kernel references, as the pipeline precompiles them
    return gm


def _entries(d):
    return len(os.listdir(d)) if os.path.isdir(d) else 0


def test_warmed_launches_are_the_runtime_launches(sm90_driver):
    gm = _fused_cuda_graph()
    precompile._DONE.clear()
    todo = precompile.tasks(gm)
    assert len({t[1] for t in todo}) >= 2 and all(isinstance(t[3][0], torch.dtype) for t in todo)
    for t in todo:
        assert precompile._warm(t, {})
    warmed = _entries(sm90_driver)
    assert warmed >= len({t[1] for t in todo})
    _launch_like_runtime(todo)
    assert _entries(sm90_driver) == warmed   # every launch hit what the workers compiled


def _launch_like_runtime(todo):
    """The runtime's first launch of each task: the same module file, real 16-byte aligned tensors,
    launch.py's keywords (compiled, not launched: there is no GPU)."""
    import importlib.util
    for path, modname, fn_name, args, consts, warps in todo:
        spec = importlib.util.spec_from_file_location(modname + "_runtime", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        real = [torch.empty(64, dtype=a) if isinstance(a, torch.dtype) else a for a in args]
        assert all(r.data_ptr() % 16 == 0 for r in real if isinstance(r, torch.Tensor))
        getattr(mod, fn_name).warmup(*real, grid=(1,), num_warps=warps, **consts)


def test_pool_compiles_for_the_runtime(sm90_driver):
    """warm() end to end: spawned workers (given the parent's target, no CUDA) fill the cache the
    runtime's launches then hit."""
    gm = _fused_cuda_graph()
    precompile._DONE.clear()
    todo = precompile.tasks(gm)
    precompile._DONE.clear()
    assert precompile.warm(gm, Options(compile_workers=2).replace(**{MIN: 1})) == len(todo) > 0
    warmed = _entries(sm90_driver)
    assert warmed >= len({t[1] for t in todo})
    _launch_like_runtime(todo)
    assert _entries(sm90_driver) == warmed
    # once the pool runs, a graph with fewer kernels than tuning.precompile_min_kernels is warmed too
    precompile._DONE.clear()
    assert precompile.warm(gm, Options(compile_workers=2).replace(**{MIN: 100})) == len(todo)


def test_no_target_no_precompile():
    """Without a GPU target (this CPU machine, no stand-in driver) warm() starts nothing, raises
    nothing, and kernels compile at their first launch as before."""
    if not torch.cuda.is_available():
        assert precompile.n_workers(Options()) == 0
    assert precompile.n_workers(Options(compile_workers=0)) == 0
    gm = _fused_cuda_graph()
    precompile._DONE.clear()
    assert precompile.warm(gm, Options(compile_workers=1).replace(**{MIN: 1})) == 0


def test_workers_do_not_rerun_an_unguarded_user_script(tmp_path):
    """A spawned worker imports the parent's __main__; a training script without a __main__ guard
    must still run once (precompile hides the main module while workers start)."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = tmp_path / "train.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {root!r})\n"
        "print('SCRIPT RUNS', flush=True)\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.runtime.driver import driver\n"
        "from kiln.runtime import precompile\n"
        "from kiln.options import Options\n"
        "import tests.codegen.test_precompile as T\n"
        "driver.set_active(precompile.target_only_driver(GPUTarget('cuda', 90, 32)))\n"
        "opts = Options(compile_workers=2).replace(**{'tuning.precompile_min_kernels': 1})\n"
        "print('warmed', precompile.warm(T._fused_cuda_graph(), opts), flush=True)\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env=env).stdout
    assert out.count("SCRIPT RUNS") == 1, out
    warmed = int(out.split("warmed")[1].split()[0])
    assert warmed > 0, out   # the workers did start (and compiled)


def test_workers_build_the_launchers(sm90_driver, monkeypatch):
    """A worker also builds each warmed kernel's host launcher (Triton's per-signature C module,
    otherwise compiled at the first launch), from the compiled kernel's source and metadata."""
    import triton.backends.nvidia.driver as nv
    built = []
    monkeypatch.setattr(nv, "CudaLauncher", lambda src, md: built.append((src.fn.__name__, md.num_warps)))
    gm = _fused_cuda_graph()
    precompile._DONE.clear()
    todo = precompile.tasks(gm)
    for t in todo:
        assert precompile._warm(t, {})
    assert sorted(built) == sorted((t[2], t[5]) for t in todo)


def test_early_start_is_off_without_workers():
    """start() spawns nothing when precompiling is off (no GPU target, or compile_workers=0)."""
    before = list(precompile._POOL)
    precompile.start(Options(compile_workers=0))
    assert precompile._POOL == before


def test_workers_key_with_the_parents_ptxas_version(sm90_driver, monkeypatch):
    """Triton keys its cache with a ptxas version it computes once per process. After another library
    repoints TRITON_PTXAS_PATH (Inductor does), the parent keeps the old version while a fresh worker
    would read the new one, and every warmed kernel would miss (seen on the H100: 79 of 79). Workers
    adopt the parent's version (``key_state``), so their entries are the ones the parent looks up."""
    from triton.backends.nvidia import compiler as nvc
    monkeypatch.setattr(nvc, "get_ptxas_version", nvc.get_ptxas_version)   # restored after the test
    real = nvc.get_ptxas_version(90)
    gm = _fused_cuda_graph()
    precompile._DONE.clear()
    todo = precompile.tasks(gm)
    parent = {"ptxas_version": real + " (the parent's first ptxas)", "libdevice_path": None}
    for t in todo:
        assert precompile._warm(t, {}, None, parent)
    warmed = _entries(sm90_driver)
    nvc.get_ptxas_version = lambda arch=80: parent["ptxas_version"]   # the parent's view
    _launch_like_runtime(todo)
    assert _entries(sm90_driver) == warmed          # hits: same key as the parent
    nvc.get_ptxas_version = lambda arch=80: real    # a process keyed with the other version
    _launch_like_runtime(todo[:1])
    assert _entries(sm90_driver) > warmed           # misses: the version is part of the key
